"""Experts of any ``nn.Module``: deep copies run one after another over their rows, as DeepSpeed's ``Experts``.

The layer takes this path for an expert module :class:`~moe_proto.experts.GroupedExperts` cannot stack
(anything but ``Linear -> GELU/ReLU/SiLU -> Linear``): gated MLPs, norms inside, custom blocks. Routing,
capacity, prototypes and expert parallelism are the layer's and do not change; only the expert compute
is a Python loop over the local experts instead of one stacked matmul per projection. The copies live
in ``deepspeed_experts`` like DeepSpeed's, so their state-dict keys are DeepSpeed's too.

Example::

    block = nn.Sequential(nn.LayerNorm(16), nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
    experts = ModuleExperts(block, num_experts=4, hidden_size=16, expert_group_name="ep_size_1")
    y = experts(buffer, tokens_per_expert)   # buffer [R, 16], tokens_per_expert [4] or [blocks, 4]
"""
from __future__ import annotations

import copy
from typing import Optional

import torch
from torch import Tensor, nn

from .experts import _check_blocks, run_expert_major


class ModuleExperts(nn.Module):
    """``num_experts`` deep copies of ``expert`` (every copy starts from the same weights, as in DeepSpeed).

    Every expert runs on every forward, on zero rows when it got none, so each one's parameters
    take a (zero) gradient on every rank. Parameters carry DeepSpeed's expert markers
    (``allreduce=False``, ``group_name``) when ``expert_group_name`` is given.
    """

    def __init__(self, expert: nn.Module, num_experts: int, hidden_size: int,
                 expert_group_name: Optional[str] = None) -> None:
        super().__init__()
        self.deepspeed_experts = nn.ModuleList([copy.deepcopy(expert) for _ in range(num_experts)])
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.ffn_hidden_size: Optional[int] = None  # unknown for an arbitrary module
        self.activation: Optional[str] = None
        self.expert_group_name = expert_group_name
        if expert_group_name is not None:
            for param in self.parameters():
                param.allreduce = False
                param.group_name = expert_group_name

    def forward(self, x: Tensor, tokens_per_expert: Tensor) -> Tensor:
        """``[R, d]`` expert-major rows -> ``[R, d]``; counts ``[E]`` or ``[blocks, E]`` as for ``GroupedExperts``."""
        if tokens_per_expert.dim() == 2:
            return run_expert_major(self, x, tokens_per_expert)
        counts = _check_blocks(tokens_per_expert, self.num_experts, x.shape[0])
        outputs = []
        for expert, rows in zip(self.deepspeed_experts, torch.split(x, counts)):
            out = expert(rows)
            out = out[0] if isinstance(out, tuple) else out  # DeepSpeed drops a returned bias too
            if out.shape != rows.shape:
                raise ValueError(f"expert module {type(expert).__name__} maps rows {tuple(rows.shape)} to "
                                 f"{tuple(out.shape)}: an MoE expert must keep the shape [rows, hidden_size]")
            outputs.append(out)
        return torch.cat(outputs)
