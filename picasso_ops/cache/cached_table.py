"""A fixed-capacity fast tier of hot rows in front of a :class:`~picasso_ops.cache.store.RowStore`.

The cache holds ``capacity`` rows and their optimizer state in compact
buffers, found through a :class:`~picasso_ops.cache.slot_index.SlotIndex`
(id -> cache slot, over the C++ hash-table op). A lookup makes every id of the batch resident: misses are
read from the store (or from a prefetch), and when the cache is full the
policy picks victims among rows the batch does not use:

* ``"lfu"``: fewest uses (one per batch that looks the id up), counted for
  every id, cached or not, in a count-min sketch (4 x ``8 * capacity``
  counters, TinyLFU-style) so a row that is evicted and comes back keeps its
  history; all counts are multiplied by ``aging_factor`` every
  ``aging_interval`` lookups so rows that were hot once do not stay forever;
  ties go to the least recently used.
* ``"lru"``: least recently used.

Updates (the sparse optimizer of ``picasso_ops.embedding.sparse_optim``,
applied to the gradient summed per id, one optimizer step per update) change
cached rows only and mark them dirty; a dirty victim is written back with its
optimizer state, so training through the cache gives the same weights as
training the full table. :meth:`flush` writes every dirty row back (call it
before a checkpoint of the store; ``state_dict()`` calls it).

Store I/O runs on one background thread (torch ops release the GIL), in
submission order: write-backs of evicted rows are queued and the step goes
on (at most ``max_pending_writes`` batches in flight); a read queued after a
write sees it. :meth:`prefetch` with the *next* batch's ids queues a read of
that batch's misses while the current step computes; the next lookup takes
them from there. A row written back after the prefetch was queued is re-read
at use, never taken from the prefetch, so a prefetch racing an update of the
same row cannot bring back a stale copy.

Statistics (:attr:`stats`): per unique id per lookup, a hit if resident, else
a miss (a miss served by the prefetch is still a miss, also counted in
``prefetched``); evictions and write-backs. :meth:`peek` (evaluation) reads
rows without touching the cache, the policy or the statistics.

For data-parallel training, ``apply_gradients(..., write_around=True)``
updates rows that are not cached in the store instead of loading them (the
global batch's rows from other ranks), and :meth:`read_store` /
:meth:`restore` copy rows out for a checkpoint and back in on resume.

Example::

    >>> import torch
    >>> from picasso_ops.cache import CachedEmbeddingTable, HostRowStore
    >>> store = HostRowStore(1000, 8, {"momentum1": 1}, weight=torch.randn(1000, 8))
    >>> table = CachedEmbeddingTable(store, capacity=100, optimizer="rowwise_adagrad", policy="lfu")
    >>> rows = table(torch.tensor([[1, 2], [2, 999]]))          # [2, 2, 8]
    >>> rows.pow(2).sum().backward()                             # updates rows 1, 2, 999 in the cache
    >>> table.prefetch(torch.tensor([5, 6])); _ = table(torch.tensor([5, 6]))
    >>> table.flush(); table.stats.misses
    5
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

import torch
from torch import Tensor, nn

from picasso_ops.cache.slot_index import SlotIndex
from picasso_ops.cache.store import HostRowStore, RowStore, StoredRows, check_store_ids  # HostRowStore: doc examples
from picasso_ops.embedding.sparse_optim import RowUpdate, create_optimizer
from picasso_ops.eviction import EvictionPolicy, eviction_scores, pick_victims
from picasso_ops.vocab.dynamic_table import with_sparse_update
from picasso_ops.vocab.hash_table import _mix

__all__ = ["CachedEmbeddingTable", "CacheStats", "CachePolicy"]

logger = logging.getLogger(__name__)

CachePolicy = EvictionPolicy  # the cache's policies are the shared eviction scorings


@dataclass(frozen=True)
class CacheStats:
    """Cumulative cache counters (unique ids per lookup).

    Example::

        >>> CacheStats(hits=3, misses=1, prefetched=1, evictions=0, writebacks=0).hit_rate
        0.75
    """

    hits: int
    misses: int
    prefetched: int  # misses whose rows came from a prefetch
    evictions: int
    writebacks: int  # rows written to the store (evicted dirty rows, flushes, write-around updates)

    @property
    def hit_rate(self) -> float:
        """hits / (hits + misses); 0 before the first lookup."""
        total = self.hits + self.misses
        return self.hits / total if total else 0.0


@dataclass
class _Staged:
    """Rows read ahead for a future lookup: ascending ``ids`` and their rows and state."""

    ids: Tensor
    rows: Optional[StoredRows] = None
    future: Optional[Future] = None
    written: list[Tensor] = field(default_factory=list)  # ids written back while the read was in flight


class CachedEmbeddingTable(nn.Module):
    """Embedding rows of a :class:`RowStore` served through a fixed-capacity cache with write-back and prefetch.

    Args:
        store: the full table (its ``state_dims`` must hold the optimizer's state:
            ``{"momentum1": 1}`` for row-wise Adagrad, ``{"momentum1": dim, "momentum2": dim}`` for Adam).
        capacity: rows held in the cache; at least the unique ids of one batch.
        optimizer, optimizer_params: the sparse optimizer (``"sgd"``, ``"rowwise_adagrad"``, ``"adam"``).
        policy: ``"lfu"`` (with aging) or ``"lru"``.
        aging_interval, aging_factor: LFU counts are multiplied by ``aging_factor`` every ``aging_interval`` lookups.
        max_pending_writes: write-back batches queued before a lookup waits for the oldest.

    Example::

        >>> store = HostRowStore(50, 4)
        >>> t = CachedEmbeddingTable(store, capacity=5, optimizer="sgd", policy="lru")
        >>> t(torch.tensor([1, 2, 3])).shape
        torch.Size([3, 4])
    """

    def __init__(
        self,
        store: RowStore,
        capacity: int,
        *,
        optimizer: str = "sgd",
        optimizer_params: Optional[Mapping[str, float]] = None,
        policy: CachePolicy = "lfu",
        aging_interval: int = 1000,
        aging_factor: float = 0.5,
        max_pending_writes: int = 2,
    ) -> None:
        super().__init__()
        if policy not in ("lfu", "lru"):
            raise ValueError(f"policy must be 'lfu' or 'lru', got {policy!r}")
        if int(aging_interval) < 1 or not 0.0 <= aging_factor <= 1.0:
            raise ValueError(f"need aging_interval >= 1 and aging_factor in [0, 1], got {aging_interval}, {aging_factor}")
        self.store = store
        self.dim = int(store.dim)
        self.policy: CachePolicy = policy
        self.aging_interval, self.aging_factor = int(aging_interval), float(aging_factor)
        self.optimizer = create_optimizer(optimizer, optimizer_params or {})
        self._index = SlotIndex(capacity)
        cap = self._index.capacity
        self.weight = torch.zeros(cap, self.dim)
        self.state = self.optimizer.init_state(cap, self.dim, num_logical_rows=cap)
        self._state_width = {k: (1 if kind == "row" else self.dim) for k, kind in self.optimizer.state_kinds.items()}
        for name, width in self._state_width.items():
            if store.state_dims.get(name) != width:
                raise ValueError(
                    f"optimizer {self.optimizer.name!r} keeps state {name!r} of width {width} per row, but the store "
                    f"holds state_dims={dict(store.state_dims)}; create the store with state_dims={self._state_width}"
                )
        width = 1 << max(10, (8 * cap - 1).bit_length())
        self._sketch = torch.zeros(4, width, dtype=torch.float32)  # count-min: 4 hashed counter rows
        self._salts = torch.tensor([0x5BD1E995, 0x27D4EB2F, 0x165667B1, 0x61C88647], dtype=torch.int64).unsqueeze(1)
        self._sketch_mask = width - 1
        self.freq = torch.zeros(cap, dtype=torch.float64)  # each resident row's sketch count, aged with it
        self.last_used = torch.zeros(cap, dtype=torch.int64)
        self.dirty = torch.zeros(cap, dtype=torch.bool)
        self.clock = 0  # lookups so far
        self.optimizer_steps = 0
        self._counts = {"hits": 0, "misses": 0, "prefetched": 0, "evictions": 0, "writebacks": 0}
        self.max_pending_writes = int(max_pending_writes)
        self._pool: Optional[ThreadPoolExecutor] = None
        self._writes: list[Future] = []
        self._staged: Optional[_Staged] = None

    # ---------------------------------------------------------------- public API
    @property
    def capacity(self) -> int:
        """Rows the cache holds."""
        return self._index.capacity

    def __len__(self) -> int:
        return len(self._index)

    @property
    def stats(self) -> CacheStats:
        """Hit/miss/prefetch/eviction/write-back counters since construction."""
        return CacheStats(**self._counts)

    def reset_stats(self) -> None:
        """Zero the counters (e.g. after warm-up)."""
        self._counts = dict.fromkeys(self._counts, 0)

    def forward(self, ids: Tensor) -> Tensor:
        """Rows of ``ids`` (any shape), ``ids.shape + (dim,)``; in training mode backward applies the optimizer.

        Example::

            >>> t = CachedEmbeddingTable(HostRowStore(10, 2), capacity=4, optimizer_params={"lr": 1.0})
            >>> t(torch.tensor([3])).sum().backward(); t.flush(); t.store.weight[3].tolist()
            [-1.0, -1.0]
        """
        rows = self.lookup(ids)
        if not self.training:
            return rows
        return with_sparse_update(rows, lambda grad: self.apply_gradients(ids, grad))

    @torch.no_grad()
    def lookup(self, ids: Tensor) -> Tensor:
        """Make ``ids`` resident (one lookup: counts toward stats and the policy) and return their rows.

        Example::

            >>> t = CachedEmbeddingTable(HostRowStore(10, 2, weight=torch.ones(10, 2)), capacity=4)
            >>> t.lookup(torch.tensor([1, 1])).tolist(), t.stats.misses
            ([[1.0, 1.0], [1.0, 1.0]], 1)
        """
        flat = check_store_ids(ids, self.store.num_rows, "CachedEmbeddingTable")
        uniq, inverse = torch.unique(flat, return_inverse=True)
        self.clock += 1
        if self.policy == "lfu":
            if self.clock % self.aging_interval == 0:
                self._sketch.mul_(self.aging_factor)
                self.freq.mul_(self.aging_factor)
            cols = self._sketch_cols(uniq)
            self._sketch.scatter_add_(1, cols, torch.ones(4, uniq.numel()))
        slots = self._make_resident(uniq, count=True)
        if self.policy == "lfu":
            self.freq[slots] = self._sketch.gather(1, cols).amin(0).to(torch.float64)
        self.last_used[slots] = self.clock
        return self.weight.index_select(0, slots)[inverse].reshape(*ids.shape, self.dim)

    @torch.no_grad()
    def apply_gradients(self, ids: Tensor, grad: Tensor, *, write_around: bool = False) -> None:
        """One optimizer step with ``grad`` (``ids.shape + (dim,)``) summed per id.

        Rows that are not cached are loaded into the cache (evicting others), or
        with ``write_around=True`` updated in the store (read, update, write on
        the I/O thread) without entering the cache: for a data-parallel step,
        where most of the global batch's rows were looked up on other ranks and
        would only push this rank's hot rows out. Either way each row takes the
        same optimizer arithmetic, so the weights do not depend on the choice.

        Example::

            >>> t = CachedEmbeddingTable(HostRowStore(10, 2), capacity=4, optimizer_params={"lr": 0.5})
            >>> t.apply_gradients(torch.tensor([7, 7]), torch.ones(2, 2)); t.lookup(torch.tensor([7])).tolist()
            [[-1.0, -1.0]]
            >>> t.apply_gradients(torch.tensor([3]), torch.ones(1, 2), write_around=True)
            >>> len(t), t.peek(torch.tensor([3])).tolist()
            (1, [[-0.5, -0.5]])
        """
        flat = check_store_ids(ids, self.store.num_rows, "CachedEmbeddingTable")
        g = grad.reshape(-1, self.dim)
        if g.shape[0] != flat.numel():
            raise ValueError(f"{flat.numel()} ids but {g.shape[0]} gradient rows")
        uniq, inverse = torch.unique(flat, return_inverse=True)
        summed = torch.zeros(uniq.numel(), self.dim, dtype=torch.float32).index_add_(0, inverse, g.float())
        self.optimizer_steps += 1
        if write_around:
            slots = self._index.find(uniq)
            away = slots < 0
            if bool(away.any()):
                self._update_in_store(uniq[away], summed[away])
            slots, summed = slots[~away], summed[~away]
        else:
            slots = self._make_resident(uniq, count=False)
        if slots.numel() == 0:
            return
        order = torch.argsort(slots)  # the optimizer wants ascending rows
        slots, summed = slots[order], summed[order]
        self.optimizer.update(self.weight, self.state, RowUpdate.simple(slots, summed, step=self.optimizer_steps))
        self.dirty[slots] = True

    def _update_in_store(self, ids: Tensor, summed: Tensor) -> None:
        """The optimizer step of uncached ascending ``ids`` applied to their stored copies (write-around)."""
        got = self._read(ids)  # queued behind pending write-backs, so it sees them
        n = ids.numel()
        weight = got.rows.to(torch.float32).clone()
        # the optimizer's layout: "row" state is [n], "element" state [n, dim]
        state = {k: got.state[k].reshape(n).clone() if kind == "row" else got.state[k].reshape(n, self.dim).clone()
                 for k, kind in self.optimizer.state_kinds.items()}
        self.optimizer.update(weight, state, RowUpdate.simple(torch.arange(n), summed, step=self.optimizer_steps))
        self._wait_writes(self.max_pending_writes)
        self._writes.append(self._io().submit(
            self.store.put_rows, ids, weight, {k: v.reshape(n, self._state_width[k]) for k, v in state.items()}))
        if self._staged is not None and self._staged.future is not None:
            self._staged.written.append(ids)  # a prefetch queued earlier reads the old copy
        self._drop_staged(ids)
        self._counts["writebacks"] += n

    @torch.no_grad()
    def peek(self, ids: Tensor) -> Tensor:
        """Current rows of ``ids`` without making them resident or counting them (evaluation).

        Cached rows come from the cache, the rest from the store (read after
        any pending write-back), so the result is the table as training left
        it while the policy, the cache contents and :attr:`stats` stay as they were.

        Example::

            >>> t = CachedEmbeddingTable(HostRowStore(10, 2, weight=torch.ones(10, 2)), capacity=4)
            >>> t.peek(torch.tensor([5])).tolist(), len(t), t.stats.misses
            ([[1.0, 1.0]], 0, 0)
        """
        flat = check_store_ids(ids, self.store.num_rows, "CachedEmbeddingTable.peek")
        uniq, inverse = torch.unique(flat, return_inverse=True)
        slots = self._index.find(uniq)
        hit = slots >= 0
        rows = torch.empty(uniq.numel(), self.dim)
        rows[hit] = self.weight.index_select(0, slots[hit])
        if not bool(hit.all()):
            self._settle_staged()
            rows[~hit] = self._read(uniq[~hit]).rows.to(rows.dtype)
        return rows[inverse].reshape(*ids.shape, self.dim)

    @torch.no_grad()
    def read_store(self, ids: Tensor) -> StoredRows:
        """Flush, then the stored rows and optimizer state of ``ids`` (a complete copy: for checkpoints).

        Example::

            >>> t = CachedEmbeddingTable(HostRowStore(10, 2), capacity=4, optimizer_params={"lr": 1.0})
            >>> t.apply_gradients(torch.tensor([2]), torch.ones(1, 2)); t.read_store(torch.tensor([2])).rows.tolist()
            [[-1.0, -1.0]]
        """
        flat = check_store_ids(ids, self.store.num_rows, "CachedEmbeddingTable.read_store")
        self._settle_staged()
        self.flush()
        return self._read(flat)

    @torch.no_grad()
    def restore(self, ids: Tensor, rows: Tensor, state: Mapping[str, Tensor],
                optimizer_steps: Optional[int] = None) -> None:
        """Overwrite the stored rows and state of unique ``ids`` and drop every cached copy (loading a checkpoint).

        Cached rows are dropped without a write-back, pending writes finish
        first, so nothing older can overwrite what is restored.

        Example::

            >>> t = CachedEmbeddingTable(HostRowStore(10, 2), capacity=4)
            >>> _ = t.lookup(torch.tensor([1])); t.restore(torch.tensor([1]), torch.ones(1, 2), {})
            >>> len(t), t.lookup(torch.tensor([1])).tolist()
            (0, [[1.0, 1.0]])
        """
        self._forget_cached(optimizer_steps)
        flat = check_store_ids(ids, self.store.num_rows, "CachedEmbeddingTable.restore")
        self._io().submit(self.store.put_rows, flat, rows, dict(state)).result()

    def _forget_cached(self, optimizer_steps: Optional[int]) -> None:
        """Drop every cached row and the prefetch without writing back (the store is about to be, or was, restored)."""
        self._settle_staged()
        self._wait_writes(0)
        if optimizer_steps is not None:
            self.optimizer_steps = int(optimizer_steps)
        self._staged = None
        self._index.clear()
        self.dirty.zero_()

    def prefetch(self, ids: Tensor) -> None:
        """Start reading the rows of ``ids`` that are not cached (the next batch's misses) on a background thread.

        Example::

            >>> t = CachedEmbeddingTable(HostRowStore(10, 2), capacity=4)
            >>> t.prefetch(torch.tensor([4, 5])); _ = t.lookup(torch.tensor([4, 5])); t.stats.prefetched
            2
        """
        flat = check_store_ids(ids, self.store.num_rows, "CachedEmbeddingTable.prefetch")
        self._settle_staged()
        uniq = torch.unique(flat)
        todo = uniq[self._index.find(uniq) < 0]
        self._staged = None
        if todo.numel() == 0:
            return
        self._staged = _Staged(ids=todo, future=self._io().submit(self._store_get, todo))

    @torch.no_grad()
    def flush(self) -> None:
        """Write every dirty row and its optimizer state back to the store; rows stay cached, now clean.

        Example::

            >>> t = CachedEmbeddingTable(HostRowStore(10, 2), capacity=4)
            >>> t.apply_gradients(torch.tensor([1]), torch.ones(1, 2)); t.flush(); t.stats.writebacks
            1
        """
        slots = self.dirty.nonzero().squeeze(1)
        self._write_back(slots)
        self._wait_writes(0)

    def frequency(self, ids: Tensor) -> Tensor:
        """The LFU policy's (aged) use-count estimate of ``ids``; 0 under LRU.

        Example::

            >>> t = CachedEmbeddingTable(HostRowStore(10, 1), capacity=4); _ = t.lookup(torch.tensor([3, 3]))
            >>> t.frequency(torch.tensor([3, 4])).tolist()
            [1.0, 0.0]
        """
        flat = check_store_ids(ids, self.store.num_rows, "CachedEmbeddingTable")
        return self._sketch.gather(1, self._sketch_cols(flat)).amin(0).reshape(ids.shape)

    def close(self) -> None:
        """Flush and stop the I/O thread."""
        self._settle_staged()
        self.flush()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    # ---------------------------------------------------------------- residency
    def _make_resident(self, uniq: Tensor, count: bool) -> Tensor:
        """Cache slots of unique ``uniq``, loading misses and evicting victims outside ``uniq``."""
        if uniq.numel() > self.capacity:
            raise ValueError(f"a batch with {uniq.numel()} unique ids does not fit a cache of {self.capacity} rows; "
                             "raise the capacity or split the batch")
        slots = self._index.find(uniq)
        hit = slots >= 0
        n_miss = int((~hit).sum())
        if count:
            self._counts["hits"] += uniq.numel() - n_miss
            self._counts["misses"] += n_miss
        if n_miss == 0:
            self._drop_staged(uniq)
            return slots
        miss_ids = uniq[~hit]
        got = self._fetch(miss_ids, count)
        short = n_miss - (self.capacity - len(self._index))
        if short > 0:
            self._evict(short, protect=slots[hit])
        new_slots = self._index.insert(miss_ids)
        self.weight[new_slots] = got.rows.to(self.weight.dtype)
        for name, buf in self.state.items():
            buf[new_slots] = got.state[name].reshape(buf[new_slots].shape).to(buf.dtype)
        self.dirty[new_slots] = False
        self.freq[new_slots] = 0.0  # set from the sketch by the lookup; 0 for a row loaded to take a gradient
        self.last_used[new_slots] = self.clock
        slots = slots.clone()
        slots[~hit] = new_slots
        self._drop_staged(uniq)  # these rows are resident now: the cache copy is the one that counts
        return slots

    def _fetch(self, ids: Tensor, count: bool) -> StoredRows:
        """Rows of ascending ``ids``: from the prefetch where it has them, the rest from the store."""
        self._settle_staged()
        staged = self._staged
        if staged is None or staged.rows is None or staged.ids.numel() == 0:
            return self._read(ids)
        pos = torch.searchsorted(staged.ids, ids).clamp(max=staged.ids.numel() - 1)
        have = staged.ids[pos] == ids
        n_have = int(have.sum())
        if n_have == 0:
            return self._read(ids)
        if count:
            self._counts["prefetched"] += n_have
        rows = torch.empty(ids.numel(), self.dim)
        state = {k: torch.empty(ids.numel(), w) for k, w in self._state_width.items()}
        rows[have] = staged.rows.rows[pos[have]]
        for k in state:
            state[k][have] = staged.rows.state[k][pos[have]]
        if n_have < ids.numel():
            rest = self._read(ids[~have])
            rows[~have] = rest.rows
            for k in state:
                state[k][~have] = rest.state[k]
        return StoredRows(rows, state)

    def _read(self, ids: Tensor) -> StoredRows:
        """A synchronous read, queued behind pending writes so it sees them."""
        return self._io().submit(self._store_get, ids).result()

    def _store_get(self, ids: Tensor) -> StoredRows:
        got = self.store.get_rows(ids)  # runs on the I/O thread
        return StoredRows(got.rows, {k: got.state[k] for k in self._state_width})

    def _io(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="cache-io")
        return self._pool

    def _wait_writes(self, keep: int) -> None:
        """Wait until at most ``keep`` write-backs are in flight; re-raises a failed write."""
        while len(self._writes) > keep:
            self._writes.pop(0).result()
        done = [f for f in self._writes if f.done()]
        for f in done:
            self._writes.remove(f)
            f.result()

    def _sketch_cols(self, ids: Tensor) -> Tensor:
        return _mix(ids.unsqueeze(0) ^ self._salts) & self._sketch_mask

    def _evict(self, n: int, protect: Tensor) -> None:
        """Remove ``n`` rows outside ``protect`` by the policy (``picasso_ops.eviction``), writing dirty ones back."""
        score = eviction_scores(self.policy, self.freq, self.last_used, self.clock)
        victims = pick_victims(score, n, occupied=self._index.occupied(), protect=protect)
        self._write_back(victims[self.dirty[victims]])
        self._index.erase(self._index.ids_of(victims))
        self._counts["evictions"] += victims.numel()

    def _write_back(self, slots: Tensor) -> None:
        if slots.numel() == 0:
            return
        ids = self._index.ids_of(slots)
        rows = self.weight[slots]  # copies: the slots may be reused before the write runs
        state = {k: self.state[k][slots].reshape(-1, w) for k, w in self._state_width.items()}
        self._wait_writes(self.max_pending_writes)
        self._writes.append(self._io().submit(self.store.put_rows, ids, rows, state))
        if self._staged is not None and self._staged.future is not None:
            self._staged.written.append(ids)  # a prefetch queued earlier reads the old copy
        self._drop_staged(ids)
        self.dirty[slots] = False
        self._counts["writebacks"] += slots.numel()

    def wait_io(self) -> None:
        """Wait for the store reads (prefetch) and write-backs in flight: the store is idle until the next call.

        For a store connection shared with other code (e.g. one ``PSClient``), which must not run concurrently.

        Example::

            >>> t = CachedEmbeddingTable(HostRowStore(10, 2), capacity=4)
            >>> t.prefetch(torch.tensor([4, 5])); t.wait_io()
        """
        self._settle_staged()
        self._wait_writes(0)

    # ---------------------------------------------------------------- prefetch bookkeeping
    def _settle_staged(self) -> None:
        """Wait for an in-flight prefetch and drop the rows written back while it ran."""
        staged = self._staged
        if staged is None or staged.future is None:
            return
        staged.rows = staged.future.result()
        staged.future = None
        if staged.written:
            self._drop_staged(torch.cat(staged.written))
            staged.written = []

    def _drop_staged(self, ids: Tensor) -> None:
        """Forget prefetched copies of ``ids`` (they became resident or were written back)."""
        staged = self._staged
        if staged is None or staged.rows is None or ids.numel() == 0 or staged.ids.numel() == 0:
            return
        keep = ~torch.isin(staged.ids, ids)
        if bool(keep.all()):
            return
        staged.ids = staged.ids[keep]
        staged.rows = StoredRows(staged.rows.rows[keep], {k: v[keep] for k, v in staged.rows.state.items()})

    # ---------------------------------------------------------------- checkpoints
    def _save_to_state_dict(self, destination: dict, prefix: str, keep_vars: bool) -> None:
        self._settle_staged()
        self.flush()  # the rows and their state live in the store: make it current
        destination[prefix + "optimizer_steps"] = torch.tensor(self.optimizer_steps, dtype=torch.int64)

    def _load_from_state_dict(self, state_dict: Mapping[str, Any], prefix: str, local_metadata: Any, strict: bool,
                              missing_keys: list, unexpected_keys: list, error_msgs: list) -> None:
        key = prefix + "optimizer_steps"
        if key not in state_dict:
            missing_keys.append(key)
            return
        self._forget_cached(int(state_dict[key]))  # the store was restored: cached copies are stale

    def extra_repr(self) -> str:
        return f"capacity={self.capacity}, dim={self.dim}, policy={self.policy!r}, optimizer={self.optimizer}"
