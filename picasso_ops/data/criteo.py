"""Streaming reader of Criteo-format TSV files into `CTRBatch`es, sharded by rank.

A line is ``label \\t I1..I13 \\t C1..C26``: label 0/1, decimal integers, hex
categorical values; an empty field is missing. Integers: missing or negative -> 0,
then log1p. Categoricals: ``int(hex, 16)`` hashed with the field index into the
field's vocabulary (``parsing.CategoricalHasher``); missing -> length 0.

Sharding is by row: global row i (counting every line of every file, in the order the
files are given, blank and bad lines included) goes to rank ``i % world_size``, so
rows are never duplicated or lost across ranks and ranks differ by at most one row.
Every rank scans all bytes for line ends (cheap) but parses only its own lines.

Files are read in chunks of ``chunk_bytes`` (bounded memory, never the whole file)
and parsed with numpy over the whole chunk, no Python loop per row or field. Bad rows
(wrong column count, label not 0/1, non-numeric integer, bad hex) are skipped and
counted; the first few are logged with file and line number; a file whose bad
fraction exceeds ``max_bad_fraction`` raises `DataError`. Blank lines are skipped
silently::

    reader = CriteoTSVReader(["day_0.tsv", "day_1.tsv"], batch_size=4096, vocab_sizes=1 << 20,
                             rank=dist.get_rank(), world_size=dist.get_world_size())
    for batch in reader:
        ...
    ckpt["data"] = reader.state()      # later: CriteoTSVReader(..., start_row=ckpt["data"]["next_row"])
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from .parsing import dense_transform, parse_decimal, parse_hex
from .quality import BadRow, DataError
from .rows import RowBlock, ShardedRowReader, owned_rows

logger = logging.getLogger(__name__)

__all__ = ["CriteoTSVReader", "NUM_INT_FEATURES", "NUM_CAT_FEATURES"]

NUM_INT_FEATURES = 13
NUM_CAT_FEATURES = 26
MAX_LINE_BYTES = 1 << 20  # a longer line is not Criteo data: stop instead of buffering without bound


def _count_lines(path: Path, chunk_bytes: int) -> int:
    """Lines in a file: newlines, plus one for a last line without a newline."""
    count, last = 0, b"\n"
    with open(path, "rb") as f:
        while chunk := f.read(chunk_bytes):
            count += chunk.count(b"\n")
            last = chunk[-1:]
    return count + (last != b"\n")


def _offset_of_line(path: Path, line: int, chunk_bytes: int) -> int:
    """Byte offset where 0-based ``line`` starts (the file size when it is past the end)."""
    if line == 0:
        return 0
    seen, base = 0, 0
    with open(path, "rb") as f:
        while chunk := f.read(chunk_bytes):
            n = chunk.count(b"\n")
            if seen + n >= line:
                newlines = np.flatnonzero(np.frombuffer(chunk, dtype=np.uint8) == 10)
                return base + int(newlines[line - seen - 1]) + 1
            seen += n
            base += len(chunk)
    return base


@dataclass
class _Cursor:
    line: int  # 0-based line of the file the next chunk starts at


class CriteoTSVReader(ShardedRowReader):
    """Iterates this rank's rows of Criteo TSV files as CTRBatches (see the module doc).

    Args:
        paths: one file or a list, read in order.
        batch_size: rows per batch; the last batch may be smaller unless ``drop_last``.
        vocab_sizes: hash range of every categorical field (one int or a list of 26).
        rank, world_size: this reader takes global rows ``i`` with ``i % world_size == rank``.
        start_row: skip global rows before it (resume: pass ``state()["next_row"]``); the
            files before it are only scanned for line ends, not parsed.
        max_bad_fraction: a file with more bad rows than this fraction raises DataError.
        max_reported: how many bad rows are logged in full.
        hash_seed: salt of the categorical hash.
        chunk_bytes: bytes read and parsed at a time.

    Each ``iter()`` starts again at ``start_row``. ``reader.state()`` tells where the
    last yielded batch ended; ``reader.tracker`` holds the bad-row counts.
    """

    kind = "Criteo TSV"

    def __init__(self, paths: str | os.PathLike | Sequence[str | os.PathLike], batch_size: int, *,
                 vocab_sizes: int | Sequence[int] = 100_000, rank: int = 0, world_size: int = 1,
                 start_row: int = 0, drop_last: bool = False, max_bad_fraction: float = 0.01,
                 max_reported: int = 5, hash_seed: int = 0, chunk_bytes: int = 4 << 20) -> None:
        super().__init__(paths, batch_size, vocab_sizes=vocab_sizes, num_cat_features=NUM_CAT_FEATURES,
                         rank=rank, world_size=world_size, start_row=start_row, drop_last=drop_last,
                         max_bad_fraction=max_bad_fraction, max_reported=max_reported, hash_seed=hash_seed)
        if chunk_bytes < 1:
            raise ValueError(f"chunk_bytes must be >= 1, got {chunk_bytes}")
        self.chunk_bytes = chunk_bytes

    def total_rows(self) -> int:
        """Lines in all files (one pass counting newlines, no parsing)."""
        return sum(_count_lines(path, self.chunk_bytes) for path in self.paths)

    def _blocks(self) -> Iterator[RowBlock]:
        file_base = 0  # global index of the current file's first line
        for path in self.paths:
            first_line = 0
            if file_base < self.start_row:  # still seeking the resume point: count instead of parsing
                num_lines = _count_lines(path, self.chunk_bytes)
                if file_base + num_lines <= self.start_row:
                    file_base += num_lines
                    continue
                first_line = self.start_row - file_base
            cursor = _Cursor(line=first_line)
            self.tracker.start_file(str(path))
            yield from self._read_file(path, _offset_of_line(path, first_line, self.chunk_bytes), file_base, cursor)
            self.tracker.finish_file()
            file_base += cursor.line
        self._end_row = file_base

    def _read_file(self, path: Path, offset: int, file_base: int, cursor: "_Cursor") -> Iterator[RowBlock]:
        """Blocks of good rows from ``offset`` on; ``cursor.line`` ends as the file's line count."""
        with open(path, "rb") as f:
            f.seek(offset)
            carry = b""
            while True:
                data = f.read(self.chunk_bytes)
                if not data:
                    if carry:  # a last line without a newline
                        block = self._parse_chunk(carry + b"\n", path, file_base, cursor.line)
                        cursor.line += 1
                        yield block
                    return
                buf = carry + data if carry else data
                cut = buf.rfind(b"\n") + 1
                if cut == 0:
                    if len(buf) > MAX_LINE_BYTES:
                        raise DataError(f"{path}: line {cursor.line + 1} is longer than {MAX_LINE_BYTES} bytes")
                    carry = buf
                    continue
                block = self._parse_chunk(memoryview(buf)[:cut], path, file_base, cursor.line)
                cursor.line += buf.count(b"\n", 0, cut)
                carry = buf[cut:]
                self.tracker.check(final=False)  # before yielding: do not train on a corrupt file
                yield block

    def _parse_chunk(self, chunk: bytes | memoryview, path: Path, file_base: int, first_line: int) -> RowBlock:
        """Parse whole lines (the chunk ends with a newline) into this rank's good rows."""
        buf = np.frombuffer(chunk, dtype=np.uint8)
        ends = np.flatnonzero(buf == 10)
        starts = np.empty_like(ends)
        starts[0] = 0
        starts[1:] = ends[:-1] + 1
        row_index = file_base + first_line + np.arange(len(ends), dtype=np.int64)
        mine = owned_rows(row_index, self.rank, self.world_size, self.start_row)
        starts, ends, row_index = starts[mine], ends[mine], row_index[mine]
        ends = ends - ((ends > starts) & (buf[np.maximum(ends - 1, 0)] == 13))  # CRLF files
        nonblank = ends > starts
        starts, ends, row_index = starts[nonblank], ends[nonblank], row_index[nonblank]

        num_cols = 1 + NUM_INT_FEATURES + NUM_CAT_FEATURES
        tabs = np.flatnonzero(buf == 9)
        first_tab = np.searchsorted(tabs, starts)
        num_tabs = np.searchsorted(tabs, ends) - first_tab
        shaped = num_tabs == num_cols - 1
        # field spans of well-shaped lines: [line start, tab+1, ...] to [tab, ..., line end]
        tab_pos = tabs[first_tab[shaped, None] + np.arange(num_cols - 1)]
        f_start = np.concatenate([starts[shaped, None], tab_pos + 1], axis=1)
        f_end = np.concatenate([tab_pos, ends[shaped, None]], axis=1)
        label_ok = (f_end[:, 0] - f_start[:, 0] == 1) & ((buf[f_start[:, 0]] == 48) | (buf[f_start[:, 0]] == 49))
        int_sl = slice(1, 1 + NUM_INT_FEATURES)
        cat_sl = slice(1 + NUM_INT_FEATURES, num_cols)
        ints, int_present, int_ok = (a.reshape(-1, NUM_INT_FEATURES) for a in
                                     parse_decimal(buf, f_start[:, int_sl].ravel(), f_end[:, int_sl].ravel()))
        raw, cat_present, cat_ok = (a.reshape(-1, NUM_CAT_FEATURES) for a in
                                    parse_hex(buf, f_start[:, cat_sl].ravel(), f_end[:, cat_sl].ravel()))
        good = label_ok & int_ok.all(axis=1) & cat_ok.all(axis=1)

        num_bad = int((~shaped).sum() + (~good).sum())
        if num_bad:
            def describe(k: int) -> list[BadRow]:
                return self._describe_bad(k, buf, path, file_base, starts, ends, row_index, shaped, num_tabs,
                                          good, label_ok, int_ok, cat_ok)
            self.tracker.record(len(starts), num_bad, describe)
        else:
            self.tracker.record(len(starts), 0, lambda k: [])
        return RowBlock(
            labels=(buf[f_start[good, 0]] == 49).astype(np.float32),
            dense=dense_transform(ints[good]),
            present=cat_present[good],
            ids=self.hasher(raw[good]),
            row_index=row_index[shaped][good],
        )

    @staticmethod
    def _describe_bad(k: int, buf: np.ndarray, path: Path, file_base: int, starts: np.ndarray, ends: np.ndarray,
                      row_index: np.ndarray, shaped: np.ndarray, num_tabs: np.ndarray, good: np.ndarray,
                      label_ok: np.ndarray, int_ok: np.ndarray, cat_ok: np.ndarray) -> list[BadRow]:
        """The first ``k`` bad lines of a chunk, in file order, with the reason (only for reporting)."""
        shaped_pos = np.flatnonzero(shaped)
        bad_lines = np.sort(np.concatenate([np.flatnonzero(~shaped), shaped_pos[~good]]))[:k]
        where_in_shaped = np.full(len(shaped), -1)
        where_in_shaped[shaped_pos] = np.arange(len(shaped_pos))
        out = []
        for i in bad_lines:  # at most k (a handful) rows, for the log only
            j = where_in_shaped[i]
            if j < 0:
                reason = f"expected {1 + NUM_INT_FEATURES + NUM_CAT_FEATURES} tab-separated columns, " \
                         f"got {num_tabs[i] + 1}"
            elif not label_ok[j]:
                reason = "label must be 0 or 1"
            elif not int_ok[j].all():
                reason = f"column I{int(np.argmin(int_ok[j])) + 1} is not an integer"
            else:
                reason = f"column C{int(np.argmin(cat_ok[j])) + 1} is not a hex value of 1-16 digits"
            text = bytes(buf[starts[i]:ends[i]]).decode("utf-8", errors="replace")
            out.append(BadRow(str(path), f"line {int(row_index[i]) - file_base + 1}", reason, text))
        return out
