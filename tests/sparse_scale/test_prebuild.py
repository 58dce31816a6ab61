"""`python -m sparse_scale.prebuild`: the one command that builds every C++ op of the project; the old ones warn."""
import shutil
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler")


def test_the_one_command_builds_every_op_library():
    done = subprocess.run([sys.executable, "-m", "sparse_scale.prebuild"], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "picasso_ops C++ CPU ops ready" in done.stderr and "moe_proto C++ CPU ops ready" in done.stderr
    assert "RuntimeWarning" not in done.stderr


def test_the_old_picasso_command_still_builds_with_a_deprecation_warning():
    done = subprocess.run([sys.executable, "-m", "picasso_ops.ops.builder", "--prebuild"], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "DeprecationWarning" in done.stderr and "python -m sparse_scale.prebuild" in done.stderr
    assert "picasso_ops C++ CPU ops ready" in done.stderr
