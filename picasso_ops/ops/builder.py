"""JIT build of the picasso C++ CPU ops, cached in torch's extensions folder, with stale-lock handling.

The ops in ``csrc/`` are compiled with ``torch.utils.cpp_extension.load`` on
first use and registered with ``torch.library`` under ``torch.ops.picasso``.
The build is cached in ``OpsConfig.extensions_dir`` (default
``~/.cache/torch_extensions/py<ver>_cpu/picasso_ops_cpu-<key>``) and reused while the
sources and flags are unchanged; ninja rebuilds only what changed. The folder's
``<key>`` (:func:`build_key`) names the ``-march`` and, for ``-march=native``, a hash
of this CPU's instruction-set flags, so a shared home on a cluster of mixed CPUs never
loads a build made for another CPU kind (which can die with an illegal instruction). The
compiler, ``-march`` and the stale-lock age come from the process's
:class:`~picasso_ops.ops.config.OpsConfig` (:func:`picasso_ops.ops.configure`);
the builder reads no environment variable itself, except in :func:`main`, the
command-line edge, which binds ``OpsConfig.from_env(os.environ)``.

torch serialises builds with a ``lock`` file in that folder and waits for it
forever; a build killed midway leaves the file behind, and every later build
hangs (seen on our machines). Before building, :func:`check_lock` looks at the
lock (``lock_staleness`` of :mod:`sparse_core.jit_build` is the one test of staleness, also used by
``moe_proto.ops`` and ``sparse_scale.prebuild``): each builder writes ``builder.<host>.<pid>`` next to it while it runs, so
a lock with no live builder on this host that is older than
``stale_after_s`` (or whose recorded builder is dead) is stale. A stale lock is
removed with a warning naming it, or, with ``clear_stale=False``, reported as a
:class:`StaleLockError` that names the file to delete. A live build is waited
for, but never longer than it takes its lock to go stale.

A machine without a compiler (or where the build fails) gets the pure-torch
reference ops, with one warning.

The library is declared once as :data:`LIBRARY` (an :class:`~sparse_core.jit_build.OpLibrary`) and
loaded by :func:`sparse_core.jit_build.load`, the project's one loader. Prebuild every op of the
project, as DeepSpeed's op builders allow (e.g. in a Docker image or before a multi-rank launch, so
ranks do not race to compile)::

    python -m sparse_scale.prebuild

(``python -m picasso_ops.ops.builder --prebuild``, the old command, still builds this library, with a
deprecation warning.)

Example::

    >>> from picasso_ops.ops import builder
    >>> builder.load_ops()  # doctest: +SKIP
    True
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import warnings
from pathlib import Path
from typing import Optional

from picasso_ops.ops.config import OpsConfig, configure, current_config
from sparse_core import jit_build
from sparse_core.jit_build import StaleLockError, cpu_isa_flags, lock_staleness

__all__ = [
    "EXTENSION_NAME",
    "SOURCES",
    "StaleLockError",
    "build_directory",
    "build_key",
    "cpu_isa_flags",
    "check_lock",
    "lock_staleness",
    "LIBRARY",
    "build_settings",
    "load_ops",
    "ops_available",
    "reset",
]

logger = logging.getLogger(__name__)

EXTENSION_NAME = "picasso_ops_cpu"
_CSRC = Path(__file__).resolve().parent / "csrc"
SOURCES: tuple[Path, ...] = (
    _CSRC / "packed_lookup.cpp",
    _CSRC / "packed_backward_update.cpp",
    _CSRC / "hash_table.cpp",
    _CSRC / "output_pool.cpp",
)
# a cold build of the three files takes 1-3 minutes on a busy 2-core box; 10 leaves a wide margin
DEFAULT_STALE_AFTER_S = OpsConfig().stale_lock_s



def build_settings(config: Optional[OpsConfig] = None) -> jit_build.BuildSettings:
    """The :class:`~sparse_core.jit_build.BuildSettings` of ``config`` (default: the bound :class:`OpsConfig`).

    Example::

        >>> build_settings(OpsConfig(march="x86-64-v2", use_cpp=False)).disabled is not None
        True
    """
    config = current_config() if config is None else config
    disabled = None if config.use_cpp else \
        "the C++ ops are turned off (OpsConfig.use_cpp is False, e.g. PICASSO_OPS_DISABLE_CPP is set)"
    return jit_build.BuildSettings(march=config.march, cxx=config.cxx,
                                   root=None if config.extensions_dir is None else Path(config.extensions_dir),
                                   stale_after_s=config.stale_lock_s, disabled=disabled)


# -fopenmp: at::parallel_for is inlined into our code and uses torch's OpenMP runtime; -march from OpsConfig.march
LIBRARY = jit_build.register(jit_build.OpLibrary(
    name=EXTENSION_NAME, package="picasso_ops", sources=SOURCES, cflags=("-O3", "-fopenmp"), ldflags=("-fopenmp",),
    is_python_module=False, fallback="using the slower pure-torch reference ops", settings=build_settings,
), declared_by=__name__)
_state = jit_build.load_state(LIBRARY)  # {"module", "failed"}: this process's load, shared with the loader


def build_key(config: Optional[OpsConfig] = None, cpuinfo: Optional[str] = None) -> str:
    """What the cached build depends on beyond sources: the ``-march`` and, when native, this CPU's ISA.

    Example::

        >>> build_key(OpsConfig(march="x86-64-v2"))
        'x86-64-v2'
        >>> build_key(OpsConfig(march="native"), "flags : sse2 avx2\\n")[:7]
        'native-'
    """
    march = (current_config() if config is None else config).march
    return jit_build.build_key(march, jit_build.cpu_isa_flags(cpuinfo) if march == "native" else ())


def build_directory(config: Optional[OpsConfig] = None, cpuinfo: Optional[str] = None) -> Path:
    """Where the extension is built and cached (``config.extensions_dir``; default: the bound config's).

    The folder is ``picasso_ops_cpu-<build_key>``: one per ``-march`` and CPU kind.

    Example::

        >>> build_directory(OpsConfig(march="x86-64-v2")).name
        'picasso_ops_cpu-x86-64-v2'
        >>> str(build_directory(OpsConfig(extensions_dir="/tmp/ext", march="")))
        '/tmp/ext/picasso_ops_cpu-generic'
    """
    return LIBRARY.directory(build_settings(config), cpuinfo)


def check_lock(
    directory: Optional[Path] = None,
    *,
    stale_after_s: Optional[float] = None,
    clear_stale: bool = True,
    wait: bool = True,
) -> None:
    """Make sure the build ``lock`` in ``directory`` will not block a build forever.

    No lock: return. A lock held by a live builder (a live ``builder.<host>.<pid>``
    marker, or a lock younger than ``stale_after_s``, default the bound
    ``OpsConfig.stale_lock_s``): wait for it to go (``wait=False``: return at
    once). A stale lock (:func:`lock_staleness`): remove it with a warning, or
    raise :class:`StaleLockError` naming it when ``clear_stale`` is false.

    Example::

        >>> check_lock(Path("/nonexistent/dir"))  # no lock: nothing to do
    """
    directory = build_directory() if directory is None else Path(directory)
    stale_after_s = current_config().stale_lock_s if stale_after_s is None else stale_after_s
    jit_build.check_lock(directory, stale_after_s=stale_after_s, clear_stale=clear_stale, wait=wait,
                         extension=EXTENSION_NAME, log=logger)


def load_ops(
    *, verbose: bool = False, stale_after_s: Optional[float] = None, clear_stale: bool = True
) -> bool:
    """Build (or load the cached build of) the C++ ops once per process; ``True`` when they are usable.

    :func:`sparse_core.jit_build.load` of :data:`LIBRARY` with the bound :class:`OpsConfig`
    (``stale_after_s`` defaults to its ``stale_lock_s``). On failure (no compiler, compile error,
    ``OpsConfig.use_cpp`` false) logs one warning and returns ``False`` from then on; callers use the
    reference path. A :class:`StaleLockError` (``clear_stale=False``) is raised, not swallowed, since the
    user must act on it.

    Example::

        >>> load_ops()  # doctest: +SKIP
        True
        >>> torch.ops.picasso.packed_lookup  # doctest: +SKIP
    """
    if _state["module"] is not None:  # the hot path: every op call asks
        return True
    return jit_build.load(LIBRARY, verbose=verbose, clear_stale=clear_stale, stale_after_s=stale_after_s) is not None


def ops_available() -> bool:
    """Whether ``torch.ops.picasso`` CPU kernels are loaded (does not trigger a build)."""
    return _state["module"] is not None


def reset() -> None:
    """Forget a failed build so the next :func:`load_ops` tries again (tests, or after installing a compiler)."""
    jit_build.forget_failure(LIBRARY)


def main(argv: Optional[list[str]] = None) -> int:
    """``python -m picasso_ops.ops.builder --prebuild`` (deprecated: ``python -m sparse_scale.prebuild``).

    Builds this library now, reports where, exits 1 on failure. The command-line edge: binds
    ``OpsConfig.from_env(os.environ)`` before anything else.
    """
    parser = argparse.ArgumentParser(prog="python -m picasso_ops.ops.builder", description=__doc__.split("\n")[0])
    parser.add_argument("--prebuild", action="store_true", help="compile the C++ ops into the torch extensions cache")
    parser.add_argument("--check-lock", action="store_true", help="report (and with --clear, remove) a stale build lock")
    parser.add_argument("--clear", action="store_true", help="with --check-lock: remove a stale lock")
    parser.add_argument("--verbose", action="store_true", help="show the compiler commands")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    warnings.warn("`python -m picasso_ops.ops.builder` is deprecated and goes in the next release: "
                  "`python -m sparse_scale.prebuild` builds every C++ op of the project", DeprecationWarning,
                  stacklevel=2)
    configure(OpsConfig.from_env(os.environ))
    if args.check_lock:
        try:
            check_lock(clear_stale=args.clear, wait=False)
        except StaleLockError as exc:
            logger.error("%s", exc)
            return 1
        logger.info("no stale lock in %s", build_directory())
        if not args.prebuild:
            return 0
    if not args.prebuild:
        parser.print_help()
        return 2
    try:
        ok = load_ops(verbose=args.verbose, clear_stale=True)
    except StaleLockError as exc:
        logger.error("%s", exc)
        return 1
    if ok:
        logger.info("built %s in %s", EXTENSION_NAME, build_directory())
        return 0
    return 1


if __name__ == "__main__":
    sys.exit(main())
