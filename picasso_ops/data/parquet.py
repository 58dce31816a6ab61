"""Reader of CTR parquet files into `CTRBatch`es, sharded by rank.

Columns come from a :class:`~picasso_ops.data.schema.DataSchema` (by name, or by 0-based position in
the file); the default is the Criteo layout: ``label`` (0/1; integer, float or bool), ``I1..I13``
(integers or floats; null/NaN = missing, +-inf or a magnitude above ``values.DENSE_LIMIT`` = a bad
row, as in a TSV file; decimal strings are parsed too) and ``C1..C26`` (hex strings as in the TSV
files, or integers; null or "" = missing; a list column of either is multi-hot, as a text column with a
separator). With ``categorical_values: "text"`` a string column is
hashed from its text and an integer column from its decimal text, as the TSV reader hashes the same
field. The values go through the same checks, transforms and hash as `CriteoTSVReader`, so a
parquet copy of a TSV/CSV file gives identical batches.

Sharding (``shard_by``):
  * ``"rows"`` (default): global row i (counting the rows of all files in order) goes to
    rank ``i % world_size``, the TSV reader's rule: balanced to one row, and a resume
    point means the same rows for any world size. Every rank decodes every row group.
  * ``"row_groups"``: global row group g goes to rank ``g % world_size``; each rank
    decodes only its own row groups (cheaper with many ranks) but ranks get whole
    groups, so use it when there are many more row groups than ranks.

Memory is bounded by one row group's decoded columns (read with ``iter_batches``,
``read_rows`` rows at a time, single-threaded so the loader leaves the cores to
training). Bad rows (label not 0/1 or null, an infinite I value, a bad decimal string, a bad hex string)
are skipped, counted and reported as "row N (0-based)" of their file, with the same
`DataError` limit as the TSV reader::

    reader = ParquetCTRReader(sorted(glob("data/*.parquet")), 4096, rank=rank, world_size=world)
    for batch in reader:
        ...
    resume_at = reader.state()["next_row"]
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Literal, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from .quality import BadRow, DataError
from .rows import RowBlock, ShardedRowReader, owned_rows
from .schema import DataSchema
from .values import check_dense, decode_categorical, decode_dense, dense_problem, pack_values, stack_categorical

logger = logging.getLogger(__name__)

__all__ = ["ParquetCTRReader", "DEFAULT_INT_COLUMNS", "DEFAULT_CAT_COLUMNS"]

DEFAULT_INT_COLUMNS = tuple(f"I{i}" for i in range(1, 14))
DEFAULT_CAT_COLUMNS = tuple(f"C{i}" for i in range(1, 27))


def _is_text(t: pa.DataType) -> bool:
    return pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_binary(t) \
        or pa.types.is_large_binary(t)


def _value_type(t: pa.DataType) -> pa.DataType:
    return t.value_type if pa.types.is_dictionary(t) else t


def _text_spans(arr: pa.Array) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Byte buffer and ``[start, end)`` spans of a string column; nulls become empty spans."""
    if pa.types.is_dictionary(arr.type):
        arr = arr.dictionary_decode()
    large = pa.types.is_large_string(arr.type) or pa.types.is_large_binary(arr.type)
    _, offsets_buf, data_buf = arr.buffers()
    offsets = np.frombuffer(offsets_buf, dtype=np.int64 if large else np.int32)[arr.offset:arr.offset + len(arr) + 1]
    data = np.frombuffer(data_buf, dtype=np.uint8) if data_buf is not None else np.zeros(0, np.uint8)
    starts = offsets[:-1].astype(np.int64)
    ends = offsets[1:].astype(np.int64)
    if arr.null_count:
        valid = arr.is_valid().to_numpy(zero_copy_only=False)
        ends = np.where(valid, ends, starts)
    return data, starts, ends


def _is_list(t: pa.DataType) -> bool:
    return pa.types.is_list(t) or pa.types.is_large_list(t)


def _numeric(arr: pa.Array) -> np.ndarray:
    """float64 values of a numeric or bool column, NaN where null."""
    return arr.cast(pa.float64()).to_numpy(zero_copy_only=False)


@dataclass(frozen=True)
class _FileLayout:
    path: Path
    first_row: int              # global index of the file's first row
    group_rows: tuple[int, ...]  # rows per row group
    first_group: int            # global index of the file's first row group
    label: str                  # the schema's columns by their names in this file
    dense: tuple[str, ...]
    categorical: tuple[str, ...]

    @property
    def columns(self) -> list[str]:
        return [self.label, *self.dense, *self.categorical]


class ParquetCTRReader(ShardedRowReader):
    """Iterates this rank's rows of parquet files as CTRBatches (see the module doc).

    Args:
        paths: one file or a list, read in order.
        batch_size, vocab_sizes, rank, world_size, start_row, drop_last, max_bad_fraction,
        max_reported, hash_seed: as for `CriteoTSVReader`.
        schema: the files' columns (default: the Criteo layout).
        label_column, int_columns, cat_columns: the Criteo layout's column names under other names
            (without ``schema`` only; a schema names its own columns).
        shard_by: "rows" or "row_groups" (module doc).
        read_rows: rows decoded per ``iter_batches`` step.

    Construction reads every file's footer: a missing file, a non-parquet file or a
    missing/unsupported column is an error right away, naming the file.
    """

    kind = "parquet"

    def __init__(self, paths: str | os.PathLike | Sequence[str | os.PathLike], batch_size: int, *,
                 vocab_sizes: int | Sequence[int] = 100_000, rank: int = 0, world_size: int = 1,
                 start_row: int = 0, drop_last: bool = False, max_bad_fraction: float = 0.01,
                 max_reported: int = 5, hash_seed: int = 0, label_column: str = "label",
                 int_columns: Sequence[str] = DEFAULT_INT_COLUMNS, cat_columns: Sequence[str] = DEFAULT_CAT_COLUMNS,
                 shard_by: Literal["rows", "row_groups"] = "rows", read_rows: int = 65536,
                 schema: DataSchema | None = None) -> None:
        renamed = (label_column, tuple(int_columns), tuple(cat_columns)) != \
            ("label", DEFAULT_INT_COLUMNS, DEFAULT_CAT_COLUMNS)
        if schema is not None and renamed:
            raise ValueError("give either schema or label_column/int_columns/cat_columns, not both")
        if schema is None:
            schema = DataSchema.criteo() if not renamed else DataSchema(
                label=label_column, dense=tuple(int_columns), categorical=tuple(cat_columns),
                categorical_values="hex", dense_values="integer")
        self.schema = schema
        super().__init__(paths, batch_size, vocab_sizes=vocab_sizes, num_cat_features=schema.num_categorical,
                         rank=rank, world_size=world_size, start_row=start_row, drop_last=drop_last,
                         max_bad_fraction=max_bad_fraction, max_reported=max_reported, hash_seed=hash_seed)
        if shard_by not in ("rows", "row_groups"):
            raise ValueError(f"shard_by must be 'rows' or 'row_groups', got {shard_by!r}")
        if read_rows < 1:
            raise ValueError(f"read_rows must be >= 1, got {read_rows}")
        self.shard_by = shard_by
        self.read_rows = read_rows
        self._layouts = self._inspect()

    def _inspect(self) -> list[_FileLayout]:
        layouts, rows, groups = [], 0, 0
        for path in self.paths:
            try:
                meta = pq.read_metadata(path)
                schema = pq.read_schema(path)
            except (pa.ArrowException, OSError) as exc:
                raise DataError(f"{path} is not a readable parquet file: {exc}") from exc
            label, dense, cats = self._resolve(path, schema)
            group_rows = tuple(meta.row_group(g).num_rows for g in range(meta.num_row_groups))
            layouts.append(_FileLayout(path, rows, group_rows, groups, label, dense, cats))
            rows += sum(group_rows)
            groups += len(group_rows)
        return layouts

    def _resolve(self, path: Path, schema: pa.Schema) -> tuple[str, tuple[str, ...], tuple[str, ...]]:
        """The names of the data schema's columns in this file; a missing or unusable column names the file."""
        def name(ref: str | int) -> str:
            if isinstance(ref, int):
                if ref >= len(schema.names):
                    raise DataError(f"{path}: the schema's column at position {ref} is past the file's "
                                    f"{len(schema.names)} columns {schema.names}")
                return schema.names[ref]
            return ref

        spec = self.schema
        label, dense = name(spec.label), tuple(name(r) for r in spec.dense)
        cats = tuple(name(c.column) for c in spec.categorical_columns)
        wanted = [label, *dense, *cats]
        missing = [c for c in wanted if schema.get_field_index(c) < 0]
        if missing:
            raise DataError(f"{path}: missing columns {missing} named in the schema; the file has {schema.names}")
        if len(set(wanted)) != len(wanted):
            raise DataError(f"{path}: the schema uses one column of the file twice ({wanted})")
        for col in wanted:
            t = _value_type(schema.field(col).type)
            numeric = pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t)
            if col == label:
                allowed = numeric
            elif col in dense:
                allowed = numeric or _is_text(t) or pa.types.is_null(t)
            else:
                item = _value_type(t.value_type) if _is_list(t) else t  # a list column: multi-hot
                allowed = pa.types.is_integer(item) or _is_text(item) or pa.types.is_null(item)
            if not allowed:
                raise DataError(f"{path}: column {col!r} has unsupported type {t}")
        return label, dense, cats

    def total_rows(self) -> int:
        """Rows in all files, from their footers."""
        return sum(sum(layout.group_rows) for layout in self._layouts)

    def _groups(self, layout: _FileLayout) -> Iterator[tuple[int, int]]:
        """(row group in file, global row of its first row) for the groups this rank reads."""
        first = layout.first_row
        for g, n in enumerate(layout.group_rows):
            mine = self.shard_by == "rows" or (layout.first_group + g) % self.world_size == self.rank
            if mine and first + n > self.start_row and n:
                yield g, first
            first += n

    def _blocks(self) -> Iterator[RowBlock]:
        for layout in self._layouts:
            groups = list(self._groups(layout))
            if not groups:
                continue
            self.tracker.start_file(str(layout.path))
            with pq.ParquetFile(layout.path) as pf:
                for g, group_first in groups:
                    row = group_first
                    for rb in pf.iter_batches(batch_size=self.read_rows, row_groups=[g], columns=layout.columns,
                                              use_threads=False):
                        row_index = row + np.arange(rb.num_rows, dtype=np.int64)
                        row += rb.num_rows
                        if self.shard_by == "rows":
                            keep = owned_rows(row_index, self.rank, self.world_size, self.start_row)
                        else:
                            keep = row_index >= self.start_row
                        if not keep.all():
                            rb = rb.filter(pa.array(keep))
                            row_index = row_index[keep]
                        block = self._convert(rb, row_index, layout)
                        self.tracker.check(final=False)  # before yielding: do not train on a corrupt file
                        yield block
            self.tracker.finish_file()
        last = self._layouts[-1]
        self._end_row = last.first_row + sum(last.group_rows)

    def _categorical(self, arr: pa.Array, separator: str | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """One categorical column as :func:`~picasso_ops.data.values.decode_categorical` gives it."""
        n, kind = len(arr), self.schema.categorical_values
        if _is_list(arr.type):  # multi-hot as a list column: its null or empty items are skipped
            counts = arr.value_lengths().fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)
            item_raw, item_present, item_ok = self._categorical(arr.flatten(), None)
            owner = np.repeat(np.arange(n, dtype=np.int64), counts)[item_present]
            return pack_values(item_raw[item_present], item_ok[item_present], owner, n)
        if pa.types.is_null(arr.type):
            raw, counts, ok = np.zeros(n, np.uint64), np.zeros(n, bool), np.ones(n, bool)
        elif _is_text(_value_type(arr.type)) or kind == "text":  # text: an integer hashes as its decimal text
            if not _is_text(_value_type(arr.type)):
                arr = arr.cast(pa.int64()).cast(pa.string())
            return decode_categorical(*_text_spans(arr), separator, kind)
        else:
            counts = arr.is_valid().to_numpy(zero_copy_only=False)
            values = arr.cast(pa.int64()).fill_null(0).to_numpy(zero_copy_only=False)
            raw, ok = values.view(np.uint64), np.ones(n, bool)  # negative ids keep their bit pattern
        if separator is not None:  # one value per row, in the multi-hot shape
            return raw[:, None], counts.astype(np.int64), ok
        return raw, counts, ok

    def _convert(self, rb: pa.RecordBatch, row_index: np.ndarray, layout: _FileLayout) -> RowBlock:
        n, spec = rb.num_rows, self.schema
        label = _numeric(rb.column(layout.label))
        label_ok = (label == 0) | (label == 1)
        values = np.zeros((n, len(layout.dense)), np.float64)
        present = np.zeros((n, len(layout.dense)), bool)
        parsed = np.ones((n, len(layout.dense)), bool)
        for j, name in enumerate(layout.dense):  # one vectorised op per column, not per row
            arr = rb.column(name)
            if _is_text(_value_type(arr.type)):
                values[:, j], present[:, j], parsed[:, j] = decode_dense(*_text_spans(arr), spec.dense_values)
            else:
                values[:, j] = _numeric(arr)
                present[:, j] = ~np.isnan(values[:, j])  # null/NaN: missing
        dense, in_range = check_dense(values, present, spec.dense_transform)  # the TSV reader's check
        dense_ok = parsed & in_range
        separators = spec.separators
        raw, cat_present, cat_ok = stack_categorical(
            [self._categorical(rb.column(name), sep) for name, sep in zip(layout.categorical, separators)],
            multi_hot=any(sep is not None for sep in separators) or any(
                _is_list(rb.schema.field(name).type) for name in layout.categorical))
        good = label_ok & dense_ok.all(axis=1) & cat_ok.all(axis=1)
        num_bad = int((~good).sum())
        self.tracker.record(n, num_bad, lambda k: self._describe_bad(k, rb, row_index, layout, good, label_ok,
                                                                     dense_ok, parsed, cat_ok))
        return RowBlock(
            labels=label[good].astype(np.float32),
            dense=dense[good],
            present=cat_present[good],
            ids=self.hasher(raw[good]),
            row_index=row_index[good],
        )

    def _describe_bad(self, k: int, rb: pa.RecordBatch, row_index: np.ndarray, layout: _FileLayout,
                      good: np.ndarray, label_ok: np.ndarray, dense_ok: np.ndarray, parsed: np.ndarray,
                      cat_ok: np.ndarray) -> list[BadRow]:
        out = []
        for i in np.flatnonzero(~good)[:k]:  # a handful of rows, for the log only
            if not label_ok[i]:
                reason = f"{layout.label} must be 0 or 1"
            elif not dense_ok[i].all():
                j = int(np.argmin(dense_ok[i]))
                name = layout.dense[j]
                value = rb.column(name)[int(i)].as_py()
                if isinstance(value, str):
                    number = None if not parsed[i, j] else float(value)
                    reason = f"column {name} is not an integer" if number is None and \
                        self.schema.dense_values == "integer" else dense_problem(name, value, number)
                else:
                    reason = dense_problem(name, str(value), float(value))
            else:
                reason = f"column {layout.categorical[int(np.argmin(cat_ok[i]))]} is not a hex value of 1-16 digits"
            text = "\t".join("" if v is None else str(v) for v in rb.slice(int(i), 1).to_pylist()[0].values())
            out.append(BadRow(str(layout.path), f"row {int(row_index[i]) - layout.first_row} (0-based)",
                              reason, text))
        return out
