"""Dispatch: move tokens into an expert-major buffer and back, by index (no one-hot tensors).

The buffer holds only the kept routes, sorted by expert (stably, kept routes of an
expert in the row order the routing record assigned), plus per-expert row counts. The
experts then compute exactly ``sum(tokens_per_expert)`` rows: empty capacity slots
cost nothing. Capacity mode and dropless share this layout; they differ only in
whether the router dropped routes.

The local permutation is kept apart from any exchange between processes: under expert
parallelism :mod:`moe_proto.parallel` moves the buffer (split by ``tokens_per_expert``) to
the ranks owning the experts between :func:`permute` and the experts, and back before
:func:`unpermute`.

Example::

    plan = plan_dispatch(record)
    buffer = permute(x, plan)                       # [total_kept, d], expert-major
    y = experts(buffer, plan.tokens_per_expert)
    out = unpermute(y, plan, num_tokens=x.shape[0]) # [S, d], gate-weighted sum
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from .routing import RoutingRecord


@dataclass(frozen=True)
class DispatchPlan:
    """Where every row of the expert-major buffer comes from and how it is weighted.

    Attributes:
        token_index: ``[R]`` int64 source token of each buffer row (R = kept routes).
        gate: ``[R]`` fp32 combine weight of each row (differentiable, from the record).
        tokens_per_expert: ``[E]`` int64 rows per expert, in buffer order.
        capacity: rows per expert of the routing (None when dropless); sizes fixed-split exchanges.
    """

    token_index: Tensor
    gate: Tensor
    tokens_per_expert: Tensor
    capacity: Optional[int] = None


def plan_dispatch(record: RoutingRecord) -> DispatchPlan:
    """Build the permutation that sorts the kept routes by expert.

    A kept route of expert e with slot j lands on row ``start[e] + j`` (``start`` is the
    exclusive cumulative sum of ``tokens_per_expert``); slots are dense per expert, so
    this is the stable sort by expert without running a sort.

    Example::

        plan = plan_dispatch(route(logits, top_k=2))
    """
    s, k = record.expert_index.shape
    keep = record.keep.reshape(-1)
    expert = record.expert_index.reshape(-1)[keep]
    counts = record.tokens_per_expert
    start = torch.cumsum(counts, dim=0) - counts
    row = start[expert] + record.slot.reshape(-1)[keep]
    # route_of_row is the inverse permutation: buffer row -> position among kept routes.
    route_of_row = torch.empty_like(row)
    route_of_row[row] = torch.arange(row.numel(), device=row.device)
    tokens = torch.arange(s, device=expert.device).repeat_interleave(k)[keep]
    return DispatchPlan(
        token_index=tokens[route_of_row],
        gate=record.gate.reshape(-1)[keep][route_of_row],
        tokens_per_expert=counts,
        capacity=record.capacity,
    )


def permute(hidden: Tensor, plan: DispatchPlan) -> Tensor:
    """Gather ``hidden [S, d]`` into the expert-major buffer ``[R, d]``.

    Example::

        buffer = permute(x, plan)
    """
    return hidden.index_select(0, plan.token_index)


def unpermute(expert_output: Tensor, plan: DispatchPlan, num_tokens: int) -> Tensor:
    """Scatter-add the gate-weighted rows back to their tokens: ``[R, d] -> [S, d]``.

    Tokens with no kept route get 0 (adding the residual is the caller's choice, as in
    DeepSpeed). Weighting and summation run in at least fp32 and the result is cast back to the
    input dtype, so bf16 experts do not lose precision in the sum over routes.

    Example::

        out = unpermute(y, plan, num_tokens=x.shape[0])
    """
    acc = torch.promote_types(expert_output.dtype, torch.float32)
    weighted = expert_output.to(acc) * plan.gate.to(acc).unsqueeze(1)
    out = weighted.new_zeros(num_tokens, expert_output.shape[1])
    return out.index_add(0, plan.token_index, weighted).to(expert_output.dtype)
