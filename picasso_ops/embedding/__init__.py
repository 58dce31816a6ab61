"""Packed embedding tables with fused sparse optimizers.

Example::

    >>> from picasso_ops.embedding import PackedEmbeddingCollection, TableSpec
    >>> emb = PackedEmbeddingCollection([TableSpec("user", 1000, 16, optimizer="rowwise_adagrad")])
"""

from picasso_ops.embedding.packed import KeyedEmbeddings, PackedEmbeddingCollection
from picasso_ops.embedding.packing import PackGroup, TablePlacement, plan_packing
from picasso_ops.embedding.sparse_optim import (
    OPTIMIZERS,
    LazyAdam,
    RowUpdate,
    RowWiseAdagrad,
    SparseOptimizer,
    SparseSGD,
    create_optimizer,
)
from picasso_ops.embedding.spec import TableSpec

__all__ = [
    "PackedEmbeddingCollection",
    "KeyedEmbeddings",
    "TableSpec",
    "PackGroup",
    "TablePlacement",
    "plan_packing",
    "SparseOptimizer",
    "SparseSGD",
    "RowWiseAdagrad",
    "LazyAdam",
    "RowUpdate",
    "OPTIMIZERS",
    "create_optimizer",
]
