"""Expert parallelism: move the expert-major buffer to the ranks that own the experts and back.

With ``ep_size = W`` ranks in an expert-parallel group and E experts, EP rank r owns the
L = E/W consecutive experts ``r*L .. r*L+L-1``. The local buffer from
:func:`moe_proto.dispatch.permute` is expert-major over all E experts, so the rows for
peer w are one contiguous block and a single ``all_to_all_single`` moves them.

Every exchange starts with a fixed-size header all-gather (hidden size, dtype, E, L,
capacity, split mode) compared across the group: a rank whose shapes disagree makes
every rank raise :class:`ExpertParallelMismatch` at once, instead of the silent hang of
an ``all_to_all_single`` with mismatched sizes (DeepSpeed #6809). Then:

* ``variable`` splits (dropless, or capacity mode by default): per-expert row counts are
  exchanged first (``[E]`` ints), and only kept rows travel.
* ``fixed`` splits (capacity mode, ``fixed_splits=True``): every expert's rows are padded
  to the capacity C, so every peer sends exactly ``L*C`` rows and the message sizes are
  known from C alone; the counts still travel so that padding rows are not computed.

Received rows stay peer-major: W blocks, block w the rows from peer w for the L local experts in
expert order, which :class:`moe_proto.experts.GroupedExperts` takes as they lie (``[W, L]`` counts,
``plan.recv_counts``): reordering them to local-expert-major and back would cost four passes over
the rows per step (two forward, two backward). Both all-to-alls are autograd functions
whose backward is the reverse all-to-all. Waits are bounded by the process group's timeout
(``init_process_group(timeout=...)``).

Example::

    plan = plan_exchange(plan.tokens_per_expert, group, hidden_size=d, dtype=x.dtype, capacity=None)
    local = dispatch_to_experts(buffer, plan, group)          # [plan.recv_counts.sum(), d], peer-major
    y = experts(local, plan.recv_counts)                      # recv_counts: [W, L]
    back = combine_from_experts(y, plan, group)               # [buffer rows, d], buffer order
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import List, Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from .buffer_pool import empty_rows
from .experts import segment_rows

logger = logging.getLogger(__name__)

_MAGIC = 0x4D6F45  # "MoE": tells a stray message of another collective from our header
_DTYPE_CODES = {torch.float32: 1, torch.float16: 2, torch.bfloat16: 3, torch.float64: 4}
HEADER_FIELDS = ("magic", "hidden_size", "dtype_code", "num_experts", "num_local_experts", "capacity",
                 "fixed_splits")


class ExpertParallelMismatch(RuntimeError):
    """Ranks of one expert-parallel group disagree on the exchange's shapes (raised on every rank)."""


@dataclass(frozen=True)
class ExchangePlan:
    """Sizes and index maps of one expert-parallel exchange.

    Attributes:
        send_splits / recv_splits: rows sent to / received from each EP peer (all_to_all_single splits).
        recv_counts: ``[W, L]`` rows received from peer w for local expert l: the experts' row counts
            for the rows :func:`dispatch_to_experts` returns (W blocks, peer-major).
        recv_index: ``[N]`` row of the padded received tensor for each real row, peer-major (fixed
            splits), else None (variable splits: nothing is padded, the rows are used as received).
        send_index: ``[R]`` row of the padded send tensor for each buffer row (fixed splits), else None.
        send_rows / recv_rows: total rows of the send / receive tensors (padding included).
    """

    send_splits: List[int]
    recv_splits: List[int]
    recv_counts: Tensor
    recv_index: Optional[Tensor]
    send_index: Optional[Tensor]
    send_rows: int
    recv_rows: int


def dtype_code(dtype: torch.dtype) -> int:
    """Small integer naming a floating dtype in the exchange header (0 = other)."""
    return _DTYPE_CODES.get(dtype, 0)


def check_group_agreement(group: Optional[dist.ProcessGroup], *, hidden_size: int, dtype: torch.dtype,
                          num_experts: int, num_local_experts: int, capacity: Optional[int],
                          fixed_splits: bool) -> None:
    """All-gather a fixed-size header over ``group``; raise on every rank if any field differs.

    Example::

        check_group_agreement(group, hidden_size=256, dtype=torch.float32, num_experts=16,
                              num_local_experts=8, capacity=None, fixed_splits=False)
    """
    # Capacity only sizes messages under fixed splits; variable splits tolerate per-rank capacities.
    cap = (capacity if capacity is not None else -1) if fixed_splits else 0
    header = torch.tensor([_MAGIC, hidden_size, dtype_code(dtype), num_experts, num_local_experts, cap,
                           int(fixed_splits)], dtype=torch.int64)
    world = dist.get_world_size(group)
    gathered = [torch.empty_like(header) for _ in range(world)]
    dist.all_gather(gathered, header, group=group)
    table = torch.stack(gathered)
    if bool((table == header).all()):
        return
    me = dist.get_rank(group)
    rows = "; ".join(f"ep rank {r}: " + ", ".join(f"{k}={int(v)}" for k, v in zip(HEADER_FIELDS, table[r]))
                     for r in range(world))
    differing = [k for i, k in enumerate(HEADER_FIELDS) if not bool((table[:, i] == table[0, i]).all())]
    hint = ""
    if "capacity" in differing:
        hint = (" Capacity depends on the local token count: give every rank the same number of tokens, "
                "or use variable splits (fixed_splits=False) or dropless routing.")
    raise ExpertParallelMismatch(f"expert-parallel ranks disagree on {differing} (this is ep rank {me}): {rows}."
                                 f"{hint}")


def plan_exchange(tokens_per_expert: Tensor, group: Optional[dist.ProcessGroup], *, hidden_size: int,
                  dtype: torch.dtype, capacity: Optional[int] = None, fixed_splits: bool = False) -> ExchangePlan:
    """Check the group agrees, exchange per-expert counts and build the index maps.

    ``tokens_per_expert`` is the local ``[E]`` row count of the expert-major buffer.
    ``fixed_splits`` needs ``capacity`` (pad every expert to C rows).

    Example::

        plan = plan_exchange(dispatch_plan.tokens_per_expert, group, hidden_size=256, dtype=torch.float32)
    """
    world = dist.get_world_size(group)
    num_experts = tokens_per_expert.numel()
    if num_experts % world:
        raise ValueError(f"{num_experts} experts cannot be split over an expert-parallel group of {world}")
    if fixed_splits and capacity is None:
        raise ValueError("fixed_splits=True needs a capacity (capacity mode); dropless uses variable splits")
    local = num_experts // world
    check_group_agreement(group, hidden_size=hidden_size, dtype=dtype, num_experts=num_experts,
                          num_local_experts=local, capacity=capacity, fixed_splits=fixed_splits)
    send_counts = tokens_per_expert.to(torch.int64).reshape(world, local)
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=group)  # equal splits: L counts per peer
    if fixed_splits:
        if int(send_counts.max()) > capacity:
            raise ValueError(f"an expert holds {int(send_counts.max())} rows, more than capacity {capacity}")
        rows_per_peer = local * capacity
        send_splits = [rows_per_peer] * world
        recv_splits = [rows_per_peer] * world
        start = torch.arange(num_experts, dtype=torch.int64) * capacity
        counts = tokens_per_expert.to(torch.int64)
        send_index = segment_rows(start, counts)
        # The real rows of each (peer, expert) block of C, peer-major.
        recv_index = segment_rows(torch.arange(world * local, dtype=torch.int64) * capacity,
                                   recv_counts.reshape(-1))
    else:
        send_splits = send_counts.sum(dim=1).tolist()
        recv_splits = recv_counts.sum(dim=1).tolist()
        send_index = recv_index = None
    return ExchangePlan(send_splits=send_splits, recv_splits=recv_splits, recv_counts=recv_counts,
                        recv_index=recv_index, send_index=send_index, send_rows=sum(send_splits),
                        recv_rows=sum(recv_splits))


def dispatch_to_experts(buffer: Tensor, plan: ExchangePlan, group: Optional[dist.ProcessGroup]) -> Tensor:
    """Send buffer rows to the experts' owners: ``[R, d]`` -> ``[N, d]`` in ``plan.recv_counts`` blocks.

    The rows come back peer-major (block w: peer w's rows for local expert 0, 1, ...), the
    layout ``GroupedExperts`` takes with ``plan.recv_counts``.

    Example::

        local = dispatch_to_experts(buffer, plan, group)
    """
    send = buffer
    if plan.send_index is not None:
        send = buffer.new_zeros(plan.send_rows, buffer.shape[1]).index_copy(0, plan.send_index.to(buffer.device),
                                                                             buffer)
    received = _AllToAll.apply(send.contiguous(), plan.recv_splits, plan.send_splits, group)
    if plan.recv_index is None:
        return received
    return received.index_select(0, plan.recv_index.to(buffer.device))


def combine_from_experts(expert_output: Tensor, plan: ExchangePlan, group: Optional[dist.ProcessGroup]) -> Tensor:
    """Return expert outputs to the ranks their tokens came from: ``[N, d]`` -> ``[R, d]`` (buffer order).

    ``expert_output`` is in the layout :func:`dispatch_to_experts` returned.

    Example::

        back = combine_from_experts(y, plan, group)
    """
    out = expert_output.contiguous()
    if plan.recv_index is not None:  # fixed splits: padding rows travel too, as zeros
        out = expert_output.new_zeros(plan.recv_rows, expert_output.shape[1]).index_copy(
            0, plan.recv_index.to(expert_output.device), expert_output)
    returned = _AllToAll.apply(out, plan.send_splits, plan.recv_splits, group)
    if plan.send_index is not None:
        returned = returned.index_select(0, plan.send_index.to(expert_output.device))
    return returned


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` with explicit splits; backward is the reverse exchange."""

    @staticmethod
    def forward(ctx, x: Tensor, out_splits: Sequence[int], in_splits: Sequence[int],  # type: ignore[override]
                group: Optional[dist.ProcessGroup]) -> Tensor:
        ctx.out_splits, ctx.in_splits, ctx.group = list(out_splits), list(in_splits), group
        out = empty_rows(x, sum(out_splits))
        dist.all_to_all_single(out, x, output_split_sizes=list(out_splits), input_split_sizes=list(in_splits),
                               group=group)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):  # type: ignore[override]
        grad = grad.contiguous()
        back = empty_rows(grad, sum(ctx.in_splits))
        dist.all_to_all_single(back, grad, output_split_sizes=ctx.in_splits, input_split_sizes=ctx.out_splits,
                               group=ctx.group)
        return back, None, None, None
