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
lock (:func:`lock_staleness` is the one test of staleness, also used by
``sparse_scale.prebuild`` for DeepSpeed's builds): each builder writes ``builder.<host>.<pid>`` next to it while it runs, so
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

from picasso_ops.ops.config import OpsConfig, configure, current_config

__all__ = [
    "EXTENSION_NAME",
    "SOURCES",
    "StaleLockError",
    "build_directory",
    "build_key",
    "cpu_isa_flags",
    "check_lock",
    "lock_staleness",
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


def cpu_isa_flags(cpuinfo: Optional[str] = None) -> tuple[str, ...]:
    """The sorted instruction-set flags of this CPU (``cpuinfo``: the text of ``/proc/cpuinfo`` to read instead).

    x86 lists them under ``flags``, ARM under ``Features``; where neither exists the
    machine and processor names stand in.

    Example::

        >>> cpu_isa_flags("processor : 0\\nflags : sse2 avx2 fma\\n")
        ('avx2', 'fma', 'sse2')
    """
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text(errors="replace")
        except OSError:
            cpuinfo = ""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return tuple(sorted(set(value.split())))
    import platform

    return (platform.machine(), platform.processor())


def build_key(config: Optional[OpsConfig] = None, cpuinfo: Optional[str] = None) -> str:
    """What the cached build depends on beyond sources: the ``-march`` and, when native, this CPU's ISA.

    Example::

        >>> build_key(OpsConfig(march="x86-64-v2"))
        'x86-64-v2'
        >>> build_key(OpsConfig(march="native"), "flags : sse2 avx2\\n")[:7]
        'native-'
    """
    march = (current_config() if config is None else config).march
    if march != "native":
        return "".join(c if c.isalnum() or c in "-_." else "_" for c in march) or "generic"
    import hashlib

    digest = hashlib.sha1(" ".join(cpu_isa_flags(cpuinfo)).encode()).hexdigest()[:12]
    return f"native-{digest}"


def build_directory(config: Optional[OpsConfig] = None, cpuinfo: Optional[str] = None) -> Path:
    """Where the extension is built and cached (``config.extensions_dir``; default: the bound config's).

    The folder is ``picasso_ops_cpu-<build_key>``: one per ``-march`` and CPU kind.

    Example::

        >>> build_directory(OpsConfig(march="x86-64-v2")).name
        'picasso_ops_cpu-x86-64-v2'
        >>> str(build_directory(OpsConfig(extensions_dir="/tmp/ext", march="")))
        '/tmp/ext/picasso_ops_cpu-generic'
    """
    root = (current_config() if config is None else config).extensions_dir
    if root is None:
        from torch.utils.cpp_extension import get_default_build_root

        cuda = torch.version.cuda
        flavour = f"cu{cuda.replace('.', '')}" if cuda else "cpu"
        root = os.path.join(get_default_build_root(), f"py{sys.version_info.major}{sys.version_info.minor}_{flavour}")
    return Path(root) / f"{EXTENSION_NAME}-{build_key(config, cpuinfo)}"


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


def lock_staleness(directory: Path, stale_after_s: float, now: Optional[float] = None
                   ) -> tuple[Optional[float], list[Path]]:
    """``(age_s, dead_markers)`` of the build ``lock`` in ``directory`` when it is stale, else ``(None, [])``.

    Stale: no live ``builder.<host>.<pid>`` marker of this host, and the lock
    is older than ``stale_after_s`` or a marker names a builder known dead.
    No lock is not stale. Reads the folder only.

    Example::

        >>> lock_staleness(Path("/nonexistent/dir"), 600.0)
        (None, [])
    """
    lock = Path(directory) / "lock"
    try:
        age = (time.time() if now is None else now) - lock.stat().st_mtime
    except FileNotFoundError:
        return None, []
    live, dead = _builders(Path(directory))
    if not live and (age > stale_after_s or dead):
        return age, dead
    return None, []


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
    lock = directory / "lock"
    while True:
        if not lock.exists():
            return
        age, dead = lock_staleness(directory, stale_after_s)
        if age is not None:
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


def _compiler(config: OpsConfig) -> Optional[str]:
    return shutil.which(config.cxx)


def _flags(config: OpsConfig) -> list[str]:
    # -fopenmp: at::parallel_for is inlined into our code and uses torch's OpenMP runtime
    flags = ["-O3", "-fopenmp"]
    # -march=native as DeepSpeed's CPU ops do; OpsConfig.march = "x86-64-v2" (or "") for images built elsewhere
    march = config.march
    if march:
        flags.append(f"-march={march}")
    return flags


def _build(verbose: bool, stale_after_s: float, clear_stale: bool, config: Optional[OpsConfig] = None) -> None:
    from torch.utils.cpp_extension import load

    config = current_config() if config is None else config
    directory = build_directory(config)
    directory.mkdir(parents=True, exist_ok=True)
    check_lock(directory, stale_after_s=stale_after_s, clear_stale=clear_stale)
    marker = directory / f"builder.{socket.gethostname()}.{os.getpid()}"
    marker.touch()
    try:
        load(
            name=EXTENSION_NAME,
            sources=[str(s) for s in SOURCES],
            extra_cflags=_flags(config),
            extra_ldflags=["-fopenmp"],
            build_directory=str(directory),
            is_python_module=False,
            verbose=verbose,
        )
    finally:
        marker.unlink(missing_ok=True)


def load_ops(
    *, verbose: bool = False, stale_after_s: Optional[float] = None, clear_stale: bool = True
) -> bool:
    """Build (or load the cached build of) the C++ ops once per process; ``True`` when they are usable.

    Builds with the bound :class:`OpsConfig` (``stale_after_s`` defaults to its
    ``stale_lock_s``). On failure (no compiler, compile error,
    ``OpsConfig.use_cpp`` false) logs one warning and returns ``False`` from then on; callers use the reference
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
        config = current_config()
        if not config.use_cpp:
            reason = "the C++ ops are turned off (OpsConfig.use_cpp is False, e.g. PICASSO_OPS_DISABLE_CPP is set)"
        elif _compiler(config) is None:
            reason = f"no C++ compiler ({config.cxx!r} is not on PATH)"
        else:
            started = time.perf_counter()
            stale_s = config.stale_lock_s if stale_after_s is None else stale_after_s
            try:
                _build(verbose, stale_s, clear_stale, config)
            except StaleLockError:
                raise
            except Exception as exc:  # a broken toolchain must not stop training: fall back, once, loudly
                reason = f"building the C++ ops failed: {type(exc).__name__}: {str(exc).strip()[-2000:]}"
            else:
                logger.info("picasso C++ ops ready in %.1f s (%s)", time.perf_counter() - started,
                            build_directory(config))
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
    """``python -m picasso_ops.ops.builder --prebuild``: build now, report where, exit 1 on failure.

    The command-line edge: binds ``OpsConfig.from_env(os.environ)`` before anything else.
    """
    parser = argparse.ArgumentParser(prog="python -m picasso_ops.ops.builder", description=__doc__.split("\n")[0])
    parser.add_argument("--prebuild", action="store_true", help="compile the C++ ops into the torch extensions cache")
    parser.add_argument("--check-lock", action="store_true", help="report (and with --clear, remove) a stale build lock")
    parser.add_argument("--clear", action="store_true", help="with --check-lock: remove a stale lock")
    parser.add_argument("--verbose", action="store_true", help="show the compiler commands")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
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
