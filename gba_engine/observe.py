"""Observability of a GBA job: mode, switch events and cost, staleness, decayed/dropped gradients, samples/s.

Every worker keeps an :class:`Observer`; the first worker writes the events to DeepSpeed's
monitor (``engine.monitor.write_events``: wandb, tensorboard, csv as configured) and
builds the console summary from what the servers and the other workers publish on the
TCPStore (``gba_engine.protocol``: ``stats_key``, ``rate_key``); the event names are the protocol's too.

Example::

    obs = Observer(rank=0, monitor=ds_engine.monitor)
    obs.on_switch(step=40, src="sync", dst="gba", seconds=0.12, nbytes=1 << 20)
    obs.summary(server_stats=[...], rates={0: 812.0, 1: 203.5})
"""
from __future__ import annotations

import collections
import dataclasses
import logging
from typing import Any, Mapping, Sequence

from .protocol import (DECAYED_EVENT, DROPPED_EVENT, MODE_IS_GBA_EVENT, SWITCH_MBYTES_EVENT, SWITCH_SECONDS_EVENT,
                       samples_per_s_event, staleness_event)

# the row cache's monitor events (row_cache.py): the first worker's view, like every event here
CACHE_HIT_RATE_EVENT = "gba/row_cache_hit_rate"
CACHE_REFRESHES_EVENT = "gba/row_cache_refreshes"
PS_MBYTES_PULLED_EVENT = "gba/ps_mbytes_pulled"

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class SwitchEvent:
    """One mode change and what the hand-over cost."""

    step: int  # the job step (GBAEngine.job_step): the last step trained before the switch, from 0
    src: str
    dst: str
    seconds: float
    nbytes: int
    reason: str


class Observer:
    """Collects one worker's view; ``rank == 0`` also writes monitor events."""

    def __init__(self, rank: int, monitor: Any | None, mode: str, global_batch: int = 1) -> None:
        self.rank = rank
        self.global_batch = global_batch
        self.version = 0  # global updates applied when this worker last looked
        self.monitor = monitor
        self.mode = mode
        self.switches: list[SwitchEvent] = []
        self.steps = 0
        self.samples = 0
        self.seconds = 0.0
        self.mode_steps: collections.Counter = collections.Counter()

    @property
    def x(self) -> int:
        """The monitor's x-axis: updates x global batch, which is DeepSpeed's global samples (wandb drops any event
        whose step is below one already logged, so every writer of a run must share one axis)."""
        return self.version * self.global_batch

    def _write(self, events: Sequence[tuple[str, float, int]]) -> None:
        if self.rank == 0 and self.monitor is not None and getattr(self.monitor, "enabled", False):
            self.monitor.write_events(list(events))

    def on_step(self, samples: int, seconds: float, version: int = 0) -> None:
        """One local optimizer step of ``samples`` samples that took ``seconds``, at model version ``version``."""
        self.version = max(self.version, version)
        self.steps += 1
        self.samples += samples
        self.seconds += seconds
        self.mode_steps[self.mode] += 1

    @property
    def samples_per_s(self) -> float:
        """This worker's local throughput so far."""
        return self.samples / self.seconds if self.seconds > 0 else 0.0

    def write_cache(self, hit_rate: float, refreshes: int, pulled_bytes: int) -> None:
        """The row cache's hit rate, refreshes and bytes pulled so far, to the monitor (first worker)."""
        self._write([(CACHE_HIT_RATE_EVENT, hit_rate, self.x), (CACHE_REFRESHES_EVENT, float(refreshes), self.x),
                     (PS_MBYTES_PULLED_EVENT, pulled_bytes / 1e6, self.x)])

    def on_switch(self, step: int, src: str, dst: str, seconds: float, nbytes: int, reason: str = "") -> None:
        """Record (and log on every worker, write on the first) one mode change."""
        ev = SwitchEvent(step, src, dst, seconds, nbytes, reason)
        self.switches.append(ev)
        self.mode = dst
        if self.rank == 0:
            logger.warning("gba: switched %s -> %s at job step %d in %.3fs moving %.2f MB (%s)", src, dst, step, seconds,
                           nbytes / 1e6, reason)
        self._write([(MODE_IS_GBA_EVENT, 1.0 if dst == "gba" else 0.0, self.x), (SWITCH_SECONDS_EVENT, seconds, self.x),
                     (SWITCH_MBYTES_EVENT, nbytes / 1e6, self.x)])

    def summary(self, server_stats: Sequence[Mapping[str, Any]] = (), rates: Mapping[int, float] | None = None) -> dict:
        """The console summary dict (also written to the monitor on the first worker)."""
        staleness: collections.Counter = collections.Counter()
        tallies = collections.Counter()
        lost: set[int] = set()
        version = 0
        for st in server_stats:
            for tau, n in st.get("staleness", {}).items():
                staleness[int(tau)] += int(n)
            for k in ("received", "counted", "dropped", "decayed"):
                tallies[k] += int(st.get(k, 0))
            lost |= set(st.get("lost_workers", []))
            version = max(version, int(st.get("version", 0)))
        out = {
            "mode": self.mode,
            "steps": self.steps,
            "steps_per_mode": dict(self.mode_steps),
            "switches": [dataclasses.asdict(e) for e in self.switches],
            "switch_seconds": sum(e.seconds for e in self.switches),
            "switch_bytes": sum(e.nbytes for e in self.switches),
            "staleness_histogram": dict(sorted(staleness.items())),
            "gradients": dict(tallies),
            "server_version": version,
            "clipped_updates": max((int(st.get("clipped", 0)) for st in server_stats), default=0),
            "lost_workers": sorted(lost),
            # every server records each join: the longest list is the job's (a worker once per restart)
            "rejoined_workers": max((list(st.get("rejoined", [])) for st in server_stats), key=len, default=[]),
            "samples_per_s": {int(k): float(v) for k, v in (rates or {self.rank: self.samples_per_s}).items()},
        }
        at = self.x
        events = [(DROPPED_EVENT, float(tallies["dropped"]), at), (DECAYED_EVENT, float(tallies["decayed"]), at)]
        events += [(samples_per_s_event(r), v, at) for r, v in out["samples_per_s"].items()]
        events += [(staleness_event(tau), float(n), at) for tau, n in staleness.items()]
        self._write(events)
        return out
