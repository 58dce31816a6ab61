"""Keeps benchmarks/moe_quality.py working: a few-step run on tiny corpora, its parsing, eval windows and tables."""
import dataclasses
import importlib
import json
import math
import sys
from pathlib import Path

import pytest
import torch

import moe_proto

_BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "moe_quality.py"


@pytest.fixture
def bench(monkeypatch):
    """The benchmark imported by name: its spawned workers unpickle run_one by module name."""
    # Appended, not prepended: the folder's other scripts must not shadow installed modules.
    monkeypatch.setattr(sys, "path", [*sys.path, str(_BENCH.parent)])
    module = importlib.import_module(_BENCH.stem)
    monkeypatch.setitem(sys.modules, _BENCH.stem, module)  # teardown drops the module again
    return module


def _write_corpus(folder: Path, files: int, lines: int) -> str:
    folder.mkdir()
    for i in range(files):
        text = "".join(f"line {j} of document {i}: the quick brown fox {i * j % 7} jumps\n" for j in range(lines))
        (folder / f"doc{i:02d}.txt").write_text(text)
    return str(folder)


def _tiny_argv(tmp_path: Path, prose: str, code: str, *extra: str) -> list:
    return ["--corpora", f"prose={prose}:*.txt", f"code={code}:*.txt", "--sizes", "a=2x32x64", "b=2x32x128",
            "--steps", "a=3", "b=2", "--seeds", "1", "2", "--variants", "dense", "top-2", "P=2",
            "--eval-tokens", "512", "--seq-len", "32", "--micro-batch", "4", "--workers", "2",
            "--json", str(tmp_path / "runs.json"), "--results", str(tmp_path / "RESULTS.md"), *extra]


@pytest.mark.slow
def test_tiny_run_pool_json_and_from_json(bench, tmp_path, capsys):
    prose = _write_corpus(tmp_path / "prose", files=12, lines=60)
    code = _write_corpus(tmp_path / "code", files=10, lines=50)
    bench.main(_tiny_argv(tmp_path, prose, code, "--no-write"))
    data = json.loads((tmp_path / "runs.json").read_text())
    assert len(data["runs"]) == 2 * 2 * 3 * 2 and len(data["commands"]) == 1
    results = {(r["spec"]["corpus"], r["spec"]["size"], r["spec"]["variant"], r["spec"]["seed"]): r["result"]
               for r in data["runs"].values()}
    top2, p2, dense = (results[("prose", "b", v, 1)] for v in ("top-2", "P=2", "dense"))
    assert top2["routes_per_token"] == p2["routes_per_token"] == 2 and dense["routes_per_token"] == 0
    assert top2["ffn_flops_per_token"] == p2["ffn_flops_per_token"] == 2 * dense["ffn_flops_per_token"]
    assert top2["params"] == p2["params"] > dense["params"] and dense["expert_params"] == 0
    assert all(0.0 < r["bpb"] < 12.0 and 0.0 <= r.get("train_drop_rate", 0.0) <= 1.0 for r in results.values())
    assert top2["eval_windows_tokens"] == 512 and len(top2["eval_load_max_over_mean"]) == 1

    # A pool worker's result is the in-process result: nothing depends on scheduling.
    spec = bench.RunSpec(**next(r["spec"] for r in data["runs"].values() if r["spec"]["variant"] == "P=2"))
    again = bench.run_one(spec)
    assert again["bpb"] == data["runs"][spec.key()]["result"]["bpb"]

    capsys.readouterr()
    bench.main(_tiny_argv(tmp_path, prose, code, "--no-write"))  # every run is reused
    assert "24 of 24 runs already in" in capsys.readouterr().out
    bench.main(_tiny_argv(tmp_path, prose, code, "--from-json"))
    out = capsys.readouterr().out
    assert "runs already" not in out and "| code | b | P=2 - top-2 |" in out  # --from-json trains nothing
    assert "| prose | P=2 - top-2 |" in out and "from a to b" in out  # the size-growth table
    section = (tmp_path / "RESULTS.md").read_text()
    assert section.count("## MoE LM quality at equal compute") == 1 and "--from-json" in section
    assert section.count("| P=2 | 2 |") == 4  # one row per (corpus, size)
    with pytest.raises(SystemExit, match="not in"):
        bench.main(_tiny_argv(tmp_path, prose, code, "--from-json", "--lr", "0.01"))


def test_reused_runs_are_counted(bench, tmp_path, capsys):
    data = {"runs": {}, "commands": []}
    spec = bench.RunSpec("c", "/nowhere", "*.txt", "s", 2, 32, 64, "dense", 1, 2, 4, 32, 1e-3, 8, 64, 0.1)
    data["runs"][spec.key()] = {"spec": dataclasses.asdict(spec), "result": {}}
    bench.run_all([spec], data, tmp_path / "runs.json", workers=1)  # nothing left to run: no pool, no folder read
    assert "1 of 1 runs already" in capsys.readouterr().out


def test_parsing_errors_name_the_entry(bench):
    assert bench.parse_sizes(["s=2x64x256"]) == {"s": (2, 64, 256)}
    with pytest.raises(SystemExit, match="s=2x64"):
        bench.parse_sizes(["s=2x64"])
    with pytest.raises(SystemExit, match="not NAME=VALUE"):
        bench.parse_sizes(["2x64x256"])
    assert bench.parse_steps(["50"], ["a", "b"]) == {"a": 50, "b": 50}
    assert bench.parse_steps(["a=5", "b=7"], ["a", "b"]) == {"a": 5, "b": 7}
    with pytest.raises(SystemExit, match="each size"):
        bench.parse_steps(["a=5"], ["a", "b"])
    with pytest.raises(SystemExit, match="unknown"):
        bench.parse_steps(["a=5", "b=7", "c=1"], ["a", "b"])
    with pytest.raises(SystemExit, match="FOLDER:GLOB"):
        bench.build_specs(bench.parse_args(["--corpora", "x=/tmp"]))


def test_aux_free_variant_needs_the_bias_update(bench, tmp_path, monkeypatch):
    monkeypatch.delattr(moe_proto, "update_expert_biases", raising=False)
    with pytest.raises(SystemExit, match="update_expert_biases"):
        bench.main(["--variants", "P=2 aux-free", "--json", str(tmp_path / "r.json"), "--no-write"])


def test_spread_eval_windows_cover_the_stream(bench):
    stream = torch.arange(1000, dtype=torch.int16)
    batches = list(bench.spread_eval_batches(stream, seq_len=10, micro_batch=4, max_tokens=50))
    tokens = torch.cat([t for t, _ in batches])
    targets = torch.cat([t for _, t in batches])
    assert tokens.shape == (5, 10) and torch.equal(targets, tokens + 1)
    starts = tokens[:, 0].tolist()
    assert starts == [0, 190, 390, 590, 790] and all(s % 10 == 0 for s in starts)
    assert sum(t.shape[0] for t, _ in bench.spread_eval_batches(stream, 10, 4, 10**9)) == 99  # every full window
    with pytest.raises(ValueError, match="fewer than one window"):
        next(bench.spread_eval_batches(stream[:5], 10, 4, 100))


def test_equal_compute_pairs_have_equal_ffn_flops(bench):
    spec = bench.RunSpec("c", "/x", "*", "s", 4, 64, 256, "top-1", 1, 1, 1, 32, 1e-3, 8, 64, 0.1)
    flops = {v: bench.ffn_flops_per_token(dataclasses.replace(spec, variant=v).model_args())
             for v in ("dense", "top-1", "top-2", "top-4", "P=2", "P=4")}
    assert flops["dense"] == flops["top-1"] == 2 * 2 * 2 * 64 * 256  # 2 MoE positions, 2 matmuls
    assert flops["P=2"] == flops["top-2"] == 2 * flops["top-1"] and flops["P=4"] == flops["top-4"] == 4 * flops["top-1"]


def test_mean_se_and_reading(bench):
    m, se = bench.mean_se([1.0, 2.0, 3.0])
    assert m == 2.0 and se == pytest.approx(1.0 / math.sqrt(3))
    assert bench.mean_se([5.0]) == (5.0, 0.0)
    assert bench.verdict(-0.01, 0.006) == "not distinguishable (within 2 s.e.: 1.7 s.e.)"
    assert bench.verdict(-0.02, 0.008) == "lower (better), 2.5 s.e." and bench.verdict(0.03, 0.01).startswith("higher")
    assert bench.verdict(0.01, 0.0) == "higher (worse), no spread"


def test_aux_free_variant_trains_with_moving_biases(bench, tmp_path, monkeypatch):
    """P=2 aux-free: the run calls update_expert_biases each step; with no aux loss its result differs from P=2."""
    folder = _write_corpus(tmp_path / "prose", files=6, lines=40)
    spec = bench.RunSpec("p", folder, "*.txt", "t", 2, 32, 64, "P=2 aux-free", 1, 4, 4, 32, 1e-2, 8, 256, 0.2)
    args = spec.model_args()
    assert args.expert_bias_update_rate == bench.AUX_FREE_RATE and args.aux_loss_coef == 0.0
    calls = []
    real = moe_proto.update_expert_biases

    def counting(model):
        calls.append(real(model))
        return calls[-1]

    monkeypatch.setattr(bench.moe_proto, "update_expert_biases", counting)
    free = bench.run_one(spec)
    assert calls == [1] * 4  # one MoE layer updated after each of the 4 steps
    plain = bench.run_one(dataclasses.replace(spec, variant="P=2"))
    assert math.isfinite(free["bpb"]) and free["bpb"] != plain["bpb"]
    assert free["routes_per_token"] == plain["routes_per_token"] == 2
