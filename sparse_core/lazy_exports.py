"""A package's public names, imported from their modules on first use (PEP 562 ``__getattr__``).

    _EXPORTS = {"initialize": "entry", "GBAEngine": "engine"}
    __all__ = sorted(_EXPORTS)
    __getattr__ = lazy_exports(__name__, _EXPORTS, globals())

``import gba_engine`` then stays cheap (no torch.distributed, no DeepSpeed) until a name is used.
"""
from __future__ import annotations

import importlib
from typing import Any, Callable, Mapping


def lazy_exports(package: str, exports: Mapping[str, str], namespace: dict[str, Any]) -> Callable[[str], Any]:
    """The module ``__getattr__`` of ``package``: name -> the attribute of its submodule ``exports[name]``.

    Binds each name into ``namespace`` (the package's ``globals()``) once imported, so later
    lookups skip ``__getattr__``.
    """

    def __getattr__(name: str) -> Any:
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f".{exports[name]}", package), name)
        namespace[name] = value
        return value

    return __getattr__
