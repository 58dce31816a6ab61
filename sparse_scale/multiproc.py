"""Run one function on N real processes over gloo on 127.0.0.1, with a hard deadline.

    >>> from sparse_scale.multiproc import run_distributed
    >>> run_distributed(my_fn, world_size=2, args=(3,), timeout_s=30)   # my_fn(rank, world_size, 3)
    [result_of_rank0, result_of_rank1]

The first rank to fail is reported with its traceback and every other rank is
killed; a rank that dies without reporting (segfault, os._exit) or a run that
passes its deadline is an error too, so a caller can never hang.

Ranks start as fresh interpreters (``spawn``), each importing torch and the rest
again (~6 s of CPU per rank). A test suite can instead fork them from a server
that has imported the heavy libraries once (the server never runs a rank):

    >>> from sparse_scale.multiproc import start_ranks_from_forkserver
    >>> start_ranks_from_forkserver(["torch", "deepspeed"])   # once, before the first run_distributed
"""
from __future__ import annotations

import atexit
import datetime
import faulthandler
import logging
import multiprocessing as mp
import os
import pickle
import queue
import signal
import socket
import sys
import time
import traceback
from multiprocessing.reduction import DupFd
from typing import Any, Callable, Sequence

logger = logging.getLogger(__name__)

_start = {"method": "spawn"}  # how ranks start; start_ranks_from_forkserver switches it for this process


class DistributedRunError(RuntimeError):
    """A rank raised, died, or the run passed its deadline."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def loopback_env(rank: int, world_size: int, port: int) -> dict[str, str]:
    """The environment torch.distributed / deepspeed.comm expect, pinned to loopback."""
    return {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(world_size),
        "GLOO_SOCKET_IFNAME": "lo",
    }


def start_ranks_from_forkserver(preload: Sequence[str]) -> None:
    """Start the ranks of later ``run_distributed`` calls by forking a server that has imported ``preload`` once.

    Call it before the first ``run_distributed`` of the process (the server starts then, with the
    environment of that moment). Each rank still starts clean: the server only imports, never runs
    a rank, and a rank takes the caller's current environment, working directory, ``sys.path`` and
    stdout/stderr as a spawned one would, and runs its atexit handlers before it exits.

        >>> start_ranks_from_forkserver(["torch", "deepspeed", "torch._dynamo"])
    """
    names = list(preload)
    bad = [n for n in names if not isinstance(n, str) or not n]
    if bad:
        raise ValueError(f"start_ranks_from_forkserver: preload must name modules, got {bad!r} in {names!r}")
    mp.get_context("forkserver").set_forkserver_preload(names)
    _start["method"] = "forkserver"
    logger.info("ranks start from a forkserver that preloads %s", names)


class _CallerFd:
    """A file descriptor of the caller that arrives in the rank as its own copy (an int), whatever the start method.

    ``_CallerFd(1)`` pickled while a rank starts (the only time it is pickled) becomes that rank's copy of fd 1.
    """

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self):
        return (_detach, (DupFd(self.fd),))  # DupFd hands the fd to the starting rank only while it is pickled


def _detach(inherited: Any) -> int:
    return inherited.detach()


def _child(fn, rank, world_size, port, args, kwargs, init_process_group, pg_timeout_s, threads, results,
           env, stdio, forked):
    # a forked rank inherits the server's environment and stdio, not the caller's: take the caller's
    os.environ.clear()
    os.environ.update(env)
    os.environ.update(loopback_env(rank, world_size, port))
    for target, fd in zip((1, 2), stdio):
        if fd != target:
            os.dup2(fd, target)
            os.close(fd)
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # a rank past its deadline shows where it was stuck
    try:
        import torch

        torch.set_num_threads(threads)
        if init_process_group:
            import torch.distributed as dist

            dist.init_process_group(
                "gloo",
                init_method=f"tcp://127.0.0.1:{port}",
                rank=rank,
                world_size=world_size,
                timeout=datetime.timedelta(seconds=pg_timeout_s),
            )
        out = fn(rank, world_size, *args, **kwargs)
        # plain pickle copies tensors: torch's queue would share them through fds that die with this process
        results.put((rank, True, pickle.dumps(out)))
    except BaseException:  # report everything, including SystemExit and KeyboardInterrupt
        results.put((rank, False, traceback.format_exc()))
    finally:
        if init_process_group:
            from sparse_scale.shutdown import SETTLE_S, shutdown_distributed

            # local: a rank's fn may end while its peers never reach a flush; a forked rank ends in os._exit,
            # which skips the interpreter teardown that settling protects
            shutdown_distributed(flush=False, settle_s=0.0 if forked else SETTLE_S)
        if forked:
            atexit._run_exitfuncs()  # a forked child ends in os._exit, which skips them; a spawned one runs them


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    args: Sequence[Any] = (),
    kwargs: dict[str, Any] | None = None,
    timeout_s: float = 45.0,
    init_process_group: bool = True,
    threads_per_rank: int = 1,
    expect_exit: dict[int, int] | None = None,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` spawned processes.

    ``fn`` must be importable (module level). Returns the per-rank results in rank
    order. Raises DistributedRunError on the first failure or at ``timeout_s``.
    ``expect_exit={rank: code}`` names ranks that must die with that exit code and
    no result (fault-injection tests); their entry in the returned list is ``None``.
    """
    expect_exit = dict(expect_exit or {})
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    method = _start["method"]
    ctx = mp.get_context(method)
    results = ctx.Queue()
    port = free_port()
    pg_timeout_s = max(5.0, timeout_s)
    for stream in (sys.stdout, sys.stderr):
        stream.flush()  # what the caller wrote so far comes before the ranks' output
    procs = [
        ctx.Process(
            target=_child,
            args=(fn, r, world_size, port, tuple(args), dict(kwargs or {}), init_process_group,
                  pg_timeout_s, threads_per_rank, results, dict(os.environ), (_CallerFd(1), _CallerFd(2)),
                  method == "forkserver"),
            name=f"rank{r}",
            daemon=True,
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout_s
    outputs: dict[int, Any] = {}
    try:
        while len(outputs) < world_size:
            for r, code in expect_exit.items():
                if r not in outputs and procs[r].exitcode is not None:
                    if procs[r].exitcode != code:
                        raise DistributedRunError(
                            f"rank {r} was expected to exit with code {code}, got {procs[r].exitcode}")
                    outputs[r] = None
            try:
                rank, ok, payload = results.get(timeout=0.2)
            except queue.Empty:
                dead = [(r, p.exitcode) for r, p in enumerate(procs)
                        if r not in outputs and r not in expect_exit and p.exitcode is not None]
                if dead:
                    # A process may have exited right after putting its result: drain once more.
                    try:
                        rank, ok, payload = results.get(timeout=1.0)
                    except queue.Empty:
                        r, code = dead[0]
                        raise DistributedRunError(
                            f"rank {r} of {world_size} exited with code {code} without reporting a result"
                        ) from None
                elif time.monotonic() > deadline:
                    missing = [r for r in range(world_size) if r not in outputs]
                    _dump_stacks([procs[r] for r in missing])
                    raise DistributedRunError(
                        f"deadline of {timeout_s:.0f}s passed; ranks {missing} of {world_size} had not finished "
                        "(their Python stacks are on stderr)"
                    ) from None
                else:
                    continue
            if not ok:
                raise DistributedRunError(f"rank {rank} of {world_size} failed:\n{payload}")
            result = pickle.loads(payload)
            if rank in expect_exit:
                raise DistributedRunError(f"rank {rank} was expected to exit with code {expect_exit[rank]} "
                                          f"but returned {result!r}")
            outputs[rank] = result
    finally:
        _stop_all(procs)
    return [outputs[r] for r in range(world_size)]


def _dump_stacks(procs: list) -> None:
    """Ask the live ``procs`` to write every thread's Python stack to their stderr (the caller's), and wait for it."""
    asked = [p for p in procs if p.is_alive()]
    for p in asked:
        try:
            os.kill(p.pid, signal.SIGUSR1)
        except ProcessLookupError:
            pass
    if asked:
        time.sleep(1.0)  # faulthandler writes from the signal handler; give it a moment before the kill


def _stop_all(procs: list) -> None:
    for p in procs:
        p.join(timeout=2.0)
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(timeout=2.0)
        if p.is_alive():
            p.kill()
            p.join(timeout=2.0)
