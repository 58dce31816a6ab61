"""Data-parallel and row-wise packed tables in one collection: a sharding plan's tables behind one forward.

:class:`MixedEmbeddingCollection` holds a :class:`DataParallelEmbeddingCollection` of the tables a
plan replicates and a :class:`RowShardedEmbeddingCollection` of those it shards row-wise, and looks
up one batch in both (the data-parallel part locally, the row-wise part with its all-to-alls),
returning the pooled features in the order of the tables given, as one unsharded collection would.

It is a container, not a sparse-step module itself: :func:`picasso_ops.distributed.sparse_step`
(and ``engine_step``, ``sparse_scale.initialize``'s engine) finds its two parts and steps each,
so every replicated row is updated on every rank from the all-gathered gradients, and every
row-wise row only on the rank that owns it.

Example::

    >>> from picasso_ops.embedding import TableSpec
    >>> from picasso_ops.distributed import sparse_step
    >>> emb = MixedEmbeddingCollection([TableSpec("user", 10**6, 16), TableSpec("country", 200, 16)],
    ...                                {"user": "row_wise", "country": "data_parallel"})
    >>> out = emb(batch)                      # KeyedEmbeddings, features in table order
    >>> loss_fn(out.values).backward()
    >>> sparse_step(emb)                      # both parts, on every rank
"""
from __future__ import annotations

import logging
from typing import Mapping, Optional, Sequence, Union

import torch
from torch import Tensor, nn

from picasso_ops.distributed.comm import ProcessGroup
from picasso_ops.distributed.data_parallel import DataParallelEmbeddingCollection
from picasso_ops.distributed.planner import PLACEMENTS, ShardingPlan
from picasso_ops.distributed.row_sharded import RowShardedEmbeddingCollection
from picasso_ops.embedding.packed import KeyedEmbeddings
from picasso_ops.embedding.spec import TableSpec
from picasso_ops.jagged import JaggedBatch

__all__ = ["MixedEmbeddingCollection"]

logger = logging.getLogger(__name__)


class MixedEmbeddingCollection(nn.Module):
    """Tables placed by a plan: a data-parallel part and a row-wise part, one forward.

    Args:
        specs: the tables.
        plan: table name -> ``"data_parallel"`` / ``"row_wise"`` for every table, or a
            :class:`~picasso_ops.distributed.planner.ShardingPlan` of them.
        packing: pack compatible tables within each part.
        process_group: the group both parts span (default: the world).
        device: where the tables live.

    Attributes:
        data_parallel: the replicated part (``None`` when the plan replicates no table).
        row_wise: the sharded part (``None`` when the plan shards no table).

    Example::

        >>> emb = MixedEmbeddingCollection([TableSpec("a", 10, 4), TableSpec("b", 7, 4)],
        ...                                {"a": "row_wise", "b": "data_parallel"})
        >>> emb.pooled_features, emb.placement("a")
        (('a', 'b'), 'row_wise')
    """

    def __init__(
        self,
        specs: Sequence[TableSpec],
        plan: Union[Mapping[str, str], ShardingPlan],
        *,
        packing: bool = True,
        process_group: Optional[ProcessGroup] = None,
        device: Optional[Union[torch.device, str]] = None,
    ) -> None:
        super().__init__()
        self.specs: tuple[TableSpec, ...] = tuple(specs)
        if not self.specs:
            raise ValueError("MixedEmbeddingCollection needs at least one table")
        placement = {t.name: t.choice for t in plan.tables} if isinstance(plan, ShardingPlan) else dict(plan)
        names = [s.name for s in self.specs]
        missing = [n for n in names if n not in placement]
        extra = sorted(set(placement) - set(names))
        bad = {n: p for n, p in placement.items() if p not in PLACEMENTS}
        if missing or extra or bad:
            raise ValueError(f"MixedEmbeddingCollection: the plan must place every table once as one of "
                             f"{list(PLACEMENTS)}; tables without a placement {missing}, unknown tables {extra}, "
                             f"bad placements {bad}")
        self._placement: dict[str, str] = {n: placement[n] for n in names}
        dp = [s for s in self.specs if self._placement[s.name] == "data_parallel"]
        rw = [s for s in self.specs if self._placement[s.name] == "row_wise"]
        self.data_parallel: Optional[DataParallelEmbeddingCollection] = (
            DataParallelEmbeddingCollection(dp, packing=packing, process_group=process_group, device=device)
            if dp else None)
        self.row_wise: Optional[RowShardedEmbeddingCollection] = (
            RowShardedEmbeddingCollection(rw, packing=packing, process_group=process_group, device=device)
            if rw else None)
        pooled = [(f, s) for s in self.specs if s.pooling != "none" for f in s.feature_names]
        self.pooled_features: tuple[str, ...] = tuple(f for f, _ in pooled)
        offsets = [0]
        for _, s in pooled:
            offsets.append(offsets[-1] + s.embedding_dim)
        self.column_offsets: tuple[int, ...] = tuple(offsets)
        # the parts' outputs side by side (data-parallel first), then one gather into table order
        where: dict[str, tuple[int, int]] = {}
        base = 0
        for part in self.parts:
            for i, f in enumerate(part.pooled_features):
                where[f] = (base + part.column_offsets[i], base + part.column_offsets[i + 1])
            base += part.column_offsets[-1]
        order = [torch.arange(*where[f]) for f in self.pooled_features]
        perm = torch.cat(order) if order else torch.zeros(0, dtype=torch.long)
        self._identity = bool(torch.equal(perm, torch.arange(perm.numel())))
        self.register_buffer("_columns", perm, persistent=False)

    @property
    def parts(self) -> list[Union[DataParallelEmbeddingCollection, RowShardedEmbeddingCollection]]:
        """The non-empty parts, data-parallel first (the order of the forward and of the sparse step)."""
        return [p for p in (self.data_parallel, self.row_wise) if p is not None]

    def placement(self, table: str) -> str:
        """``"data_parallel"`` or ``"row_wise"``: where ``table`` lives."""
        try:
            return self._placement[table]
        except KeyError:
            raise KeyError(f"no table {table!r}; tables: {list(self._placement)}") from None

    def _part(self, table: str) -> Union[DataParallelEmbeddingCollection, RowShardedEmbeddingCollection]:
        part = self.data_parallel if self.placement(table) == "data_parallel" else self.row_wise
        assert part is not None
        return part

    def table_weight(self, table: str) -> Tensor:
        """The table's weight on this rank: all rows (data-parallel) or this rank's shard (row-wise); a view."""
        return self._part(table).table_weight(table)

    @property
    def lr(self) -> float:
        """The learning rate of every pack of both parts."""
        return self.parts[0].lr

    @lr.setter
    def lr(self, value: float) -> None:
        for part in self.parts:
            part.lr = value

    def forward(self, batch: JaggedBatch) -> KeyedEmbeddings:
        """Pooled ``[B, sum D]`` in table order and the data-parallel part's sequences (a collective: every rank).

        Example::

            >>> out = emb(JaggedBatch(["a", "b"], torch.tensor([1, 2, 3]), torch.tensor([[1, 1], [1, 0]])))
            >>> out.values.shape
            torch.Size([2, 8])
        """
        outs = []
        sequences: dict[str, Tensor] = {}
        for part in self.parts:
            keys = tuple(part.pooled_features) + tuple(getattr(part, "sequence_features", ()))
            out = part(batch if tuple(batch.keys) == keys else batch.select(keys))
            outs.append(out.values)
            sequences.update(out.sequences)
        values = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
        if not self._identity:
            values = values.index_select(1, self._columns)
        return KeyedEmbeddings(self.pooled_features, values, self.column_offsets, sequences)

    @torch.no_grad()
    def full_state_dict(self) -> dict[str, Tensor]:
        """Every table's full weight and optimizer state, keyed as an unsharded collection's (a collective)."""
        out: dict[str, Tensor] = {}
        if self.data_parallel is not None:
            out.update({k: v.clone() for k, v in self.data_parallel.state_dict().items()})
        if self.row_wise is not None:
            out.update(self.row_wise.full_state_dict())
        return out

    @torch.no_grad()
    def load_full_state_dict(self, state: Mapping[str, Tensor]) -> None:
        """Load full per-table tensors (an unsharded collection's ``state_dict``); local, no collective."""
        if self.data_parallel is not None:
            names = {s.name for s in self.data_parallel.specs}
            self.data_parallel.load_state_dict({k: v for k, v in state.items() if k.split(".", 1)[0] in names})
        if self.row_wise is not None:
            self.row_wise.load_full_state_dict(state)

    def broadcast_tables(self, src: int = 0) -> None:
        """Copy the data-parallel part's tables from rank ``src`` (after a custom init); the shards stay."""
        if self.data_parallel is not None:
            self.data_parallel.broadcast_tables(src)
