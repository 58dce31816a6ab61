"""Tensor-parallel ranks around the expert exchange: drop their duplicate rows before it, gather them after.

Under a tensor-parallel ``mpu`` (Megatron-style non-expert layers, tensor-parallel size tp > 1) the
tp ranks of a tensor-parallel group hold the same tokens. As DeepSpeed's ``MOELayer`` does
(``deepspeed/moe/mappings.py``: ``drop_tokens`` / ``gather_tokens``), each of them sends only its 1/tp
share of every expert's rows through the expert all-to-all, and the shares are all-gathered over the
tensor-parallel group afterwards, so every token is computed once. With expert tensor parallelism
(``enable_expert_tensor_parallelism=True``: the expert modules are tensor-parallel, e.g. Megatron's
``ParallelMLP``, and the expert-parallel groups join ranks of equal tensor-parallel rank) the rows
received for the local experts are also all-gathered over the tensor-parallel group before the experts
run, and each rank keeps its own share of their output.

DeepSpeed splits a capacity dimension padded to a multiple of tp; this layer's rows per expert vary
(only kept rows travel), so each expert's rows are split in tp near-equal consecutive shares
(``torch.tensor_split``'s sizes) and the all-gathers pad to the largest share. Both ops are autograd
functions paired as DeepSpeed's: keeping a share has the all-gather as its backward and the all-gather
keeping a share as its backward (the loss is replicated over the tensor-parallel group).

Example::

    split = RowSplit.of(tokens_per_expert, tp_size=2, tp_rank=0)   # this rank's share of every expert's rows
    mine = keep_share(buffer, split, group)                        # [split.counts[0].sum(), d]
    full = gather_shares(mine, split, group)                       # [buffer rows, d], buffer order again
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import torch
import torch.distributed as dist
from torch import Tensor


@dataclass(frozen=True)
class RowSplit:
    """How the rows of an expert-major buffer are shared among the tensor-parallel ranks.

    Attributes:
        counts: ``[tp, E]`` rows of each expert that tensor-parallel rank t sends.
        order: ``[R]`` buffer rows in share-major order (rank 0's rows of every expert, then rank 1's, ...).
        sizes: rows of each rank's share (``counts.sum(1)``).
        rank: this rank's index in the tensor-parallel group.
    """

    counts: Tensor
    order: Tensor
    sizes: List[int]
    rank: int

    @classmethod
    def of(cls, tokens_per_expert: Tensor, tp_size: int, tp_rank: int) -> "RowSplit":
        """Split each expert's rows (``tokens_per_expert`` ``[E]``, expert-major buffer) in ``tp_size`` shares."""
        if tp_size < 1 or not 0 <= tp_rank < tp_size:
            raise ValueError(f"tensor-parallel rank {tp_rank} of size {tp_size}")
        n = tokens_per_expert.to(torch.long).cpu()
        base, extra = n // tp_size, n % tp_size
        ranks = torch.arange(tp_size).unsqueeze(1)
        counts = base.unsqueeze(0) + (ranks < extra.unsqueeze(0)).long()       # [tp, E]
        # Share t of expert e starts at expert e's first row plus the sizes of shares 0..t-1.
        expert_start = torch.cumsum(n, 0) - n                                    # [E]
        share_start = expert_start.unsqueeze(0) + torch.cumsum(counts, 0) - counts  # [tp, E]
        flat_counts = counts.reshape(-1)
        starts = share_start.reshape(-1).repeat_interleave(flat_counts)
        offsets = torch.arange(int(flat_counts.sum())) - (torch.cumsum(flat_counts, 0) - flat_counts).repeat_interleave(
            flat_counts)
        order = (starts + offsets).to(tokens_per_expert.device)
        return cls(counts=counts, order=order, sizes=counts.sum(1).tolist(), rank=tp_rank)

    @property
    def offset(self) -> int:
        return sum(self.sizes[:self.rank])


def _all_gather_rows(x: Tensor, sizes: List[int], group: Optional[dist.ProcessGroup]) -> Tensor:
    """Concatenate every rank's ``x`` (``sizes[r]`` rows each) in rank order; pads to the largest for gloo."""
    largest = max(sizes)
    padded = x if x.shape[0] == largest else torch.cat([x, x.new_zeros(largest - x.shape[0], *x.shape[1:])])
    parts = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(parts, padded.contiguous(), group=group)
    return torch.cat([part[:size] for part, size in zip(parts, sizes)])


class _KeepSlice(torch.autograd.Function):
    """Forward: this rank's rows ``[offset, offset + size)``; backward: every rank's gradient rows, all-gathered."""

    @staticmethod
    def forward(ctx, x: Tensor, sizes: List[int], rank: int, group: Optional[dist.ProcessGroup]) -> Tensor:
        ctx.sizes, ctx.group = sizes, group
        offset = sum(sizes[:rank])
        return x[offset:offset + sizes[rank]]

    @staticmethod
    def backward(ctx, grad: Tensor):
        return _all_gather_rows(grad.contiguous(), ctx.sizes, ctx.group), None, None, None


class _GatherSlices(torch.autograd.Function):
    """Forward: every rank's rows all-gathered in rank order; backward: this rank's rows of the gradient."""

    @staticmethod
    def forward(ctx, x: Tensor, sizes: List[int], rank: int, group: Optional[dist.ProcessGroup]) -> Tensor:
        ctx.offset, ctx.size = sum(sizes[:rank]), sizes[rank]
        return _all_gather_rows(x, sizes, group)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad[ctx.offset:ctx.offset + ctx.size], None, None, None


def keep_slice(x: Tensor, sizes: List[int], rank: int, group: Optional[dist.ProcessGroup]) -> Tensor:
    """Rows ``[sum(sizes[:rank]), +sizes[rank])`` of ``x``; the backward all-gathers the gradient over ``group``."""
    return _KeepSlice.apply(x, sizes, rank, group)


def gather_slices(x: Tensor, sizes: List[int], rank: int, group: Optional[dist.ProcessGroup]) -> Tensor:
    """Every rank's ``x`` concatenated in rank order (``sizes[r]`` rows each); the backward keeps this rank's rows."""
    return _GatherSlices.apply(x, sizes, rank, group)


def keep_share(buffer: Tensor, split: RowSplit, group: Optional[dist.ProcessGroup]) -> Tensor:
    """This rank's share of every expert's rows of an expert-major ``buffer`` (expert-major too)."""
    return keep_slice(buffer.index_select(0, split.order), split.sizes, split.rank, group)


def gather_shares(share: Tensor, split: RowSplit, group: Optional[dist.ProcessGroup]) -> Tensor:
    """The inverse of :func:`keep_share` over the group: every rank's share back in the buffer's row order."""
    gathered = gather_slices(share, split.sizes, split.rank, group)
    out = torch.empty_like(gathered)
    return out.index_copy(0, split.order, gathered)


def gather_counts(counts: Tensor, group: Optional[dist.ProcessGroup]) -> Tensor:
    """Every rank's ``counts`` (same shape on every rank) stacked in rank order: ``[ranks, *counts.shape]``."""
    parts = [torch.empty_like(counts) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, counts.contiguous(), group=group)
    return torch.stack(parts)
