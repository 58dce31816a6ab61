"""Build every C++ op of the project, and DeepSpeed's CPU comm op, up front: no test or launch races a JIT build.

    python -m sparse_scale.prebuild            # exit 0 when every op library is ready, 1 when one cannot be built
    python -m sparse_scale.prebuild --verbose  # with the compiler's commands

The project's one prebuild command. It imports the modules that declare an op library
(:data:`OP_MODULES`; each registers an :class:`~sparse_core.jit_build.OpLibrary`) and builds every
registered library with :func:`sparse_core.jit_build.load`, the loader the packages use at run time.

DeepSpeed JIT-builds ``deepspeed_shm_comm`` on the first ``init_distributed`` of a
multi-rank CPU job (~1 min) into ~/.cache/torch_extensions. A build killed midway
leaves a ``lock`` file there and every later build waits on it forever: this script
removes such a lock (of any op, ours or DeepSpeed's) with a warning naming it, instead of hanging. Staleness is judged by
``sparse_core.jit_build.lock_staleness``, the one stale-lock test of the project;
this edge binds ``picasso_ops.ops.configure(OpsConfig.from_env(os.environ))`` first.
"""
from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

from sparse_core import jit_build
from picasso_ops.ops.config import OpsConfig, configure, current_config

logger = logging.getLogger(__name__)

STALE_LOCK_S = OpsConfig().stale_lock_s  # no op of ours takes this long to build on 2 cores
# The modules that declare the project's op libraries (importing one registers its library).
OP_MODULES = ("picasso_ops.ops.builder", "moe_proto.ops")


def extensions_dir() -> Path:
    """Where torch's cpp_extension caches JIT builds (TORCH_EXTENSIONS_DIR, read by torch, or the default)."""
    from torch.utils.cpp_extension import _get_build_directory

    return Path(_get_build_directory("deepspeed_shm_comm", verbose=False)).parent


def stale_locks(root: Path, now: float | None = None, max_age_s: Optional[float] = None) -> list[Path]:
    """Stale lock files of the op folders under ``root`` (``jit_build.lock_staleness``): left by a killed build.

    ``max_age_s`` defaults to the bound ``OpsConfig.stale_lock_s``.

    Example::

        >>> stale_locks(Path("/nonexistent"))
        []
    """
    max_age_s = current_config().stale_lock_s if max_age_s is None else max_age_s
    return sorted(lock for lock in Path(root).glob("*/lock")
                  if jit_build.lock_staleness(lock.parent, max_age_s, now=now)[0] is not None)


def clear_stale_locks(root: Path) -> list[Path]:
    """Remove the stale locks under ``root`` (:func:`stale_locks`), each named in a warning; returns them.

    A lock left by a killed build of an op we never build ourselves (DeepSpeed's fused_adam) would
    otherwise hang the next build of that op, or fail this prebuild, on a machine nobody cleans.
    """
    stale = stale_locks(root)
    for lock in stale:
        jit_build.check_lock(lock.parent, stale_after_s=current_config().stale_lock_s, clear_stale=True, wait=False,
                             extension=lock.parent.name, log=logger)
    return stale


def build_op_libraries(*, verbose: bool = False, modules: Sequence[str] = OP_MODULES) -> list[str]:
    """Build (or find) every declared op library; returns the names of those that could not be built.

    Imports ``modules`` (each registers its library with :func:`sparse_core.jit_build.register`), then
    loads every registered library; a failure is logged once by the loader with its reason.

    Example::

        failed = build_op_libraries()   # [] when every library is ready
    """
    for name in modules:
        importlib.import_module(name)
    failed = []
    for library in jit_build.registered():
        if jit_build.load(library, verbose=verbose, clear_stale=True) is None:
            failed.append(library.name)
    return failed


def build_deepspeed_comm() -> None:
    """Build DeepSpeed's shm comm op on CPU (nothing to do on CUDA, or where DeepSpeed has none)."""
    from deepspeed.accelerator import get_accelerator

    if get_accelerator().device_name() != "cpu":
        return  # CUDA builds use NCCL; nothing to prebuild for the CPU path
    ds_builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if ds_builder is None or not ds_builder.is_compatible():
        logger.info("DeepSpeed's shm comm op is not available here; gloo is used without it")
        return
    t0 = time.monotonic()
    ds_builder.load(verbose=False)
    logger.info("DeepSpeed shm comm op ready in %s (%.0fs)", extensions_dir(), time.monotonic() - t0)


def main(argv: Optional[list[str]] = None) -> int:
    """Remove stale build locks, build every op library of the project and DeepSpeed's shm comm op.

    Exit 0 when all are ready, 1 when an op library of ours could not be built (its reason is logged).
    The command-line edge: binds ``OpsConfig.from_env(os.environ)`` first.
    """
    parser = argparse.ArgumentParser(prog="python -m sparse_scale.prebuild", description=__doc__.split("\n")[0])
    parser.add_argument("--verbose", action="store_true", help="show the compiler commands")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    configure(OpsConfig.from_env(os.environ))
    root = extensions_dir()
    clear_stale_locks(root)
    try:
        failed = build_op_libraries(verbose=args.verbose)
    except jit_build.StaleLockError as exc:
        logger.error("%s", exc)
        return 1
    build_deepspeed_comm()
    if failed:
        logger.error("could not build: %s (the reasons are logged above)", ", ".join(failed))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
