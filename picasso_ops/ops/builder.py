"""JIT build of the picasso C++ CPU ops, cached in torch's extensions folder, with stale-lock handling.

The ops in ``csrc/`` are compiled with ``torch.utils.cpp_extension.load`` on
first use and registered with ``torch.library`` under ``torch.ops.picasso``.
The build is cached in ``$TORCH_EXTENSIONS_DIR`` (default
``~/.cache/torch_extensions/py<ver>_cpu/picasso_ops_cpu``) and reused while the
sources and flags are unchanged; ninja rebuilds only what changed.

torch serialises builds with a ``lock`` file in that folder and waits for it
forever; a build killed midway leaves the file behind, and every later build
hangs (seen on our machines). Before building, :func:`check_lock` looks at the
lock: each builder writes ``builder.<host>.<pid>`` next to it while it runs, so
a lock with no live builder on this host that is older than
``stale_after_s`` (or whose recorded builder is dead) is stale. A stale lock is
removed with a warning naming it, or, with ``clear_stale=False``, reported as a
:class:`StaleLockError` that names the file to delete. A live build is waited
for, but never longer than it takes its lock to go stale.

A machine without a compiler (or where the build fails) gets the pure-torch
reference ops, with one warning.

Prebuild, as DeepSpeed's op builders allow (e.g. in a Docker image or before a
multi-rank launch, so ranks do not race to compile)::

    python -m picasso_ops.ops.builder --prebuild

Example::

    >>> from picasso_ops.ops import builder
    >>> builder.load_ops()  # doctest: +SKIP
    True
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Optional

import torch

__all__ = [
    "EXTENSION_NAME",
    "SOURCES",
    "StaleLockError",
    "build_directory",
    "check_lock",
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
DEFAULT_STALE_AFTER_S = float(os.environ.get("PICASSO_OPS_STALE_LOCK_S", 600))
_POLL_S = 2.0

_lock = threading.Lock()
_state: dict[str, object] = {"loaded": False, "failed": None}


class StaleLockError(RuntimeError):
    """A build lock left by a killed build; the message names the file to delete."""

    def __init__(self, path: Path, age_s: float) -> None:
        self.path = path
        super().__init__(
            f"stale torch extension build lock {path} (age {age_s / 60:.1f} min, no live builder): "
            f"a previous build of {EXTENSION_NAME} was killed midway. Delete it and retry: rm {path}"
        )


def build_directory() -> Path:
    """Where the extension is built and cached (respects ``TORCH_EXTENSIONS_DIR``).

    Example::

        >>> build_directory().name
        'picasso_ops_cpu'
    """
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root is None:
        from torch.utils.cpp_extension import get_default_build_root

        cuda = torch.version.cuda
        flavour = f"cu{cuda.replace('.', '')}" if cuda else "cpu"
        root = os.path.join(get_default_build_root(), f"py{sys.version_info.major}{sys.version_info.minor}_{flavour}")
    return Path(root) / EXTENSION_NAME


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


def _builders(directory: Path) -> tuple[list[Path], list[Path]]:
    """This host's builder marker files: (live, dead). Other hosts' markers count as neither."""
    live, dead = [], []
    host = socket.gethostname()
    for marker in directory.glob(f"builder.{host}.*"):
        try:
            pid = int(marker.name.rsplit(".", 1)[1])
        except ValueError:
            continue
        (live if pid != os.getpid() and _pid_alive(pid) else dead).append(marker)
    return live, dead


def check_lock(
    directory: Optional[Path] = None,
    *,
    stale_after_s: float = DEFAULT_STALE_AFTER_S,
    clear_stale: bool = True,
    wait: bool = True,
) -> None:
    """Make sure the build ``lock`` in ``directory`` will not block a build forever.

    No lock: return. A lock held by a live builder (a live ``builder.<host>.<pid>``
    marker, or a lock younger than ``stale_after_s``): wait for it to go
    (``wait=False``: return at once). A stale lock (no live builder and either
    older than ``stale_after_s`` or left by a builder that is known dead):
    remove it with a warning, or raise :class:`StaleLockError` naming it when
    ``clear_stale`` is false.

    Example::

        >>> check_lock(Path("/nonexistent/dir"))  # no lock: nothing to do
    """
    directory = build_directory() if directory is None else Path(directory)
    lock = directory / "lock"
    while True:
        try:
            age = time.time() - lock.stat().st_mtime
        except FileNotFoundError:
            return
        live, dead = _builders(directory)
        if not live and (age > stale_after_s or dead):
            if not clear_stale:
                raise StaleLockError(lock, age)
            logger.warning(
                "removing stale build lock %s (age %.1f min, no live builder; a build was killed midway)",
                lock, age / 60,
            )
            lock.unlink(missing_ok=True)
            for marker in dead:
                marker.unlink(missing_ok=True)
            return
        if not wait:
            return
        logger.info("waiting for another build of %s to release %s", EXTENSION_NAME, lock)
        time.sleep(_POLL_S)


def _compiler() -> Optional[str]:
    cxx = os.environ.get("CXX", "c++")
    return shutil.which(cxx)


def _flags() -> list[str]:
    # -fopenmp: at::parallel_for is inlined into our code and uses torch's OpenMP runtime
    flags = ["-O3", "-fopenmp"]
    # -march=native as DeepSpeed's CPU ops do; PICASSO_OPS_MARCH=x86-64-v2 (or "") for images built elsewhere
    march = os.environ.get("PICASSO_OPS_MARCH", "native")
    if march:
        flags.append(f"-march={march}")
    return flags


def _build(verbose: bool, stale_after_s: float, clear_stale: bool) -> None:
    from torch.utils.cpp_extension import load

    directory = build_directory()
    directory.mkdir(parents=True, exist_ok=True)
    check_lock(directory, stale_after_s=stale_after_s, clear_stale=clear_stale)
    marker = directory / f"builder.{socket.gethostname()}.{os.getpid()}"
    marker.touch()
    try:
        load(
            name=EXTENSION_NAME,
            sources=[str(s) for s in SOURCES],
            extra_cflags=_flags(),
            extra_ldflags=["-fopenmp"],
            build_directory=str(directory),
            is_python_module=False,
            verbose=verbose,
        )
    finally:
        marker.unlink(missing_ok=True)


def load_ops(
    *, verbose: bool = False, stale_after_s: float = DEFAULT_STALE_AFTER_S, clear_stale: bool = True
) -> bool:
    """Build (or load the cached build of) the C++ ops once per process; ``True`` when they are usable.

    On failure (no compiler, compile error, ``PICASSO_OPS_DISABLE_CPP=1``) logs
    one warning and returns ``False`` from then on; callers use the reference
    path. A :class:`StaleLockError` (``clear_stale=False``) is raised, not
    swallowed, since the user must act on it.

    Example::

        >>> load_ops()  # doctest: +SKIP
        True
        >>> torch.ops.picasso.packed_lookup  # doctest: +SKIP
    """
    if _state["loaded"]:
        return True
    if _state["failed"] is not None:
        return False
    with _lock:
        if _state["loaded"] or _state["failed"] is not None:
            return bool(_state["loaded"])
        reason = None
        if os.environ.get("PICASSO_OPS_DISABLE_CPP", "") not in ("", "0"):
            reason = "PICASSO_OPS_DISABLE_CPP is set"
        elif _compiler() is None:
            reason = f"no C++ compiler ({os.environ.get('CXX', 'c++')!r} is not on PATH)"
        else:
            started = time.perf_counter()
            try:
                _build(verbose, stale_after_s, clear_stale)
            except StaleLockError:
                raise
            except Exception as exc:  # a broken toolchain must not stop training: fall back, once, loudly
                reason = f"building the C++ ops failed: {type(exc).__name__}: {str(exc).strip()[-2000:]}"
            else:
                logger.info("picasso C++ ops ready in %.1f s (%s)", time.perf_counter() - started, build_directory())
        if reason is not None:
            _state["failed"] = reason
            logger.warning(
                "picasso_ops: C++ CPU ops unavailable, using the slower pure-torch reference ops. Reason: %s. "
                "Fix: install g++ and ninja, then run `python -m picasso_ops.ops.builder --prebuild`.",
                reason,
            )
            return False
        _state["loaded"] = True
        return True


def ops_available() -> bool:
    """Whether ``torch.ops.picasso`` CPU kernels are loaded (does not trigger a build)."""
    return bool(_state["loaded"])


def reset() -> None:
    """Forget a failed build so the next :func:`load_ops` tries again (tests, or after installing a compiler)."""
    with _lock:
        _state["failed"] = None


def main(argv: Optional[list[str]] = None) -> int:
    """``python -m picasso_ops.ops.builder --prebuild``: build now, report where, exit 1 on failure."""
    parser = argparse.ArgumentParser(prog="python -m picasso_ops.ops.builder", description=__doc__.split("\n")[0])
    parser.add_argument("--prebuild", action="store_true", help="compile the C++ ops into the torch extensions cache")
    parser.add_argument("--check-lock", action="store_true", help="report (and with --clear, remove) a stale build lock")
    parser.add_argument("--clear", action="store_true", help="with --check-lock: remove a stale lock")
    parser.add_argument("--verbose", action="store_true", help="show the compiler commands")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
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
