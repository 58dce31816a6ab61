"""Build DeepSpeed's CPU comm op once, up front, so no test or launch races a JIT build.

    python -m sparse_scale.prebuild

DeepSpeed JIT-builds ``deepspeed_shm_comm`` on the first ``init_distributed`` of a
multi-rank CPU job (~1 min) into ~/.cache/torch_extensions. A build killed midway
leaves a ``lock`` file there and every later build waits on it forever: this script
names such a lock instead of hanging.
"""
from __future__ import annotations

import logging
import sys
import time
from pathlib import Path

logger = logging.getLogger(__name__)

STALE_LOCK_S = 600.0  # no op of ours takes this long to build on 2 cores


def extensions_dir() -> Path:
    """Where torch's cpp_extension caches JIT builds (TORCH_EXTENSIONS_DIR or the default)."""
    from torch.utils.cpp_extension import _get_build_directory

    return Path(_get_build_directory("deepspeed_shm_comm", verbose=False)).parent


def stale_locks(root: Path, now: float | None = None, max_age_s: float = STALE_LOCK_S) -> list[Path]:
    """Lock files under ``root`` older than ``max_age_s``: left by a build that was killed."""
    now = time.time() if now is None else now
    return sorted(p for p in root.glob("*/lock") if now - p.stat().st_mtime > max_age_s)


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    root = extensions_dir()
    stale = stale_locks(root)
    if stale:
        print(f"stale JIT build lock(s) from a killed build; delete them and rerun: {[str(p) for p in stale]}",
              file=sys.stderr)
        return 1
    from deepspeed.accelerator import get_accelerator

    if get_accelerator().device_name() != "cpu":
        return 0  # CUDA builds use NCCL; nothing to prebuild for the CPU path
    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is None or not builder.is_compatible():
        logger.info("DeepSpeed's shm comm op is not available here; gloo is used without it")
        return 0
    t0 = time.monotonic()
    builder.load(verbose=False)
    logger.info("DeepSpeed shm comm op ready in %s (%.0fs)", root, time.monotonic() - t0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
