"""Streaming reader of delimited text CTR files (Criteo TSV by default, any TSV/CSV with a schema) into `CTRBatch`es.

Which column is the label, which are categorical and which dense comes from a
:class:`~picasso_ops.data.schema.DataSchema` (default :meth:`DataSchema.criteo`: a line is
``label \\t I1..I13 \\t C1..C26``, label 0/1, decimal integers, hex categorical values). An empty
field is missing. Dense values: missing -> 0, then the schema's transform (Criteo: negative -> 0,
then log1p); a value that is not finite or larger than ``values.DENSE_LIMIT`` makes the row bad
(the parquet reader applies the same check). Categoricals: hashed with the field index into the
field's vocabulary (``parsing.CategoricalHasher``); missing -> length 0; a multi-hot column holds
several values split by its separator. With ``header: true`` the first line of every file names the
columns and is no data row; a column the schema names that a file lacks is a `DataError` naming both.

Sharding is by row: global row i (counting every data line of every file, in the order the
files are given, blank and bad lines included) goes to rank ``i % world_size``, so
rows are never duplicated or lost across ranks and ranks differ by at most one row.
Every rank scans all bytes for line ends (cheap) but parses only its own lines.

Files are read in chunks of ``chunk_bytes`` (bounded memory, never the whole file)
and parsed with numpy over the whole chunk, no Python loop per row or field. Bad rows
(wrong column count, label not 0/1, a bad number, a bad hex value, a dense value out of range) are skipped and
counted; the first few are logged with file and line number; a file whose bad
fraction exceeds ``max_bad_fraction`` raises `DataError`. Blank lines are skipped
silently. Fields are split at every delimiter byte: there is no quoting::

    reader = CriteoTSVReader(["day_0.tsv", "day_1.tsv"], batch_size=4096, vocab_sizes=1 << 20,
                             rank=dist.get_rank(), world_size=dist.get_world_size())
    for batch in reader:
        ...
    ckpt["data"] = reader.state()      # later: CriteoTSVReader(..., start_row=ckpt["data"]["next_row"])
    csv = CriteoTSVReader("ratings.csv", 4096, schema=DataSchema.load("ratings_schema.json"))
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from .quality import BadRow, DataError
from .rows import RowBlock, ShardedRowReader, owned_rows
from .schema import ColumnRef, DataSchema
from .values import DENSE_LIMIT, check_dense, decode_categorical, decode_dense, dense_problem, stack_categorical

logger = logging.getLogger(__name__)

__all__ = ["CriteoTSVReader", "TextCTRReader", "NUM_INT_FEATURES", "NUM_CAT_FEATURES"]

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
    line: int  # 0-based data row of the file the next chunk starts at (the header line is not counted)


@dataclass(frozen=True)
class _TextLayout:
    """Where one text file holds the schema's columns."""

    num_columns: int
    names: tuple[str, ...]  # for messages: the file's column names, or "#k" by position
    label: int
    dense: np.ndarray       # column positions
    categorical: np.ndarray
    header_lines: int       # 1 with a header line, else 0


def _read_header(path: Path, delimiter: int) -> tuple[str, ...]:
    """The column names on the first line of ``path``."""
    with open(path, "rb") as f:
        line = f.readline(MAX_LINE_BYTES + 1)
    if len(line) > MAX_LINE_BYTES:
        raise DataError(f"{path}: header line is longer than {MAX_LINE_BYTES} bytes")
    try:
        text = line.rstrip(b"\r\n").decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise DataError(f"{path}: header line is not UTF-8 text: {exc}") from None
    if not text:
        raise DataError(f"{path}: the schema says the file has a header line, but its first line is empty")
    return tuple(text.split(chr(delimiter)))


def text_layout(path: Path, schema: DataSchema) -> _TextLayout:
    """Resolve the schema's columns in one text file (reading its header line if it has one).

    A column that is named but not in the file, or past its last column, is a `DataError`
    naming the column and the file: ``text_layout(Path("a.csv"), schema).categorical``.
    """
    names: tuple[str, ...] | None = None
    if schema.header:
        names = _read_header(path, schema.delimiter_byte)
    elif schema.column_names is not None:
        names = schema.column_names

    def position(ref: ColumnRef) -> int:
        if isinstance(ref, int):
            if names is not None and ref >= len(names):
                raise DataError(f"{path}: the schema's column at position {ref} is past the file's {len(names)} "
                                f"columns {list(names)}")
            return ref
        if names is None:
            raise DataError(f"{path}: the schema names column {ref!r}, but the file has no header line and the "
                            "schema no column_names; give header: true, column_names, or 0-based positions")
        if ref not in names:
            raise DataError(f"{path}: column {ref!r} named in the schema is missing from the file "
                            f"(its columns: {list(names)})")
        if names.count(ref) > 1:
            raise DataError(f"{path}: column {ref!r} appears {names.count(ref)} times in the file's header")
        return names.index(ref)

    label = position(schema.label)
    dense = np.array([position(r) for r in schema.dense], dtype=np.int64)
    cats = np.array([position(c.column) for c in schema.categorical_columns], dtype=np.int64)
    used = [label, *dense.tolist(), *cats.tolist()]
    if len(set(used)) != len(used):
        raise DataError(f"{path}: the schema uses one column of the file twice (positions {used})")
    num_columns = len(names) if names is not None else max(used) + 1
    shown = names if names is not None else tuple(f"#{i}" for i in range(num_columns))
    return _TextLayout(num_columns, shown, label, dense, cats, 1 if schema.header else 0)


class CriteoTSVReader(ShardedRowReader):
    """Iterates this rank's rows of delimited text files as CTRBatches (see the module doc).

    Args:
        paths: one file or a list, read in order.
        batch_size: rows per batch; the last batch may be smaller unless ``drop_last``.
        vocab_sizes: hash range of every categorical field (one int or a list, one per categorical column).
        rank, world_size: this reader takes global rows ``i`` with ``i % world_size == rank``.
        start_row: skip global rows before it (resume: pass ``state()["next_row"]``); the
            files before it are only scanned for line ends, not parsed.
        max_bad_fraction: a file with more bad rows than this fraction raises DataError.
        max_reported: how many bad rows are logged in full.
        hash_seed: salt of the categorical hash.
        chunk_bytes: bytes read and parsed at a time.
        schema: the files' columns (default: the Criteo layout).

    Each ``iter()`` starts again at ``start_row``. ``reader.state()`` tells where the
    last yielded batch ended; ``reader.tracker`` holds the bad-row counts. Construction
    resolves the schema's columns in every file (reading header lines): a missing column fails now.
    """

    kind = "Criteo TSV"

    def __init__(self, paths: str | os.PathLike | Sequence[str | os.PathLike], batch_size: int, *,
                 vocab_sizes: int | Sequence[int] = 100_000, rank: int = 0, world_size: int = 1,
                 start_row: int = 0, drop_last: bool = False, max_bad_fraction: float = 0.01,
                 max_reported: int = 5, hash_seed: int = 0, chunk_bytes: int = 4 << 20,
                 schema: DataSchema | None = None) -> None:
        self.schema = DataSchema.criteo() if schema is None else schema
        if not self.schema.is_criteo:
            self.kind = f"{self.schema.delimiter}-separated text"
        super().__init__(paths, batch_size, vocab_sizes=vocab_sizes, num_cat_features=self.schema.num_categorical,
                         rank=rank, world_size=world_size, start_row=start_row, drop_last=drop_last,
                         max_bad_fraction=max_bad_fraction, max_reported=max_reported, hash_seed=hash_seed)
        if chunk_bytes < 1:
            raise ValueError(f"chunk_bytes must be >= 1, got {chunk_bytes}")
        self.chunk_bytes = chunk_bytes
        self._layouts = [text_layout(path, self.schema) for path in self.paths]

    def total_rows(self) -> int:
        """Data lines in all files (one pass counting newlines, no parsing)."""
        return sum(self._data_lines(path, layout) for path, layout in zip(self.paths, self._layouts))

    def _data_lines(self, path: Path, layout: _TextLayout) -> int:
        return max(_count_lines(path, self.chunk_bytes) - layout.header_lines, 0)

    def _blocks(self) -> Iterator[RowBlock]:
        file_base = 0  # global index of the current file's first data row
        for path, layout in zip(self.paths, self._layouts):
            first_line = 0
            if file_base < self.start_row:  # still seeking the resume point: count instead of parsing
                num_lines = self._data_lines(path, layout)
                if file_base + num_lines <= self.start_row:
                    file_base += num_lines
                    continue
                first_line = self.start_row - file_base
            cursor = _Cursor(line=first_line)
            self.tracker.start_file(str(path))
            offset = _offset_of_line(path, first_line + layout.header_lines, self.chunk_bytes)
            yield from self._read_file(path, layout, offset, file_base, cursor)
            self.tracker.finish_file()
            file_base += cursor.line
        self._end_row = file_base

    def _read_file(self, path: Path, layout: _TextLayout, offset: int, file_base: int, cursor: "_Cursor"
                   ) -> Iterator[RowBlock]:
        """Blocks of good rows from ``offset`` on; ``cursor.line`` ends as the file's data row count."""
        with open(path, "rb") as f:
            f.seek(offset)
            carry = b""
            while True:
                data = f.read(self.chunk_bytes)
                if not data:
                    if carry:  # a last line without a newline
                        block = self._parse_chunk(carry + b"\n", path, layout, file_base, cursor.line)
                        cursor.line += 1
                        yield block
                    return
                buf = carry + data if carry else data
                cut = buf.rfind(b"\n") + 1
                if cut == 0:
                    if len(buf) > MAX_LINE_BYTES:
                        raise DataError(f"{path}: line {cursor.line + layout.header_lines + 1} is longer than "
                                        f"{MAX_LINE_BYTES} bytes")
                    carry = buf
                    continue
                block = self._parse_chunk(memoryview(buf)[:cut], path, layout, file_base, cursor.line)
                cursor.line += buf.count(b"\n", 0, cut)
                carry = buf[cut:]
                self.tracker.check(final=False)  # before yielding: do not train on a corrupt file
                yield block

    def _parse_chunk(self, chunk: bytes | memoryview, path: Path, layout: _TextLayout, file_base: int,
                     first_line: int) -> RowBlock:
        """Parse whole lines (the chunk ends with a newline) into this rank's good rows."""
        schema = self.schema
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

        num_cols = layout.num_columns
        tabs = np.flatnonzero(buf == schema.delimiter_byte)
        first_tab = np.searchsorted(tabs, starts)
        num_tabs = np.searchsorted(tabs, ends) - first_tab
        shaped = num_tabs == num_cols - 1
        # field spans of well-shaped lines: [line start, tab+1, ...] to [tab, ..., line end]
        tab_pos = tabs[first_tab[shaped, None] + np.arange(num_cols - 1)]
        f_start = np.concatenate([starts[shaped, None], tab_pos + 1], axis=1)
        f_end = np.concatenate([tab_pos, ends[shaped, None]], axis=1)
        m, lab = len(f_start), layout.label
        label_ok = (f_end[:, lab] - f_start[:, lab] == 1) & \
            ((buf[f_start[:, lab]] == 48) | (buf[f_start[:, lab]] == 49))
        d_cols, c_cols = layout.dense, layout.categorical
        values, d_present, parsed = (a.reshape(m, len(d_cols)) for a in
                                     decode_dense(buf, f_start[:, d_cols].ravel(), f_end[:, d_cols].ravel(),
                                                  schema.dense_values))
        dense, in_range = check_dense(values, d_present, schema.dense_transform)
        dense_ok = parsed & in_range
        separators = schema.separators
        multi_hot = any(sep is not None for sep in separators)
        if multi_hot:
            raw, cat_present, cat_ok = stack_categorical(
                [decode_categorical(buf, f_start[:, c], f_end[:, c], sep, schema.categorical_values)
                 for c, sep in zip(c_cols.tolist(), separators)], multi_hot=True)
        else:  # one call over every field of the chunk
            raw, cat_present, cat_ok = (a.reshape(m, len(c_cols)) for a in
                                        decode_categorical(buf, f_start[:, c_cols].ravel(), f_end[:, c_cols].ravel(),
                                                           None, schema.categorical_values))
        good = label_ok & dense_ok.all(axis=1) & cat_ok.all(axis=1)

        num_bad = int((~shaped).sum() + (~good).sum())
        if num_bad:
            def describe(k: int) -> list[BadRow]:
                return self._describe_bad(k, buf, path, layout, file_base, starts, ends, row_index, shaped, num_tabs,
                                          good, label_ok, parsed, values, f_start, f_end, cat_ok)
            self.tracker.record(len(starts), num_bad, describe)
        else:
            self.tracker.record(len(starts), 0, lambda k: [])
        return RowBlock(
            labels=(buf[f_start[good, lab]] == 49).astype(np.float32),
            dense=dense[good],
            present=cat_present[good],
            ids=self.hasher(raw[good]),
            row_index=row_index[shaped][good],
        )

    def _describe_bad(self, k: int, buf: np.ndarray, path: Path, layout: _TextLayout, file_base: int,
                      starts: np.ndarray, ends: np.ndarray, row_index: np.ndarray, shaped: np.ndarray,
                      num_tabs: np.ndarray, good: np.ndarray, label_ok: np.ndarray, parsed: np.ndarray,
                      values: np.ndarray, f_start: np.ndarray, f_end: np.ndarray, cat_ok: np.ndarray) -> list[BadRow]:
        """The first ``k`` bad lines of a chunk, in file order, with the reason (only for reporting)."""
        shaped_pos = np.flatnonzero(shaped)
        bad_lines = np.sort(np.concatenate([np.flatnonzero(~shaped), shaped_pos[~good]]))[:k]
        where_in_shaped = np.full(len(shaped), -1)
        where_in_shaped[shaped_pos] = np.arange(len(shaped_pos))
        names = layout.names
        out = []
        for i in bad_lines:  # at most k (a handful) rows, for the log only
            j = where_in_shaped[i]
            if j < 0:
                reason = f"expected {layout.num_columns} {self.schema.delimiter}-separated columns, " \
                         f"got {num_tabs[i] + 1}"
            elif not label_ok[j]:
                reason = f"{names[layout.label]} must be 0 or 1"
            elif (d := next((d for d in range(len(layout.dense)) if not parsed[j, d] or
                             not (np.isfinite(values[j, d]) and abs(values[j, d]) <= DENSE_LIMIT)), None)) is None:
                name = names[layout.categorical[int(np.argmin(cat_ok[j]))]]
                reason = f"column {name} is not a hex value of 1-16 digits"
            else:
                col = int(layout.dense[d])
                text = bytes(buf[f_start[j, col]:f_end[j, col]]).decode("utf-8", errors="replace")
                if not parsed[j, d] and self.schema.dense_values == "integer":
                    reason = f"column {names[col]} is not an integer"
                else:
                    reason = dense_problem(names[col], text, float(values[j, d]) if parsed[j, d] else None)
            text = bytes(buf[starts[i]:ends[i]]).decode("utf-8", errors="replace")
            line = int(row_index[i]) - file_base + layout.header_lines + 1
            out.append(BadRow(str(path), f"line {line}", reason, text))
        return out


TextCTRReader = CriteoTSVReader  # the same reader, by a name that fits a TSV/CSV file of any schema
