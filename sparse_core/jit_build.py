"""JIT builds of the project's C++ CPU ops: one loader, one cache folder per CPU kind, no build that waits forever.

Each package declares its op library once, as an :class:`OpLibrary` passed to :func:`register`
(``picasso_ops.ops.builder``, ``moe_proto.ops``; the packages may import ``sparse_core`` and nothing
else of each other), and loads it with :func:`load`: built once per process, or None after one
warning when it cannot be (the caller runs its torch code). ``python -m sparse_scale.prebuild``
builds every declared library. Each op library is compiled with
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

    LIBRARY = register(OpLibrary(name="my_ops_cpu", package="my_pkg", sources=(Path("a.cpp"),)),
                       declared_by=__name__)
    module = load(LIBRARY)   # the module, or None after one warning: run the torch code
"""
from __future__ import annotations

import hashlib
import logging
import os
import shutil
import socket
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

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


# --- declared op libraries: one description per package, one loader, one prebuild -------------------------------


@dataclass(frozen=True)
class BuildSettings:
    """How an op library is built on this machine, as its package's settings say at load time.

    ``march``: the ``-march`` flag (``""``: none); ``cxx``: the compiler looked up on ``PATH`` before
    building; ``root``: the cache folder's parent (None: :func:`extensions_root`); ``stale_after_s``: the
    age of a build lock with no live builder that counts as dead; ``disabled``: why the package turned its
    C++ ops off (None: it did not).

    Example::

        >>> BuildSettings(march="x86-64-v2").march
        'x86-64-v2'
    """

    march: str = "native"
    cxx: str = "c++"
    root: Optional[Path] = None
    stale_after_s: float = 600.0
    disabled: Optional[str] = None


@dataclass(frozen=True)
class OpLibrary:
    """One package's C++ op library, declared once and loaded by :func:`load` (built by ``sparse_scale.prebuild``).

    ``name`` is the extension's name (its cache folder is ``<root>/<name>-<build key>``), ``package`` the
    package that owns it (named in messages; its logger gets them), ``cflags``/``ldflags`` the flags
    besides ``-march``, ``fallback`` what runs without the library (for the one warning), and
    ``settings`` a function returning the :class:`BuildSettings` in force (read at each load, so a package
    whose settings are bound at run time, like ``picasso_ops.ops.configure``, is followed), and
    ``march_index`` where ``-march`` goes among ``cflags`` (None: last; the flags' order is part of a
    cached build's identity, so a library keeps the order it was first built with).

    Example::

        LIBRARY = register(OpLibrary(name="my_ops_cpu", package="my_pkg", sources=(Path("a.cpp"),),
                                     cflags=("-O3",), fallback="the torch code runs"))
        module = load(LIBRARY)   # built once per process; None after one warning if it cannot be
    """

    name: str
    package: str
    sources: tuple[Path, ...]
    cflags: tuple[str, ...] = ("-O3",)
    ldflags: tuple[str, ...] = ()
    is_python_module: bool = True
    fallback: str = "the torch paths run (slower on CPU)"
    settings: Callable[[], BuildSettings] = BuildSettings
    march_index: Optional[int] = None

    def __post_init__(self) -> None:
        if not self.name or not all(c.isalnum() or c == "_" for c in self.name):
            raise ValueError(f"OpLibrary.name must be a non-empty identifier (letters, digits, _), got {self.name!r}")
        if not self.sources:
            raise ValueError(f"OpLibrary {self.name!r}: sources is empty; name the .cpp files to compile")

    def flags(self, settings: Optional[BuildSettings] = None) -> list[str]:
        """The compiler flags for ``settings`` (default: the settings in force): ``cflags`` then ``-march``."""
        settings = self.settings() if settings is None else settings
        flags = list(self.cflags)
        if settings.march:
            flags.insert(len(flags) if self.march_index is None else self.march_index, f"-march={settings.march}")
        return flags

    def directory(self, settings: Optional[BuildSettings] = None, cpuinfo: Optional[str] = None) -> Path:
        """``<root>/<name>-<build key>``: one cache folder per ``-march`` and CPU kind (``cpuinfo``: text to read)."""
        settings = self.settings() if settings is None else settings
        root = extensions_root() if settings.root is None else Path(settings.root)
        flags = cpu_isa_flags(cpuinfo) if settings.march == "native" else ()
        return root / f"{self.name}-{build_key(settings.march, flags)}"

    def build_identity(self) -> tuple:
        """What makes two declarations the same library: everything but the settings function."""
        return (self.name, self.package, tuple(map(str, self.sources)), self.cflags, self.ldflags,
                self.is_python_module, self.march_index)

    @property
    def logger(self) -> logging.Logger:
        """The logger of the module that declared the library (``<package>`` when none)."""
        return logging.getLogger(_DECLARED_BY.get(self.name, self.package))


_REGISTRY: dict[str, OpLibrary] = {}
_DECLARED_BY: dict[str, str] = {}
_STATES: dict[str, dict] = {}
_load_lock = threading.Lock()


def register(library: OpLibrary, *, declared_by: Optional[str] = None) -> OpLibrary:
    """Declare ``library`` (once per name) and return it.

    The same declaration again (a module reloaded, or run as ``__main__``) replaces the first; another
    library under a taken name is refused.

    ``declared_by``: the declaring module's name, whose logger gets the library's messages.

    Example::

        LIBRARY = register(OpLibrary(name="my_ops_cpu", package="my_pkg", sources=(Path("a.cpp"),)), declared_by=__name__)
    """
    known = _REGISTRY.get(library.name)
    if known is not None and known.build_identity() != library.build_identity():
        raise ValueError(f"op library {library.name!r} is declared twice with different descriptions "
                         f"(by {_DECLARED_BY.get(library.name, known.package)} and {declared_by or library.package})")
    _REGISTRY[library.name] = library
    _DECLARED_BY[library.name] = declared_by or library.package
    return library


def registered() -> tuple[OpLibrary, ...]:
    """Every declared op library, in declaration order (those of the packages imported so far)."""
    return tuple(_REGISTRY.values())


def load_state(library: OpLibrary) -> dict:
    """The per-process state of ``library``'s load: ``{"module": what load returned or None, "failed": reason or None}``."""
    state = _STATES.get(library.name)
    if state is None:
        state = _STATES.setdefault(library.name, {"module": None, "failed": None})
    return state


def build(library: OpLibrary, *, settings: Optional[BuildSettings] = None, verbose: bool = False,
          clear_stale: bool = True, stale_after_s: Optional[float] = None) -> object:
    """Compile (or find the cached build of) ``library`` now, with no fallback: errors propagate.

    Returns what ``torch.utils.cpp_extension.load`` returns (the module, or the library's path when
    ``is_python_module`` is false).
    """
    settings = library.settings() if settings is None else settings
    return build_extension(name=library.name, sources=[str(s) for s in library.sources],
                           directory=library.directory(settings), extra_cflags=library.flags(settings),
                           extra_ldflags=library.ldflags,
                           stale_after_s=settings.stale_after_s if stale_after_s is None else stale_after_s,
                           clear_stale=clear_stale, verbose=verbose, is_python_module=library.is_python_module,
                           log=library.logger)


def load(library: OpLibrary, *, verbose: bool = False, clear_stale: bool = True,
         stale_after_s: Optional[float] = None) -> Optional[object]:
    """``library`` built and loaded once per process; None (after one warning naming why) when it cannot be.

    Turned off by its package's settings, no compiler on ``PATH``, or a failed build: one warning on the
    library's logger with the reason and the fix (``python -m sparse_scale.prebuild``), then None from then
    on (until :func:`forget_failure`), so callers run their torch code. A :class:`StaleLockError`
    (``clear_stale=False``) is raised, not swallowed: the user must delete the lock it names.

    Example::

        module = load(LIBRARY)   # the module, or None: run the torch expression
    """
    state = load_state(library)
    if state["module"] is not None or state["failed"] is not None:
        return state["module"]
    with _load_lock:
        if state["module"] is not None or state["failed"] is not None:
            return state["module"]
        settings = library.settings()
        log = library.logger
        reason = settings.disabled
        if reason is None and shutil.which(settings.cxx) is None:
            reason = f"no C++ compiler ({settings.cxx!r} is not on PATH)"
        if reason is None:
            started = time.perf_counter()
            try:
                module = build(library, settings=settings, verbose=verbose, clear_stale=clear_stale,
                               stale_after_s=stale_after_s)
            except StaleLockError:
                raise
            except Exception as exc:  # a broken toolchain must not stop training: fall back, once, loudly
                reason = f"building them failed: {type(exc).__name__}: {str(exc).strip()[-2000:]}"
            else:
                state["module"] = module if module is not None else library.name
                log.info("%s C++ CPU ops ready in %.1f s (%s)", library.package, time.perf_counter() - started,
                         library.directory(settings))
                return state["module"]
        state["failed"] = reason
        log.warning("%s: the C++ CPU ops are unavailable; %s. Reason: %s. Fix: install g++ and ninja, then run "
                    "`python -m sparse_scale.prebuild`.", library.package, library.fallback, reason)
        return None


def loaded(library: OpLibrary) -> bool:
    """Whether ``library`` is loaded in this process (does not trigger a build)."""
    return load_state(library)["module"] is not None


def forget_failure(library: OpLibrary) -> None:
    """Forget a failed load so the next :func:`load` tries again (tests, or after installing a compiler)."""
    with _load_lock:
        load_state(library)["failed"] = None
