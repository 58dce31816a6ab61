"""Parsed rows (numpy, row-major) regrouped into fixed-size `CTRBatch`es for the file readers.

    batcher = RowBatcher(batch_size=4096, drop_last=False)
    for batch, next_row in batcher.push(block):   # block: RowBlock of any size
        ...
    for batch, next_row in batcher.finish():      # the last partial batch
        ...
"""
from __future__ import annotations

import abc
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np
import torch

from .batch import CTRBatch
from .parsing import CategoricalHasher
from .quality import BadRowTracker, DataError

logger = logging.getLogger(__name__)
GZIP_MAGIC = b"\x1f\x8b"  # the first two bytes of every gzip member (RFC 1952)

__all__ = ["RowBlock", "RowBatcher", "ShardedRowReader", "owned_rows", "check_readable"]


def owned_rows(row_index: np.ndarray, rank: int, world_size: int, start_row: int) -> np.ndarray:
    """Mask of the rows rank ``rank`` reads: global row i goes to rank ``i % world_size``.

    ``owned_rows(np.arange(6), 1, 2, start_row=2)`` -> ``[F, F, F, T, F, T]``.
    """
    return (row_index % world_size == rank) & (row_index >= start_row)


@dataclass(frozen=True, eq=False)  # tensors/arrays have no single-bool ==
class RowBlock:
    """Good rows of one chunk: labels ``[n]``, dense ``[n, D]``, present/ids ``[n, F]``, row_index ``[n]``.

    Multi-hot rows: ``ids`` is ``[n, F, H]`` and ``present`` holds int counts ``[n, F]`` (the first
    ``present[i, f]`` entries of ``ids[i, f]`` are the row's values).
    """

    labels: np.ndarray
    dense: np.ndarray
    present: np.ndarray
    ids: np.ndarray
    row_index: np.ndarray

    def __len__(self) -> int:
        return int(len(self.labels))

    @staticmethod
    def concat(blocks: Sequence["RowBlock"]) -> "RowBlock":
        """Rows of all blocks in order: ``RowBlock.concat([a, b])``."""
        if len(blocks) == 1:
            return blocks[0]
        if any(b.ids.ndim == 3 for b in blocks):
            blocks = [b.multi_hot(max(b.ids.shape[2] if b.ids.ndim == 3 else 1 for b in blocks)) for b in blocks]
        return RowBlock(*(np.concatenate([getattr(b, name) for b in blocks])
                          for name in ("labels", "dense", "present", "ids", "row_index")))

    def multi_hot(self, width: int) -> "RowBlock":
        """The same rows with ``ids [n, F, width]`` and int counts: ``block.multi_hot(3)`` (for concatenation)."""
        ids = self.ids if self.ids.ndim == 3 else self.ids[:, :, None]
        if ids.shape[2] < width:
            ids = np.concatenate([ids, np.zeros((*ids.shape[:2], width - ids.shape[2]), ids.dtype)], axis=2)
        return RowBlock(self.labels, self.dense, self.present.astype(np.int64), ids, self.row_index)

    def rows(self, start: int, end: int) -> "RowBlock":
        """Rows ``[start, end)`` as views: ``block.rows(0, 4096)``."""
        return RowBlock(self.labels[start:end], self.dense[start:end], self.present[start:end],
                        self.ids[start:end], self.row_index[start:end])

    def to_batch(self) -> CTRBatch:
        """The rows as a CTRBatch; a missing categorical value becomes a length-0 entry."""
        present_fm = self.present.T  # field-major, like KeyedJaggedTensor
        if self.ids.ndim == 3:  # multi-hot: the first `count` ids of each row and field
            ids_fm = self.ids.transpose(1, 0, 2)
            values = ids_fm[np.arange(ids_fm.shape[2]) < present_fm[:, :, None]]
        else:
            values = self.ids.T[present_fm]
        return CTRBatch(
            dense=torch.from_numpy(np.ascontiguousarray(self.dense, dtype=np.float32)),
            values=torch.from_numpy(np.ascontiguousarray(values, dtype=np.int64)),
            lengths=torch.from_numpy(np.ascontiguousarray(present_fm, dtype=np.int64)),
            labels=torch.from_numpy(np.ascontiguousarray(self.labels, dtype=np.float32)),
        )


class RowBatcher:
    """Buffers row blocks and emits ``(CTRBatch, next_row)``; ``next_row`` = last row in the batch + 1."""

    def __init__(self, batch_size: int, drop_last: bool = False) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.batch_size = batch_size
        self.drop_last = drop_last
        self._pending: list[RowBlock] = []
        self._count = 0

    def push(self, block: RowBlock) -> Iterator[tuple[CTRBatch, int]]:
        """Add rows; yield every full batch now available."""
        if len(block) == 0:
            return
        self._pending.append(block)
        self._count += len(block)
        if self._count < self.batch_size:
            return
        rows = RowBlock.concat(self._pending)
        full = (len(rows) // self.batch_size) * self.batch_size
        for start in range(0, full, self.batch_size):
            part = rows.rows(start, start + self.batch_size)
            yield part.to_batch(), int(part.row_index[-1]) + 1
        rest = rows.rows(full, len(rows))
        # copy the remainder so the large concatenated chunk can be freed
        self._pending = [RowBlock(*(np.array(getattr(rest, n)) for n in
                                    ("labels", "dense", "present", "ids", "row_index")))] if len(rest) else []
        self._count = len(rest)

    def finish(self) -> Iterator[tuple[CTRBatch, int]]:
        """Yield the last partial batch (unless ``drop_last``) and reset."""
        if self._count and not self.drop_last:
            rows = RowBlock.concat(self._pending)
            yield rows.to_batch(), int(rows.row_index[-1]) + 1
        self._pending = []
        self._count = 0


def check_readable(paths: str | os.PathLike | Sequence[str | os.PathLike], kind: str) -> list[Path]:
    """Resolve ``paths`` and fail now, naming the path, if one is missing or unreadable.

    ``check_readable(["a.tsv"], "Criteo TSV")`` -> ``[Path("a.tsv")]``.
    """
    items = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)
    if not items:
        raise ValueError(f"no {kind} files given")
    resolved = []
    for item in items:
        path = Path(item)
        if not path.exists():
            raise FileNotFoundError(f"{kind} file not found: {path}")
        if not path.is_file():
            raise DataError(f"{kind} path is not a regular file: {path}")
        try:
            with open(path, "rb") as f:
                head = f.read(2)
        except OSError as exc:
            raise DataError(f"{kind} file cannot be read: {path}: {exc}") from exc
        if not head:  # a 0-byte file would end the data before step 1
            raise DataError(f"{kind} file is empty (0 bytes): {path}")
        if head == GZIP_MAGIC:  # otherwise every row reads as bad, without saying why
            raise DataError(f"{kind} file is gzip-compressed: {path}; decompress it first (gunzip -k {path})")
        resolved.append(path)
    return resolved


class ShardedRowReader(abc.ABC):
    """What the file readers share: rank sharding, resume point, bad-row tracking, batching.

    Subclasses implement ``total_rows()`` and ``_blocks()``, the latter yielding this rank's good rows (``RowBlock``s
    with global row indices >= ``start_row``) and feeding ``self.tracker``.
    """

    kind = "data"

    def __init__(self, paths: str | os.PathLike | Sequence[str | os.PathLike], batch_size: int, *,
                 vocab_sizes: int | Sequence[int], num_cat_features: int, rank: int, world_size: int,
                 start_row: int, drop_last: bool, max_bad_fraction: float, max_reported: int,
                 hash_seed: int) -> None:
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
        if batch_size < 1 or start_row < 0:
            raise ValueError(f"need batch_size >= 1 and start_row >= 0, got {batch_size} and {start_row}")
        if isinstance(vocab_sizes, (int, np.integer)):
            vocab = [int(vocab_sizes)] * num_cat_features
        else:
            vocab = [int(v) for v in vocab_sizes]
        if len(vocab) != num_cat_features:
            raise ValueError(f"vocab_sizes has {len(vocab)} entries for {num_cat_features} categorical fields")
        self.paths = check_readable(paths, self.kind)
        self.batch_size = batch_size
        self.rank = rank
        self.world_size = world_size
        self.start_row = start_row
        self.drop_last = drop_last
        self.max_bad_fraction = max_bad_fraction
        self.max_reported = max_reported
        self.hasher = CategoricalHasher(vocab, hash_seed)
        self.tracker = BadRowTracker(max_bad_fraction, max_reported)
        self._next_row = start_row
        self._rows_yielded = 0
        self._end_row = start_row

    def state(self) -> dict[str, int]:
        """Resume point and counters: ``Reader(paths, bs, start_row=reader.state()["next_row"])``.

        ``next_row`` is one past the last global row in a yielded batch, or the end of
        the data once the iteration finished. With the same world size each rank
        resumes from its own state.
        """
        return {"next_row": self._next_row, "rows_yielded": self._rows_yielded,
                "bad_rows": self.tracker.total_bad, "rank": self.rank, "world_size": self.world_size}

    def __iter__(self) -> Iterator[CTRBatch]:
        self.tracker = BadRowTracker(self.max_bad_fraction, self.max_reported)
        self._next_row = self.start_row
        self._rows_yielded = 0
        self._end_row = self.start_row
        batcher = RowBatcher(self.batch_size, self.drop_last)
        for block in self._blocks():
            for batch, next_row in batcher.push(block):
                yield self._emit(batch, next_row)
        for batch, next_row in batcher.finish():
            yield self._emit(batch, next_row)
        self._next_row = max(self._next_row, self._end_row)  # _blocks sets _end_row to the data's end

    def _emit(self, batch: CTRBatch, next_row: int) -> CTRBatch:
        self._next_row = next_row
        self._rows_yielded += batch.batch_size
        return batch

    def row_blocks(self) -> Iterator[RowBlock]:
        """This rank's good rows from ``start_row`` on, as parsed (``RowBlock.row_index`` = global row numbers).

        The unbatched view :class:`~picasso_ops.data.row_range.RowRangeReader` slices by row number.
        """
        self.tracker = BadRowTracker(self.max_bad_fraction, self.max_reported)
        yield from self._blocks()

    @abc.abstractmethod
    def total_rows(self) -> int:
        """Rows in all files, good and bad (Criteo: one newline-counting pass; parquet: the footers)."""

    @abc.abstractmethod
    def _blocks(self) -> Iterator[RowBlock]:
        """This rank's good rows from ``start_row`` on, feeding ``self.tracker``; sets ``self._end_row`` at the end."""
