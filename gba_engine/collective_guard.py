"""Deadlines for the waits of a gba job that run outside gba_engine: collectives the servers never join.

The server ranks serve the whole job inside ``gba_engine.initialize`` and never join a collective, so a
collective over a group that includes them (the default, world group above all) can never complete on a
worker: before, the workers waited in it for the process group's timeout (30 min for DeepSpeed's default
group) while the servers waited for their next command, and the job printed nothing. During a job:

* :class:`DefaultGroupDeadline` bounds every collective over the default group by ``gba.timeout_s``
  (the process group's own timeout: gloo raises, NCCL's watchdog aborts) and gives the previous timeout
  back when the job ends on that rank (a worker's ``close``, the end of a server's loop), so that
  collectives after the job wait as long as before;
* :class:`CollectiveWatch` (a daemon thread on each worker) looks at the training thread's Python stack
  every ``min(heartbeat_s, 0.5)`` s. Once it sees the same call of a ``torch.distributed`` collective over
  a group that includes a server rank in two samples, it logs an error naming the collective, the group,
  the module of the model that called it (its path, e.g. ``model.emb``, its class and method) and the
  call site, and publishes it as the job's ``stuck`` record (:class:`~gba_engine.protocol.StuckRecord`);
* every server's waits (:func:`raise_if_stuck`: the loop between commands and every serving tick) read
  that record and raise :class:`StuckCollectiveError` with it, within a poll. A server waiting for the
  next command stays legitimate for the whole job while the workers are alive and not stuck (a sync job
  without server tables sends nothing for hours); the record is what makes that wait end.

The worker itself gets the process group's error (gloo: "Timed out waiting ...ms for recv operation")
when ``timeout_s`` ends, after the watch's error line that says why.

Example::

    deadline = DefaultGroupDeadline(gba.timeout_s)      # every rank, before the job's first wait
    watch = CollectiveWatch(rt, model)                  # workers: from now until close
    ...
    watch.stop(); deadline.restore()
"""
from __future__ import annotations

import datetime
import logging
import os
import sys
import threading
import time
import weakref
from types import FrameType
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from .model_check import REPLACEMENT
from .protocol import StuckRecord, stuck_key

if TYPE_CHECKING:
    from .ps import PSRuntime

logger = logging.getLogger(__name__)

__all__ = ["CollectiveWatch", "DefaultGroupDeadline", "StuckCollectiveError", "default_group_timeout",
           "raise_if_stuck"]

# torch.distributed's collectives (distributed_c10d.py); point-to-point ops are the servers' own traffic
COLLECTIVES = frozenset({
    "all_reduce", "all_reduce_coalesced", "all_gather", "all_gather_object", "all_gather_into_tensor",
    "all_gather_coalesced", "_all_gather_base", "broadcast", "broadcast_object_list", "barrier", "monitored_barrier",
    "reduce", "reduce_scatter", "reduce_scatter_tensor", "_reduce_scatter_base", "all_to_all", "all_to_all_single",
    "gather", "gather_object", "scatter", "scatter_object_list",
})
_C10D = os.path.join("torch", "distributed", "distributed_c10d.py")
# wrappers, not callers (step_clock.py times DeepSpeed's collectives for auto mode's detector)
_PLUMBING = (os.path.join("torch", "distributed", ""), os.path.join("deepspeed", "comm", ""),
             os.path.join("gba_engine", "step_clock.py"))


class StuckCollectiveError(RuntimeError):
    """A worker waits in a collective the parameter servers never join: the job cannot go on.

    ``worker`` is the stuck worker's rank; the message says which collective, over which group, called
    from which module of the model and where, and since when.

    Example::

        try:
            gba_engine.initialize(model=model, config=cfg)       # on a server rank
        except StuckCollectiveError as exc:
            exc.worker                                           # 0
    """

    def __init__(self, message: str, worker: int) -> None:
        super().__init__(message)
        self.worker = worker

    def __reduce__(self):  # picklable with its field (multiprocessing reports it)
        return (type(self), (str(self), self.worker))


def _default_backends() -> list:
    group = dist.distributed_c10d._get_default_group()
    out = []
    for device in group._device_types:
        try:
            out.append(group._get_backend(device))
        except RuntimeError:
            continue
    return out


def default_group_timeout() -> datetime.timedelta | None:
    """The timeout of collectives over the default process group now (None when torch does not tell it).

    Example::

        default_group_timeout()        # datetime.timedelta(seconds=1800) after deepspeed.init_distributed
    """
    if not dist.is_available() or not dist.is_initialized():
        return None
    for backend in _default_backends():
        timeout = getattr(getattr(backend, "options", None), "_timeout", None)
        if isinstance(timeout, datetime.timedelta):
            return timeout
    return None


class DefaultGroupDeadline:
    """Collectives over the default process group time out after ``timeout_s`` until :meth:`restore`.

    Local to this rank (no collective). Where torch cannot change the timeout (no ``_set_pg_timeout``, a
    backend other than gloo/NCCL) it logs a warning and changes nothing; the watch still names a stuck
    collective to the servers.

    Example::

        deadline = DefaultGroupDeadline(60.0)
        dist.all_reduce(t)              # a peer that never joins: RuntimeError after 60 s
        deadline.restore()              # the timeout of before (DeepSpeed's default: 30 min)
    """

    def __init__(self, timeout_s: float) -> None:
        self.timeout = datetime.timedelta(seconds=float(timeout_s))
        self._group = None
        self.previous: datetime.timedelta | None = None
        if not dist.is_available() or not dist.is_initialized():
            return
        self.previous = default_group_timeout()
        if self._set(self.timeout, "bound"):
            self._group = dist.distributed_c10d._get_default_group()
            logger.info("rank %d: collectives over the default process group time out after %gs during the gba job "
                        "(gba.timeout_s; before: %s): the parameter servers never join one", dist.get_rank(),
                        self.timeout.total_seconds(), self.previous)

    @staticmethod
    def _set(timeout: datetime.timedelta, what: str) -> bool:
        try:
            dist.distributed_c10d._set_pg_timeout(timeout)
            return True
        except (AttributeError, RuntimeError, ValueError) as exc:
            logger.warning("could not %s the default process group's timeout to %s (%s): a collective over it that "
                           "the parameter servers never join waits for the group's own timeout", what, timeout, exc)
            return False

    def restore(self) -> None:
        """Give the default group its previous timeout (torch's default when it was unknown); idempotent."""
        group, self._group = self._group, None
        if group is None or not dist.is_initialized() or dist.distributed_c10d._get_default_group() is not group:
            return  # never bound, or the group is gone / replaced: nothing of ours is left on it
        previous = self.previous if self.previous is not None else dist.distributed_c10d.default_pg_timeout
        self._set(previous, "restore")


def _group_ranks(group: object) -> set[int] | None:
    """Global ranks of ``group`` as a collective's ``group`` argument names it (None: the default group)."""
    if group is None or group is dist.GroupMember.WORLD:
        return set(range(dist.get_world_size()))
    try:
        return set(dist.get_process_group_ranks(group))
    except Exception:  # not a registered group (a rejoined worker's pair group, a torchcomms object): not ours
        return None


def _frames(thread_id: int) -> list[FrameType]:
    frame = sys._current_frames().get(thread_id)
    out = []
    while frame is not None:
        out.append(frame)
        frame = frame.f_back
    return out  # innermost first


def _where(frame: FrameType) -> str:
    return f"{frame.f_code.co_filename}:{frame.f_lineno} ({frame.f_code.co_name})"


class CollectiveWatch:
    """A worker's daemon thread that finds the training thread stuck in a collective the servers never join.

    Start it from the thread that runs the training loop (it watches that thread). ``model`` gives the
    paths of the modules it names (``name`` is the root's). Reports at most once: an error line on this
    rank and the job's ``stuck`` record, which every server raises as :class:`StuckCollectiveError`.

    Example::

        watch = CollectiveWatch(rt, model)      # after init_runtime, on a worker
        ...                                     # a dist.all_reduce(t) here is named within 2 periods
        watch.stop()
    """

    def __init__(self, rt: "PSRuntime", model: torch.nn.Module, name: str = "model",
                 period_s: float | None = None) -> None:
        self.rt = rt
        self.period_s = float(period_s) if period_s is not None else min(rt.heartbeat_s, 0.5)
        self.report: str | None = None
        self._thread_id = threading.get_ident()
        self._servers = set(rt.layout.servers)
        self._modules = {id(m): (weakref.ref(m), f"{name}.{path}" if path else name, type(m).__name__)
                         for path, m in model.named_modules()}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"gba-collective-watch-{rt.rank}", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """End the watch (the job ended on this rank); idempotent."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=self.period_s + 1.0)

    def _run(self) -> None:
        seen: tuple | None = None  # (call key, monotonic, wall clock) of the stuck call first seen
        while not self._stop.wait(self.period_s):
            try:
                found = self._inspect()
            except Exception as exc:  # a racing stack must never take the job down: look again next period
                logger.debug("rank %d: collective watch could not read the training thread's stack: %s",
                             self.rt.rank, exc)
                continue
            if found is None:
                seen = None
                continue
            key, describe = found
            if seen is None or seen[0] != key:
                seen = (key, time.monotonic(), time.time())
                continue
            self._publish(describe(seen[2]))  # the same call in two samples: it waits, and nothing will answer
            return

    def _inspect(self):
        chain = _frames(self._thread_id)
        outer = None
        for i, frame in enumerate(chain):  # the outermost collective: the call the user's code made
            if frame.f_code.co_name in COLLECTIVES and frame.f_code.co_filename.endswith(_C10D):
                outer = i
        if outer is None:
            return None
        collective = chain[outer]
        group = collective.f_locals.get("group")
        ranks = _group_ranks(group)
        if ranks is None or not ranks & self._servers:
            return None  # e.g. engine.worker_group: the workers only, a legitimate collective
        caller = next((f for f in chain[outer + 1:]
                       if not any(p in f.f_code.co_filename for p in _PLUMBING)), None)
        module = None
        for frame in chain[outer + 1:]:
            code = frame.f_code
            if code.co_argcount and code.co_varnames[0] == "self":
                entry = self._modules.get(id(frame.f_locals.get("self")))
                if entry is not None and entry[0]() is frame.f_locals.get("self"):
                    module = (entry[1], entry[2], code.co_name)
                    break
        name = collective.f_code.co_name
        where = _where(caller) if caller is not None else "an unknown place"
        group_text = ("the default (world) process group" if group is None or group is dist.GroupMember.WORLD
                      else "a process group")
        servers = sorted(ranks & self._servers)
        key = (id(collective), collective.f_code)

        def describe(since: float) -> str:
            stamp = time.strftime("%H:%M:%S", time.localtime(since)) + f".{int(since % 1 * 1000):03d}"
            by = (f"called by {module[0]} ({module[1]}).{module[2]} at {where}" if module is not None
                  else f"called at {where} (by no module of the model)")
            return (f"worker rank {self.rt.rank} waits in torch.distributed.{name} over {group_text} (ranks "
                    f"{sorted(ranks)}, with parameter-server rank{'s' if len(servers) > 1 else ''} "
                    f"{', '.join(map(str, servers))}) since {stamp} ({time.time() - since:.1f}s), {by}: the servers "
                    f"serve the job inside gba_engine.initialize and never join a collective, so it cannot "
                    f"complete: the servers stop the job with this reason, and the collective fails at the latest "
                    f"when its group's timeout ends (the default group's is gba.timeout_s={self.rt.timeout_s:g}s "
                    f"during the job). Run collectives among the workers over engine.worker_group; a table that "
                    f"exchanges rows in its step cannot train under gba: {REPLACEMENT}")

        return key, describe

    def _publish(self, reason: str) -> None:
        self.report = reason
        logger.error("%s", reason)
        try:  # a store client of this thread's own: TCPStore clients are not shared across threads
            store = dist.TCPStore(self.rt.store_host, self.rt.store_port, is_master=False,
                                  timeout=datetime.timedelta(seconds=self.rt.timeout_s))
            store.compare_set(stuck_key(), "", StuckRecord(self.rt.rank, reason).encode())
        except Exception as exc:  # the control plane is gone: this rank's error line still says why
            logger.warning("rank %d could not tell the servers it is stuck: %s", self.rt.rank, exc)


def raise_if_stuck(rt: "PSRuntime") -> None:
    """Raise :class:`StuckCollectiveError` once a worker published that it is stuck (one store read when not).

    Example::

        raise_if_stuck(rt)        # in a server's wait loop
    """
    if not rt.store.check([stuck_key()]):
        return
    record = StuckRecord.decode(rt.store.get(stuck_key()))
    role = f"parameter server {rt.layout.server_index(rt.rank)}" if rt.is_server else "worker"
    raise StuckCollectiveError(f"rank {rt.rank} ({role}): the job cannot go on: {record.reason}", worker=record.by)
