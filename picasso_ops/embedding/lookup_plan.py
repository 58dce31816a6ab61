"""A pack's per-batch lookup plan: the batch's ids as buffer rows, bag offsets and mean scales.

Bags are ordered column-major, the order the batch already has (field-major), so a pack whose fields
are consecutive in the batch reads the ids in place (``first_field``); otherwise one gather collects
its columns. The plan built here is kept for the backward, which sums gradients into the same rows.

Example::

    >>> plan = build_plan(columns, batch, column_fields, first_field=0, check=lambda ids, counts: ids,
    ...                   op_path=False)  # doctest: +SKIP
    >>> plan.indices.shape, plan.offsets.shape  # [ids], [C * B + 1]  # doctest: +SKIP
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import Tensor

from picasso_ops.embedding.pack_columns import INT32_MAX, PackColumns
from picasso_ops.jagged import JaggedBatch

__all__ = ["IdCheck", "LookupPlan", "Run", "build_plan", "offsets_of", "torch_plan"]

# a run copies kernel column blocks [c0, c1) to output columns starting at `start`
Run = tuple[int, int, int]
# (ids, ids per column) -> the ids to look up (the same tensor, or a copy with bad ids replaced)
IdCheck = Callable[[Tensor, Tensor], Tensor]


@dataclass
class LookupPlan:
    """One pack's per-batch indices, built by :func:`build_plan` and kept for the backward."""

    indices: Tensor  # [N] buffer rows, int32 or int64, column-major: all ids of column 0, then column 1, ...
    offsets: Optional[Tensor]  # pooled: [C * B + 1] bag offsets, same dtype as indices
    lengths: Optional[Tensor]  # pooled: [C * B] ids per bag (bag (c, b) at c * B + b)
    weights: Optional[Tensor]  # pooled, weighted batches: [N] per-sample weights
    bag_scale: Optional[Tensor]  # pooled packs with mean tables: [C * B] 1 / length for mean bags, 1 for sum bags
    batch_size: int
    seq_rows: tuple[int, ...] = ()  # sequence packs: buffer rows per feature
    seq_ids: tuple[int, ...] = ()  # sequence packs: ids per feature
    row_offsets: Optional[Tensor] = None  # custom ops: indices are raw ids, buffer row = id + row_offsets[column]
    column_rows: Optional[Tensor] = None  # custom ops: ids not checked yet; the op checks id < column_rows[column]


def build_plan(columns: PackColumns, batch: JaggedBatch, column_fields: Tensor, first_field: Optional[int],
               check: IdCheck, op_path: bool, check_in_op: bool = False) -> LookupPlan:
    """The plan of one pack for ``batch``.

    ``column_fields`` holds the batch field of each column; ``first_field`` is set when the columns are
    the consecutive batch fields ``first_field, ...``, so their ids are one slice of ``batch.values``.
    ``op_path``: a custom op runs the lookup, which adds each column's row offset itself; with
    ``check_in_op`` it also checks the ids as it reads them, so ``check`` is skipped.
    """
    B, C = batch.batch_size, columns.num_columns
    device = batch.values.device
    field_offsets = batch.field_offsets
    weights = None
    if first_field is not None:
        f0, f1 = first_field, first_field + C
        lo, hi = (int(v) for v in field_offsets[f0 : f1 + 1 : C])
        raw = batch.values[lo:hi]  # a view: never modified below
        counts = field_offsets[f0 + 1 : f1 + 1] - field_offsets[f0:f1]
        lengths = batch.lengths[f0:f1].reshape(-1)
        offsets = batch.offsets[f0 * B : f1 * B + 1]  # a view: never modified below
        if lo:
            offsets = offsets - lo
        if batch.weights is not None and columns.pooled:
            weights = batch.weights[lo:hi]
    else:
        starts = field_offsets[:-1].index_select(0, column_fields)
        counts = field_offsets[1:].index_select(0, column_fields) - starts
        n = int(counts.sum())
        # each column is one contiguous run of the batch's ids: gather index = run start + position in run
        src = torch.repeat_interleave(starts - (torch.cumsum(counts, 0) - counts), counts, output_size=n)
        src += torch.arange(n, device=device)
        raw = batch.values.index_select(0, src)
        lengths = batch.lengths.index_select(0, column_fields).reshape(-1)
        offsets = offsets_of(lengths) if columns.pooled else None
        if batch.weights is not None and columns.pooled:
            weights = batch.weights.index_select(0, src)
    n = raw.numel()
    if op_path:
        # the op adds each column's row offset itself (no shifted copy of the ids) and, when it checks
        # the ids, does so while it reads them (no separate pass here)
        if not check_in_op:
            raw = check(raw, counts)
        return LookupPlan(
            indices=raw, offsets=offsets, lengths=lengths, weights=weights, bag_scale=None,
            batch_size=B, row_offsets=columns.add, column_rows=columns.rows,
        )
    raw = check(raw, counts)
    index_dtype = columns.index_dtype if n <= INT32_MAX and B * C < INT32_MAX else torch.int64
    add = torch.repeat_interleave(columns.add, counts, output_size=n)
    if columns.uniform:  # narrowing first is safe (ids were checked) and halves the bytes moved
        indices = raw.to(index_dtype, copy=True)
        indices += add
    else:
        indices = (raw * torch.repeat_interleave(columns.mult, counts, output_size=n) + add).to(index_dtype)
    if not columns.pooled:
        return _sequence_plan(columns, indices, counts, B, index_dtype)
    return LookupPlan(
        indices=indices,
        offsets=offsets.to(index_dtype),
        lengths=lengths,
        weights=weights,
        bag_scale=columns.mean_scale(lengths, B),
        batch_size=B,
    )


def torch_plan(columns: PackColumns, plan: LookupPlan) -> LookupPlan:
    """``plan`` with buffer rows as indices (and mean scales), for the torch path, from a custom-op plan."""
    if plan.row_offsets is None:
        return plan
    counts = plan.offsets[:: max(plan.batch_size, 1)].diff() if plan.batch_size > 0 else plan.offsets[:0]
    rows = plan.indices + torch.repeat_interleave(plan.row_offsets.long(), counts, output_size=plan.indices.numel())
    return LookupPlan(
        indices=rows, offsets=plan.offsets, lengths=plan.lengths, weights=plan.weights,
        bag_scale=columns.mean_scale(plan.lengths, plan.batch_size), batch_size=plan.batch_size,
    )


def offsets_of(lengths: Tensor) -> Tensor:
    """``[n]`` lengths -> ``[n + 1]`` int64 offsets with a leading zero."""
    out = torch.zeros(lengths.numel() + 1, dtype=torch.int64, device=lengths.device)
    torch.cumsum(lengths, 0, dtype=torch.int64, out=out[1:])
    return out


def _sequence_plan(columns: PackColumns, indices: Tensor, counts: Tensor, batch_size: int,
                   index_dtype: torch.dtype) -> LookupPlan:
    """Sequence packs: expand each id to its table's ``k`` buffer rows (``k == 1`` in same-dim packs)."""
    rows = counts
    if not columns.uniform:
        n = indices.numel()
        k = torch.repeat_interleave(columns.mult, counts, output_size=n)
        rows = counts * columns.mult
        m = int(rows.sum())
        first = torch.repeat_interleave(torch.cumsum(k, 0) - k, k, output_size=m)
        indices = torch.repeat_interleave(indices, k, output_size=m) + (torch.arange(m, device=indices.device) - first)
    return LookupPlan(
        indices=indices.to(index_dtype if indices.numel() <= INT32_MAX else torch.int64),
        offsets=None,
        lengths=None,
        weights=None,
        bag_scale=None,
        batch_size=batch_size,
        seq_rows=tuple(rows.tolist()),
        seq_ids=tuple(counts.tolist()),
    )
