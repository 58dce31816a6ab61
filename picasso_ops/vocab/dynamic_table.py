"""An embedding table keyed by raw int64 ids: admission by frequency, eviction by LFU, LRU or time-to-live.

No vocabulary is fixed in advance (DeepRec's ``EmbeddingVariable``): a
collision-free :class:`~picasso_ops.vocab.hash_table.IdHashTable` maps each
admitted id to a slot of a ``[capacity, dim]`` weight buffer, and each slot's
optimizer state sits at the same slot, so state always moves with its row.

Semantics, per training lookup (``forward`` in training mode, or
``lookup(ids, admit=True)``), which is one *step* of the table's clock:

* **Admission**: an id gets a slot once it has been seen ``min_frequency``
  times (counts over the lookups so far, kept for not-yet-admitted ids in a
  bounded counter table of ``counter_capacity`` ids that is cleared when it
  overflows). Until then it reads ``default_value`` and gets no update.
  ``min_frequency=1`` admits on first sight. A new row starts at a
  deterministic function of its id (uniform in ``[-init_scale, init_scale]``),
  its optimizer state at zero.
* **Time-to-live** (``eviction="ttl"``): rows unseen for more than
  ``ttl_steps`` steps are dropped at the start of each step.
* **Full table** (more admissions than free slots): with
  ``full_policy="evict"`` victims are taken by the eviction order (``"lfu"``:
  fewest lookups, then least recent; ``"lru"`` and ``"ttl"``: least recent),
  never among rows this batch uses; with ``full_policy="reject"`` nothing is
  evicted. Admissions that still do not fit are rejected (most frequent
  candidates win): they read the default row, keep their counts and may be
  admitted later. Rows are never overwritten in place by another id.
  :attr:`stats` counts admissions, evictions, expiries and rejections, and
  the first rejection is logged as a warning.

Evaluation lookups (``eval()`` mode or ``admit=False``) neither count, admit
nor advance the clock.

``state_dict`` is keyed by raw id: ``ids`` (ascending) and, in the same
order, ``weight``, each optimizer state, ``freq`` and ``last_seen``; plus the
clock, the optimizer step and the pending admission counts. It loads into a
table of any capacity that holds its rows.

Example::

    >>> import torch
    >>> table = DynamicEmbeddingTable(capacity=2, dim=4, min_frequency=2, optimizer="sgd",
    ...                               optimizer_params={"lr": 0.1}, full_policy="reject")
    >>> _ = table(torch.tensor([7, 8, 8]))   # 8 is seen twice: admitted; 7 once: not yet
    >>> table.stats.size, table.stats.admitted
    (1, 1)
    >>> rows = table(torch.tensor([7, 8])); rows.sum().backward()   # backward applies SGD to row 8 only
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Literal, Mapping, Optional

import torch
from torch import Tensor, nn
from torch.autograd.function import once_differentiable

from picasso_ops.embedding.sparse_optim import RowUpdate, create_optimizer
from picasso_ops.eviction import eviction_scores, pick_victims
from picasso_ops.vocab.hash_table import IdHashTable, _mix

__all__ = ["DynamicEmbeddingTable", "VocabStats", "Eviction", "FullPolicy", "with_sparse_update", "hashed_init"]

logger = logging.getLogger(__name__)

Eviction = Literal["lfu", "lru", "ttl"]
FullPolicy = Literal["evict", "reject"]


@dataclass(frozen=True)
class VocabStats:
    """Counts of a dynamic table; all but ``size`` are cumulative since construction (or load).

    Example::

        >>> VocabStats(size=1, capacity=2, admitted=3, evicted=2, expired=0, rejected=0, pending=0).size
        1
    """

    size: int  # rows held now
    capacity: int
    admitted: int  # ids given a slot
    evicted: int  # rows removed to make room (full table, full_policy="evict")
    expired: int  # rows removed by time-to-live
    rejected: int  # admissions refused because the table was full (counted once per id per step)
    pending: int  # ids counted but not yet admitted


def hashed_init(ids: Tensor, dim: int, scale: float, seed: int) -> Tensor:
    """Rows uniform in ``[-scale, scale)`` that depend only on ``(id, column, seed)``, ``[len(ids), dim]``.

    Example::

        >>> a = hashed_init(torch.tensor([5, 9]), 3, 0.1, seed=0)
        >>> bool((a[0] == hashed_init(torch.tensor([5]), 3, 0.1, seed=0)[0]).all()), a.shape
        (True, torch.Size([2, 3]))
    """
    keys = ids.reshape(-1, 1) * dim + torch.arange(dim, device=ids.device) + seed * 0x9E3779B97F4A7C15 % (1 << 62)
    bits = _mix(keys) & ((1 << 24) - 1)  # 24 bits: exact in float32
    return (bits.to(torch.float32) * (2.0 / (1 << 24)) - 1.0) * scale


class _SparseUpdate(torch.autograd.Function):
    """Identity on a table's looked-up rows whose backward hands their gradient to the table."""

    @staticmethod
    def forward(ctx: Any, anchor: Tensor, rows: Tensor, apply: Callable[[Tensor], None]) -> Tensor:  # type: ignore[override]
        ctx.update_fn = apply
        return rows

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: Tensor) -> tuple[None, None, None]:  # type: ignore[override]
        if ctx.update_fn is None:
            raise RuntimeError("backward ran twice through a fused embedding lookup; that would apply the update twice")
        ctx.update_fn(grad)
        ctx.update_fn = None
        return None, None, None


def with_sparse_update(rows: Tensor, apply: Callable[[Tensor], None]) -> Tensor:
    """``rows`` as a graph node whose backward calls ``apply(grad_of_rows)`` (the fused sparse update).

    Example::

        >>> seen = []
        >>> out = with_sparse_update(torch.ones(2, 3), seen.append)
        >>> out.sum().backward(); seen[0].shape
        torch.Size([2, 3])
    """
    anchor = torch.empty(0, requires_grad=True)  # makes the output require grad without a real parameter
    return _SparseUpdate.apply(anchor, rows.detach(), apply)


class DynamicEmbeddingTable(nn.Module):
    """Embedding rows for raw int64 ids with frequency admission and LFU/LRU/TTL eviction.

    Args:
        capacity: most rows held at once.
        dim: embedding dim.
        optimizer: ``"sgd"``, ``"rowwise_adagrad"`` or ``"adam"`` (``picasso_ops.embedding.sparse_optim``);
            applied inside backward, one step per backward.
        optimizer_params: its hyperparameters.
        min_frequency: lookups before an id is admitted.
        eviction: ``"lfu"``, ``"lru"`` or ``"ttl"``.
        ttl_steps: for ``"ttl"``: rows unseen for more than this many steps expire.
        full_policy: ``"evict"`` or ``"reject"`` (see the module doc).
        init_scale: new rows are uniform in ``[-init_scale, init_scale)``.
        default_value: what non-admitted ids read.
        counter_capacity: most not-yet-admitted ids counted at once (default ``4 * capacity``).
        seed: for the row initialisation.

    Example::

        >>> t = DynamicEmbeddingTable(100, 8, eviction="ttl", ttl_steps=10, optimizer="rowwise_adagrad")
        >>> t(torch.tensor([2**40, 3])).shape
        torch.Size([2, 8])
    """

    def __init__(
        self,
        capacity: int,
        dim: int,
        *,
        optimizer: str = "sgd",
        optimizer_params: Optional[Mapping[str, float]] = None,
        min_frequency: int = 1,
        eviction: Eviction = "lfu",
        ttl_steps: Optional[int] = None,
        full_policy: FullPolicy = "evict",
        init_scale: float = 0.01,
        default_value: float = 0.0,
        counter_capacity: Optional[int] = None,
        seed: int = 0,
    ) -> None:
        super().__init__()
        if int(dim) < 1:
            raise ValueError(f"dim must be >= 1, got {dim}")
        if int(min_frequency) < 1:
            raise ValueError(f"min_frequency must be >= 1, got {min_frequency}")
        if eviction not in ("lfu", "lru", "ttl"):
            raise ValueError(f"eviction must be 'lfu', 'lru' or 'ttl', got {eviction!r}")
        if eviction == "ttl" and (ttl_steps is None or int(ttl_steps) < 1):
            raise ValueError(f"eviction='ttl' needs ttl_steps >= 1, got {ttl_steps}")
        if full_policy not in ("evict", "reject"):
            raise ValueError(f"full_policy must be 'evict' or 'reject', got {full_policy!r}")
        self.dim = int(dim)
        self.min_frequency = int(min_frequency)
        self.eviction: Eviction = eviction
        self.ttl_steps = None if ttl_steps is None else int(ttl_steps)
        self.full_policy: FullPolicy = full_policy
        self.init_scale = float(init_scale)
        self.default_value = float(default_value)
        self.seed = int(seed)
        self.optimizer = create_optimizer(optimizer, optimizer_params or {})
        self._index = IdHashTable(capacity)
        cap = self._index.capacity
        self.weight = torch.zeros(cap, self.dim)
        self.state = self.optimizer.init_state(cap, self.dim, num_logical_rows=cap)
        self.freq = torch.zeros(cap, dtype=torch.int64)
        self.last_seen = torch.zeros(cap, dtype=torch.int64)
        self._counter = IdHashTable(int(counter_capacity) if counter_capacity else 4 * cap)
        self._counts = torch.zeros(self._counter.capacity, dtype=torch.int64)
        self.step_count = 0  # the clock: training lookups so far
        self.optimizer_steps = 0
        self._totals = {"admitted": 0, "evicted": 0, "expired": 0, "rejected": 0}
        self._warned_full = False

    # ---------------------------------------------------------------- public API
    @property
    def capacity(self) -> int:
        """Most rows held at once."""
        return self._index.capacity

    def __len__(self) -> int:
        return len(self._index)

    @property
    def stats(self) -> VocabStats:
        """Current size and cumulative admission/eviction/expiry/rejection counts."""
        return VocabStats(size=len(self._index), capacity=self.capacity, pending=len(self._counter), **self._totals)

    def forward(self, ids: Tensor) -> Tensor:
        """Rows for ``ids`` (any shape), ``ids.shape + (dim,)``; in training mode backward applies the optimizer.

        Example::

            >>> t = DynamicEmbeddingTable(10, 2, optimizer_params={"lr": 1.0})
            >>> t(torch.tensor([4])).sum().backward(); t.lookup(torch.tensor([4]), admit=False).shape
            torch.Size([1, 2])
        """
        if not self.training:
            return self.lookup(ids, admit=False)
        rows = self.lookup(ids, admit=True)
        return with_sparse_update(rows, lambda grad: self.apply_gradients(ids, grad))

    @torch.no_grad()
    def lookup(self, ids: Tensor, *, admit: bool = True) -> Tensor:
        """Rows for ``ids``; with ``admit`` this is a training step of the clock (count, expire, admit, evict).

        Example::

            >>> t = DynamicEmbeddingTable(10, 2, min_frequency=3)
            >>> float(t.lookup(torch.tensor([1, 1])).abs().sum()), len(t)   # seen twice: not admitted
            (0.0, 0)
        """
        flat = _check_ids(ids)
        if admit:
            self._train_step(flat)
        slots = self._index.find(flat)
        out = torch.full((flat.numel(), self.dim), self.default_value, dtype=self.weight.dtype)
        hit = slots >= 0
        out[hit] = self.weight.index_select(0, slots[hit])
        return out.reshape(*ids.shape, self.dim)

    @torch.no_grad()
    def apply_gradients(self, ids: Tensor, grad: Tensor) -> None:
        """One optimizer step: ``grad`` (``ids.shape + (dim,)``) summed per id, applied to admitted ids' rows.

        Example::

            >>> t = DynamicEmbeddingTable(10, 2, optimizer_params={"lr": 1.0}); _ = t.lookup(torch.tensor([4]))
            >>> before = t.lookup(torch.tensor([4]), admit=False)
            >>> t.apply_gradients(torch.tensor([4, 4]), torch.ones(2, 2))
            >>> (t.lookup(torch.tensor([4]), admit=False) - before).tolist()
            [[-2.0, -2.0]]
        """
        flat = _check_ids(ids)
        g = grad.reshape(-1, self.dim)
        if g.shape[0] != flat.numel():
            raise ValueError(f"{flat.numel()} ids but {g.shape[0]} gradient rows")
        self.optimizer_steps += 1
        slots = self._index.find(flat)
        keep = slots >= 0
        if not bool(keep.any()):
            return
        uniq, inverse = torch.unique(slots[keep], return_inverse=True)
        summed = torch.zeros(uniq.numel(), self.dim, dtype=torch.float32).index_add_(0, inverse, g[keep].float())
        self.optimizer.update(self.weight, self.state, RowUpdate.simple(uniq, summed, step=self.optimizer_steps))

    # ---------------------------------------------------------------- the step
    def _train_step(self, flat: Tensor) -> None:
        self.step_count += 1
        now = self.step_count
        if self.eviction == "ttl":
            self._expire(now)
        uniq, counts = torch.unique(flat, return_counts=True)
        slots = self._index.find(uniq)
        present = slots >= 0
        used = slots[present]
        self.freq[used] += counts[present]
        self.last_seen[used] = now
        cand_ids, cand_counts = uniq[~present], counts[~present]
        if cand_ids.numel() == 0:
            return
        if self.min_frequency > 1:
            cand_counts = self._count_candidates(cand_ids, cand_counts)
            eligible = cand_counts >= self.min_frequency
            cand_ids, cand_counts = cand_ids[eligible], cand_counts[eligible]
        n_new = cand_ids.numel()
        if n_new == 0:
            return
        short = n_new - (self.capacity - len(self._index))
        if short > 0 and self.full_policy == "evict":
            self._evict(short, protect=used)
        room = self.capacity - len(self._index)
        if n_new > room:
            # the most frequent candidates win the free slots; ties go to the smaller id (unique() sorted them)
            order = torch.sort(cand_counts, descending=True, stable=True).indices
            refused = n_new - room
            cand_ids, cand_counts = cand_ids[order[:room]], cand_counts[order[:room]]
            self._totals["rejected"] += refused
            if not self._warned_full:
                logger.warning(
                    "dynamic table full (%d rows, full_policy=%r): %d new ids rejected at step %d; they read the "
                    "default row until there is room (see .stats)", self.capacity, self.full_policy, refused, now)
                self._warned_full = True
        if cand_ids.numel() == 0:
            return
        new_slots = self._index.insert(cand_ids)
        self.weight[new_slots] = hashed_init(cand_ids, self.dim, self.init_scale, self.seed).to(self.weight.dtype)
        for buf in self.state.values():
            buf[new_slots] = 0.0
        self.freq[new_slots] = cand_counts
        self.last_seen[new_slots] = now
        self._totals["admitted"] += cand_ids.numel()
        if self.min_frequency > 1:
            self._counter.erase(cand_ids)

    def _count_candidates(self, ids: Tensor, counts: Tensor) -> Tensor:
        """Add this step's counts of not-admitted ids; returns their totals."""
        known = self._counter.find(ids) >= 0
        n_unknown = int((~known).sum())
        if n_unknown > self._counter.capacity - len(self._counter):
            logger.info("admission counter full (%d ids): clearing it", self._counter.capacity)
            self._counter.clear()
            known = torch.zeros_like(known)
            if ids.numel() > self._counter.capacity:  # more new ids in one batch than the counter holds
                ids, counts, known = ids[: self._counter.capacity], counts[: self._counter.capacity], known[: self._counter.capacity]
        slots = self._counter.insert(ids)
        self._counts[slots[~known]] = 0
        self._counts[slots] += counts
        totals = self._counts[slots]
        if totals.numel() < counts.numel():  # ids cut off above count only this step
            totals = torch.cat([totals, counts[totals.numel():]])
        return totals

    def _expire(self, now: int) -> None:
        assert self.ttl_steps is not None
        stale = self._index.occupied() & (now - self.last_seen > self.ttl_steps)
        if bool(stale.any()):
            dead = stale.nonzero().squeeze(1)
            self._index.erase(self._index.ids_of(dead))
            self._totals["expired"] += dead.numel()

    def _evict(self, n: int, protect: Tensor) -> None:
        """Remove up to ``n`` rows not in ``protect``, chosen by the eviction order (``picasso_ops.eviction``)."""
        policy = "lfu" if self.eviction == "lfu" else "lru"  # "ttl" rows expire by age; a full table drops the oldest
        score = eviction_scores(policy, self.freq, self.last_seen, self.step_count)
        victims = pick_victims(score, n, occupied=self._index.occupied(), protect=protect)
        if victims.numel() == 0:
            return
        self._index.erase(self._index.ids_of(victims))
        self._totals["evicted"] += victims.numel()

    # ---------------------------------------------------------------- checkpoints
    def _save_to_state_dict(self, destination: dict, prefix: str, keep_vars: bool) -> None:
        ids, slots = self._index.items()
        destination[prefix + "ids"] = ids
        destination[prefix + "weight"] = self.weight[slots].clone()
        for name, buf in self.state.items():
            destination[prefix + name] = buf[slots].clone()
        destination[prefix + "freq"] = self.freq[slots].clone()
        destination[prefix + "last_seen"] = self.last_seen[slots].clone()
        cids, cslots = self._counter.items()
        destination[prefix + "candidate_ids"] = cids
        destination[prefix + "candidate_counts"] = self._counts[cslots].clone()
        destination[prefix + "clock"] = torch.tensor([self.step_count, self.optimizer_steps], dtype=torch.int64)

    def _load_from_state_dict(self, state_dict: Mapping[str, Any], prefix: str, local_metadata: Any, strict: bool,
                              missing_keys: list, unexpected_keys: list, error_msgs: list) -> None:
        names = ["ids", "weight", *self.state, "freq", "last_seen", "candidate_ids", "candidate_counts", "clock"]
        missing = [prefix + n for n in names if prefix + n not in state_dict]
        if missing:
            missing_keys.extend(missing)
            return
        ids = state_dict[prefix + "ids"]
        weight = state_dict[prefix + "weight"]
        if weight.shape != (ids.numel(), self.dim):
            error_msgs.append(f"{prefix}weight: expected shape ({ids.numel()}, {self.dim}), got {tuple(weight.shape)}")
            return
        if ids.numel() > self.capacity:
            error_msgs.append(f"{prefix}ids: {ids.numel()} rows do not fit a table of capacity {self.capacity}")
            return
        self._index.clear()
        slots = self._index.insert(ids)
        with torch.no_grad():
            self.weight[slots] = weight.to(self.weight.dtype)
            for name, buf in self.state.items():
                buf[slots] = state_dict[prefix + name].to(buf.dtype)
            self.freq[slots] = state_dict[prefix + "freq"]
            self.last_seen[slots] = state_dict[prefix + "last_seen"]
        self._counter.clear()
        cids = state_dict[prefix + "candidate_ids"][: self._counter.capacity]
        self._counts[self._counter.insert(cids)] = state_dict[prefix + "candidate_counts"][: cids.numel()]
        self.step_count, self.optimizer_steps = (int(x) for x in state_dict[prefix + "clock"])

    def extra_repr(self) -> str:
        return (f"capacity={self.capacity}, dim={self.dim}, optimizer={self.optimizer}, min_frequency={self.min_frequency}, "
                f"eviction={self.eviction!r}, ttl_steps={self.ttl_steps}, full_policy={self.full_policy!r}")


def _check_ids(ids: Tensor) -> Tensor:
    if not isinstance(ids, Tensor) or ids.dtype != torch.int64:
        raise TypeError(f"ids must be an int64 tensor, got {getattr(ids, 'dtype', type(ids))}")
    return ids.reshape(-1)
