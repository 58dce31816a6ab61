"""Packed tables across ranks: data-parallel replicas, row-wise shards, a planner mixing them, the sparse step.

Example::

    >>> from picasso_ops.embedding import TableSpec
    >>> from picasso_ops.distributed import DataParallelEmbeddingCollection, RowShardedEmbeddingCollection
    >>> dp = DataParallelEmbeddingCollection([TableSpec("user", 1000, 16)])   # every rank, every row
    >>> rw = RowShardedEmbeddingCollection([TableSpec("item", 10**7, 16)])     # id % world_size on its owner
    >>> plan = plan_tables(specs, world_size=8, batch_size=256)                # each table: dp or row-wise
    >>> both = MixedEmbeddingCollection(specs, plan)                          # one forward over both parts
    >>> # loss.backward(); then on every rank, once per optimizer step:
    >>> dp.sparse_step(); rw.sparse_step()
    >>> replica_problems(model, world_size=2)  # table modules whose ranks would drift apart: refuse them
    >>> pipe = SparseDistPipeline(model, peek=stream.peek, to_batch=lambda b: (b.values, b.lengths))  # next batch's ids
"""

from picasso_ops.distributed.comm import world_info
from picasso_ops.distributed.data_parallel import DataParallelEmbeddingCollection
from picasso_ops.distributed.mixed import MixedEmbeddingCollection
from picasso_ops.distributed.pipeline import PipelineError, SparseDistPipeline
from picasso_ops.distributed.planner import CostModel, ShardingPlan, plan_tables
from picasso_ops.distributed.replicas import replica_problems
from picasso_ops.distributed.row_sharded import RowShardedEmbeddingCollection, shard_rows
from picasso_ops.distributed.step import (discard_sparse_gradients, engine_step, sparse_modules, sparse_step,
                                          wait_sparse_backward)

__all__ = [
    "DataParallelEmbeddingCollection",
    "RowShardedEmbeddingCollection",
    "MixedEmbeddingCollection",
    "plan_tables",
    "ShardingPlan",
    "CostModel",
    "shard_rows",
    "sparse_step",
    "sparse_modules",
    "discard_sparse_gradients",
    "wait_sparse_backward",
    "engine_step",
    "world_info",
    "replica_problems",
    "SparseDistPipeline",
    "PipelineError",
]
