"""benchmarks/own_pipeline.py end to end on a tiny run: three variants, the pipeline changes no result."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.soak
def test_a_tiny_run_trains_every_variant_and_the_pipeline_changes_no_loss():
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "own_pipeline.py"), "--rounds", "1", "--steps", "3",
                          "--shapes", "26x500", "--no-write"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [line for line in out.stdout.splitlines() if line.startswith("| 26 x 500 |")]
    assert rows, out.stdout[-2000:]
    cells = [c.strip() for c in rows[0].strip("|").split("|")]
    assert len(cells) == 8 and cells[-1] == "equal", rows[0]  # last losses with the pipeline on and off agree
    assert int(cells[-2]) >= 3, rows[0]  # the batches after the first were read ahead on the pipeline's thread
