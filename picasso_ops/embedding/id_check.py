"""Ids checked against their own table's size, with ``picasso.bounds_check``'s three answers.

"fatal" raises ``IndexError`` naming the field, id and table size; "warn" and "clamp" return a copy whose
bad ids are replaced, and count them per table (``BoundsCheck.record``). One ``aminmax`` decides the common
case; only when the largest id reaches the smallest table's size are ids compared with their own table's.

Example::

    >>> check_ids(columns, bounds, batch_ids, ids_per_column)  # doctest: +SKIP
"""
from __future__ import annotations

import torch
from torch import Tensor

from picasso_ops.embedding.bounds import BoundsCheck
from picasso_ops.embedding.lookup_plan import LookupPlan
from picasso_ops.embedding.pack_columns import PackColumns

__all__ = ["check_ids", "check_plan_ids"]


def check_ids(columns: PackColumns, bounds: BoundsCheck, raw: Tensor, counts: Tensor) -> Tensor:
    """``raw`` (ids, column after column, ``counts[c]`` of column ``c``), or a copy with bad ids replaced."""
    if raw.numel() == 0:
        return raw
    lo, hi = (int(v) for v in torch.aminmax(raw))
    if lo >= 0 and hi < columns.min_rows:
        return raw
    bound = torch.repeat_interleave(columns.rows, counts, output_size=raw.numel())
    bad = (raw < 0) | (raw >= bound)
    if not bool(bad.any()):
        return raw
    if bounds.mode == "fatal":
        i = int(bad.nonzero()[0, 0])
        column = int(torch.searchsorted(torch.cumsum(counts, 0), torch.tensor(i, device=counts.device), right=True))
        name, p = columns.features[columns.column_owner[column]]
        raise IndexError(
            f"field {name!r}: id {int(raw[i])} is out of range for table {p.spec.name!r} "
            f"of size {p.spec.num_embeddings} (valid ids are 0..{p.spec.num_embeddings - 1}; "
            "picasso.bounds_check 'warn' or 'clamp' replaces such ids instead, counted)"
        )
    _count_bad(columns, bounds, raw, counts, bad)
    return bounds.replace(raw, bound, bad)


def check_plan_ids(columns: PackColumns, bounds: BoundsCheck, plan: LookupPlan) -> None:
    """:func:`check_ids` for a custom-op plan whose ids the op has not checked (raises ``IndexError``)."""
    if plan.column_rows is None:
        return
    B = plan.batch_size
    counts = plan.offsets[::B].diff() if B > 0 else plan.offsets.new_zeros(columns.num_columns)
    check_ids(columns, bounds, plan.indices, counts)  # fatal raises; warn/clamp replaced the ids when planned


def _count_bad(columns: PackColumns, bounds: BoundsCheck, raw: Tensor, counts: Tensor, bad: Tensor) -> None:
    """Count the bad ids per table (once per id: a sub-row table's other columns repeat its ids)."""
    column_of = torch.repeat_interleave(torch.arange(columns.num_columns, device=raw.device), counts,
                                        output_size=raw.numel())
    per_column = torch.bincount(column_of[bad], minlength=columns.num_columns).tolist()
    per_table: dict[str, int] = {}
    example: dict[str, tuple[str, int, int]] = {}
    for fi, (name, p) in enumerate(columns.features):
        c = columns.feature_first_column[fi]
        if per_column[c]:
            table = p.spec.name
            per_table[table] = per_table.get(table, 0) + per_column[c]
            if table not in example:
                first = int((bad & (column_of == c)).nonzero()[0, 0])
                example[table] = (name, int(raw[first]), p.spec.num_embeddings)
    bounds.record(per_table, example)
