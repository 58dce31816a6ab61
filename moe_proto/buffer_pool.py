"""A caching pool for the MoE layer's large CPU buffers: no page faults from step to step.

Why: glibc serves allocations of megabytes from fresh ``mmap`` pages (or trims and regrows
its heap), so every training step's activations, expert-major buffers and weight
gradients are page-faulted in again, one 4 KiB page at a time, which costs a measurable part of the
expert stage on CPU (benchmarks/RESULTS.md). CUDA has a caching allocator for
this reason; this is the same idea for the few large CPU tensors the layer creates itself.

How: a buffer is one untyped storage held by the pool; :meth:`HostBufferPool.empty` hands
out a tensor viewing it. A storage is free again when nothing but the pool refers to it
(``_storage_Use_Count == 1``: every tensor or view over it, a parameter's ``.grad``
included, holds a reference), so buffers return by themselves when autograd frees saved
tensors or the optimizer sets gradients to None; no ``release`` call can be forgotten.
Sizes are rounded up to one of 8 classes per power of two (at most 12.5% slack) so that a
step whose row count moves a little reuses the last step's buffers.

Bounded: the pool never holds more than ``max_bytes`` (free buffers are dropped, oldest
first, to make room; past that a request gets a plain ``torch.empty``). Requests under
``min_bytes`` (cheap for malloc) and non-CPU tensors are never pooled.

Example::

    pool = HostBufferPool(max_bytes=512 * 2**20)
    h = pool.empty((4096, 1024), torch.float32)   # uninitialised, like torch.empty
    del h                                          # the next request of that size reuses it
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

DEFAULT_MAX_BYTES = 1 << 30
DEFAULT_MIN_BYTES = 256 << 10
_CLASSES_PER_DOUBLING = 8


# References to a storage (torch >= 2.1); without it nothing can be known free, so nothing is pooled.
_STORAGE_USE_COUNT = getattr(torch._C, "_storage_Use_Count", None)


def _use_count(storage: torch.UntypedStorage) -> int:
    return _STORAGE_USE_COUNT(storage._cdata)


def size_class(nbytes: int) -> int:
    """``nbytes`` rounded up to ``m * 2**k`` with ``8 <= m < 16`` (at most 12.5% above it).

    Example::

        size_class(4096 * 1024 * 4)   # 16777216 (already a class)
        size_class(4000 * 1024 * 4)   # 16777216
    """
    if nbytes <= _CLASSES_PER_DOUBLING:
        return max(nbytes, 1)
    shift = nbytes.bit_length() - 4  # keep the top 4 bits: m in [8, 16)
    m = -(-nbytes >> shift)  # ceil(nbytes / 2**shift)
    return m << shift


@dataclass(frozen=True)
class PoolStats:
    """Counters of one pool: hits reuse a held buffer, misses allocate one, bypasses are not pooled."""

    held_bytes: int
    free_bytes: int
    buffers: int
    hits: int
    misses: int
    bypasses: int


class HostBufferPool:
    """Reusable CPU storages, freed by reference count (see the module docstring).

    Args:
        max_bytes: most bytes the pool holds, free and in use together (0 disables pooling).
        min_bytes: requests smaller than this are plain ``torch.empty``.
    """

    def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES, min_bytes: int = DEFAULT_MIN_BYTES) -> None:
        if max_bytes < 0 or min_bytes < 0:
            raise ValueError(f"max_bytes and min_bytes must be >= 0, got {max_bytes}, {min_bytes}")
        self.max_bytes = max_bytes
        self.min_bytes = min_bytes
        self._lock = threading.Lock()
        # size class -> storages of that size, least recently handed out first.
        self._buffers: Dict[int, "OrderedDict[int, torch.UntypedStorage]"] = {}
        self._held = 0
        self._hits = self._misses = self._bypasses = 0

    def empty(self, shape: Sequence[int], dtype: torch.dtype = torch.float32,
              device: Optional[torch.device] = None) -> Tensor:
        """An uninitialised contiguous tensor of ``shape``, backed by a pooled storage when worth it.

        Example::

            y = pool.empty((rows, 256), x.dtype, x.device)
        """
        shape = tuple(int(s) for s in shape)
        numel = 1
        for s in shape:
            numel *= s
        nbytes = numel * dtype.itemsize
        if (device is not None and torch.device(device).type != "cpu") or nbytes < max(self.min_bytes, 1) \
                or nbytes > self.max_bytes or _STORAGE_USE_COUNT is None:
            with self._lock:
                self._bypasses += 1
            return torch.empty(shape, dtype=dtype, device=device)
        view = self._acquire(size_class(nbytes), shape, dtype)
        return torch.empty(shape, dtype=dtype, device=device) if view is None else view

    def _acquire(self, nbytes: int, shape: Tuple[int, ...], dtype: torch.dtype) -> Optional[Tensor]:
        # The view is made under the lock: until it exists the storage still looks free to other threads.
        with self._lock:
            same = self._buffers.setdefault(nbytes, OrderedDict())
            for key, storage in same.items():
                if _use_count(storage) == 1:  # only the pool refers to it
                    same.move_to_end(key)
                    self._hits += 1
                    return torch.empty(0, dtype=dtype).set_(storage, 0, shape)
            if self._held + nbytes > self.max_bytes:
                self._evict_free(self._held + nbytes - self.max_bytes)
            if self._held + nbytes > self.max_bytes:
                self._bypasses += 1
                return None
            storage = torch.UntypedStorage(nbytes)
            same[id(storage)] = storage
            self._held += nbytes
            self._misses += 1
            return torch.empty(0, dtype=dtype).set_(storage, 0, shape)

    def _evict_free(self, need: int) -> None:
        """Drop free storages (least recently used of each class first) until ``need`` bytes are released."""
        candidates: List[Tuple[int, int]] = [(size, key) for size, same in self._buffers.items()
                                             for key, st in same.items() if _use_count(st) == 1]
        for size, key in candidates:
            if need <= 0:
                break
            del self._buffers[size][key]
            self._held -= size
            need -= size

    def clear(self) -> None:
        """Forget every free buffer (buffers in use stay valid; they are simply no longer pooled)."""
        with self._lock:
            self._evict_free(self._held)

    def stats(self) -> PoolStats:
        """Current counters (free bytes are those no tensor refers to)."""
        with self._lock:
            free = sum(size for size, same in self._buffers.items() for st in same.values() if _use_count(st) == 1)
            return PoolStats(held_bytes=self._held, free_bytes=free,
                             buffers=sum(len(same) for same in self._buffers.values()),
                             hits=self._hits, misses=self._misses, bypasses=self._bypasses)


_DEFAULT = HostBufferPool()


def use_buffer_pool(model: "torch.nn.Module", pool: HostBufferPool) -> int:
    """Make every ``GroupedExperts`` inside ``model`` take its buffers from ``pool``; returns how many.

    The config's ``moe_proto.host_buffer_pool_mb`` reaches a model this way (one pool per model,
    shared by its layers: a buffer freed by one layer's backward serves the next layer's).

    Example::

        use_buffer_pool(model, HostBufferPool(max_bytes=256 * 2**20))
    """
    from .experts import GroupedExperts

    experts = [m for m in model.modules() if isinstance(m, GroupedExperts)]
    for module in experts:
        module.buffer_pool = pool
    return len(experts)


def default_pool() -> HostBufferPool:
    """The pool the MoE layers use unless given another (``GroupedExperts(..., buffer_pool=...)``).

    Example::

        moe_proto.buffer_pool.default_pool().max_bytes = 256 * 2**20   # hold at most 256 MiB
    """
    return _DEFAULT


def empty_rows(like: Tensor, rows: int) -> Tensor:
    """An uninitialised ``[rows, like.shape[1]]`` tensor of ``like``'s dtype and device from :func:`default_pool`.

    For the row buffers of functions that see no layer (a model's own pool, from
    ``moe_proto.host_buffer_pool_mb``, holds its experts' buffers). Example: ``empty_rows(x, 128)``.
    """
    return default_pool().empty((rows, like.shape[1]), like.dtype, like.device)
