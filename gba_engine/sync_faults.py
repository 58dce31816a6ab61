"""Faults of a sync phase, named: a lost worker (rank and host) on every survivor, a lost server within the lease.

In a sync phase the workers train with DeepSpeed's collectives and, without server tables, never talk
to the servers, so without this module a fault there goes unnoticed or unnamed: a killed server leaves the
job training without its fallback, a killed worker leaves the others with gloo's "Connection reset by
peer". Here:

* :func:`explain_collective_failure`: a collective of a worker that raised is explained before it is
  re-raised. If the job is aborted (a server was found lost), its reason (``ServerLostError``);
  if a worker's heartbeat stops within the lease, :class:`WorkerLostError` naming it (rank and
  host), published on the control plane (``worker_lost_key``) so every other worker that fails
  and every server that ends names the same worker;
* :class:`ServerWatch`: the workers read the servers' heartbeats once per ``heartbeat_s`` at the
  end of a sync step; a server silent past the lease stops the job with ``ServerLostError`` (the
  abort record every rank polls), so a lost server is noticed within ``timeout_s`` in every phase.
  Policy (docs/gba.md): a job that needs the servers (mode ``auto``: its fallback; server tables:
  their rows) stops; a ``sync`` job without server tables only logs it once and trains on.

Example::

    watch = ServerWatch(rt, needs_servers=True)
    watch.check()          # end of each sync step: raises ServerLostError once a server is silent past the lease
"""
from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, NoReturn

from .protocol import host_key, worker_lost_key

if TYPE_CHECKING:
    from .ps import PSRuntime
    from .ps.runtime import Liveness

logger = logging.getLogger(__name__)

__all__ = ["ServerWatch", "WorkerLostError", "explain_collective_failure", "rank_host"]

POLL_S = 0.05


class WorkerLostError(RuntimeError):
    """A worker of a sync phase is gone: DeepSpeed's collectives need every worker it launched.

    ``worker`` is its rank, ``host`` its host name; the message says who found it, how, and what to do.

    Example::

        except WorkerLostError as exc:
            exc.worker, exc.host          # (1, 'node-3')
    """

    def __init__(self, message: str, worker: int = -1, host: str = "") -> None:
        super().__init__(message)
        self.worker, self.host = worker, host

    def __reduce__(self):  # picklable with its fields (multiprocessing reports it)
        return (type(self), (str(self), self.worker, self.host))


def rank_host(rt: "PSRuntime", rank: int) -> str:
    """The host name ``rank`` published at start-up, or ``"unknown host"``."""
    try:
        if rt.store.check([host_key(rank)]):
            return rt.store.get(host_key(rank)).decode()
    except Exception as exc:  # the store may be gone at the end of a failed job
        logger.debug("host of rank %d unreadable: %s", rank, exc)
    return "unknown host"


def _published(rt: "PSRuntime") -> tuple[int, str, str] | None:
    if not rt.store.check([worker_lost_key()]):
        return None
    worker, host, reason = rt.store.get(worker_lost_key()).decode().split("|", 2)
    return int(worker), host, reason


def lost_worker_record(rt: "PSRuntime") -> tuple[int, str, str] | None:
    """``(worker, host, reason)`` when a survivor found a worker lost in a sync phase, else None."""
    try:
        return _published(rt)
    except Exception as exc:
        logger.debug("worker-lost record unreadable: %s", exc)
        return None


def explain_collective_failure(rt: "PSRuntime", live: "Liveness", what: str, exc: BaseException) -> None:
    """After collective ``what`` raised ``exc`` on this worker: raise the named reason if one is found in time.

    Waits at most the lease and two heartbeats for a worker's heartbeat to stop; returns (the caller
    re-raises ``exc``) when nothing explains it.
    """
    deadline = time.monotonic() + live.lease_s + 2 * rt.heartbeat_s
    while True:
        rt.check_abort()  # a lost server: the job's reason (ServerLostError)
        found = _published(rt)
        if found is not None:
            _raise_lost(rt, *found, exc)
        lost = live.poll() - {rt.rank}
        if lost:
            worker = min(lost)
            host = rank_host(rt, worker)
            reason = (f"worker rank {worker} (host {host}) is gone: {live.silence(worker)}; rank {rt.rank} found it "
                      f"when its {what} failed in a sync phase. DeepSpeed's collectives need every worker it launched, "
                      "so the job stops (a lost worker is dropped only in a gba phase): restart the job from its last "
                      "checkpoint")
            rt.store.compare_set(worker_lost_key(), "", f"{worker}|{host}|{reason}")
            _raise_lost(rt, *_published(rt), exc)
        if time.monotonic() > deadline:
            return
        time.sleep(POLL_S)


def _raise_lost(rt: "PSRuntime", worker: int, host: str, reason: str, exc: BaseException) -> NoReturn:
    logger.error("rank %d: %s", rt.rank, reason)
    raise WorkerLostError(f"rank {rt.rank}: {reason}", worker=worker, host=host) from exc


class ServerWatch:
    """A worker's look at the servers' heartbeats at the end of sync steps (see the module docstring)."""

    def __init__(self, rt: "PSRuntime", live: "Liveness", needs_servers: bool) -> None:
        self.rt, self.live, self.needs_servers = rt, live, needs_servers
        self._next = 0.0
        self._warned = False

    def check(self) -> None:
        """Read the servers' heartbeats if ``heartbeat_s`` passed since the last look; raise on a lost server."""
        now = time.monotonic()
        if now < self._next:
            return
        self._next = now + self.rt.heartbeat_s
        lost = self.live.poll()  # raises ServerLostError once any rank aborted the job
        if not lost:
            return
        server = min(lost)
        if not self.needs_servers:
            if not self._warned:
                self._warned = True
                logger.warning("rank %d: parameter server rank %d %s; this sync job without server tables does not "
                               "need it and trains on", self.rt.rank, server, self.live.silence(server))
            return
        raise self.rt.server_lost(server, self.live.silence(server),
                                  "the end of a sync step (the servers hold auto mode's fallback and the server "
                                  "tables' rows; their heartbeats are watched in every phase)",
                                  since=time.time() - self.live.silent_s(server))
