"""A hot-row cache in front of a slower row store (host memory, a memory-mapped file, a parameter server).

Example::

    >>> import torch
    >>> from picasso_ops.cache import CachedEmbeddingTable, HostRowStore
    >>> table = CachedEmbeddingTable(HostRowStore(10_000, 16), capacity=1_000, policy="lfu")
    >>> table(torch.tensor([3, 42, 3])).shape
    torch.Size([3, 16])
"""

from picasso_ops.cache.belady import belady_hit_rate
from picasso_ops.cache.cached_table import CachedEmbeddingTable, CachePolicy, CacheStats
from picasso_ops.cache.fields import CachedFieldEmbeddings, CacheTooSmall
from picasso_ops.cache.store import (HostRowStore, MmapRowStore, RowStore, StoredRows, TableRowService, TableRowStore,
                                     check_store_ids)

__all__ = [
    "CachedEmbeddingTable",
    "CachedFieldEmbeddings",
    "CacheTooSmall",
    "CacheStats",
    "CachePolicy",
    "RowStore",
    "TableRowService",
    "StoredRows",
    "HostRowStore",
    "MmapRowStore",
    "TableRowStore",
    "check_store_ids",
    "belady_hit_rate",
]
