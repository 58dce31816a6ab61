"""Smoke tests of the issue 4 item 9 benchmarks: tiny sizes, one run, well-formed rows (never timings)."""
import importlib.util
import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "benchmarks" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def test_embedding_bench_row_is_well_formed():
    emb = _load("embedding")
    methods = emb._available(["per_field", "torchrec_ebc", "fbgemm_tbe", "ours"])
    assert "per_field" in methods and "ours" in methods
    row = emb.bench_config(3, 4, batch_size=8, rows=50, reps=1, warmup=0, methods=methods)
    assert (row["F"], row["D"], row["B"], row["rows_per_table"]) == (3, 4, 8, 50)
    assert row["methods"] == methods
    for m in methods:
        for key in ("fwd_wall", "fwd_cpu", "step_wall", "step_cpu"):
            v = row[f"{m}_{key}_ms"]
            assert isinstance(v, float) and math.isfinite(v) and v >= 0
    # every method computes the same lookup and the same row-wise Adagrad step from the same weights
    for name, a in row["agreement"].items():
        assert a["max_fwd_diff"] < 1e-5, name
        assert a["max_step_diff"] is None or a["max_step_diff"] < 1e-5, name
    if "fbgemm_tbe" in methods:
        assert row["ours_vs_fbgemm_fwd_cpu"] > 0 and row["ours_vs_fbgemm_step_wall"] > 0
    table = emb.format_table([row], "cpu")
    assert table.count("\n") == 2 and "| 3 | 4 | 50 |" in table


def test_embedding_rows_cap_and_results_section(tmp_path):
    emb = _load("embedding")
    assert emb.rows_for(26, 10_000, 2_500_000) == 10_000
    assert emb.rows_for(1000, 10_000, 2_500_000) == 2_500
    path = tmp_path / "RESULTS.md"
    path.write_text("# Benchmark results\n\n## Other\n\nkeep me\n")
    emb.write_section(path, emb.SECTION, "first", title="run 1")
    emb.write_section(path, emb.SECTION, "second", title="run 2")
    text = path.read_text()
    # every run is kept, newest first, under one section heading; other sections are untouched
    assert "keep me" in text and text.count(emb.SECTION) == 1
    assert text.index(emb.SECTION) < text.index("### run 2") < text.index("second") < text.index("### run 1")
    assert text.index("### run 1") < text.index("first")


@pytest.mark.slow
def test_rec_e2e_rows_are_well_formed(tmp_path):
    e2e = _load("rec_e2e")
    rows = [
        e2e.run_variant(name, picasso, tmp_path, fields=26, vocab=100, steps=2, eval_samples=256, micro_batch=32,
                        timeout_s=170)
        for name, picasso in (("off", False), ("on", True))
    ]
    for row in rows:
        assert row["steps"] == 2 and row["samples"] == 64
        assert row["samples_per_s"] > 0 and 0.0 <= row["auc"] <= 1.0 and row["process_wall_s"] > 0
    assert "picasso" in (tmp_path / "on.json").read_text() and "picasso" not in (tmp_path / "off.json").read_text()
    table = e2e.format_table(rows)
    assert "| off | 1 | 2 |" in table and "| on | 1 | 2 |" in table and "on/off samples/s" in table


def test_cache_build_memory_bench_reports_both_builds(tmp_path):
    bench = _load("cache_build_memory")
    for variant in ("converted", "straight"):
        row = bench._build(variant, fields=3, vocab=200, dim=4, cache_rows=50, workdir=str(tmp_path / variant))
        assert row["variant"] == variant and row["seconds"] >= 0
        assert row["peak_anon_mb"] >= row["before_build_mb"] > 0


def test_rec_e2e_copy_into_packed_gives_the_plain_models_logits():
    import torch

    from picasso_ops.models import SparseArgs, WideAndDeep, WideAndDeepArgs, packed_wide_and_deep

    e2e = _load("rec_e2e")
    args = WideAndDeepArgs(vocab_sizes=[30, 40, 50], num_dense=3, embedding_dim=4, hidden=(8,))
    torch.manual_seed(0)
    plain = WideAndDeep(args)
    torch.nn.init.normal_(plain.wide.bags[1].weight)  # the wide tables start at zero: make the copy show
    packed = packed_wide_and_deep(args, SparseArgs(optimizer="sgd", optimizer_params={"lr": 0.1}))
    e2e.copy_into_packed(plain, packed)
    lengths = torch.tensor([[1, 2], [0, 1], [3, 1]])
    values = torch.tensor([1, 2, 29, 5, 0, 1, 49, 7])
    dense = torch.randn(2, 3)
    with torch.no_grad():
        torch.testing.assert_close(packed(dense, values, lengths), plain(dense, values, lengths), rtol=0, atol=1e-6)


@pytest.mark.slow
@pytest.mark.soak
def test_rec_e2e_same_arithmetic_mode_gives_the_same_scores(tmp_path):
    """--optimizer sgd: packed tables with fused SGD = per-field bags with DeepSpeed's SGD, from the same weights."""
    import json

    import numpy as np

    e2e = _load("rec_e2e")
    rows = {name: e2e.run_variant(name, picasso, tmp_path, fields=26, vocab=100, steps=6, eval_samples=512,
                                  micro_batch=32, timeout_s=170, lr=0.3, optimizer="sgd")
            for name, picasso in (("off", False), ("on", True))}
    on_cfg = json.loads((tmp_path / "on.json").read_text())
    assert on_cfg["optimizer"]["type"] == "SGD" and on_cfg["gradient_clipping"] == 0.0
    assert on_cfg["picasso"]["optimizer"] == {"type": "sgd", "lr": 0.3, "lr_schedule": "deepspeed"}
    off, on = (np.load(rows[n]["scores"]) for n in ("off", "on"))
    assert np.array_equal(off["labels"], on["labels"])
    assert np.abs(off["scores"] - on["scores"]).max() < 1e-4  # float rounding order only
    assert np.abs(off["scores"] - off["scores"].mean()).max() > 1e-3  # six steps moved the model off its start
    assert abs(rows["on"]["auc"] - rows["off"]["auc"]) < 1e-3


def test_cache_bench_runs_end_with_the_same_table(tmp_path):
    bench = _load("cache")
    out = bench.training_speed(vocab=2_000, dim=4, batch=16, fields=2, pool=2, steps=10, warmup=5, workdir=tmp_path)
    assert out["max_weight_diff"] == 0.0 and out["max_state_diff"] == 0.0
    assert all(out[k] > 0 for k in ("no_cache", "cache", "cache_no_prefetch"))
    assert 0.0 < out["train_hit_rate"] <= 1.0 and out["prefetched"] > 0
