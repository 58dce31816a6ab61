"""A collision-free hash table from raw int64 ids to dense slots, in vectorised torch ops.

Open addressing with linear probing over a power-of-two bucket array. Every
operation works on a whole batch of ids: it deduplicates them, then runs probing
*rounds*; in each round every still-unresolved id looks at a window of 8
consecutive buckets, and the ids that are done (found, proven missing, or
placed) drop out. A batch takes about (longest probe chain / 8) rounds, each
O(active ids). Ids of one batch competing for a free bucket: the smallest wins,
the others probe on.

Keys and slots are separate: a bucket holds ``(key, slot)``, and slots are dense
indices in ``[0, capacity)`` handed out from a free list, so a caller can keep
its rows in a ``[capacity, dim]`` buffer however many buckets the table uses.
Erased keys leave tombstones (a lookup must probe past them); the table rebuilds
itself when tombstones pile up.

Any int64 is a valid key (bucket state lives in its own byte array, so no key
value is reserved), which is why the dynamic vocabulary keeps this pure-torch
table for raw ids; the hot-row cache, whose keys are store rows, indexes them
with the C++ op instead (:class:`~picasso_ops.cache.slot_index.SlotIndex` over
:class:`~picasso_ops.ops.HashTable`, which reserves two key values).

Example::

    >>> import torch
    >>> from picasso_ops.vocab.hash_table import IdHashTable
    >>> table = IdHashTable(capacity=4)
    >>> table.insert(torch.tensor([10**12, -5, 10**12])).tolist()  # new ids take slots in ascending id order
    [1, 0, 1]
    >>> table.find(torch.tensor([-5, 7])).tolist()
    [0, -1]
    >>> _ = table.erase(torch.tensor([-5])); len(table)
    1
"""

from __future__ import annotations

import logging
from typing import Optional

import torch
from torch import Tensor

__all__ = ["IdHashTable", "TableFullError"]

logger = logging.getLogger(__name__)

_EMPTY, _FULL, _TOMB = 0, 1, 2
# murmur3 fmix64 constants as signed int64 (torch int64 multiplication wraps like uint64)
_C1 = 0xFF51AFD7ED558CCD - (1 << 64)
_C2 = 0xC4CEB9FE1A85EC53 - (1 << 64)
_LOW31 = (1 << 31) - 1
_WINDOW = 8  # buckets probed per round: fewer rounds of small ops, one cache line of keys


class TableFullError(RuntimeError):
    """An insert needs more free slots than the table has; nothing was inserted."""


def _mix(ids: Tensor) -> Tensor:
    """murmur3's 64-bit finaliser; shifts are masked so they act as logical shifts on int64."""
    k = ids ^ ((ids >> 33) & _LOW31)
    k = k * _C1
    k = k ^ ((k >> 33) & _LOW31)
    k = k * _C2
    return k ^ ((k >> 33) & _LOW31)


class IdHashTable:
    """Map raw int64 ids to slots in ``[0, capacity)``; no collisions, no fixed vocabulary.

    Args:
        capacity: most keys held at once (= number of slots).
        load_factor: largest ``capacity / buckets``; buckets are the next power
            of two of ``capacity / load_factor`` (always at least ``capacity + 1``,
            so a probe chain always ends at an empty bucket).
        device: where the tables live.

    Example::

        >>> t = IdHashTable(capacity=1000, load_factor=0.9)
        >>> slots = t.insert(torch.arange(1000) * 7919)
        >>> bool((t.find(torch.arange(1000) * 7919) == slots).all()), len(t)
        (True, 1000)
    """

    def __init__(self, capacity: int, *, load_factor: float = 0.5, device: Optional[torch.device] = None) -> None:
        if int(capacity) < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        if not 0.0 < load_factor <= 1.0:
            raise ValueError(f"load_factor must be in (0, 1], got {load_factor}")
        self._capacity = int(capacity)
        need = max(self._capacity + 1, int(self._capacity / load_factor + 0.999999))
        self.num_buckets = 1 << (need - 1).bit_length()
        self._mask = self.num_buckets - 1
        self._offsets = torch.arange(_WINDOW, dtype=torch.int64, device=device)
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self._keys = torch.zeros(self.num_buckets, dtype=torch.int64, device=self.device)
        self._slots = torch.full((self.num_buckets,), -1, dtype=torch.int64, device=self.device)
        self._state = torch.zeros(self.num_buckets, dtype=torch.uint8, device=self.device)
        self._slot_bucket = torch.full((self._capacity,), -1, dtype=torch.int64, device=self.device)
        # free slots are a stack: the last _num_free entries of _free, popped from the front of that range
        self._free = torch.arange(self._capacity - 1, -1, -1, dtype=torch.int64, device=self.device)
        self._num_free = self._capacity
        self._tombstones = 0

    # ---------------------------------------------------------------- queries
    @property
    def capacity(self) -> int:
        """The number of slots: the most keys the table holds at once."""
        return self._capacity

    def __len__(self) -> int:
        return self._capacity - self._num_free

    def find(self, ids: Tensor) -> Tensor:
        """Slot of each id, ``-1`` where absent; any shape, duplicates allowed.

        Example::

            >>> t = IdHashTable(8); _ = t.insert(torch.tensor([3]))
            >>> t.find(torch.tensor([[3, 4], [3, 3]])).tolist()
            [[0, -1], [0, 0]]
        """
        flat = self._checked(ids)
        uniq, inverse = torch.unique(flat, return_inverse=True)
        return self._find_buckets(uniq)[1][inverse].reshape(ids.shape)

    def items(self) -> tuple[Tensor, Tensor]:
        """``(ids, slots)`` of every key, ids ascending.

        Example::

            >>> t = IdHashTable(8); _ = t.insert(torch.tensor([9, 2]))
            >>> [x.tolist() for x in t.items()]
            [[2, 9], [0, 1]]
        """
        full = self._state == _FULL
        keys, slots = self._keys[full], self._slots[full]
        order = torch.argsort(keys)
        return keys[order], slots[order]

    def ids_of(self, slots: Tensor) -> Tensor:
        """The ids held by occupied ``slots``.

        Example::

            >>> t = IdHashTable(4); s = t.insert(torch.tensor([-8, 30]))
            >>> t.ids_of(s.flip(0)).tolist()
            [30, -8]
        """
        return self._keys[self._slot_bucket[slots]]

    def occupied(self) -> Tensor:
        """``[capacity]`` bool: which slots hold a key."""
        return self._slot_bucket >= 0

    # ---------------------------------------------------------------- updates
    def insert(self, ids: Tensor) -> Tensor:
        """Slots of ``ids``, adding the absent ones; raises :class:`TableFullError` (changing nothing) if they do not fit.

        Example::

            >>> t = IdHashTable(2)
            >>> t.insert(torch.tensor([5, 6, 5])).tolist()
            [0, 1, 0]
            >>> t.insert(torch.tensor([7]))
            Traceback (most recent call last):
            ...
            picasso_ops.vocab.hash_table.TableFullError: inserting 1 new ids needs 1 free slots, the table has 0 of 2
        """
        flat = self._checked(ids)
        uniq, inverse = torch.unique(flat, return_inverse=True)
        _, slots = self._find_buckets(uniq)
        missing = slots < 0
        n_new = int(missing.sum())
        if n_new:
            if n_new > self._num_free:
                raise TableFullError(
                    f"inserting {n_new} new ids needs {n_new} free slots, the table has {self._num_free} of {self._capacity}"
                )
            if len(self) + self._tombstones + n_new >= self.num_buckets or self._tombstones > self.num_buckets // 4:
                self._rehash()  # keeps an empty bucket at the end of every chain and chains short
            new_ids = uniq[missing]
            new_slots = self._free[self._num_free - n_new : self._num_free].flip(0)
            self._num_free -= n_new
            buckets = self._place(new_ids)
            self._keys[buckets] = new_ids
            self._slots[buckets] = new_slots
            self._state[buckets] = _FULL
            self._slot_bucket[new_slots] = buckets
            slots = slots.clone()
            slots[missing] = new_slots
        return slots[inverse].reshape(ids.shape)

    def erase(self, ids: Tensor) -> Tensor:
        """Remove ``ids`` (absent ones are ignored); returns the freed slots.

        Example::

            >>> t = IdHashTable(4); _ = t.insert(torch.tensor([1, 2]))
            >>> t.erase(torch.tensor([2, 2, 99])).tolist(), len(t)
            ([1], 1)
        """
        flat = self._checked(ids)
        uniq = torch.unique(flat)
        buckets, slots = self._find_buckets(uniq)
        hit = slots >= 0
        buckets, slots = buckets[hit], slots[hit]
        n = slots.numel()
        if n:
            self._state[buckets] = _TOMB
            self._slots[buckets] = -1
            self._slot_bucket[slots] = -1
            self._free[self._num_free : self._num_free + n] = slots.flip(0)
            self._num_free += n
            self._tombstones += n
        return slots

    def clear(self) -> None:
        """Remove every key."""
        self._state.zero_()
        self._slots.fill_(-1)
        self._slot_bucket.fill_(-1)
        self._free = torch.arange(self._capacity - 1, -1, -1, dtype=torch.int64, device=self.device)
        self._num_free = self._capacity
        self._tombstones = 0

    # ---------------------------------------------------------------- probing
    def _checked(self, ids: Tensor) -> Tensor:
        if not isinstance(ids, Tensor) or ids.dtype != torch.int64:
            raise TypeError(f"ids must be an int64 tensor, got {getattr(ids, 'dtype', type(ids))}")
        return ids.reshape(-1).to(self.device)

    def _window(self, pos: Tensor) -> Tensor:
        """The ``_WINDOW`` consecutive buckets from each of ``pos``, ``[n, _WINDOW]``."""
        return (pos.unsqueeze(1) + self._offsets) & self._mask

    def _find_buckets(self, uniq: Tensor) -> tuple[Tensor, Tensor]:
        """``(bucket, slot)`` of unique ids, ``(-1, -1)`` where absent; probes a window of buckets per round."""
        n = uniq.numel()
        out_bucket = torch.full((n,), -1, dtype=torch.int64, device=self.device)
        out_slot = torch.full((n,), -1, dtype=torch.int64, device=self.device)
        active = torch.arange(n, device=self.device)
        pos = _mix(uniq) & self._mask
        keys = uniq
        for _ in range(self.num_buckets // _WINDOW + 1):
            if active.numel() == 0:
                break
            win = self._window(pos)
            state = self._state[win]
            match = (state == _FULL) & (self._keys[win] == keys.unsqueeze(1))
            # a key never sits past an empty bucket of its chain, so one match anywhere is the key
            found = match.any(1)
            if bool(found.any()):
                b = win[found].gather(1, match[found].to(torch.uint8).argmax(1, keepdim=True)).squeeze(1)
                idx = active[found]
                out_bucket[idx] = b
                out_slot[idx] = self._slots[b]
            go_on = ~found & ~(state == _EMPTY).any(1)  # no empty bucket yet: the chain goes on
            active, pos, keys = active[go_on], (pos[go_on] + _WINDOW) & self._mask, keys[go_on]
        return out_bucket, out_slot

    def _place(self, new_ids: Tensor) -> Tensor:
        """Claim a free bucket for each of ``new_ids`` (unique, known absent); lowest index wins a contested bucket."""
        n = new_ids.numel()
        out = torch.empty(n, dtype=torch.int64, device=self.device)
        active = torch.arange(n, device=self.device)
        pos = _mix(new_ids) & self._mask
        claimed = self._state.clone()  # buckets taken earlier in this call count as full
        for _ in range(self.num_buckets + n):
            if active.numel() == 0:
                return out
            win = self._window(pos)
            free = claimed[win] != _FULL
            has_free = free.any(1)
            first = free.to(torch.uint8).argmax(1)  # the first non-full bucket of the window
            cand, cpos = active[has_free], win[has_free].gather(1, first[has_free].unsqueeze(1)).squeeze(1)
            placed = torch.zeros(active.numel(), dtype=torch.bool, device=self.device)
            if cand.numel():
                contested, which = torch.unique(cpos, return_inverse=True)
                winner = torch.full((contested.numel(),), n, dtype=torch.int64, device=self.device)
                winner.scatter_reduce_(0, which, cand, reduce="amin")
                won = winner[which] == cand
                out[cand[won]] = cpos[won]
                claimed[cpos[won]] = _FULL
                placed[has_free.nonzero().squeeze(1)[won]] = True
            # losers retry from their first free bucket (now taken); windows without one move on
            nxt = torch.where(has_free, win.gather(1, first.unsqueeze(1)).squeeze(1), (pos + _WINDOW) & self._mask)
            keep = ~placed
            active, pos = active[keep], nxt[keep]
        raise RuntimeError("hash table probing did not terminate (internal error)")

    def _rehash(self) -> None:
        """Rebuild the bucket array without tombstones; slots stay the same."""
        full = self._state == _FULL
        keys, slots = self._keys[full], self._slots[full]
        self._state.zero_()
        self._slots.fill_(-1)
        self._tombstones = 0
        if keys.numel():
            buckets = self._place(keys)
            self._keys[buckets] = keys
            self._slots[buckets] = slots
            self._state[buckets] = _FULL
            self._slot_bucket[slots] = buckets
        logger.debug("hash table rebuilt: %d keys in %d buckets", keys.numel(), self.num_buckets)
