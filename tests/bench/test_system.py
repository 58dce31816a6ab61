"""benchmarks/system.py: the rivals section's alternated plan trains and scores (--quick), and its table's arithmetic."""
from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _system() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_system_rivals", ROOT / "benchmarks" / "system.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up by name
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.slow
@pytest.mark.soak
def test_quick_rivals_rows_train_and_score(tmp_path: Path) -> None:
    out = tmp_path / "rows.json"
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "GLOO_SOCKET_IFNAME": "lo", "WANDB_MODE": "disabled"}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "system.py"), "--quick", "--sections", "rivals",
         "--only", "torchrec table_wise", "ours auto", "--json", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rivals"]
    names = [r["variant"] for r in rows]
    assert names == ["torchrec table_wise", "ours auto"]
    for r in rows:
        res = r["result"]
        assert res is not None, f"{r['variant']} failed: {r['failed']}"
        assert math.isfinite(res["samples_per_s"]) and res["samples_per_s"] > 0, r
        assert 0.5 < res["auc"] <= 1.0, r  # the planted teacher's dense part is learnt within 30 steps
        assert res["eval_samples"] == 4096, r  # every variant scored the whole held-out set
        assert r["shape"] == "26 x 100" and r["rep"] == 0
    assert rows[1]["result"]["plan_log"], "the planner's plan (picasso.sharding auto) was not logged on rank 0"
    assert "wrote" not in proc.stdout  # --quick never writes RESULTS.md
    assert "| 26 x 100 | torchrec table_wise (anchor) | 1/1 | 30 |" in proc.stdout  # the table is printed
    assert "| 26 x 100 | ours auto | 1/1 | 30 |" in proc.stdout and "plan: 26 data_parallel, 0 row_wise" in proc.stdout


def test_parse_shape_and_bad_specs() -> None:
    system = _system()
    shape = system.parse_shape("200x10000:40:8192", system.Shape())
    assert (shape.fields, shape.vocab, shape.steps, shape.eval_samples) == (200, 10_000, 40, 8192)
    assert system.parse_shape("26x100", system.Shape()).steps == system.Shape().steps
    for bad in ("26", "26x100:0", "26x100:10:1000", "axb", "26x100:1:512:9"):
        with pytest.raises(SystemExit, match="shape"):
            system.parse_shape(bad, system.Shape())


def test_variant_config_merges_the_overrides() -> None:
    system = _system()
    v = system.Variant("x", picasso={"sharding": "auto", "interleave": {"prefetch_batches": 2}},
                       deepspeed={"zero_optimization": {"stage": 2, "overlap_comm": True}})
    cfg = system.variant_config(system.Shape(), v)
    assert cfg["picasso"]["sharding"] == "auto" and cfg["picasso"]["interleave"] == {"prefetch_batches": 2}
    assert cfg["picasso"]["optimizer"]["type"] == "rowwise_adagrad"  # the base block is kept
    assert cfg["zero_optimization"] == {"stage": 2, "overlap_comm": True}
    assert cfg["optimizer"]["type"] == "AdamW"


def test_matrix_table_pairs_each_run_with_the_fastest_anchor_of_its_repetition() -> None:
    system = _system()

    def row(variant: str, rep: int, rate: float | None, auc: float = 0.7) -> object:
        result = None if rate is None else {"samples_per_s": rate, "auc": auc, "eval_samples": 512}
        return system.Row(variant, False, 10, result=result, failed=None if rate else "boom", shape="2 x 10", rep=rep)

    rows = [row("torchrec a", 0, 100.0), row("torchrec b", 0, 200.0), row("ours", 0, 300.0, 0.7005),
            row("torchrec a", 1, 110.0), row("torchrec b", 1, 100.0), row("ours", 1, 400.0, 0.7005),
            row("torchrec a", 2, 90.0), row("torchrec b", 2, 300.0), row("ours", 2, None)]
    text = system.matrix_table(rows, "torchrec *", 1.5)
    # b's median (200) beats a's (100): b is the anchor; ours pairs 300/200 and 400/100, its median 350 / 200
    assert "| 2 x 10 | torchrec b (anchor) | 3/3 | 10 | 200 (100-300) | 1 |" in text
    assert "| 2 x 10 | ours | 2/3 | 10 | 350 (300-400) | 2.75 (1.50-4.00) | 0.7005 (0.7005-0.7005) | +0.0005 |" in text
    assert "boom" in text
    assert "ours / torchrec b: **1.75x** samples/s" in text and "**hit**" in text
    slow = [row("torchrec b", 0, 200.0), row("ours", 0, 250.0, 0.69)]
    assert "**miss**" in system.matrix_table(slow, "torchrec *", 1.5)
    assert "2 x 10, ours / torchrec b: **1.25x**" in system.matrix_table(slow, "torchrec b", None)
