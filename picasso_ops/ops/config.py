"""How the custom ops choose and build their kernels: one frozen :class:`OpsConfig`, set once per process.

The ops never read the environment. An edge (a CLI, ``python -m
picasso_ops.ops.builder``, ``python -m sparse_scale.prebuild``, a notebook) reads
it once with :meth:`OpsConfig.from_env` and hands the result to
:func:`configure`; until then every process runs with ``OpsConfig()``, the
defaults. :meth:`OpsConfig.from_env` is the one place that knows the variable
names (:data:`ENV_VARS`).

Example::

    >>> import os
    >>> from picasso_ops.ops.config import OpsConfig, configure, current_config
    >>> previous = configure(OpsConfig.from_env({"PICASSO_OPS_DISABLE_TRITON": "1"}))
    >>> current_config().use_triton
    False
    >>> _ = configure(previous)  # back to what it was
"""

from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass
from typing import Mapping, Optional

__all__ = ["ENV_VARS", "OpsConfig", "configure", "current_config"]

# the environment variables OpsConfig.from_env reads, and the field each one sets
ENV_VARS: Mapping[str, str] = {
    "PICASSO_OPS_DISABLE_TRITON": "use_triton",
    "PICASSO_OPS_DISABLE_CPP": "use_cpp",
    "PICASSO_OPS_MARCH": "march",
    "PICASSO_OPS_STALE_LOCK_S": "stale_lock_s",
    "CXX": "cxx",
    "TORCH_EXTENSIONS_DIR": "extensions_dir",
}


def _flag_set(value: Optional[str]) -> bool:
    """A ``PICASSO_OPS_DISABLE_*`` value that turns the thing off: anything but unset, ``""`` or ``"0"``."""
    return value not in (None, "", "0")


@dataclass(frozen=True)
class OpsConfig:
    """The ops' settings; ``OpsConfig()`` is the default every process starts with.

    Fields:

    * ``use_triton``: CUDA tensors use the Triton kernels when Triton is
      importable (``False``: the pure-torch reference on CUDA).
    * ``use_cpp``: CPU tensors use the JIT-built C++ kernels (``False``: never
      build them; the reference ops, with one warning).
    * ``march``: the ``-march=`` the C++ ops are compiled for (``"native"`` as
      DeepSpeed's CPU ops; ``"x86-64-v2"`` for an image built on another
      machine; ``""`` adds no ``-march`` flag).
    * ``stale_lock_s``: seconds after which a build lock with no live builder
      is stale (a cold build takes 1-3 minutes on a busy 2-core box).
    * ``cxx``: the C++ compiler to look for on ``PATH``.
    * ``extensions_dir``: the root of the build cache (``None``: torch's
      default, ``~/.cache/torch_extensions/py<ver>_<flavour>``).

    Example::

        >>> OpsConfig().march, OpsConfig(use_cpp=False).use_cpp
        ('native', False)
    """

    use_triton: bool = True
    use_cpp: bool = True
    march: str = "native"
    stale_lock_s: float = 600.0
    cxx: str = "c++"
    extensions_dir: Optional[str] = None

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> "OpsConfig":
        """The config the variables in ``environ`` ask for (unset ones keep the defaults); raises on a bad number.

        ``PICASSO_OPS_DISABLE_TRITON`` / ``PICASSO_OPS_DISABLE_CPP``: set and not
        ``"0"`` turns the kernels off; ``PICASSO_OPS_MARCH``, ``PICASSO_OPS_STALE_LOCK_S``,
        ``CXX``, ``TORCH_EXTENSIONS_DIR``: the fields of the same meaning.

        Example::

            >>> OpsConfig.from_env({"PICASSO_OPS_MARCH": "", "PICASSO_OPS_STALE_LOCK_S": "30"})
            OpsConfig(use_triton=True, use_cpp=True, march='', stale_lock_s=30.0, cxx='c++', extensions_dir=None)
        """
        default = cls()
        stale = environ.get("PICASSO_OPS_STALE_LOCK_S")
        try:
            stale_lock_s = default.stale_lock_s if stale is None else float(stale)
        except ValueError:
            raise ValueError(f"PICASSO_OPS_STALE_LOCK_S must be a number of seconds, got {stale!r}") from None
        return cls(
            use_triton=not _flag_set(environ.get("PICASSO_OPS_DISABLE_TRITON")),
            use_cpp=not _flag_set(environ.get("PICASSO_OPS_DISABLE_CPP")),
            march=environ.get("PICASSO_OPS_MARCH", default.march),
            stale_lock_s=stale_lock_s,
            cxx=environ.get("CXX", default.cxx),
            extensions_dir=environ.get("TORCH_EXTENSIONS_DIR", default.extensions_dir),
        )

    def replace(self, **changes: object) -> "OpsConfig":
        """A copy with some fields changed.

        Example::

            >>> OpsConfig().replace(use_cpp=False).use_cpp
            False
        """
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]


_lock = threading.Lock()
_current = OpsConfig()


def configure(config: OpsConfig) -> OpsConfig:
    """Bind ``config`` as this process's ops config (process-wide); returns the one it replaces.

    Call it at the edge, before the first op call: the C++ ops are built (or
    found unusable) once per process with the config of that moment.

    Example::

        >>> previous = configure(OpsConfig(use_triton=False)); _ = configure(previous)
    """
    global _current
    if not isinstance(config, OpsConfig):
        raise TypeError(f"configure() takes an OpsConfig, got {type(config).__name__}")
    with _lock:
        previous, _current = _current, config
    return previous


def current_config() -> OpsConfig:
    """The config bound by the last :func:`configure` (``OpsConfig()`` before any).

    Example::

        >>> isinstance(current_config(), OpsConfig)
        True
    """
    return _current
