"""DeepSpeed's CPU shared-memory all-reduce leaves a /dev/shm segment per rank behind; release it once mapped.

On CPU with every rank on one node (``LOCAL_SIZE`` equal to the world size), ``deepspeed.init_distributed``
creates ``/dev/shm/deepspeed_allreduce_buffer_<uid>_<MASTER_ADDR>_<MASTER_PORT>_<rank>`` (about 69 MB) and maps
every rank's segment; DeepSpeed never unlinks them, so each run leaves ``local ranks x 69 MB`` of RAM-backed
tmpfs behind until the machine reboots (a test suite or a sweep fills the memory). Once every rank has mapped
every segment, unlinking the names takes nothing from the running job: the memory goes back to the system
when the last process unmaps it.

    release_shm_segment()   # every rank, after deepspeed.init_distributed (sparse_scale's entry points call it)
"""
from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Mapping

logger = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
PREFIX = "deepspeed_allreduce_buffer"  # DeepSpeed's SHM_BUFFER_NAME (csrc/cpu/comm/shm.cpp)


def segment_path(rank: int, environ: Mapping[str, str] = os.environ) -> Path:
    """Where DeepSpeed's shm all-reduce put ``rank``'s segment, from the rendezvous address it was made with.

    Example::

        >>> segment_path(1, {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}).name.endswith("_127.0.0.1_29500_1")
        True
    """
    addr, port = environ.get("MASTER_ADDR", ""), environ.get("MASTER_PORT", "")
    return SHM_DIR / f"{PREFIX}_{os.getuid()}_{addr}_{port}_{rank}"


def release_shm_segment() -> bool:
    """Unlink this rank's DeepSpeed shm segment after a barrier (a collective where DeepSpeed made segments).

    Returns whether a segment was unlinked. Where DeepSpeed made none (several nodes, no CPU shm op,
    torch.distributed started without DeepSpeed) it returns ``False`` without a collective; the test is
    DeepSpeed's own (its comm op loaded and ``LOCAL_SIZE`` equal to the world size), the same on every rank.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or not _deepspeed_made_segments(dist.get_world_size()):
        return False
    dist.barrier()  # every rank has left deepspeed.init_distributed, so every rank has mapped every segment
    path = segment_path(dist.get_rank())
    try:
        path.unlink()
    except FileNotFoundError:  # released already, by an earlier call
        return False
    logger.debug("released DeepSpeed's shm all-reduce segment %s (still mapped by the job)", path)
    return True


def _deepspeed_made_segments(world_size: int) -> bool:
    """DeepSpeed's condition for its shm all-reduce (deepspeed/comm/torch.py, csrc/cpu/comm/shm_interface.cpp)."""
    try:
        from deepspeed.comm import comm as ds_comm
    except ImportError:
        return False
    backend = getattr(ds_comm, "cdb", None)
    local_size = os.environ.get("LOCAL_SIZE", "")
    return (getattr(backend, "shm_comm_op", None) is not None and local_size.isdigit()
            and int(local_size) == world_size)
