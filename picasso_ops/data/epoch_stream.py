"""Training batches over several epochs of files, in the order an :class:`~.epochs.EpochPlan` gives.

Two readers, one per kind of training stream:

* :class:`EpochFileStream`: one rank's shard, epoch after epoch. Each epoch opens a fresh reader
  over the files in that epoch's order (so a rank's rows differ between epochs) and emits its
  batches window by window in the plan's order. Between two epochs it yields :data:`EPOCH_END`
  (not after the last), so a caller that keeps ranks in lockstep can end an epoch on every rank
  at once even when the shards differ by a batch. ``state()`` is the exact resume point.
* :class:`EpochRowRanges`: job-wide batch numbers (a GBA job's claims). Number ``k`` lies in epoch
  ``k // per_epoch``; there it is read batch ``j = plan.numbered(k, per_epoch)[1]``, the rows
  ``[j*R, (j+1)*R)`` of that epoch's file order (``R`` rows per numbered batch). A worker holds the
  rows of one window at a time and reads forward only.

Example::

    plan = EpochPlan(seed=1234, window=4)
    stream = EpochFileStream(lambda order, row: CriteoTSVReader([files[i] for i in order], 256,
                                                                rank=r, world_size=w, start_row=row),
                             num_files=len(files), plan=plan, epochs=3)
    for item in stream:               # CTRBatch, ..., EPOCH_END, CTRBatch, ..., EPOCH_END, ...
        ...
    ckpt["data"] = stream.state()     # {"epoch": 1, "next_row": 4096, "window": 2, "taken": 3}
"""
from __future__ import annotations

import dataclasses
import itertools
import logging
from typing import Any, Callable, Iterator, Mapping, Sequence

import numpy as np

from .batch import CTRBatch
from .epochs import EpochPlan
from .quality import DataError
from .row_range import RowRangeReader
from .rows import RowBlock, ShardedRowReader

__all__ = ["EPOCH_END", "EpochPosition", "EpochFileStream", "EpochRowRanges"]

logger = logging.getLogger(__name__)
OpenReader = Callable[[Sequence[int], int], ShardedRowReader]  # (file order, start row) -> a reader from there


class _EpochEnd:
    """The marker between two epochs of an :class:`EpochFileStream`."""

    def __repr__(self) -> str:
        return "EPOCH_END"


EPOCH_END = _EpochEnd()


@dataclasses.dataclass(frozen=True)
class EpochPosition:
    """Where an :class:`EpochFileStream` stands: the next item comes from here.

    ``next_row``: where the epoch's reader reopens (global row of the epoch's file order). In a
    shuffled epoch that is the start of window ``window``, of whose batches ``taken`` were emitted;
    in an unshuffled one the row after the last emitted batch (``window`` = ``taken`` = 0).
    ``epoch`` equal to the job's epochs: every epoch was read.
    """

    epoch: int = 0
    next_row: int = 0
    window: int = 0
    taken: int = 0

    @classmethod
    def from_state(cls, state: Mapping[str, Any] | None) -> "EpochPosition":
        """The position a ``state()`` records; a one-epoch reader's ``{"next_row": r, ...}`` is epoch 0 at row r."""
        if not state:
            return cls()
        return cls(int(state.get("epoch", 0)), int(state["next_row"]), int(state.get("window", 0)),
                   int(state.get("taken", 0)))

    def as_state(self) -> dict[str, int]:
        """``{"epoch", "next_row", "window", "taken"}`` (what checkpoints record)."""
        return dataclasses.asdict(self)


class EpochFileStream:
    """One rank's batches over ``epochs`` epochs of the files (see the module doc).

    ``open_reader(order, start_row)``: this rank's reader over the files in ``order`` from ``start_row``.
    Each ``iter()`` starts again at ``start``.
    """

    def __init__(self, open_reader: OpenReader, num_files: int, plan: EpochPlan, epochs: int,
                 start: EpochPosition = EpochPosition()) -> None:
        if epochs < 1 or num_files < 1:
            raise ValueError(f"need epochs >= 1 and num_files >= 1, got {epochs} and {num_files}")
        if not 0 <= start.epoch <= epochs:
            raise ValueError(f"resume position in epoch {start.epoch}, outside the job's epochs 0..{epochs - 1}")
        self.open_reader, self.num_files, self.plan, self.epochs, self.start = open_reader, num_files, plan, epochs, start
        self._pos = start

    def state(self) -> dict[str, int]:
        """The resume point after the last item handed out: ``EpochPosition.from_state(s)`` continues there."""
        return self._pos.as_state()

    def __iter__(self) -> Iterator[CTRBatch | _EpochEnd]:
        pos = self._pos = self.start
        while pos.epoch < self.epochs:
            reader = self.open_reader(self.plan.file_order(pos.epoch, self.num_files), pos.next_row)
            if self.plan.shuffled(pos.epoch):
                yield from self._windows(reader, pos)
            else:
                for batch in reader:
                    self._pos = EpochPosition(pos.epoch, reader.state()["next_row"])
                    yield batch
            pos = self._pos = EpochPosition(pos.epoch + 1)
            if pos.epoch < self.epochs:
                yield EPOCH_END

    def _windows(self, reader: ShardedRowReader, pos: EpochPosition) -> Iterator[CTRBatch]:
        """The epoch's batches from ``pos``: ``plan.window`` read in order, emitted in the window's permutation."""
        batches = iter(reader)
        window, row, skip = pos.window, pos.next_row, pos.taken
        while read := list(itertools.islice(batches, self.plan.window)):
            order = self.plan.window_order(pos.epoch, window, len(read))
            for taken in range(skip, len(read)):
                self._pos = EpochPosition(pos.epoch, row, window, taken + 1)
                yield read[order[taken]]
            # the next window starts after the last batch read (a reopened reader batches the same rows)
            skip, window, row = 0, window + 1, reader.state()["next_row"]


class EpochRowRanges:
    """The micro-batches of job-wide batch numbers over epochs of the files (see the module doc).

    ``open_reader(order, start_row)``: a reader over *every* row (``world_size=1``) of the files in
    ``order``. ``per_epoch``: the whole numbered batches of ``micro_batch x gas`` rows in the files.
    Numbers must be asked in increasing order (a worker's claims only grow).

    Example::

        ranges = EpochRowRanges(open_all, num_files=2, plan=EpochPlan(seed=1), micro_batch=256, gas=2)
        batch = ranges.micro(number=ranges.per_epoch + 3, j=1)   # epoch 1, 2nd micro-batch of its number 3
    """

    def __init__(self, open_reader: OpenReader, num_files: int, plan: EpochPlan, micro_batch: int, gas: int,
                 reopen_rows: int = 1 << 18) -> None:
        self.open_reader, self.num_files, self.plan = open_reader, num_files, plan
        self.micro_batch, self.gas, self.reopen_rows = micro_batch, gas, reopen_rows
        self._epoch = 0
        self._reader = self._ranges(0)
        self.num_rows = self._reader.num_rows
        self.per_epoch = self.num_rows // (micro_batch * gas)  # whole numbered batches only
        self._window: tuple[int, int] | None = None  # (epoch, window) of the rows held
        self._block: RowBlock | None = None

    def _ranges(self, epoch: int) -> RowRangeReader:
        order = self.plan.file_order(epoch, self.num_files)
        return RowRangeReader(lambda row: self.open_reader(order, row), reopen_rows=self.reopen_rows)

    def epoch_of(self, number: int) -> int:
        """The epoch batch ``number`` belongs to."""
        return number // max(self.per_epoch, 1)

    def micro(self, number: int, j: int) -> CTRBatch:
        """Micro-batch ``j`` (0 .. gas-1) of batch ``number``: the good rows among its ``micro_batch`` rows.

        Raises DataError when all of them are bad, ValueError for a number of an earlier window.
        """
        epoch, read = self.plan.numbered(number, self.per_epoch)
        window = read // self.plan.window
        if self._window != (epoch, window):
            self._load(epoch, window)
        assert self._block is not None  # _load set it
        start = (read * self.gas + j) * self.micro_batch
        lo, hi = np.searchsorted(self._block.row_index, [start, start + self.micro_batch])
        if hi == lo:
            raise DataError(f"epoch {epoch}: rows [{start}, {start + self.micro_batch}) of the files in the order "
                            f"{self.plan.file_order(epoch, self.num_files)} hold no good row")
        return self._block.rows(int(lo), int(hi)).to_batch()

    def _load(self, epoch: int, window: int) -> None:
        """Read the rows of ``window`` of ``epoch`` (a fresh file order: a fresh reader)."""
        if self._window is not None and (epoch, window) < self._window:
            raise ValueError(f"numbered batches are read forward only: epoch {epoch} window {window} comes before "
                             f"epoch {self._window[0]} window {self._window[1]}")
        if epoch != self._epoch:
            self._epoch, self._reader = epoch, self._ranges(epoch)
        rows = self.micro_batch * self.gas
        first, last = window * self.plan.window, min((window + 1) * self.plan.window, self.per_epoch)
        self._block = self._reader.block(first * rows, last * rows)
        self._window = (epoch, window)
        logger.debug("epoch %d window %d: rows [%d, %d) read", epoch, window, first * rows, last * rows)
