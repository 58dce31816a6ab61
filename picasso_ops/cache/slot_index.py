"""The cache's index: store row -> cache slot, over the C++ hash-table op, with the reverse map eviction needs.

:class:`~picasso_ops.ops.HashTable` (the C++ op; its pure-torch reference on a
machine without a compiler) maps keys to dense slots in batch calls. The cache
also asks which row a slot holds (to write a victim back and erase it) and
which slots are occupied; :class:`SlotIndex` keeps that reverse map beside the
table. Keys are store rows, so they are never negative and ``-1`` can mark a
free slot.

Example::

    >>> index = SlotIndex(4)
    >>> index.insert(torch.tensor([7, 3])).tolist()
    [0, 1]
    >>> index.find(torch.tensor([3, 5])).tolist(), index.ids_of(torch.tensor([0])).tolist()
    ([1, -1], [7])
"""
from __future__ import annotations

import torch
from torch import Tensor

from picasso_ops.ops import HashTable
from picasso_ops.vocab.hash_table import TableFullError

__all__ = ["SlotIndex"]


class SlotIndex:
    """Non-negative int64 ids -> slots in ``[0, capacity)``; batch ``find``/``insert``/``erase`` and slot queries."""

    def __init__(self, capacity: int) -> None:
        if int(capacity) < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self._table = HashTable(int(capacity))
        self._ids = torch.full((int(capacity),), -1, dtype=torch.int64)  # the id each slot holds, -1: free

    @property
    def capacity(self) -> int:
        """The number of slots: the most ids held at once."""
        return self._table.num_slots

    def __len__(self) -> int:
        return len(self._table)

    def find(self, ids: Tensor) -> Tensor:
        """Slot of each id, ``-1`` where absent (same shape as ``ids``)."""
        return self._table.find(self._flat(ids)).reshape(ids.shape)

    def insert(self, ids: Tensor) -> Tensor:
        """Slots of ``ids``, adding the absent ones; raises :class:`TableFullError` (changing nothing) if they do not fit."""
        flat = self._checked(ids)
        slots = self._table.find(flat)
        missing = slots < 0
        if not bool(missing.any()):
            return slots.reshape(ids.shape)
        new = torch.unique(flat[missing])
        if new.numel() > self.capacity - len(self):
            raise TableFullError(f"inserting {new.numel()} new ids needs {new.numel()} free slots, the index has "
                                 f"{self.capacity - len(self)} of {self.capacity}")
        new_slots = self._table.insert(new)  # ascending ids take free slots in order
        self._ids[new_slots] = new
        slots[missing] = new_slots[torch.searchsorted(new, flat[missing])]
        return slots.reshape(ids.shape)

    def erase(self, ids: Tensor) -> Tensor:
        """Remove ``ids`` (absent ones are ignored); returns the freed slots."""
        slots = self._table.erase(torch.unique(self._flat(ids)))
        freed = slots[slots >= 0]
        self._ids[freed] = -1
        return freed

    def ids_of(self, slots: Tensor) -> Tensor:
        """The ids held by occupied ``slots``."""
        return self._ids[slots]

    def occupied(self) -> Tensor:
        """``[capacity]`` bool: which slots hold an id."""
        return self._ids >= 0

    def items(self) -> tuple[Tensor, Tensor]:
        """``(ids, slots)`` of every held id, ids ascending."""
        slots = self.occupied().nonzero().squeeze(1)
        ids = self._ids[slots]
        order = torch.argsort(ids)
        return ids[order], slots[order]

    def clear(self) -> None:
        """Remove every id."""
        self._table = HashTable(self.capacity)
        self._ids.fill_(-1)

    @staticmethod
    def _flat(ids: Tensor) -> Tensor:
        if not isinstance(ids, Tensor) or ids.dtype != torch.int64:
            raise TypeError(f"ids must be an int64 tensor, got {getattr(ids, 'dtype', type(ids))}")
        return ids.reshape(-1)

    @classmethod
    def _checked(cls, ids: Tensor) -> Tensor:
        """``_flat`` plus the sign check an insert needs (-1 marks a free slot); a find of a negative id is just absent."""
        flat = cls._flat(ids)
        if flat.numel() and int(flat.min()) < 0:
            raise ValueError(f"cache ids are store rows, never negative; got {int(flat.min())}")
        return flat
