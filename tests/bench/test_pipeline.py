"""benchmarks/pipeline.py end to end on a tiny run: both shardings, pipeline off and on, the same AUC each."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.soak
def test_the_ab_runs_both_modes_and_pipelining_changes_no_result():
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "pipeline.py"), "--vocab", "1000", "--steps", "6",
                          "--eval-samples", "1024", "--reps", "1", "--shardings", "row_wise", "data_parallel"],
                         capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    runs = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert sorted((r["sharding"], r["pipeline"]) for r in runs) == [
        ("data_parallel", "all"), ("data_parallel", "off"), ("row_wise", "off"), ("row_wise", "row_wise")]
    for sharding in ("row_wise", "data_parallel"):
        aucs = {r["auc"] for r in runs if r["sharding"] == sharding}
        assert len(aucs) == 1, f"{sharding}: the pipeline changed the result: {runs}"
    assert "on/off per rep" in out.stdout
