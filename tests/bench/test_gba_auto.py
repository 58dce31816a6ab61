"""Plumbing of benchmarks/system.py's ``auto`` section and of benchmarks/gba_detector_trace.py.

The table's arithmetic (k from the step clock, the asynchronous ceiling over the straggler's window,
the targets) is checked on hand-made rows; the soak tests run the section's ``--quick`` plan (one
place) and a short detector trace on real processes.
"""
from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _system():
    spec = importlib.util.spec_from_file_location("bench_system", ROOT / "benchmarks" / "system.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses resolve their annotations through it
    spec.loader.exec_module(mod)
    return mod


def _row(mod, variant: str, rate: float, auc: float, k=math.nan, switches=None):
    return mod.Row(variant, "none" not in variant, 400, {
        "samples_per_s": rate, "auc": auc, "eval_samples": 4096, "k": k, "rep": 0, "window": (100, 300),
        "switches": switches, "switch_seconds": 0.5 if switches is not None else None,
        "switch_bytes": 2e8 if switches is not None else None})


def test_the_plan_alternates_auto_and_plain_per_place_after_the_two_anchors():
    mod = _system()
    plan = mod.auto_plan(mod.Shape(), ("data", "optimizer"))
    assert plan == [("plain packed", None, False), ("auto", None, True), ("auto", "data", True),
                    ("plain packed", "data", False), ("auto", "optimizer", True), ("plain packed", "optimizer", False)]


def test_the_table_measures_k_the_ceiling_and_the_targets():
    mod = _system()
    rows = [_row(mod, "plain packed, none", 10_000, 0.7000), _row(mod, "auto, none", 9_500, 0.7004, switches=[]),
            _row(mod, "auto, data", 7_000, 0.7005, k=4.0, switches=[{}, {}]),
            _row(mod, "plain packed, data", 4_000, 0.7000, k=4.0)]
    text = mod.auto_table(rows)
    # k = 4: c = (1 + 1/4) / 2 = 0.625; half the job steps slowed: ceiling = 10,000 / (0.5 + 0.5 / 0.625) = 7,692
    assert "| auto, data | 1/1 | 7,000 | 0.70 | 4.00 | 6,250 / 7,692 | 0.91 | 0.7005 | +0.0005 | 2 | 0.50 / 200 |" in text
    assert "| plain packed, data | 1/1 | 4,000 | 0.40 | 4.00 | 6,250 / 7,692 | - |" in text
    assert "auto without a straggler: **0.95x** plain (paired by repetition; target >= 0.9x: **hit**)" in text
    assert "straggler in data: **0.91x** the asynchronous ceiling of the run (target >= 0.85x: **hit**)" in text


@pytest.mark.soak
def test_quick_auto_section_runs_every_variant_of_one_place(tmp_path: Path) -> None:
    out = tmp_path / "rows.json"
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "GLOO_SOCKET_IFNAME": "lo", "WANDB_MODE": "disabled"}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "system.py"), "--quick", "--sections", "auto", "--places",
         "optimizer", "--json", str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())["auto"]
    assert [r["variant"] for r in rows] == ["plain packed, none", "auto, none", "auto, optimizer",
                                            "plain packed, optimizer"]
    for r in rows:
        res = r["result"]
        assert res is not None, f"{r['variant']} failed: {r['failed']}"
        assert res["samples_per_s"] > 0 and 0.5 < res["auc"] <= 1.0, r
    for slowed in (rows[2]["result"], rows[3]["result"]):  # worker 1 slept in its optimizer step, calibrated
        # plumbing only: k is measured (its size is a timing, and a timing under load is no test)
        assert slowed["sleep_s"] > 0 and math.isfinite(slowed["k"]) and slowed["k"] > 0, slowed
    assert "wrote" not in proc.stdout  # --quick never writes RESULTS.md
    assert "| auto, optimizer | 1/1 |" in proc.stdout


@pytest.mark.soak
def test_detector_trace_records_both_workers_step_times(tmp_path: Path) -> None:
    out = tmp_path / "trace.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gba_detector_trace.py"), "--steps", "12", "--hogs", "1",
         "--width", "64", "--out", str(out), "--timeout-s", "120"], cwd=ROOT, capture_output=True, text=True,
        timeout=180, env={**os.environ, "WANDB_MODE": "disabled"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    trace = json.loads(out.read_text())
    assert trace["hogs"] == 1 and trace["steps"] == 12
    assert len(trace["rows"]) == 12 and all(len(r) == 2 and min(r) > 0 for r in trace["rows"]), trace["rows"]
