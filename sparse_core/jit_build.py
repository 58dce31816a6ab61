"""JIT builds of the project's C++ CPU ops: one cache folder per CPU kind, and no build that waits forever.

Shared by ``picasso_ops.ops.builder`` and ``moe_proto.ops`` (the packages may import
``sparse_core`` and nothing else of each other). Each op library is compiled with
``torch.utils.cpp_extension.load`` into ``<torch extensions root>/<name>-<build key>``,
the key naming the ``-march`` and, for ``-march=native``, a hash of this CPU's
instruction-set flags, so a home folder shared by mixed CPUs never loads a build made
for another kind.

torch serialises builds with a ``lock`` file and waits for it forever; a build killed
midway leaves it behind and every later build hangs (seen on our machines). Each build
here writes ``builder.<host>.<pid>`` beside the lock while it runs, so
:func:`lock_staleness` (the project's one stale-lock test) can tell a dead build's lock
(no live builder and older than ``stale_after_s``, or its builder known dead) from a slow
one, and :func:`check_lock` removes it with a warning or names it in a
:class:`StaleLockError`.

Example::

    directory = extensions_root() / f"my_ops-{build_key('native', cpu_isa_flags())}"
    module = build_extension(name="my_ops", sources=["a.cpp"], directory=directory,
                             extra_cflags=["-O3", "-march=native"], stale_after_s=600)
"""
from __future__ import annotations

import hashlib
import logging
import os
import socket
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

logger = logging.getLogger(__name__)

_POLL_S = 2.0


class StaleLockError(RuntimeError):
    """A build lock left by a killed build; the message names the file to delete."""

    def __init__(self, path: Path, age_s: float, extension: str = "the extension") -> None:
        self.path = path
        super().__init__(
            f"stale torch extension build lock {path} (age {age_s / 60:.1f} min, no live builder): "
            f"a previous build of {extension} was killed midway. Delete it and retry: rm {path}"
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


def build_key(march: str, isa_flags: Sequence[str] = ()) -> str:
    """What a cached build depends on beyond its sources: the ``-march`` and, when native, the CPU's ISA flags.

    Example::

        >>> build_key("x86-64-v2")
        'x86-64-v2'
        >>> build_key("native", ("sse2", "avx2"))[:7]
        'native-'
    """
    if march != "native":
        return "".join(c if c.isalnum() or c in "-_." else "_" for c in march) or "generic"
    digest = hashlib.sha1(" ".join(isa_flags).encode()).hexdigest()[:12]
    return f"native-{digest}"


def extensions_root() -> Path:
    """torch's default cache of JIT builds for this Python and flavour (``~/.cache/torch_extensions/py311_cpu``)."""
    import torch
    from torch.utils.cpp_extension import get_default_build_root

    cuda = torch.version.cuda
    flavour = f"cu{cuda.replace('.', '')}" if cuda else "cpu"
    return Path(get_default_build_root()) / f"py{sys.version_info.major}{sys.version_info.minor}_{flavour}"


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


def check_lock(directory: Path, *, stale_after_s: float, clear_stale: bool = True, wait: bool = True,
               extension: str = "the extension", log: logging.Logger = logger) -> None:
    """Make sure the build ``lock`` in ``directory`` will not block a build forever.

    No lock: return. A lock held by a live builder (a live marker, or a lock younger
    than ``stale_after_s``): wait for it to go (``wait=False``: return at once). A stale
    lock (:func:`lock_staleness`): remove it with a warning on ``log``, or raise
    :class:`StaleLockError` naming it when ``clear_stale`` is false.

    Example::

        >>> check_lock(Path("/nonexistent/dir"), stale_after_s=600)  # no lock: nothing to do
    """
    lock = Path(directory) / "lock"
    while True:
        if not lock.exists():
            return
        age, dead = lock_staleness(Path(directory), stale_after_s)
        if age is not None:
            if not clear_stale:
                raise StaleLockError(lock, age, extension)
            log.warning("removing stale build lock %s (age %.1f min, no live builder; a build was killed midway)",
                        lock, age / 60)
            lock.unlink(missing_ok=True)
            for marker in dead:
                marker.unlink(missing_ok=True)
            return
        if not wait:
            return
        log.info("waiting for another build of %s to release %s", extension, lock)
        time.sleep(_POLL_S)


def build_extension(*, name: str, sources: Sequence[str], directory: Path, extra_cflags: Sequence[str],
                    stale_after_s: float, extra_ldflags: Sequence[str] = (), clear_stale: bool = True,
                    verbose: bool = False, is_python_module: bool = True, log: logging.Logger = logger) -> object:
    """``torch.utils.cpp_extension.load`` into ``directory`` after :func:`check_lock`, with a builder marker.

    Returns what ``load`` returns (the module, or None with ``is_python_module=False``).
    """
    from torch.utils import cpp_extension

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    check_lock(directory, stale_after_s=stale_after_s, clear_stale=clear_stale, extension=name, log=log)
    marker = directory / f"builder.{socket.gethostname()}.{os.getpid()}"
    marker.touch()
    try:
        return cpp_extension.load(name=name, sources=[str(s) for s in sources], extra_cflags=list(extra_cflags),
                                  extra_ldflags=list(extra_ldflags), build_directory=str(directory),
                                  is_python_module=is_python_module, verbose=verbose)
    finally:
        marker.unlink(missing_ok=True)
