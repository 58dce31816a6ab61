"""Data schemas: a user's own columns in TSV/CSV and parquet, the Criteo preset, and one value check in both readers."""
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from picasso_ops.data import CriteoTSVReader, CTRBatch, DataError, DataSchema, ParquetCTRReader
from picasso_ops.data.values import DENSE_LIMIT, check_dense
from sparse_core.config_file import ConfigError
from tests.picasso_ops.data.test_files import M64, assert_same, py_hash, py_mix64, random_rows, to_parquet, write_tsv

ROOT = Path(__file__).resolve().parents[3]
CATS = [f"c{i}" for i in range(10)]
DENSE = ["d0", "d1", "d2"]


def py_text_hash(text: str) -> int:
    """The documented text hash, written independently with Python ints: words of the left-zero-padded bytes."""
    data = text.encode()
    words = -(-len(data) // 8)
    padded = data.rjust(8 * words, b"\0")
    h = py_mix64((len(data) + 0x243F6A8885A308D3) & M64)
    for i in range(words):
        h = py_mix64(h ^ int.from_bytes(padded[8 * i:8 * i + 8], "big"))
    return h


def py_id(text: str, field: int, vocab: int) -> int:
    return py_hash(format(py_text_hash(text), "x"), field, vocab)


def user_rows(n: int, seed: int = 0, multi: bool = False) -> list[dict]:
    """Rows of a non-Criteo data set: a label, 10 categorical columns (text and integers), 3 dense columns."""
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        row = {"y": str(int(rng.random() < 0.3))}
        for j, c in enumerate(CATS):
            r = rng.random()
            row[c] = "" if r < 0.1 else (str(int(rng.integers(0, 500))) if j % 2 else f"v{int(rng.integers(0, 40))}")
        if multi:
            row["c9"] = "|".join(f"g{int(k)}" for k in rng.integers(0, 6, size=int(rng.integers(0, 4))))
        row["d0"] = str(i)  # a row id: log1p(i) traces the row
        row["d1"] = "" if rng.random() < 0.2 else f"{rng.normal() * 10:.3f}"
        row["d2"] = str(int(rng.integers(0, 10_000)))
        rows.append(row)
    return rows


# the file's columns in another order than the schema's, plus one the schema does not use
FILE_COLUMNS = ["d2", "c0", "c1", "y", "c2", "c3", "c4", "c5", "unused", "c6", "c7", "c8", "c9", "d0", "d1"]


def write_text(path: Path, rows: list[dict], delimiter: str = "\t", header: bool = True) -> Path:
    lines = [delimiter.join(FILE_COLUMNS)] if header else []
    lines += [delimiter.join(r.get(c, "x") for c in FILE_COLUMNS) for r in rows]
    path.write_text("\n".join(lines) + "\n")
    return path


def write_parquet(path: Path, rows: list[dict]) -> Path:
    data = {"y": pa.array([int(r["y"]) for r in rows], pa.int8())}
    for j, c in enumerate(CATS):  # odd columns as integers: hashed as their decimal text, as in the text file
        values = [r[c] or None for r in rows]
        data[c] = pa.array([None if v is None else int(v) for v in values], pa.int64()) \
            if j % 2 and j != 9 else pa.array(values, pa.string())
    for c in DENSE:
        data[c] = pa.array([float(r[c]) if r[c] else None for r in rows], pa.float64())
    pq.write_table(pa.table(data), path, row_group_size=16)
    return path


def schema(**overrides) -> DataSchema:
    spec = {"label": "y", "categorical": CATS, "dense": DENSE, "header": True, **overrides}
    return DataSchema.model_validate(spec)


# ------------------------------------------------------------------------------------------------ the schema

@pytest.mark.parametrize("spec,words", [
    ({"label": "y", "categorical": ["a"], "delimeter": "comma"}, ["schema.delimeter: unknown key", "'delimiter'"]),
    ({"label": "y", "categorical": ["a", "b", "a"]}, ["column 'a' is listed twice"]),
    ({"label": "y", "categorical": ["a"], "dense": ["y"]}, ["column 'y' is listed twice (label and dense)"]),
    ({"label": "y", "categorical": []}, ["schema.categorical", "at least 1 item"]),
    ({"label": "y", "categorical": [{"column": "g", "separator": "||"}]}, ["separator must be one ASCII character"]),
    ({"label": "y", "categorical": ["a"], "header": True, "column_names": ["y", "a"]}, ["either header"]),
    ({"label": "y", "categorical": ["b"], "column_names": ["y", "a"]}, ["column 'b' is not among column_names"]),
    ({"label": -1, "categorical": ["a"]}, ["position must be >= 0"]),
    ({"label": "y", "categorical": ["a"], "delimiter": ";"}, ["schema.delimiter"]),
])
def test_schema_file_errors_name_the_file_and_the_key(tmp_path, spec, words):
    path = tmp_path / "s.json"
    path.write_text(json.dumps(spec))
    with pytest.raises(ConfigError) as err:
        DataSchema.load(path)
    assert str(path) in str(err.value)
    for word in words:
        assert word in str(err.value)


def test_presets_and_counts():
    criteo = DataSchema.load("criteo")
    assert criteo == DataSchema.criteo() and criteo.is_criteo
    assert (criteo.num_categorical, criteo.num_dense) == (26, 13)
    s = schema(categorical=["a", {"column": 3, "separator": ";"}, "b"], separator="|")
    assert s.num_categorical == 3 and s.separators == ("|", ";", "|") and not s.is_criteo
    with pytest.raises(ConfigError, match="neither a preset"):
        DataSchema.load("kriteo")


# ------------------------------------------------------------------------------------------------ reading

def test_tsv_with_header_and_ten_categorical_three_dense_columns(tmp_path):
    rows = user_rows(40)
    batches = list(CriteoTSVReader(write_text(tmp_path / "u.tsv", rows), 16, vocab_sizes=97, schema=schema()))
    assert [b.batch_size for b in batches] == [16, 16, 8]
    b = batches[0]
    assert b.num_fields == 10 and b.num_dense == 3
    assert b.labels.tolist() == [float(r["y"]) for r in rows[:16]]
    expect_dense = [[math.log1p(max(float(r[c] or 0), 0.0)) for c in DENSE] for r in rows[:16]]
    assert b.dense.double().numpy() == pytest.approx(np.array(expect_dense), rel=1e-6, abs=1e-6)
    for f, c in enumerate(CATS):
        ids, offsets = b.field_values(f)
        present = [r[c] for r in rows[:16] if r[c]]
        assert (offsets[1:] - offsets[:-1]).tolist() == [int(bool(r[c])) for r in rows[:16]]
        assert ids.tolist() == [py_id(v, f, 97) for v in present]


def test_csv_and_positions_read_the_same_rows(tmp_path):
    rows = user_rows(40, seed=1)
    tsv = list(CriteoTSVReader(write_text(tmp_path / "u.tsv", rows), 16, vocab_sizes=97, schema=schema()))
    csv = list(CriteoTSVReader(write_text(tmp_path / "u.csv", rows, delimiter=","), 16, vocab_sizes=97,
                               schema=schema(delimiter="comma")))
    by_position = schema(header=False, label=FILE_COLUMNS.index("y"),
                         categorical=[FILE_COLUMNS.index(c) for c in CATS],
                         dense=[FILE_COLUMNS.index(c) for c in DENSE])
    headerless = list(CriteoTSVReader(write_text(tmp_path / "p.tsv", rows, header=False), 16, vocab_sizes=97,
                                      schema=by_position))
    named = list(CriteoTSVReader(write_text(tmp_path / "n.tsv", rows, header=False), 16, vocab_sizes=97,
                                 schema=schema(header=False, column_names=FILE_COLUMNS)))
    assert len(tsv) == len(csv) == len(headerless) == len(named) == 3
    for a, b, c, d in zip(tsv, csv, headerless, named):
        assert_same(a, b)
        assert_same(a, c)
        assert_same(a, d)


def _row_ids(batches) -> list[int]:
    return [round(math.expm1(float(v))) for b in batches for v in b.dense[:, 0].double()]  # d0 = the row id


def test_header_files_shard_and_resume_by_data_row(tmp_path):
    files = [write_text(tmp_path / "a.csv", user_rows(23), delimiter=","),
             write_text(tmp_path / "b.csv", user_rows(18), delimiter=",")]
    spec = schema(delimiter="comma")
    whole = CriteoTSVReader(files, 5, schema=spec)
    assert whole.total_rows() == 41  # header lines are no rows
    ids = _row_ids(whole)
    assert ids == list(range(23)) + list(range(18))
    for rank in range(2):  # row i of the data (headers not counted) goes to rank i % 2
        assert _row_ids(CriteoTSVReader(files, 5, schema=spec, rank=rank, world_size=2)) == ids[rank::2]
    reader = CriteoTSVReader(files, 5, schema=spec)
    it = iter(reader)
    head = [next(it) for _ in range(6)]  # 30 rows: into the second file
    resumed = CriteoTSVReader(files, 5, schema=spec, start_row=reader.state()["next_row"])
    assert _row_ids(head) + _row_ids(resumed) == ids


def test_multi_hot_separator(tmp_path):
    rows = user_rows(30, seed=2, multi=True)
    spec = schema(categorical=[*CATS[:9], {"column": "c9", "separator": "|"}])
    path = write_text(tmp_path / "m.tsv", rows)
    path.write_text(path.read_text().replace("\tg1|", "\tg1||", 1))  # an empty piece is skipped
    batch = next(iter(CriteoTSVReader(path, 30, vocab_sizes=97, schema=spec)))
    ids, offsets = batch.field_values(9)
    genres = [[g for g in r["c9"].split("|") if g] for r in rows]
    assert (offsets[1:] - offsets[:-1]).tolist() == [len(g) for g in genres]
    assert ids.tolist() == [py_id(g, 9, 97) for gs in genres for g in gs]
    assert max(len(g) for g in genres) >= 2 and min(len(g) for g in genres) == 0  # the data has both
    single = next(iter(CriteoTSVReader(path, 30, vocab_sizes=97, schema=schema(categorical=CATS[:9]))))
    assert batch.field_values(0)[0].tolist() == single.field_values(0)[0].tolist()  # other fields unchanged


@pytest.mark.parametrize("multi", [False, True])
def test_parquet_copy_gives_identical_batches(tmp_path, multi):
    rows = user_rows(50, seed=3, multi=multi)
    spec = schema(categorical=[*CATS[:9], {"column": "c9", "separator": "|"}]) if multi else schema()
    tsv = list(CriteoTSVReader(write_text(tmp_path / "u.tsv", rows), 16, vocab_sizes=97, schema=spec))
    par = list(ParquetCTRReader(write_parquet(tmp_path / "u.parquet", rows), 16, vocab_sizes=97, schema=spec,
                                read_rows=10))
    assert len(tsv) == len(par) == 4
    for a, b in zip(tsv, par):
        assert_same(a, b)


def test_parquet_list_column_is_multi_hot_and_row_ranges_keep_it(tmp_path):
    from picasso_ops.data.row_range import RowRangeReader

    rows = user_rows(40, seed=6, multi=True)
    spec = schema(categorical=[*CATS[:9], {"column": "c9", "separator": "|"}])
    path = write_parquet(tmp_path / "u.parquet", rows)
    table = pq.read_table(path)
    genres = pa.array([[g for g in r["c9"].split("|") if g] or None for r in rows], pa.list_(pa.string()))
    pq.write_table(table.set_column(table.schema.get_field_index("c9"), "c9", genres), tmp_path / "l.parquet",
                   row_group_size=16)
    text = write_text(tmp_path / "u.tsv", rows)
    expected = list(CriteoTSVReader(text, 40, vocab_sizes=97, schema=spec))
    listed = list(ParquetCTRReader(tmp_path / "l.parquet", 40, vocab_sizes=97, schema=schema(), read_rows=7))
    assert len(expected) == len(listed) == 1
    assert_same(expected[0], listed[0])
    # numbered row ranges (gba) cross chunks of different widths: the same rows as one pass
    ranges = RowRangeReader(lambda start: CriteoTSVReader(text, 8, vocab_sizes=97, schema=spec, start_row=start,
                                                          chunk_bytes=300))
    assert_same(CTRBatch.concat([ranges.rows(0, 17), ranges.rows(17, 40)]), expected[0])


def test_missing_column_names_the_column_and_the_file(tmp_path):
    rows = user_rows(4)
    text = write_text(tmp_path / "u.tsv", rows)
    with pytest.raises(DataError, match=r"u\.tsv: column 'c42' named in the schema is missing from the file"):
        CriteoTSVReader(text, 4, schema=schema(categorical=[*CATS, "c42"]))
    par = write_parquet(tmp_path / "u.parquet", rows)
    with pytest.raises(DataError, match=r"u\.parquet: missing columns \['c42'\] named in the schema"):
        ParquetCTRReader(par, 4, schema=schema(categorical=[*CATS, "c42"]))
    with pytest.raises(DataError, match=r"u\.tsv: .* position 99 is past the file's 15 columns"):
        CriteoTSVReader(text, 4, schema=schema(dense=[99]))
    with pytest.raises(DataError, match=r"h\.tsv: the schema names column 'y', but the file has no header"):
        CriteoTSVReader(write_text(tmp_path / "h.tsv", rows, header=False), 4, schema=schema(header=False))


def test_an_overflowing_dense_value_is_the_same_bad_row_in_both_readers(tmp_path):
    rows = user_rows(20, seed=4)
    rows[5]["d2"] = "1e308"
    rows[9]["d1"] = "-2e18"
    text = write_text(tmp_path / "u.tsv", rows)
    par = write_parquet(tmp_path / "u.parquet", rows)
    readers = [CriteoTSVReader(text, 8, schema=schema(), max_bad_fraction=0.2),
               ParquetCTRReader(par, 8, schema=schema(), max_bad_fraction=0.2)]
    results = [list(r) for r in readers]
    for a, b in zip(*results):
        assert_same(a, b)
    for reader, where in zip(readers, (["line 7", "line 11"], ["row 5 (0-based)", "row 9 (0-based)"])):
        assert reader.tracker.total_bad == 2
        assert [r.location for r in reader.tracker.reported] == where
        assert "column d2 is out of range" in reader.tracker.reported[0].reason
    for reader in (CriteoTSVReader(text, 8, schema=schema(), max_bad_fraction=0.05),
                   ParquetCTRReader(par, 8, schema=schema(), max_bad_fraction=0.05)):
        with pytest.raises(DataError, match="2 of 20 rows"):
            list(reader)
    # the Criteo preset too: a parquet I value of 1e308 is no longer trained as log1p(1e308) = 709.2
    crit = random_rows(10, seed=5)
    path = to_parquet(crit, tmp_path / "c.parquet")
    table = pq.read_table(path)
    i3 = table.column("I3").to_pylist()
    i3[4] = 1e308
    table = table.set_column(table.schema.get_field_index("I3"), "I3", pa.array(i3, pa.float64()))
    pq.write_table(table, path)
    crit[4][3] = "1" + "0" * 308
    for reader in (ParquetCTRReader(path, 16, max_bad_fraction=0.2),
                   CriteoTSVReader(write_tsv(tmp_path / "c.tsv", crit), 16, max_bad_fraction=0.2)):
        batch = next(iter(reader))
        assert reader.tracker.total_bad == 1 and batch.batch_size == 9
        assert float(batch.dense.max()) < 30.0


def test_check_dense_is_the_one_rule():
    values = np.array([[3.0, DENSE_LIMIT, -DENSE_LIMIT * 1.0000001, np.inf, 1e308, 0.0]])
    present = np.array([[True, True, True, True, True, False]])
    features, ok = check_dense(values, present, "log1p")
    assert ok.tolist() == [[True, True, False, False, False, True]]
    assert features[0, 0] == pytest.approx(math.log1p(3.0)) and features[0, 2:].tolist() == [0.0] * 4
    features, _ = check_dense(np.array([[-2.5]]), np.array([[True]]), "none")
    assert features.tolist() == [[-2.5]]


def test_criteo_preset_reads_criteo_files_unchanged(tmp_path):
    rows = random_rows(70, seed=7)
    tsv = write_tsv(tmp_path / "d.tsv", rows)
    par = to_parquet(rows, tmp_path / "d.parquet")
    default = list(CriteoTSVReader(tsv, 16, vocab_sizes=5000))
    for batches in (list(CriteoTSVReader(tsv, 16, vocab_sizes=5000, schema=DataSchema.load("criteo"))),
                    list(ParquetCTRReader(par, 16, vocab_sizes=5000, schema=DataSchema.criteo()))):
        assert len(batches) == len(default) == 5
        for a, b in zip(default, batches):
            assert_same(a, b)
    ids, _ = default[0].field_values(0)  # the documented hash of the hex value, as before schemas
    assert ids.tolist() == [py_hash(r[14], 0, 5000) for r in rows[:16] if r[14]]


# ------------------------------------------------------------------------------------------------ the rec job

def _docs_example() -> tuple[dict, str]:
    """The JSON and the command of docs/rec_job.md's "Your own data set" section."""
    text = (ROOT / "docs" / "rec_job.md").read_text()
    section = text.split("## Your own data set", 1)[1].split("\n## ", 1)[0]
    spec = json.loads(re.search(r"```json\n(.*?)```", section, re.S).group(1))
    command = re.search(r"```bash\n(.*?)```", section, re.S).group(1).replace("\\\n", " ")
    return spec, " ".join(command.split())


def test_docs_schema_is_the_example_file_and_the_job_sizes_its_tables_from_it(tmp_path):
    from sparse_scale.rec.config import RecJobConfig, RecJobError
    from sparse_scale.rec.job import RecJob

    spec, command = _docs_example()
    assert spec == json.loads((ROOT / "examples" / "ratings_schema.json").read_text())
    assert "--schema examples/ratings_schema.json" in command
    cfg = str(ROOT / "ds_configs" / "demo_cpu.json")
    job = RecJob.build(RecJobConfig(config=cfg, data="criteo", schema=str(ROOT / "examples" / "ratings_schema.json"),
                                    vocab=50), rank=0, world_size=1)
    assert job.model_args.vocab_sizes == [50] * 6 and job.model_args.num_dense == 3
    with pytest.raises(RecJobError, match="--schema .*--data synthetic"):
        RecJobConfig(config=cfg, schema="criteo")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({**spec, "dense": ["age", "age"]}))
    with pytest.raises(RecJobError, match=r"--schema .*bad\.json: .*column 'age' is listed twice"):
        RecJobConfig(config=cfg, data="criteo", schema=str(bad))


def _ratings_csv(path: Path, n: int, seed: int) -> Path:
    rng = np.random.default_rng(seed)
    lines = ["hour,clicked,user_id,item_id,gender,age,occupation,zip,genres,year,title"]
    for _ in range(n):
        user, item = int(rng.integers(0, 60)), int(rng.integers(0, 80))
        genres = "|".join(sorted({f"G{int(g)}" for g in rng.integers(0, 8, size=int(rng.integers(1, 4)))}))
        clicked = int(rng.random() < 1 / (1 + math.exp(-((user % 7) - 3 + (item % 5) - 2) / 2)))
        lines.append(f"{int(rng.integers(0, 24))},{clicked},u{user},{item},{'MF'[user % 2]},{18 + user % 50},"
                     f"occ{user % 20},{10000 + user},{genres},{1950 + item % 50},title {item}")
    path.write_text("\n".join(lines) + "\n")
    return path


def test_the_documented_command_trains_on_a_users_own_csv(tmp_path):
    """The docs' command, paths swapped for a small CSV, as one process: rc 0, summary with a held-out AUC."""
    _, command = _docs_example()
    train = _ratings_csv(tmp_path / "ratings_train.csv", 600, seed=0)
    evalf = _ratings_csv(tmp_path / "ratings_eval.csv", 200, seed=1)
    argv = command.split()[1:]
    argv[argv.index("--train-files") + 1] = str(train)
    argv[argv.index("--eval-files") + 1] = str(evalf)
    argv[argv.index("--out") + 1] = str(tmp_path / "run")
    argv += ["--threads", "1"]
    env = {**os.environ, "WANDB_MODE": "disabled"}
    proc = subprocess.run([sys.executable, "-m", "sparse_scale.rec", *argv], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["samples"] == 600 and summary["eval_samples"] == 200  # every row good, the data ran out
    assert 0.0 <= summary["auc"] <= 1.0 and math.isfinite(summary["log_loss"])
