"""sparse_core.lazy_exports: a package's names imported from their submodules on first use."""
import subprocess
import sys

import pytest

from sparse_core.lazy_exports import lazy_exports


def test_a_name_is_imported_on_first_use_and_bound_into_the_namespace():
    namespace: dict = {}
    getattr_ = lazy_exports("sparse_core", {"StrictBlock": "blocks"}, namespace)
    from sparse_core.blocks import StrictBlock

    assert getattr_("StrictBlock") is StrictBlock and namespace == {"StrictBlock": StrictBlock}
    with pytest.raises(AttributeError, match="module 'sparse_core' has no attribute 'Missing'"):
        getattr_("Missing")


def test_importing_a_package_does_not_import_its_heavy_modules():
    code = ("import sys, gba_engine, sparse_scale.rec; "
            "print('torch.distributed' in sys.modules, 'deepspeed' in sys.modules, 'gba_engine.engine' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.split() == ["False", "False", "False"]
    code = "import gba_engine; print(gba_engine.GBAConfig.__module__)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "gba_engine.config"
