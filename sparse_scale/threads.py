"""torch threads per rank: the cores this process may use over the ranks sharing its node, unless the user chose.

The ``deepspeed`` launcher leaves ``OMP_NUM_THREADS`` unset, so each rank starts as many torch
threads as the node has cores: N ranks on N cores then run N x N threads and every small op
waits for a core. torchrun sets 1; Slurm and mpirun set nothing either.

Example::

    >>> threads_per_rank(cores=16, ranks_on_node=4)
    4
    >>> choose_threads(requested=0, environ={}, cores=2, ranks_on_node=2, current=2)
    (1, 'one per core over 2 ranks on this node (OMP_NUM_THREADS unset)')
"""
from __future__ import annotations

import logging
import os
from typing import Mapping

logger = logging.getLogger(__name__)


def available_cores() -> int:
    """The cores this process may run on (its CPU affinity, else the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def threads_per_rank(cores: int, ranks_on_node: int) -> int:
    """``cores // ranks_on_node``, at least 1."""
    return max(1, cores // max(1, ranks_on_node))


def choose_threads(requested: int, environ: Mapping[str, str], cores: int, ranks_on_node: int,
                   current: int) -> tuple[int | None, str]:
    """``(threads to set or None to leave torch's, why)``: the rule, as a pure function.

    ``requested`` > 0 (a ``--threads`` flag) wins; a set ``OMP_NUM_THREADS`` is the user's choice;
    a ``current`` thread count already at or below the fair share was set by the user or is fine.
    """
    if requested > 0:
        return requested, f"{requested} as requested"
    if environ.get("OMP_NUM_THREADS", "").strip():
        return None, f"OMP_NUM_THREADS={environ['OMP_NUM_THREADS']} set by the user"
    share = threads_per_rank(cores, ranks_on_node)
    if current <= share:
        return None, f"torch already runs {current} thread(s), within {cores} core(s) over {ranks_on_node} rank(s)"
    return share, f"one per core over {ranks_on_node} ranks on this node (OMP_NUM_THREADS unset)"


def set_default_threads(ranks_on_node: int, requested: int = 0, environ: Mapping[str, str] | None = None) -> int:
    """Apply :func:`choose_threads` to torch in this process and log the choice once; returns torch's thread count.

    Example::

        set_default_threads(ranks_on_node=2)      # 2 cores, 2 ranks, OMP_NUM_THREADS unset -> 1
    """
    import torch

    threads, why = choose_threads(requested, os.environ if environ is None else environ, available_cores(),
                                  ranks_on_node, torch.get_num_threads())
    if threads is not None and threads != torch.get_num_threads():
        torch.set_num_threads(threads)
        logger.info("torch threads per rank: %d (%s; set OMP_NUM_THREADS to choose)", threads, why)
    else:
        logger.debug("torch threads per rank: %d (%s)", torch.get_num_threads(), why)
    return torch.get_num_threads()
