"""A pack's row gradients: the batch's output gradient summed into unique buffer rows, block by block,
and turned into the optimizer's :class:`~picasso_ops.embedding.sparse_optim.RowUpdate`.

Sorting the ids turns the scatter into segments, so the row gradients come out of one
``embedding_bag`` over the output gradient without materialising ``[ids, width]``; blocks of whole
tables touch disjoint rows, so working per block equals one global pass while each sort stays in cache.

Example::

    >>> rows, grads = sum_by_row(torch.tensor([3, 1, 3]), None, None, torch.ones(3, 2))
    >>> rows.tolist(), grads.tolist()
    ([1, 3], [[1.0, 1.0], [2.0, 2.0]])
"""
from __future__ import annotations

from typing import Iterator, Optional, Sequence, Union

import torch
import torch.nn.functional as F
from torch import Tensor

from picasso_ops.embedding.lookup_plan import LookupPlan, offsets_of
from picasso_ops.embedding.pack_columns import PackColumns
from picasso_ops.embedding.sparse_optim import RowUpdate

__all__ = ["cumsum", "row_update", "sum_by_row", "update_blocks"]


def sum_by_row(indices: Tensor, bag_of: Optional[Tensor], weights: Optional[Tensor],
               grad: Tensor) -> tuple[Tensor, Tensor]:
    """Unique rows of ``indices`` (ascending) and ``sum_i w_i * grad[bag_of[i]]`` per row."""
    if indices.numel() == 0:
        return indices.new_zeros(0, dtype=torch.int64), grad.new_zeros(0, grad.shape[1])
    sorted_idx, perm = torch.sort(indices, stable=True)  # stable int sort is the radix path on CPU
    rows, counts = torch.unique_consecutive(sorted_idx, return_counts=True)
    segments = offsets_of(counts)
    sources = perm if bag_of is None else bag_of.index_select(0, perm)
    w = None if weights is None else weights.index_select(0, perm).to(grad.dtype)
    summed = F.embedding_bag(sources, grad, segments, mode="sum", per_sample_weights=w, include_last_offset=True)
    return rows, summed


def update_blocks(columns: PackColumns, plan: LookupPlan, block_ids: int) -> list[tuple[int, int, int, int]]:
    """``(first id, end id, first grad row, end grad row)`` per block of whole tables of about ``block_ids`` ids."""
    if columns.pooled:
        B = plan.batch_size
        column_start = plan.offsets[:: max(B, 1)].tolist() if B > 0 else [0] * (columns.num_columns + 1)
        grad_start = [c * B for c in range(columns.num_columns + 1)]
    else:
        column_start = [0] + list(cumsum(plan.seq_rows))
        grad_start = column_start
    blocks, c0 = [], 0
    for c in columns.table_first_columns[1:] + [columns.num_columns]:
        if column_start[c] - column_start[c0] >= block_ids or c == columns.num_columns:
            blocks.append((column_start[c0], column_start[c], grad_start[c0], grad_start[c]))
            c0 = c
    return blocks


def row_update(columns: PackColumns, rows: Tensor, grad_rows: Tensor, uniform_step: Optional[int],
               steps: Tensor) -> RowUpdate:
    """The optimizer's view of unique storage ``rows``: their logical rows, row dims and steps.

    ``uniform_step`` is the step every table of the pack is at, or ``None`` when they differ (then each
    row's table's entry of ``steps`` is used).
    """
    rows = rows.long()
    table = None
    if not columns.uniform or uniform_step is None:
        table = torch.searchsorted(columns.t_storage_start, rows, right=True) - 1
    row_dim: Union[Tensor, int]
    if columns.uniform:
        logical, segment, row_dim = rows, None, columns.width
    else:
        logical = columns.t_row_start[table] + (rows - columns.t_storage_start[table]) // columns.t_sub_rows[table]
        logical, segment = torch.unique_consecutive(logical, return_inverse=True)
        row_dim = (columns.t_sub_rows[table] * columns.width).to(torch.float32)
    step = uniform_step if uniform_step is not None else steps[table]
    return RowUpdate(rows=rows, grad=grad_rows, logical_rows=logical, segment=segment, row_dim=row_dim, step=step)


def cumsum(values: Sequence[int]) -> Iterator[int]:
    """Running totals of ``values``."""
    total = 0
    for v in values:
        total += v
        yield total
