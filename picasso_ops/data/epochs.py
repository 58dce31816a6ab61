"""The plan of a multi-epoch pass over training files: each epoch's file order and its shuffled windows.

Pure numbers, no I/O: every rank, every worker and a resumed run compute the same plan from
``(seed, epoch)``, so the shuffle needs no communication and a checkpoint only records a position.

* **Epoch 0 reads the files in the order given, unshuffled** (``shuffle_first=False``), so a
  one-epoch job reads exactly what it read before epochs existed. Later epochs are shuffled.
* **File order**: a Fisher-Yates permutation of the file indices, seeded by ``(seed, epoch)``.
* **Windows**: an epoch's batches are read sequentially in windows of ``window`` consecutive
  batches (the last window may be shorter); each window's batches are emitted in a Fisher-Yates
  permutation seeded by ``(seed, epoch, window index)``. Memory holds one window; the files are
  never read backwards or at random.
* The random numbers are SplitMix64 (Steele, Lea, Flood 2014), written out here so that a plan
  never changes with a numpy or Python upgrade (a resumed run must see the batches it would have).

Example::

    plan = EpochPlan(seed=1234, window=4)
    plan.file_order(epoch=1, num_files=3)         # e.g. [2, 0, 1]: epoch 1 reads file 2 first
    plan.window_order(epoch=1, window=0, size=4)  # e.g. [3, 1, 0, 2]: emit the 4th read batch first
    plan.read_index(epoch=1, index=5, num_batches=10)   # which read batch the epoch emits 6th
    plan.numbered(number=13, per_epoch=10)        # (1, read index of emitted batch 3 of epoch 1)
"""
from __future__ import annotations

import dataclasses

__all__ = ["EpochPlan", "SplitMix64", "DEFAULT_WINDOW", "permutation", "seed_of"]

MASK64 = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15  # SplitMix64's increment (2^64 / golden ratio)
DEFAULT_WINDOW = 16  # batches shuffled together: 16 x 4096 rows is a few tens of MB
FILES, WINDOWS = 1, 2  # stream tags: file order and window permutations draw from unrelated seeds


class SplitMix64:
    """SplitMix64: ``SplitMix64(1234567).next()`` -> 6457827717110365317 (the reference output)."""

    def __init__(self, seed: int) -> None:
        self.state = seed & MASK64

    def next(self) -> int:
        """The next 64-bit output."""
        self.state = (self.state + GOLDEN) & MASK64
        z = self.state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
        return z ^ (z >> 31)


def seed_of(*words: int) -> int:
    """One 64-bit seed from integers: each word is xored into the state, which is then mixed once.

    ``seed_of(7)`` == ``SplitMix64(7).next()``; negative words count modulo 2^64.
    """
    state = 0
    for word in words:
        state = SplitMix64(state ^ (word & MASK64)).next()
    return state


def permutation(size: int, seed: int) -> list[int]:
    """Fisher-Yates: for i = size-1 .. 1, swap item i with item ``next() % (i + 1)``.

    ``permutation(2, seed)`` is ``[1, 0]`` when the first output of ``SplitMix64(seed)`` is even.
    """
    if size < 0:
        raise ValueError(f"permutation size must be >= 0, got {size}")
    order, rng = list(range(size)), SplitMix64(seed)
    for i in range(size - 1, 0, -1):
        j = rng.next() % (i + 1)
        order[i], order[j] = order[j], order[i]
    return order


@dataclasses.dataclass(frozen=True)
class EpochPlan:
    """Which file order and which window permutations each epoch uses (see the module doc).

    ``seed``: the job's ``--seed``; ``window``: batches shuffled together; ``shuffle_first``: shuffle
    epoch 0 too (default: epoch 0 reads the files as given).
    """

    seed: int
    window: int = DEFAULT_WINDOW
    shuffle_first: bool = False

    def __post_init__(self) -> None:
        if self.window < 1:
            raise ValueError(f"EpochPlan window must be >= 1 batch, got {self.window}")

    def shuffled(self, epoch: int) -> bool:
        """Whether ``epoch`` permutes its files and windows."""
        if epoch < 0:
            raise ValueError(f"epoch must be >= 0, got {epoch}")
        return epoch > 0 or self.shuffle_first

    def file_order(self, epoch: int, num_files: int) -> list[int]:
        """The indices of the files in the order ``epoch`` reads them."""
        if not self.shuffled(epoch):
            return list(range(num_files))
        return permutation(num_files, seed_of(self.seed, epoch, FILES))

    def window_order(self, epoch: int, window: int, size: int) -> list[int]:
        """Position p of the result: which of the window's ``size`` read batches is emitted p-th."""
        if not 1 <= size <= self.window:
            raise ValueError(f"a window holds 1..{self.window} batches, got {size}")
        if not self.shuffled(epoch):
            return list(range(size))
        return permutation(size, seed_of(self.seed, epoch, WINDOWS, window))

    def read_index(self, epoch: int, index: int, num_batches: int) -> int:
        """Which read batch (0-based, in the epoch's file order) an epoch of ``num_batches`` emits ``index``-th."""
        if not 0 <= index < num_batches:
            raise IndexError(f"batch {index} outside the epoch's {num_batches} batches")
        window, pos = divmod(index, self.window)
        first = window * self.window
        return first + self.window_order(epoch, window, min(self.window, num_batches - first))[pos]

    def numbered(self, number: int, per_epoch: int) -> tuple[int, int]:
        """Job-wide batch ``number`` of epochs of ``per_epoch`` batches: (its epoch, its read index there)."""
        if per_epoch < 1 or number < 0:
            raise ValueError(f"need per_epoch >= 1 and number >= 0, got {per_epoch} and {number}")
        epoch, index = divmod(number, per_epoch)
        return epoch, self.read_index(epoch, index, per_epoch)
