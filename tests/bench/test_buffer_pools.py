"""benchmarks/buffer_pools.py runs end to end on tiny shapes; its adapter over the C++ pool gives real, shaped buffers."""
from __future__ import annotations

import importlib.util
import shutil
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler: pooled_empty is what it measures")


def _bench():
    spec = importlib.util.spec_from_file_location("bench_buffer_pools", ROOT / "benchmarks" / "buffer_pools.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def test_the_script_prints_both_tables(capsys):
    _bench().main(["--fields", "4", "--dim", "8", "--batch", "64", "--rows", "50", "--experts", "2", "--hidden", "64",
                   "--ffn", "128", "--tokens", "1024", "--jitter", "8", "--reps", "1", "--warmup", "0"])
    out = capsys.readouterr().out
    assert out.count("| C++ pooled_empty") == 2 and out.count("| HostBufferPool") == 2
    assert out.count("| torch.empty") == 2


def test_the_cpp_pool_adapter_gives_the_shape_and_real_storage():
    from picasso_ops.ops import builder

    assert builder.load_ops()
    adapter = _bench().CppPoolAdapter()
    big = adapter.empty((512, 256), torch.float32)  # 512 KiB: from the C++ pool
    small = adapter.empty((4, 4), torch.float32)  # under 256 KiB: torch.empty
    assert big.shape == (512, 256) and big.is_contiguous() and small.shape == (4, 4)
    big.fill_(3.0)
    assert float(big.sum()) == 3.0 * 512 * 256
