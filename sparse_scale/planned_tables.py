"""The ``picasso`` block's ``sharding: "auto"``: per-field tables placed by the sharding planner.

:func:`planned_field_embeddings` gives a factory with the signature of
``picasso_ops.models.PackedFieldEmbeddings`` (``vocab_sizes, dim, pooling, sparse, init_std,
prefix``). Each call plans its tables (``picasso_ops.distributed.planner.plan_tables``, with the
block's ``table_sharding`` overrides), logs the plan once on rank 0, and builds

* a ``PackedFieldEmbeddings`` of the one placement when the plan places every table alike
  (the class ``"data_parallel"`` / ``"row_wise"`` would give), or
* a :class:`PlannedFieldEmbeddings` over a ``MixedEmbeddingCollection`` for a mixed plan.

The own-script builder ``sparse_scale.tables_from_block`` uses it; the plan depends only on the block,
the tables, the world size and the batch, so the same config gives the same placement wherever it is built.

Example::

    make = planned_field_embeddings(block, world_size=2, batch_size=256)
    emb = make([10**6, 100], 16, "sum", SparseArgs.from_block(block), 0.01, "emb")   # [B, 2, 16]
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable, Mapping, Optional, Sequence

from torch import nn

from picasso_ops.distributed.mixed import MixedEmbeddingCollection
from picasso_ops.distributed.planner import CostModel, ShardingPlan, plan_tables, resolve_overrides
from picasso_ops.embedding.spec import TableSpec
from picasso_ops.models.field_embeddings import PackedFieldEmbeddings, SparseArgs

__all__ = ["PlannedFieldEmbeddings", "field_specs", "planned_field_embeddings"]

logger = logging.getLogger(__name__)

FieldTablesFactory = Callable[..., nn.Module]


def field_specs(vocab_sizes: Sequence[int], dim: int, pooling: str, sparse: SparseArgs, prefix: str) -> list[TableSpec]:
    """The tables ``PackedFieldEmbeddings`` builds: ``{prefix}{f}`` for field ``f`` (feature ``f{f}``).

    Example::

        >>> [s.name for s in field_specs([5, 7], 4, "sum", SparseArgs(), "emb")]
        ['emb0', 'emb1']
    """
    return [TableSpec(f"{prefix}{i}", int(v), dim, pooling, sparse.optimizer, dict(sparse.optimizer_params),
                      feature_names=(f"f{i}",)) for i, v in enumerate(vocab_sizes)]


class PlannedFieldEmbeddings(PackedFieldEmbeddings):
    """``PackedFieldEmbeddings`` over a mixed plan: some fields' tables replicated, the others row-wise.

    Same ``forward(values, lengths) -> [B, F, dim]``, table names and init as ``PackedFieldEmbeddings``;
    ``collection`` is a ``MixedEmbeddingCollection`` (its data-parallel part starts as rank 0's rows).

    Example::

        >>> plan = {"emb0": "row_wise", "emb1": "data_parallel"}
        >>> emb = PlannedFieldEmbeddings([10, 20], 4, "sum", SparseArgs(), plan, init_std=0.01, prefix="emb")
        >>> emb(torch.tensor([1, 2, 3]), torch.tensor([[1, 1], [1, 0]])).shape
        torch.Size([2, 2, 4])
    """

    def __init__(self, vocab_sizes: list[int], dim: int, pooling: str, sparse: SparseArgs,
                 plan: ShardingPlan | Mapping[str, str], init_std: Optional[float] = None,
                 prefix: str = "field") -> None:
        nn.Module.__init__(self)
        self.keys = tuple(f"f{i}" for i in range(len(vocab_sizes)))
        self.dim = dim
        specs = field_specs(vocab_sizes, dim, pooling, sparse, prefix)
        self.collection = MixedEmbeddingCollection(specs, plan, packing=sparse.packing,
                                                   process_group=sparse.process_group)
        if init_std is not None:
            self._init(specs, init_std)
            self.collection.broadcast_tables()  # the replicated part: rank 0's init wins


def planned_field_embeddings(block: Any, *, world_size: int, batch_size: int, rank: int = 0,
                             ids_per_field: float = 1.0, unique_ids: Optional[Mapping[str, float]] = None,
                             prefixes: Sequence[str] = ("emb",), cost: CostModel = CostModel(),
                             pipelined: bool = False) -> FieldTablesFactory:
    """A ``PackedFieldEmbeddings``-like factory that places each table by the planner (and the block's overrides).

    Args:
        block: a validated ``picasso`` block (``sharding`` ``"auto"``; its ``table_sharding`` overrides).
        world_size: ranks the tables span.
        batch_size: samples per rank per step (the micro-batch).
        rank: this process's rank (the plan is logged on rank 0).
        ids_per_field: mean ids per sample and field.
        unique_ids: table name -> expected distinct rows of one rank's batch (in place of the estimate).
        prefixes: the table prefixes the caller will build with this factory (``table_sharding`` keys
            must name one of their tables or a field index).
        cost: the planner's constants.
        pipelined: plan the row-wise lookups as prepared ahead by the sparse-dist pipeline (the rec job's
            loop, where ``picasso.pipeline`` lets it run); False: on the step.

    Example::

        make = planned_field_embeddings(PicassoConfig(sharding="auto"), world_size=2, batch_size=256)
        emb = make([100] * 26, 16, "sum", SparseArgs(), 0.01, "emb")
    """
    overrides = dict(block.table_sharding)
    unique = dict(unique_ids or {})

    def make(vocab_sizes: Sequence[int], dim: int, pooling: str, sparse: SparseArgs, init_std: Optional[float],
             prefix: str) -> nn.Module:
        specs = field_specs(vocab_sizes, dim, pooling, sparse, prefix)
        # keys may name any table the caller builds with this factory (e.g. "emb3" and "wide3") or a field index
        index = {f"{p}{i}": i for p in dict.fromkeys([*prefixes, prefix]) for i in range(len(vocab_sizes))}
        universe = [TableSpec(name, 1, 1) for name in index]
        resolved = resolve_overrides(overrides, universe, index, where="picasso.table_sharding")
        mine = {s.name for s in specs}
        unknown = sorted(set(unique) - {s.name for s in universe})
        if unknown:
            raise ValueError(f"unique_ids names tables {unknown} that this factory does not build "
                             f"(tables {list(index)[:6]}{' ...' if len(index) > 6 else ''})")
        plan = plan_tables(specs, world_size=world_size, batch_size=batch_size, ids_per_field=ids_per_field,
                           unique_ids={k: v for k, v in unique.items() if k in mine},
                           overrides={k: v for k, v in resolved.items() if k in mine}, cost=cost,
                           pipelined=pipelined)
        plan.log(rank, what=f"{len(specs)} '{prefix}' tables (picasso.sharding auto)")
        if plan.uniform is not None:
            return PackedFieldEmbeddings(list(vocab_sizes), dim, pooling,
                                         dataclasses.replace(sparse, sharding=plan.uniform), init_std, prefix)
        return PlannedFieldEmbeddings(list(vocab_sizes), dim, pooling, sparse, plan, init_std, prefix)

    return make

