"""Grouping embedding tables into packs that share one weight buffer and one lookup kernel.

Tables share a pack when one kernel call can serve them all with one
optimizer: same weight dtype, same optimizer and hyperparameters, and both
pooled (``sum``/``mean``) or both sequence (``none``). Sum and mean share a
kernel because mean is sum with each bag scaled by ``1 / length``.

Dims. By default a pack also needs one embedding dim (PICASSO's
same-attribute merge). With ``across_dims=True`` tables of different dims
share a pack whose buffer rows are ``width = gcd(dims)`` wide: a table row of
dim ``D`` is stored as ``D / width`` consecutive buffer rows, and a lookup of
id ``i`` reads buffer rows ``start + i * k .. start + i * k + k - 1`` into
``k`` adjacent output column blocks, so the pack still writes one
``[B, sum D]`` output in one call. The price is ``k`` times more indices for
the wider tables, so it pays when it removes many calls (many distinct dims)
and the dims share a large factor; dims whose gcd is below ``min_width`` stay
in one pack per dim.

Example::

    >>> from picasso_ops.embedding.spec import TableSpec
    >>> from picasso_ops.embedding.packing import plan_packing
    >>> specs = [TableSpec("a", 10, 16), TableSpec("b", 20, 16), TableSpec("c", 5, 32)]
    >>> [[p.spec.name for p in g.tables] for g in plan_packing(specs)]
    [['a', 'b'], ['c']]
    >>> g, = plan_packing(specs, across_dims=True)
    >>> g.width, [(p.storage_offset, p.sub_rows) for p in g.tables]
    (16, [(0, 1), (10, 1), (30, 2)])
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Hashable, Sequence

import torch

from picasso_ops.embedding.spec import TableSpec

__all__ = ["TablePlacement", "PackGroup", "plan_packing", "compat_key"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TablePlacement:
    """Where one table lives in its pack's buffer.

    Attributes:
        spec: the table.
        row_offset: first logical (table) row in the pack; row-wise state index.
        storage_offset: first buffer row in the pack.
        sub_rows: buffer rows per table row, ``embedding_dim / width``.
    """

    spec: TableSpec
    row_offset: int
    storage_offset: int
    sub_rows: int


@dataclass(frozen=True)
class PackGroup:
    """Tables sharing one ``[num_storage_rows, width]`` buffer, one kernel and one optimizer.

    Attributes:
        tables: placements in spec order.
        width: buffer row width (the common dim, or the gcd of dims across dims).
        pooled: ``True`` for sum/mean tables, ``False`` for sequence (``none``) tables.
        optimizer, hyperparams, dtype: shared by all tables.
    """

    tables: tuple[TablePlacement, ...]
    width: int
    pooled: bool
    optimizer: str
    hyperparams: tuple[tuple[str, float], ...]
    dtype: torch.dtype

    @property
    def num_rows(self) -> int:
        """Logical rows in the pack (sum of table rows)."""
        last = self.tables[-1]
        return last.row_offset + last.spec.num_embeddings

    @property
    def num_storage_rows(self) -> int:
        """Buffer rows in the pack."""
        last = self.tables[-1]
        return last.storage_offset + last.spec.num_embeddings * last.sub_rows

    @property
    def sub_rows_uniform(self) -> bool:
        """Whether every table row is exactly one buffer row (the fast path)."""
        return all(p.sub_rows == 1 for p in self.tables)


def compat_key(spec: TableSpec, *, across_dims: bool = False) -> Hashable:
    """What two tables must share to be packed together.

    Example::

        >>> compat_key(TableSpec("a", 10, 8)) == compat_key(TableSpec("b", 99, 8, pooling="mean"))
        True
    """
    key = (spec.pooling != "none", spec.dtype, spec.optimizer, spec.optimizer_params)
    return key if across_dims else key + (spec.embedding_dim,)


def plan_packing(
    specs: Sequence[TableSpec],
    *,
    pack: bool = True,
    across_dims: bool = False,
    min_width: int = 4,
) -> list[PackGroup]:
    """Group tables into packs; packs in order of their first table, tables in spec order.

    Args:
        specs: the tables (names must be unique).
        pack: ``False`` gives one pack per table (the unpacked layout, for comparison).
        across_dims: let tables of different dims share a pack (see the module doc).
        min_width: smallest buffer row width accepted when packing across dims.

    Example::

        >>> len(plan_packing([TableSpec("a", 10, 8), TableSpec("b", 10, 8)], pack=False))
        2
    """
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise ValueError(f"duplicate table names: {sorted({n for n in names if names.count(n) > 1})}")
    if not pack:
        buckets: list[list[TableSpec]] = [[s] for s in specs]
    else:
        by_key: dict[Hashable, list[TableSpec]] = {}
        for spec in specs:
            by_key.setdefault(compat_key(spec, across_dims=across_dims), []).append(spec)
        buckets = []
        for members in by_key.values():
            width = math.gcd(*(s.embedding_dim for s in members))
            if across_dims and width < min_width and len({s.embedding_dim for s in members}) > 1:
                logger.info(
                    "dims %s share a factor of only %d < min_width=%d: one pack per dim",
                    sorted({s.embedding_dim for s in members}), width, min_width,
                )
                per_dim: dict[int, list[TableSpec]] = {}
                for s in members:
                    per_dim.setdefault(s.embedding_dim, []).append(s)
                buckets.extend(per_dim.values())
            else:
                buckets.append(members)
        order = {name: i for i, name in enumerate(names)}
        buckets.sort(key=lambda b: order[b[0].name])
    return [_place(bucket) for bucket in buckets]


def _place(specs: Sequence[TableSpec]) -> PackGroup:
    width = math.gcd(*(s.embedding_dim for s in specs))
    placements = []
    row, storage = 0, 0
    for spec in specs:
        k = spec.embedding_dim // width
        placements.append(TablePlacement(spec=spec, row_offset=row, storage_offset=storage, sub_rows=k))
        row += spec.num_embeddings
        storage += spec.num_embeddings * k
    first = specs[0]
    return PackGroup(
        tables=tuple(placements),
        width=width,
        pooled=first.pooling != "none",
        optimizer=first.optimizer,
        hyperparams=first.optimizer_params,
        dtype=first.dtype,
    )
