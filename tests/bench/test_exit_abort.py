"""benchmarks/exit_abort.py end to end on one run per way: every way ends its ranks, the table has every row."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.soak
def test_one_run_per_way_reports_every_way_and_shutdown_leaves_no_abort():
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "exit_abort.py"), "--runs", "1", "--ranks", "2",
                          "--no-write"], capture_output=True, text=True, timeout=200, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    table = out.stdout.split("| scenario |", 1)[1]  # the RESULTS section (the rows are also printed as they come)
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in table.splitlines()
            if line.startswith(("| waited |", "| unwaited |"))]
    ways = [(r[0], r[1].split()[0]) for r in rows]
    assert ways == [(s, w) for s in ("waited", "unwaited") for w in ("none", "destroy", "local", "flush")], rows
    for scenario, way, runs, procs in rows:
        assert runs in ("0 of 1", "1 of 1") and procs.endswith(" of 2"), (scenario, way, runs, procs)
        if way == "flush":
            assert runs == "0 of 1", (scenario, way, runs)  # flush=True waits for everything in flight
