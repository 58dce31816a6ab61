"""benchmarks/system.py --quick: torchrec's and our rows of the rivals section train and score the held-out set."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.soak
def test_quick_rivals_rows_train_and_score(tmp_path: Path) -> None:
    out = tmp_path / "rows.json"
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "GLOO_SOCKET_IFNAME": "lo", "WANDB_MODE": "disabled"}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "system.py"), "--quick", "--sections", "rivals",
         "--shardings", "table_wise", "--no-straggler", "--only", "torchrec table_wise", "ours packed",
         "--json", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rivals"]
    names = [r["variant"] for r in rows]
    assert names == ["torchrec table_wise", "ours packed"]
    for r in rows:
        res = r["result"]
        assert res is not None, f"{r['variant']} failed: {r['failed']}"
        assert math.isfinite(res["samples_per_s"]) and res["samples_per_s"] > 0, r
        assert 0.5 < res["auc"] <= 1.0, r  # the planted teacher's dense part is learnt within 30 steps
        assert res["eval_samples"] == 4096, r  # every variant scored the whole held-out set
    assert "wrote" not in proc.stdout  # --quick never writes RESULTS.md
    assert "| torchrec table_wise | - | 30 |" in proc.stdout  # the table is printed
