"""Deprecated path, kept for one release: the foundation moved to :mod:`sparse_core`, and the modules
only the jobs use moved up into :mod:`sparse_scale`.

``import sparse_scale.base.blocks`` still works and returns the very module ``sparse_core.blocks`` (same
classes, so ``isinstance`` holds), with a ``DeprecationWarning`` naming the new path.
"""
import importlib
import importlib.abc
import importlib.util
import sys
import warnings

MOVED = {
    "blocks": "sparse_core.blocks",
    "config_file": "sparse_core.config_file",
    "jit_build": "sparse_core.jit_build",
    "lazy_exports": "sparse_core.lazy_exports",
    "zero_state": "sparse_core.zero_state",
    "zero3_state": "sparse_core.zero3_state",
    "atomic_checkpoint": "sparse_scale.atomic_checkpoint",
    "divergence": "sparse_scale.divergence",
}


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Answers ``sparse_scale.base.<old>`` with the module at its new path."""

    def find_spec(self, fullname, path=None, target=None):
        package, _, short = fullname.rpartition(".")
        if package != __name__ or short not in MOVED:
            return None
        warnings.warn(f"{fullname} moved to {MOVED[short]}; the old path goes away in the next release",
                      DeprecationWarning, stacklevel=2)
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec):
        return importlib.import_module(MOVED[spec.name.rpartition(".")[2]])

    def exec_module(self, module):
        # already executed at its new path; the import machinery overwrote its __spec__ with the old name
        module.__spec__ = importlib.util.spec_from_file_location(module.__name__, module.__file__)


if not any(isinstance(finder, _MovedModules) for finder in sys.meta_path):
    sys.meta_path.insert(0, _MovedModules())
