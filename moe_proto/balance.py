"""Load balancing for the MoE layer: aux-loss-free expert biases (DeepSeek-V3), global-batch counts, scoped aux losses.

:func:`sequence_aux_loss` and :func:`global_batch_aux_loss` are the ``"sequence"`` and
``"global_batch"`` scopes of :func:`moe_proto.routing.route`'s load-balancing loss.

An :class:`ExpertBalance` is a small child module of a :class:`moe_proto.MoE` layer that holds

* ``bias`` ``[E]`` fp32 (a persistent buffer, saved with the model): added to the routing
  scores for *choosing* experts only; the gate weights use the unbiased scores. It covers all
  E experts and is replicated on every rank (it is not an expert parameter).
* ``step_load`` ``[E]`` int64 (not persistent): routes per expert (before capacity drops) over
  the training forwards of the current optimizer step, all micro-batches together.
* ``global_load`` ``[E + 1]`` fp32 (not persistent, ``aux_loss_scope="global_batch"`` only):
  routes per expert and used tokens of the current step, summed over the data-parallel ranks.

After each optimizer step, :func:`update_expert_biases` sums every layer's ``step_load`` over
the ranks (one all-reduce for all layers), moves each bias by
``rate * sign(mean_load - load_e)`` (mean over the experts of e's prototype) and clears the
step's counts (``global_load`` too).

Example::

    moe = MoE(64, None, num_experts=8, ffn_hidden_size=128, use_rts=False, expert_bias_update_rate=1e-3)
    for micro_batch in step_batches:          # gradient accumulation: counts add up
        loss = task(moe(micro_batch)[0]); loss.backward()
    optimizer.step()
    update_expert_biases(model)               # 1 layer updated
"""
from __future__ import annotations

import logging
from typing import List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import Tensor, nn

logger = logging.getLogger(__name__)


def global_batch_aux_loss(mean_probs: Tensor, global_routed: Tensor, global_tokens: Tensor, top_k: int) -> Tensor:
    """``mean_p [E_g * sum_e f_pe * p_pe]``: f from the global batch's routes and tokens, p this call's mean probabilities.

    ``mean_probs`` ``[P, E/P]`` (over this call's used tokens), ``global_routed`` ``[E]``, ``global_tokens`` a scalar.

    Example::

        global_batch_aux_loss(torch.full((1, 2), 0.5), torch.tensor([6, 2]), torch.tensor(8), 1)  # 1.0
    """
    num_prototypes, group = mean_probs.shape
    f = global_routed.view(num_prototypes, group).to(mean_probs.dtype) / (top_k * global_tokens.clamp(min=1))
    return (group * (f * mean_probs).sum(dim=-1)).mean()


def sequence_aux_loss(probs_g: Tensor, expert_index: Tensor, top_k: int, token_mask: Optional[Tensor],
                       sequence_length: int) -> Tensor:
    """The prototype aux loss of every sequence of ``sequence_length`` tokens, averaged over used sequences.

    ``probs_g`` ``[S, P, E/P]``, ``expert_index`` ``[S, K]`` global expert ids (before drops).

    Example::

        sequence_aux_loss(torch.full((4, 1, 2), 0.5), torch.tensor([[0], [0], [0], [1]]), 1, None, 2)  # 1.0
    """
    s, num_prototypes, group = probs_g.shape
    n, e = s // sequence_length, num_prototypes * group
    seq = torch.arange(s, device=probs_g.device).div(sequence_length, rounding_mode="floor")
    key = (seq.unsqueeze(1) * e + expert_index).reshape(-1)
    if token_mask is not None:
        # Unused tokens count towards a bin past the end, which is cut off.
        key = torch.where(token_mask.unsqueeze(1).expand_as(expert_index).reshape(-1), key, n * e)
    routed = torch.bincount(key, minlength=n * e + 1)[:n * e].view(n, num_prototypes, group).to(probs_g.dtype)
    weight = probs_g.new_ones(n, sequence_length) if token_mask is None else \
        token_mask.view(n, sequence_length).to(probs_g.dtype)
    used = weight.sum(dim=1)  # [n]
    p = (probs_g.view(n, sequence_length, num_prototypes, group) * weight.view(n, sequence_length, 1, 1)).sum(1)
    p = p / used.clamp(min=1).view(n, 1, 1)
    f = routed / (top_k * used.clamp(min=1)).view(n, 1, 1)
    per_sequence = (group * (f * p).sum(dim=-1)).mean(dim=-1)  # [n]
    has_tokens = (used > 0).to(probs_g.dtype)
    return (per_sequence * has_tokens).sum() / has_tokens.sum().clamp(min=1)


class ExpertBalance(nn.Module):
    """Per-layer bias and load accumulators (see the module docstring).

    Args:
        num_experts: E, all experts of the layer (not only this rank's).
        num_prototypes: P; the bias update balances within each prototype's E/P experts.
        update_rate: bias step per update (0: no bias; the module then only counts global loads).
        global_batch: keep ``global_load`` for the global-batch aux loss.

    Example::

        balance = ExpertBalance(8, 2, update_rate=1e-3)
        balance.add_step_load(torch.tensor([3, 1, 0, 0, 2, 2, 0, 0]))
    """

    def __init__(self, num_experts: int, num_prototypes: int, update_rate: float, global_batch: bool = False) -> None:
        super().__init__()
        if num_experts % num_prototypes:
            raise ValueError(f"num_experts={num_experts} must be divisible by num_prototypes={num_prototypes}")
        if update_rate < 0:
            raise ValueError(f"expert_bias_update_rate must be >= 0, got {update_rate}")
        self.num_prototypes = num_prototypes
        self.update_rate = float(update_rate)
        self.group: Optional[object] = None  # process group of the bias replicas (None: the whole world)
        if update_rate > 0:
            self.register_buffer("bias", torch.zeros(num_experts, dtype=torch.float32))
            self.register_buffer("step_load", torch.zeros(num_experts, dtype=torch.int64), persistent=False)
        else:
            self.bias = None
            self.step_load = None
        if global_batch:
            self.register_buffer("global_load", torch.zeros(num_experts + 1, dtype=torch.float32), persistent=False)
        else:
            self.global_load = None

    @property
    def has_bias(self) -> bool:
        return self.bias is not None

    def add_step_load(self, routed_per_expert: Tensor) -> None:
        """Add one training forward's routes per expert (before drops) to the step's counts."""
        self.step_load += routed_per_expert.detach().to(self.step_load.dtype)

    def add_global_load(self, routed_per_expert: Tensor, used_tokens: Tensor) -> Tuple[Tensor, Tensor]:
        """Sum this forward's counts over the ranks, add them to the step's and return ``(routes [E], tokens)``.

        A collective over ``self.group`` in every training forward: every rank must run it.
        """
        counts = torch.cat([routed_per_expert.detach().float(), used_tokens.detach().float().reshape(1)])
        if dist.is_available() and dist.is_initialized() and dist.get_world_size(self.group) > 1:
            dist.all_reduce(counts, group=self.group)
        self.global_load += counts.to(self.global_load.device)
        return self.global_load[:-1].clone(), self.global_load[-1].clone()

    def reset(self) -> None:
        """Start a new optimizer step: clear the step's load counts."""
        if self.step_load is not None:
            self.step_load.zero_()
        if self.global_load is not None:
            self.global_load.zero_()

    def apply_load(self, load: Tensor) -> None:
        """``bias += rate * sign(mean_load - load_e)``, the mean within each prototype's experts.

        Example::

            balance.apply_load(torch.tensor([4, 0, 2, 2]))   # P=1, rate r: bias = [-r, r, 0, 0]
        """
        per_group = load.to(torch.float64).view(self.num_prototypes, -1)
        delta = torch.sign(per_group.mean(dim=1, keepdim=True) - per_group).reshape(-1)
        self.bias += (self.update_rate * delta).to(self.bias.dtype)


def balance_modules(model: nn.Module) -> List[ExpertBalance]:
    """Every :class:`ExpertBalance` in ``model``, in ``named_modules`` order (the same on every rank)."""
    return [m for m in model.modules() if isinstance(m, ExpertBalance)]


def update_expert_biases(model: nn.Module, group: Optional[object] = None) -> int:
    """Update every MoE layer's expert bias from its step's loads, reset the counts; returns the layers updated.

    Call it right after each optimizer step (DeepSpeed: after ``engine.step()`` at the gradient
    accumulation boundary, when ``engine.was_step_applied()``; see :func:`reset_expert_loads` for a
    skipped step). The loads of all micro-batches since the last call are summed over the ranks of
    ``group`` (None: the whole world; with expert parallelism every rank routes its own tokens over
    all E experts, so that is the data-parallel x expert-parallel world) in one all-reduce, so every
    rank computes the same new biases. Collective when torch.distributed is up: every rank must call it.
    Layers with ``aux_loss_scope="global_batch"`` start a new global batch too.

    Example::

        for _ in range(grad_accum):
            engine.backward(engine(batch).loss); engine.step()
        if engine.was_step_applied():
            update_expert_biases(engine.module)      # returns the number of layers updated
        else:
            reset_expert_loads(engine.module)
    """
    modules = balance_modules(model)
    biased = [m for m in modules if m.has_bias]
    if biased:
        loads = torch.cat([m.step_load for m in biased])
        if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
            dist.all_reduce(loads, group=group)
        for m, load in zip(biased, loads.split([m.step_load.numel() for m in biased])):
            m.apply_load(load)
    for m in modules:
        m.reset()
    return len(biased)


def reset_expert_loads(model: nn.Module) -> None:
    """Drop the step's load counts without moving any bias (a step skipped on fp16 overflow, a partial window)."""
    for m in balance_modules(model):
        m.reset()
