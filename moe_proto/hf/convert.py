"""Expert weights between Hugging Face's fused MoE experts and :class:`moe_proto.GroupedExperts`.

transformers 5.x keeps a Mixtral-style layer's experts as two stacked parameters
(``MixtralExperts``): ``gate_up_proj [E, 2*I, d]`` (the gate projection's I rows, then the
up projection's) and ``down_proj [E, d, I]``, applied as ``F.linear`` (``x @ W.T``), with
``down(act(gate x) * up x)`` and ``act = silu`` (SwiGLU). Modules marked
``is_transposed`` store ``[E, d, 2*I]`` and ``[E, I, d]`` instead. GroupedExperts with
``activation="swiglu"`` keeps ``w1 [E, d, I]`` (gate), ``w3 [E, d, I]`` (up) and
``w2 [E, I, d]`` (down) applied as ``x @ W``, so the conversion is a split and a transpose.

Example::

    experts = grouped_experts_from_hf(hf_block.experts, expert_group_name="ep_size_1")
    copy_grouped_experts_to_hf(experts, hf_block.experts)   # and back
"""
from __future__ import annotations

import logging
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..experts import GroupedExperts

logger = logging.getLogger(__name__)


def hf_expert_shapes(hf_experts: nn.Module) -> Tuple[int, int, int]:
    """``(num_experts, hidden_size, intermediate_size)`` of a fused HF experts module, after checking its layout.

    Accepted: ``gate_up_proj`` / ``down_proj`` parameters, concatenated ``[gate; up]`` layout,
    no biases, SiLU gate activation (Mixtral, Qwen-MoE and similar ``*Experts`` classes).

    Example::

        num_experts, hidden, ffn = hf_expert_shapes(model.model.layers[0].mlp.experts)
    """
    name = type(hf_experts).__name__
    for attr in ("gate_up_proj", "down_proj"):
        if not isinstance(getattr(hf_experts, attr, None), Tensor):
            raise ValueError(f"{name} has no {attr!r} tensor: expected a fused transformers 5.x experts module "
                             "(gate_up_proj [E, 2*I, d], down_proj [E, d, I])")
    if getattr(hf_experts, "has_bias", False) or getattr(hf_experts, "gate_up_proj_bias", None) is not None:
        raise ValueError(f"{name} has expert biases; only bias-free SwiGLU experts (Mixtral style) are converted")
    if not getattr(hf_experts, "has_gate", True):
        raise ValueError(f"{name} has no gate projection (has_gate=False); only SwiGLU experts are converted")
    if not getattr(hf_experts, "is_concatenated", True):
        raise ValueError(f"{name} interleaves gate and up rows (is_concatenated=False); only the concatenated "
                         "[gate; up] layout is converted")
    _check_silu(getattr(hf_experts, "act_fn", None), name)
    gate_up, down = hf_experts.gate_up_proj, hf_experts.down_proj
    if gate_up.dim() != 3 or down.dim() != 3 or gate_up.shape[0] != down.shape[0]:
        raise ValueError(f"{name}: gate_up_proj {tuple(gate_up.shape)} and down_proj {tuple(down.shape)} are not "
                         "stacks of the same number of experts")
    transposed = _is_transposed(hf_experts)
    num_experts = gate_up.shape[0]
    hidden, two_ffn = (gate_up.shape[1], gate_up.shape[2]) if transposed else (gate_up.shape[2], gate_up.shape[1])
    expected_down = (num_experts, two_ffn // 2, hidden) if transposed else (num_experts, hidden, two_ffn // 2)
    if two_ffn % 2 or tuple(down.shape) != expected_down:
        raise ValueError(f"{name}: gate_up_proj {tuple(gate_up.shape)} and down_proj {tuple(down.shape)} do not "
                         f"match (expected down_proj {expected_down}, is_transposed={transposed})")
    return num_experts, hidden, two_ffn // 2


def grouped_experts_from_hf(hf_experts: nn.Module, expert_group_name: Optional[str] = None) -> GroupedExperts:
    """A new ``GroupedExperts(activation="swiglu")`` holding a copy of ``hf_experts``' weights.

    Same device and dtype as the source. ``expert_group_name`` marks the parameters for
    DeepSpeed (``"ep_size_1"``), as :class:`moe_proto.MoE` does.

    Example::

        experts = grouped_experts_from_hf(hf_block.experts, "ep_size_1")
    """
    num_experts, hidden, ffn = hf_expert_shapes(hf_experts)
    gate_up = hf_experts.gate_up_proj
    experts = GroupedExperts(num_experts, hidden, ffn, activation="swiglu", expert_group_name=expert_group_name,
                             device=gate_up.device, dtype=gate_up.dtype)
    load_hf_expert_weights(experts, hf_experts)
    return experts


def load_hf_expert_weights(experts: GroupedExperts, hf_experts: nn.Module) -> None:
    """Copy ``hf_experts``' weights into an existing swiglu ``GroupedExperts`` of the same shape (in place).

    Example::

        load_hf_expert_weights(moe.experts, hf_block.experts)
    """
    _check_pair(experts, hf_experts)
    gate, up, down = _hf_gate_up_down(hf_experts)
    with torch.no_grad():
        experts.w1.copy_(gate)
        experts.w3.copy_(up)
        experts.w2.copy_(down)


def copy_grouped_experts_to_hf(experts: GroupedExperts, hf_experts: nn.Module) -> None:
    """Write a swiglu ``GroupedExperts``' weights into a fused HF experts module of the same shape (in place).

    Example::

        copy_grouped_experts_to_hf(moe.experts, MixtralExperts(config))
    """
    _check_pair(experts, hf_experts)
    ffn = experts.ffn_hidden_size
    with torch.no_grad():
        if _is_transposed(hf_experts):
            hf_experts.gate_up_proj[..., :ffn].copy_(experts.w1)
            hf_experts.gate_up_proj[..., ffn:].copy_(experts.w3)
            hf_experts.down_proj.copy_(experts.w2)
        else:
            hf_experts.gate_up_proj[:, :ffn].copy_(experts.w1.transpose(1, 2))
            hf_experts.gate_up_proj[:, ffn:].copy_(experts.w3.transpose(1, 2))
            hf_experts.down_proj.copy_(experts.w2.transpose(1, 2))


def _hf_gate_up_down(hf_experts: nn.Module) -> Tuple[Tensor, Tensor, Tensor]:
    """The HF weights as GroupedExperts' ``(w1, w3, w2)`` views (``x @ W`` orientation)."""
    gate_up, down = hf_experts.gate_up_proj, hf_experts.down_proj
    if _is_transposed(hf_experts):
        gate, up = gate_up.chunk(2, dim=-1)
        return gate, up, down
    gate, up = gate_up.chunk(2, dim=1)
    return gate.transpose(1, 2), up.transpose(1, 2), down.transpose(1, 2)


def _check_pair(experts: GroupedExperts, hf_experts: nn.Module) -> None:
    if experts.activation != "swiglu" or experts.w3 is None:
        raise ValueError(f"GroupedExperts has activation={experts.activation!r}; HF SwiGLU experts need "
                         "activation='swiglu'")
    if experts.b1 is not None:
        raise ValueError("GroupedExperts has biases; HF Mixtral-style experts have none: build it with bias=False")
    ours = (experts.num_experts, experts.hidden_size, experts.ffn_hidden_size)
    theirs = hf_expert_shapes(hf_experts)
    if ours != theirs:
        raise ValueError(f"GroupedExperts (experts, hidden, ffn)={ours} does not match {type(hf_experts).__name__} "
                         f"{theirs}")


def _is_transposed(hf_experts: nn.Module) -> bool:
    return bool(getattr(hf_experts, "is_transposed", False))


def _check_silu(act_fn: Optional[nn.Module], name: str) -> None:
    """SwiGLU needs a SiLU gate: compare the module's activation with F.silu on a probe (names vary by class)."""
    if act_fn is None:
        raise ValueError(f"{name} has no act_fn; expected SiLU (hidden_act='silu')")
    probe = torch.linspace(-4.0, 4.0, 17)
    with torch.no_grad():
        if not torch.allclose(act_fn(probe), F.silu(probe), atol=1e-6):
            raise ValueError(f"{name}.act_fn is {type(act_fn).__name__}, not SiLU: GroupedExperts' gated "
                             "activation is SwiGLU only (hidden_act='silu')")
