"""benchmarks/guard_sync.py: the divergence guard's A/B table, and a tiny alternated run of both settings."""
from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _guard_sync() -> ModuleType:
    if str(ROOT / "benchmarks") not in sys.path:  # the script imports system.py beside it, as when it runs
        sys.path.insert(0, str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location("bench_guard_sync", ROOT / "benchmarks" / "guard_sync.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def test_table_pairs_each_setting_with_the_reference_of_its_repetition() -> None:
    runs = [{"every": 1, "samples_per_s": 100.0, "auc": 0.7}, {"every": 16, "samples_per_s": 110.0, "auc": 0.7},
            {"every": 16, "samples_per_s": 60.0, "auc": 0.7}, {"every": 1, "samples_per_s": 50.0, "auc": 0.7}]
    text = _guard_sync().table(runs, [1, 16])
    assert "| 1 | 1 | 100 | 0.7000 | - |" in text, text
    assert "| 1 | 2 | 75 (50-100) | 1.000 (1.000-1.000) |" in text, text
    assert "| 16 | 2 | 85 (60-110) | 1.150 (1.100-1.200) |" in text, text  # 110/100 and 60/50


@pytest.mark.soak
def test_a_tiny_abba_run_trains_both_settings() -> None:
    got = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "guard_sync.py"), "--reps", "2", "--abba",
                          "--shape", "26x100:10:1024"], cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert got.returncode == 0, got.stderr[-3000:]
    order = [line.split("agree every ")[1].split(":")[0] for line in got.stdout.splitlines() if line.startswith("rep ")]
    assert order == ["1", "16", "16", "1"], got.stdout[-2000:]
    assert "| 16 | 2 |" in got.stdout
