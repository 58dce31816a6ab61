"""The end of a torch.distributed run: destroy the process groups so that the process exits with its own code.

Why a function of its own: a gloo worker thread drops the tensors of a collective just *after* ``wait()``
has returned. When the script ends at once, that drop can come while the interpreter is finalizing; it
takes the GIL to free the tensors' Python objects, Python ends the thread with ``pthread_exit``, and the
unwind through torch's C++ frames aborts a process whose run had succeeded ("terminate called without an
active exception", SIGABRT; the deepspeed launcher reports rc 250). ``destroy_process_group()`` alone joins
only the workers of groups nothing else refers to; DeepSpeed and MoE layers keep their expert and
data-parallel groups alive, and their workers with them.

    import sparse_scale
    ...train...
    sparse_scale.shutdown_distributed()     # every rank, last line of the script
"""
from __future__ import annotations

import datetime
import logging
import time

logger = logging.getLogger(__name__)

SETTLE_S = 0.05  # GIL released this long at the end: a worker still dropping older work finishes meanwhile
RELEASE_DEADLINE_S = 5.0  # longest wait for the workers to drop the flush tensors
FLUSH_TIMEOUT_S = 300.0  # longest wait for the other ranks to reach the flush of a group


class ShutdownError(RuntimeError):
    """The flush found a group whose other ranks did not come (a rank failed or never called it)."""


def shutdown_distributed(flush: bool = False, settle_s: float = SETTLE_S,
                         flush_timeout_s: float = FLUSH_TIMEOUT_S) -> None:
    """Finish every process group's pending work, then destroy all groups (a no-op without torch.distributed).

    Args:
        flush: ``False`` (local, safe on any rank at any time): destroy the groups and release the GIL for
            ``settle_s``, so that a worker still dropping finished work does so while the interpreter runs.
            ``True`` (a collective, for scripts where every rank reaches this line after a run that
            succeeded): first, on each group this rank belongs to and in creation order, a barrier (it
            waits for every collective still in flight, ``async_op=True`` ones never waited for included)
            and one small all_reduce, waited for until the worker that ran it has let go of its tensors.
            The local form assumes the script waited for its collectives, as DeepSpeed's step does.
        settle_s: seconds the GIL is released after the groups are destroyed.
        flush_timeout_s: longest wait for the other ranks at each step of a flush; past it
            :class:`ShutdownError` names the group (the groups are left as they are).

    Example::

        engine, *_ = sparse_scale.initialize(model=model, config="ds_config.json")
        for batch in loader: ...
        sparse_scale.shutdown_distributed()
    """
    import torch.distributed as dist

    if settle_s < 0 or flush_timeout_s <= 0:
        raise ValueError(f"shutdown_distributed: settle_s={settle_s} must be >= 0 and flush_timeout_s="
                         f"{flush_timeout_s} > 0")
    if not (dist.is_available() and dist.is_initialized()):
        return
    if flush:
        for index, group in enumerate(_member_groups()):
            _flush(group, index, flush_timeout_s)
        from sparse_scale.deepspeed_shm import release_shm_segment

        release_shm_segment()  # a run started by plain deepspeed.init_distributed left it in /dev/shm
    dist.destroy_process_group()
    time.sleep(settle_s)


def _member_groups() -> list:
    """This rank's gloo groups, in creation order (the same order on every rank: new_group is collective).

    Only gloo's workers drop tensors after ``wait()``; a flush's CPU tensor is no NCCL operand either.
    """
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    return [g for g in c10d._world.pg_map if dist.get_backend(g) == "gloo"]  # non-members get no entry


def _flush(group, index: int, timeout_s: float = FLUSH_TIMEOUT_S) -> bool:
    """Wait for the group's collectives in flight, then for its workers to let go; ``False``: one still holds one."""
    import torch
    import torch.distributed as dist

    mark = torch.zeros(1)
    steps = (("barrier", lambda: dist.barrier(group=group, async_op=True)),  # gloo's barrier first waits for
             ("all_reduce", lambda: dist.all_reduce(mark, group=group, async_op=True)))  # the collectives in flight
    for what, start in steps:
        try:
            start().wait(timeout=datetime.timedelta(seconds=timeout_s))
        except RuntimeError as exc:
            raise ShutdownError(
                f"shutdown_distributed(flush=True) on rank {dist.get_rank()}: the {what} of gloo group {index} "
                f"(ranks {dist.get_process_group_ranks(group)}) did not finish within {timeout_s:.0f} s: another "
                f"rank failed or does not call shutdown_distributed(flush=True) ({exc})") from exc
    deadline = time.monotonic() + RELEASE_DEADLINE_S
    while mark._use_count() > 1 and time.monotonic() < deadline:  # the worker that ran it still holds the work
        time.sleep(0.001)
    if mark._use_count() > 1:
        logger.warning("a %s worker still holds a finished all_reduce %.0f s after it returned; the process "
                       "may abort at exit", type(group).__name__, RELEASE_DEADLINE_S)
        return False
    return True
