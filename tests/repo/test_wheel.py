"""A wheel built from the tree works like the checkout: its native sources ship and its C++ ops build and load.

The wheel is built from a copy of the packages, installed into a fresh venv that sees this venv's
dependencies (torch, deepspeed) but not the editable checkout, and asked to build each native op into
an empty extensions folder. A wheel missing a source or header fails the build, and the op reports
its fallback instead of loading.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("sparse_core", "sparse_scale", "picasso_ops", "moe_proto", "gba_engine")
NATIVE_DIRS = (ROOT / "picasso_ops" / "ops" / "csrc", ROOT / "moe_proto" / "csrc")

CHECK_OPS = """
import sys, picasso_ops, moe_proto
from picasso_ops.ops import builder
from moe_proto import ops
installed = sys.argv[1]
for module in (picasso_ops, moe_proto):
    assert module.__file__.startswith(installed), f"{module.__name__} imported from {module.__file__}"
assert builder.load_ops(), "picasso_ops C++ ops did not load from the wheel"
assert ops.load_cpu_ops() is not None, "moe_proto C++ ops did not load from the wheel"
print("native ops loaded")
"""


def _native_sources() -> list[str]:
    """Every C++ source and header in the tree, as paths inside the wheel."""
    return sorted(str(p.relative_to(ROOT)) for d in NATIVE_DIRS for p in d.iterdir()
                  if p.suffix in (".cpp", ".h", ".cu", ".cuh"))


def _build_wheel(tmp_path: Path) -> Path:
    """``pip wheel`` over a copy of setup.py and the packages, so the build leaves nothing in the tree."""
    src = tmp_path / "src"
    src.mkdir()
    shutil.copy(ROOT / "setup.py", src / "setup.py")
    for name in PACKAGES:
        shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    out = tmp_path / "dist"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "-w", str(out), str(src)], check=True, timeout=120)
    (wheel,) = out.glob("sparse_scale-*.whl")
    return wheel


def test_wheel_ships_every_native_source(tmp_path):
    with zipfile.ZipFile(_build_wheel(tmp_path)) as wheel:
        names = set(wheel.namelist())
    missing = [path for path in _native_sources() if path not in names]
    assert not missing, f"the wheel lacks {missing}"


@pytest.mark.soak
@pytest.mark.timeout(600)  # two JIT builds from scratch: ~1 min on an idle 2-core machine
def test_wheel_installed_in_fresh_venv_loads_native_ops(tmp_path):
    wheel = _build_wheel(tmp_path)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=60)
    python = venv / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                               check=True, capture_output=True, text=True, timeout=60).stdout.strip())
    # this venv's dependencies, as a plain path: its .pth files (the editable checkout) are not run
    (site / "dependencies.pth").write_text(sysconfig.get_path("purelib") + "\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps",
                    str(wheel)], check=True, timeout=120)
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "PICASSO_OPS_DISABLE_CPP", "TORCH_EXTENSIONS_DIR")}
    env["XDG_CACHE_HOME"] = str(tmp_path / "cache")  # torch's build cache, empty: the ops build from the wheel
    result = subprocess.run([str(python), "-c", CHECK_OPS, str(site)], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=540)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "native ops loaded" in result.stdout
    built = sorted(p.name for p in (tmp_path / "cache" / "torch_extensions").glob("*/*"))
    assert any(n.startswith("picasso_ops") for n in built) and any(n.startswith("moe_proto") for n in built), built
