"""Dynamic vocabularies: embedding tables keyed by raw int64 ids through a collision-free hash table.

Example::

    >>> import torch
    >>> from picasso_ops.vocab import DynamicEmbeddingTable
    >>> table = DynamicEmbeddingTable(capacity=1000, dim=8, min_frequency=2, eviction="lfu")
    >>> rows = table(torch.tensor([10**15, 3, 3]))  # 3 is seen twice: admitted; 10**15 reads zeros
"""

from picasso_ops.vocab.dynamic_table import DynamicEmbeddingTable, VocabStats, hashed_init, with_sparse_update
from picasso_ops.vocab.hash_table import IdHashTable, TableFullError

__all__ = ["IdHashTable", "TableFullError", "DynamicEmbeddingTable", "VocabStats", "hashed_init", "with_sparse_update"]
