"""A pack's static lookup constants: its "columns", and where each maps in the pack's weight buffer.

Pooled packs look up one column per (feature, buffer row of a table row), so a table of dim
``k * width`` owns ``k`` adjacent columns; sequence packs have one column per feature. An id ``i``
of column ``c`` reads buffer row ``i * mult[c] + add[c]`` and must be below ``rows[c]``.

Example::

    >>> from picasso_ops.embedding.packing import plan_packing
    >>> from picasso_ops.embedding.spec import TableSpec
    >>> group = plan_packing([TableSpec("a", 10, 8), TableSpec("b", 20, 8)])[0]
    >>> PackColumns(group, None).num_columns
    2
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor, nn

from picasso_ops.embedding.packing import PackGroup, TablePlacement

__all__ = ["INT32_MAX", "PackColumns", "long_tensor"]

INT32_MAX = 2**31 - 1


def long_tensor(values: Sequence[int], device: Optional[torch.device]) -> Tensor:
    """``values`` as an int64 tensor on ``device``."""
    return torch.tensor(list(values), dtype=torch.int64, device=device)


class PackColumns(nn.Module):
    """The per-column and per-table constants of one pack (buffers, so they follow ``.to(device)``)."""

    def __init__(self, group: PackGroup, device: Optional[torch.device]) -> None:
        super().__init__()
        self.pooled = group.pooled
        self.width = group.width
        self.uniform = group.sub_rows_uniform  # storage rows are table rows (no sub-row tables)
        self.index_dtype = torch.int32 if group.num_storage_rows <= INT32_MAX else torch.int64
        # features in spec order: (feature name, placement)
        self.features: list[tuple[str, TablePlacement]] = [
            (name, p) for p in group.tables for name in p.spec.feature_names
        ]
        self.min_rows = min(p.spec.num_embeddings for p in group.tables)
        # per table, for mapping buffer rows back to tables (sub-row packs, per-table steps)
        self.register_buffer("t_storage_start", long_tensor([p.storage_offset for p in group.tables], device),
                             persistent=False)
        self.register_buffer("t_row_start", long_tensor([p.row_offset for p in group.tables], device), persistent=False)
        self.register_buffer("t_sub_rows", long_tensor([p.sub_rows for p in group.tables], device), persistent=False)
        mult, add, rows, mean, owner, first = [], [], [], [], [], []
        for i, (_, p) in enumerate(self.features):
            first.append(len(owner))
            for j in range(p.sub_rows if group.pooled else 1):
                mult.append(p.sub_rows)
                add.append(p.storage_offset + j)
                rows.append(p.spec.num_embeddings)
                mean.append(p.spec.pooling == "mean")
                owner.append(i)
        self.column_owner = owner  # the feature of each column
        self.feature_first_column = first
        # features come grouped by table, so a table's columns are contiguous: where each table starts
        self.table_first_columns = [
            first[i] for i, (_, p) in enumerate(self.features) if i == 0 or self.features[i - 1][1].spec.name != p.spec.name
        ]
        self.num_columns = len(owner)
        self.has_mean = any(mean)
        self.register_buffer("mult", long_tensor(mult, device), persistent=False)
        self.register_buffer("add", long_tensor(add, device).to(self.index_dtype), persistent=False)
        self.register_buffer("rows", long_tensor(rows, device), persistent=False)
        self.register_buffer("mean", torch.tensor(mean, dtype=torch.bool, device=device), persistent=False)

    def mean_scale(self, lengths: Tensor, batch_size: int) -> Optional[Tensor]:
        """``[C * B]`` per-bag scale: ``1 / length`` for bags of mean tables, 1 for sum bags; ``None`` without mean."""
        if not self.has_mean:
            return None
        inv = lengths.to(torch.float32).clamp(min=1.0).reciprocal()
        return torch.where(self.mean.repeat_interleave(batch_size), inv, torch.ones_like(inv))

    def extra_repr(self) -> str:
        return f"columns={self.num_columns}, width={self.width}, pooled={self.pooled}"
