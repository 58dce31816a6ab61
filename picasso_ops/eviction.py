"""Which resident rows to evict: the one LFU / LRU scoring of the hot-row cache and the dynamic vocabulary.

Both keep per slot a use count ``freq`` (the cache ages it, the vocabulary
does not) and the clock value ``last_used`` of its last use (``<= clock``).
The lowest score goes first:

* ``"lfu"``: ``freq * (clock + 1) + last_used``. Since ``0 <= last_used <= clock``,
  this orders by ``(freq, last_used)``: fewest uses first, ties by least recent.
* ``"lru"``: ``last_used``.

The score has ``freq``'s dtype (float64 for the cache's aged counts, int64 for
the vocabulary's), so each caller's ordering, ties included, is exactly its own.
Pure functions over tensors: the inputs are never written.

Example::

    >>> import torch
    >>> freq, last = torch.tensor([3, 1, 1, 5]), torch.tensor([7, 2, 6, 1])
    >>> scores = eviction_scores("lfu", freq, last, clock=7)
    >>> sorted(pick_victims(scores, 2, occupied=torch.ones(4, dtype=torch.bool), protect=torch.tensor([1])).tolist())
    [0, 2]
"""
from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

__all__ = ["EvictionPolicy", "EVICTION_POLICIES", "eviction_scores", "pick_victims"]

EvictionPolicy = Literal["lfu", "lru"]
EVICTION_POLICIES: tuple[str, ...] = ("lfu", "lru")


def eviction_scores(policy: str, freq: Tensor, last_used: Tensor, clock: int) -> Tensor:
    """Per-slot eviction scores (lowest evicted first), a new tensor of ``freq``'s dtype.

    Example::

        >>> eviction_scores("lru", torch.zeros(2, dtype=torch.float64), torch.tensor([4, 2]), 5).tolist()
        [4.0, 2.0]
    """
    if policy == "lfu":
        if freq.is_floating_point():
            return freq * float(clock + 1) + last_used.to(freq.dtype)
        return freq * (clock + 1) + last_used.to(freq.dtype)
    if policy == "lru":
        return last_used.to(freq.dtype, copy=True)
    raise ValueError(f"eviction policy must be one of {EVICTION_POLICIES}, got {policy!r}")


def _never(dtype: torch.dtype) -> float | int:
    """A score no eligible slot reaches: the mark of an ineligible one."""
    return float("inf") if dtype.is_floating_point else torch.iinfo(dtype).max


def pick_victims(scores: Tensor, n: int, *, occupied: Tensor, protect: Tensor) -> Tensor:
    """Slots of the ``n`` lowest ``scores`` among occupied slots outside ``protect`` (fewer if fewer qualify).

    ``occupied``: a bool mask per slot; ``protect``: slot indices (or a bool
    mask) that must stay. Unordered int64 indices; ``scores`` is not written.

    Example::

        >>> pick_victims(torch.tensor([5, 1, 3]), 5, occupied=torch.tensor([True, True, False]),
        ...              protect=torch.tensor([], dtype=torch.long)).sort().values.tolist()
        [0, 1]
    """
    never = _never(scores.dtype)
    masked = scores.masked_fill(~occupied, never)
    masked[protect] = never
    n = min(int(n), int((masked < never).sum()))
    if n <= 0:
        return torch.empty(0, dtype=torch.int64, device=scores.device)
    return torch.topk(masked, n, largest=False, sorted=False).indices
