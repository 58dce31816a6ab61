"""Criteo TSV and parquet readers: values, hashing, bad rows, errors, sharding, resume, parity."""
import logging
import math
import random
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from picasso_ops.data import CriteoTSVReader, CTRBatch, DataError, ParquetCTRReader
from picasso_ops.data.parsing import parse_decimal, parse_hex

M64 = (1 << 64) - 1


def py_mix64(x: int) -> int:
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & M64
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & M64
    return x ^ (x >> 31)


def py_hash(hex_value: str, field: int, vocab: int, seed: int = 0) -> int:
    """The documented hash, written independently with Python ints."""
    salt = py_mix64((((field + 1) * 0x9E3779B97F4A7C15) + seed) & M64)
    return py_mix64(int(hex_value, 16) ^ salt) % vocab


def random_rows(n: int, seed: int, first_id: int = 0) -> list[list[str]]:
    """Criteo-like rows; I1 holds a unique row id so every row can be traced."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        ints = [str(first_id + i)] + ["" if rng.random() < 0.2 else str(rng.randint(-3, 5000)) for _ in range(12)]
        cats = []
        for _ in range(26):
            r = rng.random()
            cats.append("" if r < 0.15 else f"{rng.getrandbits(32):08x}" if r < 0.9 else f"{rng.getrandbits(20):X}")
        rows.append([str(rng.randint(0, 1))] + ints + cats)
    return rows


def write_tsv(path, rows, newline="\n", trailing=True):
    text = newline.join("\t".join(r) if isinstance(r, list) else r for r in rows)
    path.write_bytes((text + (newline if trailing else "")).encode())
    return path


def row_ids(batches) -> list[int]:
    """Row ids (I1) back from the dense feature log1p(I1)."""
    dense = torch.cat([b.dense for b in batches])
    return [round(math.expm1(float(v))) for v in dense[:, 0].double()]


def assert_same(a: CTRBatch, b: CTRBatch):
    assert torch.equal(a.values, b.values) and torch.equal(a.lengths, b.lengths)
    assert torch.equal(a.dense, b.dense) and torch.equal(a.labels, b.labels)


# ---------------------------------------------------------------- parsing and values

def test_decimal_and_hex_parsers_against_python():
    rng = random.Random(3)
    tokens = ["", "-", "+5", "1.5", "0x1f", "-0", "00012", "9" * 18, "9" * 19, "-12a", "FFFFFFFFFFFFFFFF",
              "fFfF", "g", "1" * 17, "-9" + "9" * 17]
    tokens += [str(rng.randint(-10**18 + 1, 10**18 - 1)) for _ in range(200)]
    tokens += [f"{rng.getrandbits(64):x}"[:rng.randint(1, 16)] for _ in range(200)]
    text = "\t".join(tokens).encode()
    buf = np.frombuffer(text, dtype=np.uint8)
    lens = np.array([len(t) for t in tokens])
    starts = np.concatenate([[0], np.cumsum(lens + 1)[:-1]])
    ends = starts + lens
    values, present, ok = parse_decimal(buf, starts, ends)
    for i, t in enumerate(tokens):
        digits = t[1:] if t.startswith("-") else t
        want_ok = t == "" or (digits.isdigit() and digits.isascii() and len(digits) <= 18)
        assert ok[i] == want_ok, t
        assert present[i] == (t != "")
        if want_ok and t:
            assert values[i] == int(t), t
    values, present, ok = parse_hex(buf, starts, ends)
    for i, t in enumerate(tokens):
        want_ok = t == "" or (len(t) <= 16 and all(c in "0123456789abcdefABCDEF" for c in t))
        assert ok[i] == want_ok, t
        if want_ok and t:
            assert int(values[i]) == int(t, 16), t


def test_tsv_values_missing_and_hash(tmp_path):
    row_a = ["1", "5", "", "-7"] + ["0"] * 10 + ["0a1b2c3d", ""] + ["ff"] * 24
    row_b = ["0"] + [""] * 13 + [""] * 25 + ["DEADBEEF"]
    path = write_tsv(tmp_path / "a.tsv", [row_a, row_b])
    vocab = [1000 + f for f in range(26)]
    batch = next(iter(CriteoTSVReader(path, 8, vocab_sizes=vocab)))
    assert batch.labels.tolist() == [1.0, 0.0]
    assert batch.dense.shape == (2, 13)
    assert batch.dense[0, :3].tolist() == pytest.approx([math.log1p(5), 0.0, 0.0])  # missing and negative -> 0
    assert torch.all(batch.dense[1] == 0)
    lengths = batch.lengths
    assert lengths[:, 0].tolist() == [1, 0] + [1] * 24 and lengths[:, 1].tolist() == [0] * 25 + [1]
    want = [py_hash("0a1b2c3d", 0, vocab[0])] + [py_hash("ff", f, vocab[f]) for f in range(2, 26)] \
        + [py_hash("DEADBEEF", 25, vocab[25])]
    assert batch.values.tolist() == want  # field-major: field 25 holds sample 0 then sample 1


def test_hash_stays_in_each_field_range(tmp_path):
    vocab = [3 + 7 * f for f in range(26)]
    path = write_tsv(tmp_path / "r.tsv", random_rows(300, seed=1))
    batches = list(CriteoTSVReader(path, 64, vocab_sizes=vocab))
    for batch in batches:
        for f in range(26):
            ids, _ = batch.field_values(f)
            assert ids.numel() == 0 or (0 <= int(ids.min()) and int(ids.max()) < vocab[f])
    # the same hex value in two fields lands on unrelated ids
    same = [py_hash("0a1b2c3d", f, 1 << 20) for f in range(26)]
    assert len(set(same)) == 26


def test_crlf_blank_lines_and_no_trailing_newline(tmp_path):
    rows = random_rows(20, seed=2)
    plain = list(CriteoTSVReader(write_tsv(tmp_path / "p.tsv", rows), 7))
    crlf = list(CriteoTSVReader(write_tsv(tmp_path / "c.tsv", rows, newline="\r\n", trailing=False), 7))
    blank = CriteoTSVReader(write_tsv(tmp_path / "b.tsv", rows[:10] + [""] + rows[10:] + [""]), 7)
    blank_batches = list(blank)
    for a, b, c in zip(plain, crlf, blank_batches):
        assert_same(a, b)
        assert_same(a, c)
    assert blank.tracker.total_bad == 0 and sum(b.batch_size for b in blank_batches) == 20


# ---------------------------------------------------------------- bad rows and errors

def bad_file(tmp_path):
    rows = random_rows(30, seed=4)
    good = [r[:] for r in rows]
    rows[2] = rows[2][:-1]                      # line 3: 39 columns
    rows[5][0] = "2"                            # line 6: label not 0/1
    rows[9][4] = "12x"                          # line 10: I4 not an integer
    rows[14][14 + 6] = "zz12"                   # line 15: C7 bad hex
    rows[20] = rows[20] + ["extra"]             # line 21: 41 columns
    rows[25][0] = "label"                       # line 26: header-like junk
    return write_tsv(tmp_path / "bad.tsv", rows), good, [3, 6, 10, 15, 21, 26]


def test_bad_rows_are_counted_skipped_and_reported_with_line_numbers(tmp_path, caplog):
    path, good, bad_lines = bad_file(tmp_path)
    reader = CriteoTSVReader(path, 8, max_bad_fraction=0.5, chunk_bytes=700)
    with caplog.at_level(logging.WARNING, logger="picasso_ops.data"):
        batches = list(reader)
    assert reader.tracker.total_bad == 6
    assert reader.state()["bad_rows"] == 6
    assert [r.location for r in reader.tracker.reported] == [f"line {n}" for n in bad_lines[:5]]
    reasons = [r.reason for r in reader.tracker.reported]
    assert "expected 40 tab-separated columns, got 39" in reasons[0]
    assert "label must be 0 or 1" in reasons[1]
    assert "column I4 is not an integer" in reasons[2]
    assert "column C7 is not a hex value" in reasons[3]
    assert f"{path}:line 3" in caplog.text and f"{path}:line 15" in caplog.text
    assert "line 26" not in caplog.text  # only the first five are logged in full
    kept = row_ids(batches)
    assert kept == [i for i in range(30) if i + 1 not in bad_lines]


def test_too_many_bad_rows_raise_data_error_naming_file(tmp_path):
    path, _, _ = bad_file(tmp_path)
    with pytest.raises(DataError) as err:
        list(CriteoTSVReader(path, 8, max_bad_fraction=0.01))
    msg = str(err.value)
    assert str(path) in msg and "6 of 30 rows" in msg and "line 3" in msg


def test_missing_or_unusable_files_fail_at_construction(tmp_path):
    missing = tmp_path / "nope.tsv"
    with pytest.raises(FileNotFoundError, match="nope.tsv"):
        CriteoTSVReader([write_tsv(tmp_path / "ok.tsv", random_rows(2, 0)), missing], 4)
    with pytest.raises(DataError, match="not a regular file"):
        CriteoTSVReader(tmp_path, 4)
    with pytest.raises(FileNotFoundError, match="nope.parquet"):
        ParquetCTRReader(tmp_path / "nope.parquet", 4)
    with pytest.raises(DataError, match="not a readable parquet file"):
        ParquetCTRReader(tmp_path / "ok.tsv", 4)


# ---------------------------------------------------------------- sharding and resume

@pytest.fixture
def two_files(tmp_path):
    a = write_tsv(tmp_path / "a.tsv", random_rows(47, seed=5), trailing=False)
    rows_b = random_rows(40, seed=6, first_id=47)
    rows_b[3][0] = "7"  # one bad row (id 50) inside the second file
    b = write_tsv(tmp_path / "b.tsv", rows_b)
    return [a, b]


@pytest.mark.parametrize("world_size", [2, 3])
def test_tsv_sharding_covers_every_row_exactly_once(two_files, world_size):
    every = [i for i in range(87) if i != 50]
    single = list(CriteoTSVReader(two_files, 10, max_bad_fraction=0.1))
    assert row_ids(single) == every
    seen = []
    for rank in range(world_size):
        ids = row_ids(CriteoTSVReader(two_files, 10, rank=rank, world_size=world_size, max_bad_fraction=0.1,
                                      chunk_bytes=999))
        assert all(i % world_size == rank for i in ids)  # global row i belongs to rank i % W
        seen += ids
    assert sorted(seen) == every


@pytest.mark.parametrize("rank,world_size,taken", [(0, 1, 3), (0, 1, 11), (1, 2, 5)])
def test_tsv_resume_from_state_continues_exactly(two_files, rank, world_size, taken):
    kw = dict(rank=rank, world_size=world_size, max_bad_fraction=0.1, chunk_bytes=1500)
    full = list(CriteoTSVReader(two_files, 5, **kw))
    reader = CriteoTSVReader(two_files, 5, **kw)
    it = iter(reader)
    head = [next(it) for _ in range(taken)]  # within the first file, or past its end
    state = reader.state()
    resumed = list(CriteoTSVReader(two_files, 5, start_row=state["next_row"], **kw))
    assert row_ids(head) + row_ids(resumed) == row_ids(full)
    for a, b in zip(resumed, full[taken:]):
        assert_same(a, b)
    assert state["next_row"] == row_ids(head)[-1] + 1
    assert list(CriteoTSVReader(two_files, 6, start_row=87)) == []


# ---------------------------------------------------------------- parquet

def to_parquet(rows, path, cat_as_int=False, int_as_str=False, row_group_size=16):
    cols = list(zip(*rows))
    data = {"label": pa.array([int(v) for v in cols[0]], pa.int64())}
    for j in range(13):
        vals = [v if v != "" else None for v in cols[1 + j]]
        data[f"I{j + 1}"] = pa.array(vals if int_as_str else [None if v is None else int(v) for v in vals],
                                     pa.string() if int_as_str else pa.int64())
    for j in range(26):
        vals = [v if v != "" else None for v in cols[14 + j]]
        data[f"C{j + 1}"] = pa.array([None if v is None else int(v, 16) for v in vals], pa.int64()) \
            if cat_as_int else pa.array(vals, pa.string())
    pq.write_table(pa.table(data), path, row_group_size=row_group_size)
    return path


@pytest.mark.parametrize("variant", [dict(), dict(cat_as_int=True), dict(int_as_str=True)])
def test_parquet_round_trip_equals_tsv_reader(tmp_path, variant):
    rows = random_rows(70, seed=7)
    tsv = list(CriteoTSVReader(write_tsv(tmp_path / "d.tsv", rows), 16, vocab_sizes=5000))
    par = list(ParquetCTRReader(to_parquet(rows, tmp_path / "d.parquet", **variant), 16, vocab_sizes=5000,
                                read_rows=10))
    assert len(tsv) == len(par) == 5
    for a, b in zip(tsv, par):
        assert_same(a, b)


@pytest.mark.parametrize("shard_by,world_size", [("rows", 2), ("rows", 3), ("row_groups", 2), ("row_groups", 3)])
def test_parquet_sharding_covers_every_row_once(tmp_path, shard_by, world_size):
    files = [to_parquet(random_rows(50, seed=8), tmp_path / "a.parquet", row_group_size=8),
             to_parquet(random_rows(33, seed=9, first_id=50), tmp_path / "b.parquet", row_group_size=8)]
    seen = []
    for rank in range(world_size):
        ids = row_ids(ParquetCTRReader(files, 9, rank=rank, world_size=world_size, shard_by=shard_by))
        if shard_by == "rows":
            assert all(i % world_size == rank for i in ids)
        else:  # global row group: file a has groups 0..6, file b continues at 7
            group = [i // 8 if i < 50 else 7 + (i - 50) // 8 for i in ids]
            assert ids and all(g % world_size == rank for g in group)
        seen += ids
    assert sorted(seen) == list(range(83))


def test_parquet_resume_and_bad_rows(tmp_path, caplog):
    rows = random_rows(60, seed=10)
    rows[7][0] = "3"
    rows[40][14] = "xyz"
    path = to_parquet(rows, tmp_path / "bad.parquet", int_as_str=True, row_group_size=16)
    rows[12][3] = "1e5"  # a bad integer string, in the second file only
    path_str = to_parquet(rows, tmp_path / "bad_int.parquet", int_as_str=True)
    with caplog.at_level(logging.WARNING, logger="picasso_ops.data"):
        reader = ParquetCTRReader(path, 8, max_bad_fraction=0.1)
        full = list(reader)
    assert reader.tracker.total_bad == 2
    assert [r.location for r in reader.tracker.reported] == ["row 7 (0-based)", "row 40 (0-based)"]
    assert "column C1 is not a hex value" in reader.tracker.reported[1].reason
    assert f"{path}:row 7 (0-based)" in caplog.text
    assert row_ids(full) == [i for i in range(60) if i not in (7, 40)]
    it = iter(reader)
    head = [next(it) for _ in range(3)]
    resumed = list(ParquetCTRReader(path, 8, start_row=reader.state()["next_row"], max_bad_fraction=0.1))
    assert row_ids(head) + row_ids(resumed) == row_ids(full)
    with pytest.raises(DataError, match=r"3 of 60 rows") as err:
        list(ParquetCTRReader(path_str, 8, max_bad_fraction=0.01))
    assert str(path_str) in str(err.value)


def test_parquet_schema_errors_at_construction(tmp_path):
    path = tmp_path / "s.parquet"
    pq.write_table(pa.table({"label": [1, 0], "I1": [1, 2]}), path)
    with pytest.raises(DataError, match="missing columns"):
        ParquetCTRReader(path, 4)
    custom = tmp_path / "c.parquet"
    pq.write_table(pa.table({"y": [1, 0], "x": [3.0, None], "c": ["a", None]}), custom)
    batch = next(iter(ParquetCTRReader(custom, 4, label_column="y", int_columns=["x"], cat_columns=["c"],
                                       vocab_sizes=10)))
    assert batch.dense[:, 0].tolist() == pytest.approx([math.log1p(3.0), 0.0])
    assert batch.lengths.tolist() == [[1, 0]]


def test_tsv_parse_speed(tmp_path):
    path = write_tsv(tmp_path / "speed.tsv", random_rows(2000, seed=11) * 10)
    reader = CriteoTSVReader(path, 4096)
    start = time.process_time()
    rows = sum(b.batch_size for b in reader)
    rate = rows / (time.process_time() - start)
    assert rows == 20_000 and rate > 20_000  # measured ~150-250k rows/s; loose for a busy machine
