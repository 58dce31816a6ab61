"""Belady's optimal (MIN) hit rate of a trace: the bound a cache policy is measured against.

The trace is a sequence of ids; a cache of ``capacity`` entries misses on an id
it does not hold and then, when full, evicts the entry whose next use is
farthest in the future (never used again first). No policy has more hits.

Example::

    >>> import torch
    >>> belady_hit_rate(torch.tensor([1, 2, 3, 1, 2, 3]), capacity=2)
    0.3333333333333333
"""

from __future__ import annotations

import heapq
import logging

import torch
from torch import Tensor

__all__ = ["belady_hit_rate", "next_use"]

logger = logging.getLogger(__name__)


def next_use(trace: Tensor) -> Tensor:
    """Position of each reference's next reference to the same id; ``len(trace)`` when none.

    Example::

        >>> next_use(torch.tensor([5, 6, 5])).tolist()
        [2, 3, 3]
    """
    n = trace.numel()
    order = torch.sort(trace, stable=True).indices  # same ids together, in time order
    nxt = torch.full((n,), n, dtype=torch.int64)
    same = trace[order[1:]] == trace[order[:-1]]
    nxt[order[:-1][same]] = order[1:][same]
    return nxt


def belady_hit_rate(trace: Tensor, capacity: int, count_from: int = 0) -> float:
    """Hits / references of Belady's MIN on ``trace`` (1-D int64) with ``capacity`` entries.

    Only references at positions ``>= count_from`` are counted (the cache still
    runs from the start: warm-up excluded). O(n log capacity) with a lazy
    max-heap on next use; a few seconds per million references.

    Example::

        >>> belady_hit_rate(torch.tensor([1, 1, 1, 2]), capacity=1), belady_hit_rate(torch.tensor([1, 2, 1, 1]), 1, count_from=2)
        (0.5, 0.5)
    """
    if capacity < 1:
        raise ValueError(f"capacity must be >= 1, got {capacity}")
    flat = trace.reshape(-1)
    if flat.numel() <= count_from:
        return 0.0
    nxt = next_use(flat).tolist()
    ids = flat.tolist()
    current: dict[int, int] = {}  # cached id -> its next use
    heap: list[tuple[int, int]] = []  # (-next use, id); stale entries are skipped when popped
    hits = 0
    for t, x in enumerate(ids):
        if x in current:
            hits += t >= count_from
        elif len(current) >= capacity:
            while True:
                neg, victim = heapq.heappop(heap)
                if current.get(victim) == -neg:
                    del current[victim]
                    break
        current[x] = nxt[t]
        heapq.heappush(heap, (-nxt[t], x))
    return hits / (len(ids) - count_from)
