"""Which global batch a worker trains next: lockstep in sync mode, first come first served in gba mode.

GBA's speed-up under stragglers comes from fast workers taking more batches than slow ones
(the paper's workers pull batches from a shared queue). Batches are numbered ``0 .. total-1``
job-wide and a batch number is all a data source needs (the synthetic stream is indexable):

* sync phase starting at ``base``: the workers step together, so worker ``w`` of ``N`` takes
  ``base + k*N + w`` at its k-th step; the phase ends for everyone at once when fewer than
  ``N`` batches are left (drop-last), which needs no message;
* gba phase ``p`` starting at ``base``: every worker takes ``base + store.add(counter_p, 1) - 1``
  from a TCPStore counter, so a worker 4x slower takes about a quarter of the batches.

A batch number handed out in a gba phase is consumed by that worker (or lost with it if it
dies: a lost token changes neither correctness nor progress, DESIGN.md "GBA").

Example::

    claims = BatchClaims(store, num_workers=4, worker_index=1, total=1000)
    claims.enter_sync(base=0)
    claims.next()              # 1  (then 5, 9, ...)
    claims.enter_gba(phase=1, base=claims.taken)
    claims.next()              # whatever the shared counter hands out

A restarted worker (``gba_engine.rejoin``) calls ``join_gba(phase)`` and draws from the same counter.
"""
from __future__ import annotations

from torch.distributed import Store

from .protocol import claims_base_key, claims_counter_key, decode_int, encode_int


class BatchClaims:
    """Batch numbers for one worker over sync and gba phases (see the module docstring)."""

    def __init__(self, store: Store, num_workers: int, worker_index: int, total: int) -> None:
        if num_workers < 1 or not 0 <= worker_index < num_workers:
            raise ValueError(f"worker_index {worker_index} is not in [0, {num_workers})")
        if isinstance(total, bool) or not isinstance(total, int) or total < 0:
            raise ValueError(f"total batches must be a non-negative integer, got {total!r}")
        self.store, self.num_workers, self.worker_index, self.total = store, num_workers, worker_index, total
        self.mode = "sync"
        self.base = 0
        self.phase = 0
        self._k = 0  # sync: steps taken in this phase
        self.next_free = 0  # one past the highest number this worker took (or the phase base)

    def enter_sync(self, base: int) -> None:
        """Start a sync phase at batch ``base`` (the same on every worker)."""
        self.mode, self.base, self._k = "sync", base, 0
        self.next_free = max(self.next_free, base)

    def enter_gba(self, phase: int, base: int) -> None:
        """Start gba phase ``phase`` at batch ``base`` (the same on every worker)."""
        self.mode, self.base, self.phase = "gba", base, phase
        self.next_free = max(self.next_free, base)
        self.store.set(claims_base_key(phase), encode_int(base))

    def join_gba(self, phase: int) -> None:
        """A restarted worker joins running gba phase ``phase`` at the base its peers published.

        Raises LookupError when no worker of the job has claimed batches in that phase yet.
        """
        if not self.store.check([claims_base_key(phase)]):
            raise LookupError(f"gba phase {phase} has no claimed batches yet: the running job does not use "
                              "claim_batches, or has not started it")
        self.enter_gba(phase, decode_int(self.store.get(claims_base_key(phase))))

    @property
    def taken(self) -> int:
        """Batches handed out job-wide so far (the resume point), as this worker sees it."""
        if self.mode == "sync":
            return min(self.total, self.base + self._k * self.num_workers)
        # add 0 reads without blocking; the counter also counts the claims that found nothing left
        return min(self.total, self.base + self.store.add(claims_counter_key(self.phase), 0))

    def next(self) -> int | None:
        """The next batch number, or None when this phase has run out of batches."""
        if self.mode == "sync":
            first = self.base + self._k * self.num_workers
            if first + self.num_workers > self.total:
                return None  # too few left for a whole step of every worker (drop-last)
            self._k += 1
            index = first + self.worker_index
        else:
            index = self.base + self.store.add(claims_counter_key(self.phase), 1) - 1
            if index >= self.total:
                return None
        self.next_free = max(self.next_free, index + 1)
        return index
