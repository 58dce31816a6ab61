"""Liveness over the control plane: each rank's heartbeat counter, and who stopped moving theirs.

A :class:`Heartbeat` thread bumps this rank's counter every ``heartbeat_s`` on its own store
client; a :class:`Liveness` reads the counters of the ranks it tracks and presumes lost those
whose counter did not move for the lease (``HEARTBEAT_LEASE`` periods). Observers time the
changes on their own clock, so hosts need no synchronised clocks.

Example::

    live = Liveness(rt, ranks=rt.layout.workers)
    live.poll()          # set of ranks presumed lost now
"""
from __future__ import annotations

import datetime
import logging
import threading
import time
from typing import TYPE_CHECKING, Iterable

from torch.distributed import TCPStore

from ..config import HEARTBEAT_LEASE
from ..protocol import heartbeat_key

if TYPE_CHECKING:
    from .runtime import PSRuntime

__all__ = ["Heartbeat", "Liveness"]

logger = logging.getLogger(__name__)


class Heartbeat:
    """Daemon thread bumping this rank's heartbeat counter every period, on its own store client."""

    def __init__(self, host: str, port: int, rank: int, period_s: float, timeout_s: float) -> None:
        self._stop = threading.Event()
        self._store = TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=timeout_s))
        self._store.add(heartbeat_key(rank), 1)  # the key exists before anyone polls it
        self._thread = threading.Thread(target=self._run, args=(rank, period_s), name=f"gba-heartbeat-{rank}",
                                        daemon=True)
        self._thread.start()

    def _run(self, rank: int, period_s: float) -> None:
        while not self._stop.wait(period_s):
            try:
                self._store.add(heartbeat_key(rank), 1)
            except Exception as exc:  # the store host has shut down: nobody is listening any more
                logger.debug("heartbeat of rank %d stopped: %s", rank, exc)
                return

    def stop(self, timeout_s: float) -> None:
        self._stop.set()
        self._thread.join(timeout=timeout_s)


class Liveness:
    """Tells which ranks' heartbeats stopped moving for longer than the lease.

    Example::

        live = Liveness(rt, ranks=rt.layout.workers)
        live.poll()          # set of ranks presumed lost now
    """

    def __init__(self, runtime: "PSRuntime", ranks: Iterable[int]) -> None:
        self._rt = runtime
        now = time.monotonic()
        self._seen = {r: (-1, now) for r in ranks}  # rank -> (last counter, when it last changed)

    @property
    def lease_s(self) -> float:
        """Seconds without a heartbeat after which a rank is presumed lost."""
        return HEARTBEAT_LEASE * self._rt.heartbeat_s

    def silent_s(self, rank: int) -> float:
        """Seconds since ``rank``'s heartbeat last moved (as of the last :meth:`poll`)."""
        return time.monotonic() - self._seen[rank][1]

    def silence(self, rank: int) -> str:
        """What a lost ``rank`` looks like, for a :meth:`PSRuntime.server_lost` state."""
        return (f"stopped heartbeating (dead, frozen or cut off): its heartbeat has not moved for "
                f"{self.silent_s(rank):.1f}s, past the lease of {self.lease_s:g}s")

    def poll(self) -> set[int]:
        """Read every tracked heartbeat once; return the ranks presumed lost.

        Raises :class:`ServerLostError` once the job is aborted (a server was found lost by
        any rank): every wait loop polls one, so none outlives the abort by more than its poll.
        """
        self._rt.check_abort()
        now = time.monotonic()
        lost = set()
        for rank, (last, since) in self._seen.items():
            beat = self._rt.store.add(heartbeat_key(rank), 0)  # add 0: reads without blocking on a missing key
            if beat != last:
                self._seen[rank] = (beat, now)
            elif now - since > self.lease_s:
                lost.add(rank)
        return lost
