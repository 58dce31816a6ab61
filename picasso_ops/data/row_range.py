"""Rows of CTR files by global row number: numbered batches over Criteo TSV or parquet files.

GBA hands batches out by number (fast workers take more), so a worker needs "batch k" rather than
"my next batch". :class:`RowRangeReader` returns the good rows among global rows ``[start, end)``
of a file reader, moving forward only (each worker's batch numbers only grow). Rows between two
asked ranges are parsed and dropped; a jump of more than ``reopen_rows`` rows reopens the reader at
the new start instead (Criteo: a newline-counting seek, parquet: row-group footers).

Example::

    reader = RowRangeReader(lambda start: CriteoTSVReader(files, 4096, start_row=start))
    batch = reader.rows(7 * 4096, 8 * 4096)        # CTRBatch of the good rows among rows 28672..32767
"""
from __future__ import annotations

import logging
from typing import Callable, Iterator, Optional

import numpy as np

from .batch import CTRBatch
from .quality import DataError
from .rows import RowBlock, ShardedRowReader

__all__ = ["RowRangeReader"]

logger = logging.getLogger(__name__)


class RowRangeReader:
    """Good rows of global row ranges, asked in increasing order (see the module doc).

    ``open_at(start)`` builds a one-rank reader (``rank=0, world_size=1``) positioned at row
    ``start``. ``num_rows`` (good and bad) comes from the first reader's ``total_rows()``.
    """

    def __init__(self, open_at: Callable[[int], ShardedRowReader], reopen_rows: int = 1 << 18) -> None:
        self._open_at = open_at
        self.reopen_rows = int(reopen_rows)
        first = open_at(0)
        if first.world_size != 1:
            raise ValueError(f"RowRangeReader needs a reader over every row (world_size=1), got {first.world_size}")
        self.num_rows = first.total_rows()
        self._reader: Optional[ShardedRowReader] = first
        self._blocks: Optional[Iterator[RowBlock]] = None
        self._pending: Optional[RowBlock] = None  # parsed rows at or after self._pos
        self._pos = 0  # rows before it were handed out or dropped

    def rows(self, start: int, end: int) -> CTRBatch:
        """The good rows among ``[start, end)`` as a CTRBatch; ``start`` must not go back.

        Raises IndexError outside ``[0, num_rows]``, ValueError for a range before the last one,
        DataError when every row of the range is bad (or a file has too many bad rows).
        """
        return self.block(start, end).to_batch()

    def block(self, start: int, end: int) -> RowBlock:
        """The good rows among ``[start, end)`` as parsed (``row_index``: global row numbers); as :meth:`rows`."""
        if not 0 <= start < end <= self.num_rows:
            raise IndexError(f"row range [{start}, {end}) outside the files' {self.num_rows} rows")
        if start < self._pos:
            raise ValueError(f"rows are read forward only: [{start}, {end}) starts before row {self._pos}")
        if self._blocks is None or start - self._pos > self.reopen_rows:
            self._reader = self._reader if self._blocks is None and start == 0 else self._open_at(start)
            self._blocks, self._pending = self._reader.row_blocks(), None
        pieces = []
        while True:
            block = self._pending if self._pending is not None else next(self._blocks, None)
            self._pending = None
            if block is None:
                break  # the data ended inside the range
            lo, hi = np.searchsorted(block.row_index, [start, end])
            if hi > lo:
                pieces.append(block.rows(int(lo), int(hi)))
            if hi < len(block):  # rows at or after `end` belong to a later range
                self._pending = block.rows(int(hi), len(block))
                break
        self._pos = end
        if not pieces:
            raise DataError(f"rows [{start}, {end}) hold no good row")
        return RowBlock.concat(pieces)
