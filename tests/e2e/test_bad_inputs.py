"""A battery of bad inputs, as a new user would make them: each is refused (or recovered from, as documented)
with an error of the expected type whose message names what is wrong.

Every case carries its outcome class; ``python -m tests.e2e.test_bad_inputs --table`` prints the counts per
outcome and per area. The cases call validators, readers, library calls and the CLIs' ``main([...])``
in-process; two run the real console command in a subprocess.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import gzip
import io
import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Callable, Optional
from unittest import mock

import pytest

ROOT = Path(__file__).resolve().parents[2]
DEMO = str(ROOT / "ds_configs" / "demo_cpu.json")
PLAN_CFG = str(ROOT / "ds_configs" / "m6t_1t.json")

BEFORE_STEP_1 = "refused before step 1"
AT_LOAD = "refused at load"
AT_CALL = "refused at the call"
RECOVERED = "recovered (documented)"
OUTCOMES = (BEFORE_STEP_1, AT_LOAD, AT_CALL, RECOVERED)


@dataclasses.dataclass(frozen=True)
class Case:
    """One bad input: ``run(tmp_path)`` makes it and returns the message to check (raising cases: see ``error``).

    ``error``: the exception type ``run`` must raise (None: ``run`` recovers and returns the log or result
    text); ``words``: what the message must contain (the flag, key, file, row, field or value at fault).
    """

    name: str
    area: str
    outcome: str
    run: Callable[[Path], Optional[str]]
    error: Optional[type[BaseException]]
    words: tuple[str, ...]


CASES: list[Case] = []


def case(name: str, area: str, outcome: str, error: Optional[type[BaseException]], *words: str):
    """Register the decorated ``run(tmp_path)`` as a case of the battery."""
    assert outcome in OUTCOMES

    def register(fn: Callable[[Path], Optional[str]]) -> Callable[[Path], Optional[str]]:
        CASES.append(Case(name, area, outcome, fn, error, words))
        return fn
    return register


# ------------------------------------------------------------------------------------------------ helpers

def _config(tmp: Path, **blocks) -> str:
    """demo_cpu.json with ``blocks`` added (a value None removes that key), written to tmp; returns its path."""
    cfg = json.loads(Path(DEMO).read_text())
    cfg["wandb"] = {"enabled": False}
    for key, value in blocks.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    path = tmp / "cfg.json"
    path.write_text(json.dumps(cfg))
    return str(path)


def _no_rendezvous(config) -> None:
    raise AssertionError(f"{config}: reached the launcher's rendezvous, so it was not refused before step 1")


def _rec_main(tmp: Path, *flags: str, config: Optional[str] = None) -> None:
    """``sparse-train-rec`` in-process, stopped at the rendezvous; a refusal is a SystemExit carrying the message."""
    from sparse_scale.rec import cli

    argv = ["--config", config or _config(tmp), "--out", str(tmp / "out"), *flags]
    if "--out" in flags:
        argv = ["--config", config or _config(tmp), *flags]
    with mock.patch("sparse_scale.rec.runner.job_context", _no_rendezvous):
        cli.main(argv)  # raises SystemExit: a message (job error) or 2 (argparse, message on stderr)


class CliError(Exception):
    """A CLI's refusal: its exit code and message (argparse's stderr, or SystemExit's text)."""


def _cli(fn: Callable[[], object]) -> None:
    """Run a CLI main in-process and turn its SystemExit into a :class:`CliError` carrying the message."""
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            fn()
    except SystemExit as exc:
        code = exc.code
        message = code if isinstance(code, str) else stderr.getvalue()
        if code in (0, None):
            raise AssertionError(f"exited 0: {message}") from None
        raise CliError(f"[exit {code if not isinstance(code, str) else 1}] {message}") from None
    raise AssertionError("the CLI did not refuse")


def _rec(tmp: Path, *flags: str, config: Optional[str] = None) -> None:
    _cli(lambda: _rec_main(tmp, *flags, config=config))


def _plan(*flags: str) -> None:
    from sparse_scale.lm.plan import main

    _cli(lambda: main(list(flags)))


def _tsv_row(label: str = "1", ints: Optional[list[str]] = None, cats: Optional[list[str]] = None) -> str:
    ints = ints if ints is not None else ["1"] * 13
    cats = cats if cats is not None else ["0a1b2c3d"] * 26
    return "\t".join([label, *ints, *cats])


def _good_tsv(tmp: Path, name: str = "good.tsv", rows: int = 4) -> Path:
    path = tmp / name
    path.write_text("".join(_tsv_row() + "\n" for _ in range(rows)))
    return path


def _read_tsv(path: Path, max_bad_fraction: float = 0.0) -> list:
    from picasso_ops.data.criteo import CriteoTSVReader

    return list(CriteoTSVReader(path, 8, vocab_sizes=100, max_bad_fraction=max_bad_fraction))


def _parquet(tmp: Path, rows: int = 4, ints: Optional[dict[str, list]] = None, label: Optional[list] = None,
             drop: tuple[str, ...] = ()) -> Path:
    """A parquet file of ``rows`` good rows with float I columns; ``ints`` overrides whole I columns."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    data = {"label": pa.array(label if label is not None else [1] * rows, pa.int64())}
    for j in range(1, 14):
        values = (ints or {}).get(f"I{j}", [float(j)] * rows)
        data[f"I{j}"] = pa.array(values, pa.float64())
    for j in range(1, 27):
        data[f"C{j}"] = pa.array(["0a1b2c3d"] * rows, pa.string())
    for name in drop:
        data.pop(name)
    path = tmp / "d.parquet"
    pq.write_table(pa.table(data), path)
    return path


def _read_parquet(path: Path, max_bad_fraction: float = 0.0) -> list:
    from picasso_ops.data.parquet import ParquetCTRReader

    return list(ParquetCTRReader(path, 8, vocab_sizes=100, max_bad_fraction=max_bad_fraction))


@contextlib.contextmanager
def _logs(logger_name: str, level: int = logging.INFO):
    """Collect the messages ``logger_name`` logs inside the block."""
    records: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())
    handler, log = Collect(level), logging.getLogger(logger_name)
    old = log.level
    log.addHandler(handler)
    log.setLevel(min(level, old) if old else level)
    try:
        yield records
    finally:
        log.removeHandler(handler)
        log.setLevel(old)


def _emb(mode: str = "fatal"):
    from picasso_ops.embedding import PackedEmbeddingCollection, TableSpec

    return PackedEmbeddingCollection([TableSpec("user", 10, 4), TableSpec("item", 5, 4)], bounds_check=mode,
                                     custom_ops=False)


def _batch(values: list[int], weights: Optional[list[float]] = None):
    import torch

    from picasso_ops.jagged import JaggedBatch

    return JaggedBatch(["user", "item"], torch.tensor(values), torch.tensor([[1, 1], [1, 1]]),
                       None if weights is None else torch.tensor(weights))


def _moe_layer():
    import torch

    from moe_proto.layer import MoE

    torch.manual_seed(0)
    return MoE(8, None, num_experts=4, ffn_hidden_size=8, use_rts=False)


def _checkpoint(tmp: Path, tag: str, payload: bytes = b"weights" * 10) -> Path:
    from sparse_scale import atomic_checkpoint as ac

    staged = ac.begin(tmp / "ckpt", tag) / tag
    staged.mkdir(parents=True)
    (staged / "model.pt").write_bytes(payload)
    return ac.commit(tmp / "ckpt", tag)


# ------------------------------------------------------------------------------------------------ config files

def _load(tmp: Path, text: str, suffix: str = ".json") -> None:
    from sparse_scale.config import load_config

    path = tmp / f"cfg{suffix}"
    path.write_text(text) if isinstance(text, str) else path.write_bytes(text)
    load_config(str(path))


def _load_blocks(tmp: Path, **blocks) -> None:
    from sparse_scale.config import load_config

    load_config(_config(tmp, **blocks))


from sparse_core.config_file import ConfigError  # noqa: E402  (after the helpers: the battery's imports)

case("misspelt block key", "config", AT_LOAD, ConfigError, "picasso.cache.polcy", "did you mean 'policy'")(
    lambda t: _load_blocks(t, picasso={"cache": {"rows": 10, "polcy": "lru"}}))
case("misspelt block name", "config", AT_LOAD, ConfigError, "'picaso'", "did you mean 'picasso'")(
    lambda t: _load(t, json.dumps({"train_micro_batch_size_per_gpu": 8, "picaso": {}})))
case("misspelt DeepSpeed key", "config", AT_LOAD, ConfigError, "'zero_optimisation'", "zero_optimization")(
    lambda t: _load(t, json.dumps({"train_micro_batch_size_per_gpu": 8, "zero_optimisation": {"stage": 1}})))
case("binary config file", "config", AT_LOAD, ConfigError, "cfg.json", "not a text (UTF-8) config file")(
    lambda t: _load(t, b"\xff\xfe\x00binary"))
case("missing config file", "config", AT_LOAD, ConfigError, "nope.json", "config file not found")(
    lambda t: __import__("sparse_scale.config", fromlist=["load_config"]).load_config(str(t / "nope.json")))
case("invalid JSON", "config", AT_LOAD, ConfigError, "cfg.json", "not valid json")(
    lambda t: _load(t, '{"train_micro_batch_size_per_gpu": 8,'))
case("duplicate key", "config", AT_LOAD, ConfigError, "cfg.json", "duplicate key 'gba'")(
    lambda t: _load(t, '{"gba": {}, "gba": {}}'))
case("top level is a list", "config", AT_LOAD, ConfigError, "top level must be an object, got list")(
    lambda t: _load(t, "[1, 2]"))
case("string micro-batch size", "config", AT_LOAD, ConfigError, "train_micro_batch_size_per_gpu", "'8'")(
    lambda t: _load_blocks(t, train_micro_batch_size_per_gpu="8"))
case("zero micro-batch size", "config", AT_LOAD, ConfigError, "train_micro_batch_size_per_gpu", "got 0")(
    lambda t: _load_blocks(t, train_micro_batch_size_per_gpu=0))
case("gba mode not a mode", "config", AT_LOAD, ConfigError, "gba.mode", "'fast'")(
    lambda t: _load_blocks(t, gba={"mode": "fast"}))
case("experts not divisible by prototypes", "config", AT_LOAD, ConfigError, "moe_proto", "num_experts=6",
     "num_prototypes=4")(lambda t: _load_blocks(t, moe_proto={"num_experts": 6, "num_prototypes": 4}))
case("cache of 0 rows", "config", AT_LOAD, ConfigError, "picasso.cache.rows", "got 0")(
    lambda t: _load_blocks(t, picasso={"cache": {"rows": 0}}))
case("prefetch too far ahead", "config", AT_LOAD, ConfigError, "picasso.interleave.prefetch_batches", "100")(
    lambda t: _load_blocks(t, picasso={"interleave": {"prefetch_batches": 100}}))
case("bounds_check not a mode", "config", AT_LOAD, ConfigError, "picasso.bounds_check", "'ignore'")(
    lambda t: _load_blocks(t, picasso={"bounds_check": "ignore"}))
case("picasso block not an object", "config", AT_LOAD, ConfigError, "picasso", "must be an object")(
    lambda t: _load_blocks(t, picasso=[1]))

# ------------------------------------------------------------------------------------------------ block combinations

PICASSO = {"packing": True, "embedding_dim": 8, "optimizer": {"type": "sgd", "lr": 0.05}}
GBA = {"mode": "sync", "num_servers": 1}

case("moe_proto dropless with capacity keys", "combination", BEFORE_STEP_1, CliError, "moe_proto.dropless is true",
     "moe_proto.capacity_factor", "moe_proto.drop_policy")(
    lambda t: _rec(t, config=_config(t, moe_proto={"num_experts": 4, "dropless": True, "capacity_factor": 2.0,
                                                   "drop_policy": "position"})))
case("--embedding-dim beside picasso.embedding_dim", "combination", BEFORE_STEP_1, CliError,
     "--embedding-dim 32", "picasso.embedding_dim (8)")(
    lambda t: _rec(t, "--embedding-dim", "32", config=_config(t, picasso=PICASSO)))
case("bounds_check warn with gba", "combination", BEFORE_STEP_1, CliError, 'picasso.bounds_check "warn"',
     "a gba block")(lambda t: _rec(t, config=_config(t, picasso={**PICASSO, "bounds_check": "warn"}, gba=GBA)))
case("bounds_check clamp with a cache", "combination", BEFORE_STEP_1, CliError, 'picasso.bounds_check "clamp"',
     "picasso.cache")(
    lambda t: _rec(t, config=_config(t, picasso={**PICASSO, "bounds_check": "clamp", "cache": {"rows": 100}})))
case("bounds_check warn with row_wise", "combination", BEFORE_STEP_1, CliError, 'picasso.sharding "row_wise"')(
    lambda t: _rec(t, config=_config(t, picasso={**PICASSO, "bounds_check": "warn", "sharding": "row_wise"})))
case("moe_model block in a rec job", "combination", BEFORE_STEP_1, CliError, "moe_model block",
     "remove the moe_model block")(
    lambda t: _rec(t, config=_config(t, moe_model={"num_layers": 2, "d_model": 32, "num_heads": 2,
                                                   "ffn_hidden_size": 64})))
case("--server-tables without gba", "combination", BEFORE_STEP_1, CliError, "--server-tables needs a gba block")(
    lambda t: _rec(t, "--server-tables"))
case("--data criteo without files", "combination", BEFORE_STEP_1, CliError, "--data criteo",
     "--train-files and --eval-files")(lambda t: _rec(t, "--data", "criteo"))
case("synthetic-only flags with file data", "combination", BEFORE_STEP_1, CliError, "--fields, --eval-samples",
     "synthetic stream only", "--data parquet")(
    lambda t: _rec(t, "--data", "parquet", "--fields", "40", "--eval-samples", "100"))
case("--ps-link-latency-ms without gba", "combination", BEFORE_STEP_1, CliError, "--ps-link-latency-ms")(
    lambda t: _rec(t, "--ps-link-latency-ms", "5"))
case("--rejoin-as without gba", "combination", BEFORE_STEP_1, CliError, "--rejoin-as needs a gba block")(
    lambda t: _rec(t, "--rejoin-as", "1"))

# ------------------------------------------------------------------------------------------------ train_rec flags

for flag, value, words in [
    ("--steps", "0", ("--steps 0: must be >= 1",)), ("--steps", "-5", ("--steps -5: must be >= 1",)),
    ("--eval-samples", "0", ("--eval-samples 0: must be >= 1",)), ("--fields", "0", ("--fields 0: must be >= 1",)),
    ("--embedding-dim", "0", ("--embedding-dim 0: must be >= 1",)), ("--vocab", "0", ("--vocab 0: must be >= 1",)),
    ("--max-hot", "0", ("--max-hot 0: must be >= 1",)), ("--num-dense", "-1", ("--num-dense -1: must be >= 0",)),
    ("--zipf", "nan", ("--zipf nan",)), ("--max-bad-fraction", "1.5", ("--max-bad-fraction 1.5",)),
    ("--max-skipped-steps", "0", ("--max-skipped-steps 0: must be >= 1",)),
    ("--ps-link-mbit", "-1", ("--ps-link-mbit -1.0",)),
    ("--eval-every", "-3", ("--eval-every -3: must be >= 0",)), ("--threads", "-1", ("--threads -1: must be >= 0",)),
]:
    case(f"{flag} {value}", "train_rec flags", BEFORE_STEP_1, CliError, *words)(
        lambda t, flag=flag, value=value: _rec(t, flag, value))

# values the synthetic stream refuses (picasso_ops SyntheticConfig): named by flag, not in pydantic's words
for flag, value, words in [
    ("--fields", "5", ("--fields 5: must be >= 26", "<= 1000")),
    ("--fields", "2000", ("--fields 2000: must be <= 1000",)),
    ("--vocab", "3000000000", ("--vocab 3000000000: must lie in [1, 2147483648]",)),
    ("--zipf", "0.5", ("--zipf 0.5: must be > 1.0", "<= 4.0")), ("--zipf", "9", ("--zipf 9.0: must be <= 4.0",)),
    ("--max-hot", "2000", ("--max-hot 2000: must be <= 1024",)),
    ("--num-dense", "20000", ("--num-dense 20000: must be <= 10000",)), ("--seed", "-1", ("--seed -1: must be >= 0",)),
]:
    case(f"{flag} {value} (synthetic stream)", "train_rec flags", BEFORE_STEP_1, CliError, *words)(
        lambda t, flag=flag, value=value: _rec(t, flag, value))

for flag, value, words in [
    ("--straggler", "0:nan", ("argument --straggler", "'0:nan'", "FACTOR a finite number >= 1")),
    ("--straggler", "0:inf", ("argument --straggler", "'0:inf'", "finite")),
    ("--straggler", "1", ("argument --straggler", "expected RANK:FACTOR")),
    ("--straggler", "1:x", ("argument --straggler", "'1:x'")),
    ("--straggler", "1:2:5-5", ("argument --straggler", "empty step window 5-5")),
    ("--crash", "1:0", ("argument --crash", "'1:0'", "STEP >= 1")),
    ("--steps", "ten", ("argument --steps", "invalid int value: 'ten'")),
    ("--data", "csv", ("argument --data", "invalid choice: 'csv'")),
]:
    case(f"{flag} {value}", "train_rec flags", BEFORE_STEP_1, CliError, "[exit 2]", *words)(
        lambda t, flag=flag, value=value: _rec(t, flag, value))


@case("--straggler 9:4 in a one-rank job (subprocess)", "train_rec flags", BEFORE_STEP_1, CliError,
      "--straggler: rank 9 is out of range", "ranks 0..0")
def _straggler_rank_subprocess(t: Path) -> None:
    env = {**os.environ, "WANDB_MODE": "disabled"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    got = subprocess.run([sys.executable, "-m", "sparse_scale.rec", "--config", _config(t), "--out",
                          str(t / "out"), "--steps", "1", "--straggler", "9:4"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=120)
    if got.returncode != 0:
        raise CliError(f"[exit {got.returncode}] {got.stderr.strip().splitlines()[-1]}")


@case("--crash 3:2 in a one-rank job", "train_rec flags", BEFORE_STEP_1, Exception, "--crash: rank 3 is out of range")
def _crash_rank(t: Path) -> None:
    from sparse_scale.rec import cli
    from sparse_scale.rec.config import RecJobConfig
    from sparse_scale.rec.faults import Crash

    cli.check_stragglers(RecJobConfig(config=_config(t), crash=Crash(3, 2)), world_size=1)


case("--out is a file", "train_rec flags", BEFORE_STEP_1, CliError, "is not a folder")(
    lambda t: (t.joinpath("f").write_text("x"), _rec(t, "--out", str(t / "f"))))
case("--out under a file", "train_rec flags", BEFORE_STEP_1, CliError, "cannot write there", "is not a writable folder")(
    lambda t: (t.joinpath("f").write_text("x"), _rec(t, "--out", str(t / "f" / "run"))))


@case("--out holds an earlier run, no --resume", "train_rec flags", BEFORE_STEP_1, CliError,
      "already holds a run", "--resume", "--overwrite")
def _earlier_run(t: Path) -> None:
    (t / "out" / "checkpoints").mkdir(parents=True)
    (t / "out" / "checkpoints" / "latest").write_text("step6")
    _rec(t)

# ------------------------------------------------------------------------------------------------ data files


def _files(t: Path, train: Path, evalf: Path, kind: str = "criteo") -> None:
    _rec(t, "--data", kind, "--train-files", str(train), "--eval-files", str(evalf))


case("empty training file", "data files", BEFORE_STEP_1, CliError, "--train-files", "empty (0 bytes)", "train.tsv")(
    lambda t: _files(t, (t / "train.tsv", t.joinpath("train.tsv").write_bytes(b""))[0], _good_tsv(t)))
case("empty eval file", "data files", BEFORE_STEP_1, CliError, "--eval-files", "empty (0 bytes)", "eval.tsv")(
    lambda t: _files(t, _good_tsv(t), (t / "eval.tsv", t.joinpath("eval.tsv").write_bytes(b""))[0]))
case("gzip training file", "data files", BEFORE_STEP_1, CliError, "--train-files", "gzip-compressed", "gunzip")(
    lambda t: _files(t, (t / "d.tsv", t.joinpath("d.tsv").write_bytes(gzip.compress(b"1\t2\n")))[0], _good_tsv(t)))
case("gzip parquet file", "data files", BEFORE_STEP_1, CliError, "parquet file is gzip-compressed")(
    lambda t: _files(t, (t / "z.parquet", t.joinpath("z.parquet").write_bytes(gzip.compress(b"x")))[0],
                     _parquet(t), kind="parquet"))
case("missing training file", "data files", BEFORE_STEP_1, CliError, "--train-files", "file not found", "nope.tsv")(
    lambda t: _files(t, t / "nope.tsv", _good_tsv(t)))
case("folder as eval file", "data files", BEFORE_STEP_1, CliError, "--eval-files", "not a regular file")(
    lambda t: _files(t, _good_tsv(t), t))

from picasso_ops.data.quality import DataError  # noqa: E402

case("parquet +inf dense value", "data files", AT_LOAD, DataError, "d.parquet", "row 1 (0-based)",
     "column I3 is not finite (inf)")(
    lambda t: _read_parquet(_parquet(t, ints={"I3": [1.0, float("inf"), 2.0, 3.0]})))
case("parquet -inf dense value", "data files", AT_LOAD, DataError, "row 0 (0-based)", "column I13 is not finite (-inf)")(
    lambda t: _read_parquet(_parquet(t, ints={"I13": [-float("inf"), 1.0, 2.0, 3.0]})))
case("TSV inf dense value", "data files", AT_LOAD, DataError, "d.tsv", "line 2", "column I3 is not an integer")(
    lambda t: _read_tsv(_write(t / "d.tsv", [_tsv_row(), _tsv_row(ints=["1", "2", "inf"] + ["1"] * 10)])))
case("TSV nan dense value", "data files", AT_LOAD, DataError, "line 1", "column I5 is not an integer")(
    lambda t: _read_tsv(_write(t / "d.tsv", [_tsv_row(ints=["1"] * 4 + ["nan"] + ["1"] * 8), _tsv_row()])))
case("parquet label 2", "data files", AT_LOAD, DataError, "row 2 (0-based)", "label must be 0 or 1")(
    lambda t: _read_parquet(_parquet(t, label=[1, 0, 2, 1])))
case("parquet missing a column", "data files", AT_LOAD, DataError, "d.parquet", "missing columns ['I7']")(
    lambda t: _read_parquet(_parquet(t, drop=("I7",))))
case("text file named .parquet", "data files", AT_LOAD, DataError, "d.parquet", "is not a readable parquet file")(
    lambda t: _read_parquet((t / "d.parquet", t.joinpath("d.parquet").write_text("1\t2\n"))[0]))
case("TSV wrong column count", "data files", AT_LOAD, DataError, "line 1", "expected 40 tab-separated columns, got 3")(
    lambda t: _read_tsv(_write(t / "d.tsv", ["1\t2\t3", _tsv_row()])))
case("TSV bad hex", "data files", AT_LOAD, DataError, "line 1", "column C2 is not a hex value")(
    lambda t: _read_tsv(_write(t / "d.tsv", [_tsv_row(cats=["0a"] + ["zz"] + ["0a"] * 24)])))
case("TSV label 7", "data files", AT_LOAD, DataError, "line 1", "label must be 0 or 1")(
    lambda t: _read_tsv(_write(t / "d.tsv", [_tsv_row(label="7")])))


def _write(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines))
    return path


@case("TSV bad row under --max-bad-fraction", "data files", RECOVERED, None, "skipping bad row", "d.tsv:line 2",
      "label must be 0 or 1")
def _bad_row_skipped(t: Path) -> str:
    with _logs("picasso_ops.data.quality") as lines:
        batches = _read_tsv(_write(t / "d.tsv", [_tsv_row(), _tsv_row(label="x"), _tsv_row()]), 0.5)
    assert sum(b.batch_size for b in batches) == 2
    return "\n".join(lines)


@case("parquet NaN dense value = missing", "data files", RECOVERED, None, "dense I2 = 0.0")
def _nan_is_missing(t: Path) -> str:
    batches = _read_parquet(_parquet(t, ints={"I2": [float("nan"), 1.0, 2.0, 3.0]}))
    return f"dense I2 = {float(batches[0].dense[0, 1])}"  # missing -> 0 before log1p, as a null or empty TSV field

# ------------------------------------------------------------------------------------------------ library calls


case("embedding id >= table rows", "library", AT_CALL, IndexError, "field 'user'", "id 12", "table 'user' of size 10",
     "valid ids are 0..9")(lambda t: _emb()(_batch([12, 1, 2, 3])))
case("negative embedding id", "library", AT_CALL, IndexError, "field 'item'", "id -3", "valid ids are 0..4")(
    lambda t: _emb()(_batch([1, 2, -3, 3])))


@case("embedding id out of range, bounds_check warn", "library", RECOVERED, None, "picasso.bounds_check 'warn'",
      "field 'user': id 12", "looked up as row 0", "counts {'user': 1}")
def _warn(t: Path) -> str:
    emb = _emb("warn")
    with _logs("picasso_ops.embedding.bounds") as lines:
        emb(_batch([12, 1, 2, 3]))
    return "\n".join(lines) + f"\ncounts {emb.bounds_check_counts()}"


@case("embedding id out of range, bounds_check clamp", "library", RECOVERED, None, "'clamp'", "id -3",
      "counts {'item': 1}")
def _clamp(t: Path) -> str:
    emb = _emb("clamp")
    with _logs("picasso_ops.embedding.bounds") as lines:
        emb(_batch([1, 2, -3, 3]))
    return "\n".join(lines) + f"\ncounts {emb.bounds_check_counts()}"


case("NaN per-sample weight", "library", AT_CALL, ValueError, "per-sample weights", "field 'item'", "is nan")(
    lambda t: _emb()(_batch([1, 2, 3, 4], [1.0, 1.0, float("nan"), 1.0])))
case("inf per-sample weight", "library", AT_CALL, ValueError, "field 'user'", "is inf")(
    lambda t: _emb()(_batch([1, 2, 3, 4], [float("inf"), 1.0, 1.0, 1.0])))
case("unknown bounds_check mode", "library", AT_CALL, ValueError, "bounds_check must be one of", "'ignore'")(
    lambda t: _emb("ignore"))


@case("NaN entering an MoE layer", "library", AT_CALL, FloatingPointError, "router logits are not finite",
      "1 of 6 tokens", "the layer's input (hidden_states) holds NaN/inf")
def _moe_nan(t: Path) -> None:
    import torch

    x = torch.randn(6, 8)
    x[2, 3] = float("nan")
    _moe_layer()(x)


@case("inf router weight in an MoE layer", "library", AT_CALL, FloatingPointError, "gate.weight", "6 of 6 tokens")
def _moe_inf_gate(t: Path) -> None:
    import torch

    layer = _moe_layer()
    with torch.no_grad():
        layer.gate.weight[0, 0] = float("inf")
    layer(torch.randn(6, 8).abs() + 0.1)


case("table of 0 rows", "library", AT_CALL, ValueError, "table 'user'", "num_embeddings must be >= 1, got 0")(
    lambda t: __import__("picasso_ops.embedding", fromlist=["TableSpec"]).TableSpec("user", 0, 4))
case("jagged lengths that do not add up", "library", AT_CALL, ValueError, "lengths")(
    lambda t: __import__("picasso_ops.jagged", fromlist=["JaggedBatch"]).JaggedBatch(
        ["a"], __import__("torch").tensor([1, 2]), __import__("torch").tensor([1, 5])))
case("divergence guard of 0 skipped steps", "library", AT_CALL, ValueError, "--max-skipped-steps 0")(
    lambda t: __import__("sparse_scale.divergence", fromlist=["DivergenceGuard"]).DivergenceGuard(0))
case("bad-row fraction above 1", "library", AT_CALL, ValueError, "max_bad_fraction must lie in [0, 1], got 2")(
    lambda t: __import__("picasso_ops.data.quality", fromlist=["BadRowTracker"]).BadRowTracker(2))

# ------------------------------------------------------------------------------------------------ checkpoints

from sparse_scale.atomic_checkpoint import CheckpointError, NoIntactCheckpointError  # noqa: E402


def _verify(folder: Path) -> None:
    from sparse_scale.atomic_checkpoint import verify

    verify(folder)


@case("truncated checkpoint file", "checkpoints", AT_LOAD, CheckpointError, "model.pt", "has 10 bytes",
      "the manifest says 70 (truncated?)")
def _truncated(t: Path) -> None:
    folder = _checkpoint(t, "step2")
    (folder / "model.pt").write_bytes(b"weightswei")
    _verify(folder)


@case("missing checkpoint file", "checkpoints", AT_LOAD, CheckpointError, "model.pt is missing")
def _missing(t: Path) -> None:
    folder = _checkpoint(t, "step2")
    (folder / "model.pt").unlink()
    _verify(folder)


@case("corrupt checkpoint file", "checkpoints", AT_LOAD, CheckpointError, "model.pt is corrupt", "crc32")
def _corrupt(t: Path) -> None:
    folder = _checkpoint(t, "step2")
    (folder / "model.pt").write_bytes(b"WEIGHTS" * 10)
    _verify(folder)


@case("checkpoint without a manifest", "checkpoints", AT_LOAD, CheckpointError, "MANIFEST.json is missing",
      "the save never finished")
def _no_manifest(t: Path) -> None:
    (t / "ckpt" / "step2").mkdir(parents=True)
    _verify(t / "ckpt" / "step2")


@case("dangling 'latest' beside an intact older step", "checkpoints", RECOVERED, None, "'latest' names 'step9'",
      "resuming from the newest intact checkpoint", "repaired: now names 'step2'")
def _dangling(t: Path) -> str:
    from sparse_scale.atomic_checkpoint import select

    _checkpoint(t, "step2")
    (t / "ckpt" / "latest").write_text("step9")
    choice = select(t / "ckpt")
    assert choice.tag == "step2" and (t / "ckpt" / "latest").read_text() == "step2"
    return "\n".join(choice.warnings)


@case("every checkpoint broken", "checkpoints", AT_LOAD, NoIntactCheckpointError, "no intact checkpoint in",
      "model.pt has 1 bytes")
def _none_intact(t: Path) -> None:
    from sparse_scale.atomic_checkpoint import select

    (_checkpoint(t, "step2") / "model.pt").write_bytes(b"x")
    select(t / "ckpt")

# ------------------------------------------------------------------------------------------------ the planner


for flags, words in [
    (("--gpus", "0"), ("argument --gpus", "must be >= 1, got 0")),
    (("--gpus", "-480"), ("argument --gpus", "got -480")),
    (("--gpus", "4.5"), ("argument --gpus", "whole number", "'4.5'")),
    (("--gpu-mem", "0"), ("argument --gpu-mem", "finite number > 0, got 0")),
    (("--gpu-mem", "nan"), ("argument --gpu-mem", "got nan")),
    (("--gpu-mem", "-32"), ("argument --gpu-mem", "got -32")),
    (("--reserve-gb", "-1"), ("argument --reserve-gb", "finite number >= 0")),
    (("--reserve-gb", "40"), ("argument --reserve-gb", "leaves nothing of --gpu-mem 32")),
    (("--zero-stage", "7"), ("argument --zero-stage", "invalid choice: 7")),
    (("--gpus", "7"), ("ep_size=480 does not divide --gpus 7",)),
]:
    def _planner(t: Path, flags=flags) -> None:
        base = {"--gpus": "480", "--gpu-mem": "32"}
        base.update(dict(zip(flags[::2], flags[1::2])))
        _plan(PLAN_CFG, *[x for kv in base.items() for x in kv])
    case(f"sparse-plan {' '.join(flags)}", "planner", BEFORE_STEP_1, CliError, "[exit 2]", *words)(_planner)


@case("ZeRO stage 7 in the planned config", "planner", AT_LOAD, CliError, "zero_optimization.stage", "got 7")
def _stage_7(t: Path) -> None:
    cfg = json.loads(Path(PLAN_CFG).read_text())
    cfg["zero_optimization"]["stage"] = 7
    (t / "p.json").write_text(json.dumps(cfg))
    _plan(str(t / "p.json"), "--gpus", "480", "--gpu-mem", "32")


case("planned config without moe_model", "planner", AT_LOAD, CliError, "no 'moe_model' block to plan")(
    lambda t: _plan(DEMO, "--gpus", "8", "--gpu-mem", "32"))
case("plan_config(gpus=0)", "planner", AT_CALL, ValueError, "gpus must be a whole number >= 1, got 0")(
    lambda t: __import__("sparse_scale.lm.plan", fromlist=["plan_config"]).plan_config(PLAN_CFG, 0, 32.0))


@case("sparse-plan --gpus 0 (subprocess)", "planner", BEFORE_STEP_1, CliError, "[exit 2]", "argument --gpus")
def _plan_subprocess(t: Path) -> None:
    got = subprocess.run([sys.executable, "-m", "sparse_scale.lm.plan", PLAN_CFG, "--gpus", "0", "--gpu-mem", "32"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    if got.returncode != 0:
        raise CliError(f"[exit {got.returncode}] {got.stderr.strip().splitlines()[-1]}")

# ------------------------------------------------------------------------------------------------ the test and table


@pytest.mark.parametrize("bad", CASES, ids=[f"{c.area}: {c.name}" for c in CASES])
def test_bad_input_is_refused_naming_what_is_wrong(bad: Case, tmp_path: Path) -> None:
    if bad.error is None:
        message = bad.run(tmp_path)
        assert isinstance(message, str), f"{bad.name}: a recovered case returns what it logged or computed"
    else:
        with pytest.raises(bad.error) as info:
            bad.run(tmp_path)
        message = str(info.value)
    missing = [w for w in bad.words if w not in message]
    assert not missing, f"{bad.name} [{bad.outcome}]: message lacks {missing}:\n{message}"


def test_the_battery_is_large_and_every_case_names_something():
    assert len(CASES) >= 60
    assert len({c.name for c in CASES}) == len(CASES), "case names are unique"
    assert all(c.words for c in CASES)
    assert {c.outcome for c in CASES} == set(OUTCOMES)


def table() -> dict[str, collections.Counter]:
    """Counts of the cases per outcome, and per outcome and area."""
    return {"outcome": collections.Counter(c.outcome for c in CASES),
            "area": collections.Counter(f"{c.outcome} / {c.area}" for c in CASES)}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="the bad-input battery's table")
    parser.add_argument("--table", action="store_true", help="print the counts per outcome (and area)")
    if parser.parse_args().table:
        counts = table()
        print(f"{len(CASES)} cases")
        for outcome in OUTCOMES:
            print(f"  {outcome}: {counts['outcome'][outcome]}")
        for key, n in sorted(counts["area"].items()):
            print(f"    {key}: {n}")
