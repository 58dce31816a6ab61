"""Straggler detection on per-worker step times: robust statistics, hysteresis, minimum dwell.

Pure code (no processes): :class:`StragglerDetector` is fed one row of per-worker local
step times per step and says which mode ``auto`` should be in.

* Robust statistics: each worker's time is the **median** of its last ``window`` times
  (one slow step is noise, not a straggler), and its jitter the **MAD** over that window.
  The reference is the lower median of the workers' medians, so with two workers one
  slow worker cannot drag the reference up to itself.
* A worker becomes slow when, for ``confirm_steps`` consecutive steps (default: ``window``, so two
  windows of evidence counting the one that fills the median), its median exceeds
  ``slow_ratio x reference`` *and* the gap is significant: below 64 workers larger than 3 scaled MADs of its own jitter; from 64 workers
  on, its log-median stands out from the spread of all workers' log-medians by more than
  :func:`peer_sigmas` (N) robust sigmas, a bar that grows with N so that a straggler-free job of
  1,024 workers is not flagged by chance. It recovers only below
  ``recover_ratio x reference`` (hysteresis: ``recover_ratio < slow_ratio``) for ``confirm_steps // 2``
  consecutive steps of its own. The confirmation tells a
  straggler from CPU contention: a competing process makes one worker's median look well above its
  peer's for a few steps now and then, a straggler stays slow (``benchmarks/gba_sim.py --detector`` measures both).
* The suggested mode is ``gba`` while any worker is slow, else ``sync``; a change is
  released only ``min_dwell_steps`` after the previous one (and after the first window
  is full), so the job never flaps between modes.

Every worker of a sync-mode job feeds the same all-gathered rows, so every worker reaches
the same decision at the same step without extra messages; in gba mode the first worker
feeds rows read from the TCPStore (see ``engine.py``).

Example::

    det = StragglerDetector(num_workers=2, slow_ratio=1.5, recover_ratio=1.2, window=8, min_dwell_steps=20)
    for step in range(100):
        d = det.observe([0.10, 0.40])      # worker 1 is 4x slower
    d.mode, d.slow                         # ('gba', frozenset({1}))
"""
from __future__ import annotations

import collections
import dataclasses
import math
import statistics
from typing import Iterable, Sequence

_MAD_TO_SIGMA = 1.4826  # MAD x this estimates the standard deviation of normal noise
_MAD_SIGMAS = 3.0  # a gap smaller than 3 sigmas of the worker's own jitter is noise
# From this many workers on, a worker is compared with the spread of all workers' medians. Below, that
# spread (a MAD of N medians) is too noisy: at jitter sigma 0.38 (benchmarks/gba_sim.py and 12 seeded
# runs of 150 steps) the peer test flagged straggler-free workers as often as the own-jitter test at
# 16-32 workers and for a few steps in 2 of 24 runs at 48-64; from 128 workers on, in none.
_PEER_TEST_WORKERS = 64
_FAMILY_FALSE_FLAG = 1e-6  # chance per step that some worker of a straggler-free job passes the peer test


def peer_sigmas(num_workers: int) -> float:
    """How many robust sigmas of the workers' log-medians a worker must stand out by (Bonferroni over N).

    Among 1,024 jittery workers some pass any fixed bar by chance every few steps (benchmarks/gba_sim.py
    showed auto mode switching to gba with no straggler at 256 and 1,024 workers), so the bar rises with N::

        peer_sigmas(64), peer_sigmas(1024)    # (5.53..., 6.00...)
    """
    return statistics.NormalDist().inv_cdf(1.0 - _FAMILY_FALSE_FLAG / num_workers)


@dataclasses.dataclass(frozen=True)
class Decision:
    """What the detector concluded after one step."""

    step: int
    mode: str  # "sync" or "gba": the mode auto should be in now
    switched: bool  # mode differs from the previous step's
    slow: frozenset  # workers flagged slow now
    ratios: tuple  # per-worker median / reference (nan before the window fills)
    reference_s: float  # the reference step time (nan before the window fills)


def _median(xs: Sequence[float]) -> float:
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])


class StragglerDetector:
    """Decides sync vs gba from per-worker step times (see the module docstring).

    Example::

        det = StragglerDetector.from_config(GBAConfig(mode="auto").switch, num_workers=4)
        det.observe([0.1, 0.1, 0.1, float("nan")])     # nan: no new time from worker 3 this step
    """

    def __init__(self, num_workers: int, slow_ratio: float = 1.5, recover_ratio: float = 1.2, window: int = 8,
                 min_dwell_steps: int = 20, mode: str = "sync", slow: Iterable[int] = (),
                 confirm_steps: int | None = None) -> None:
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        if not 1.0 < recover_ratio < slow_ratio:
            raise ValueError(f"need 1 < recover_ratio ({recover_ratio}) < slow_ratio ({slow_ratio})")
        if window < 1 or min_dwell_steps < 0:
            raise ValueError(f"window must be >= 1 and min_dwell_steps >= 0, got {window}, {min_dwell_steps}")
        if confirm_steps is not None and confirm_steps < 1:
            raise ValueError(f"confirm_steps must be >= 1 (1: no confirmation), got {confirm_steps}")
        if mode not in ("sync", "gba"):
            raise ValueError(f"mode must be 'sync' or 'gba', got {mode!r}")
        self.num_workers = num_workers
        self.slow_ratio, self.recover_ratio = slow_ratio, recover_ratio
        self.window, self.min_dwell_steps = window, min_dwell_steps
        self.confirm_steps = window if confirm_steps is None else confirm_steps
        self.recover_steps = max(1, self.confirm_steps // 2)  # a false recovery costs two switches: confirm it too
        self._over = [0] * num_workers  # consecutive fresh steps each worker looked slow (confirmation)
        self._under = [0] * num_workers  # consecutive fresh steps a slow worker looked recovered
        self.mode = mode
        self.step = 0
        self.last_switch_step = 0
        self.slow: set[int] = set(slow)  # carried over a switch: only the worker's own times can clear it
        if any(not 0 <= w < num_workers for w in self.slow):
            raise ValueError(f"slow workers {sorted(self.slow)} are not in [0, {num_workers})")
        self._times = [collections.deque(maxlen=window) for _ in range(num_workers)]
        self._peer_sigmas = peer_sigmas(num_workers)

    @classmethod
    def from_config(cls, switch, num_workers: int, mode: str = "sync", slow: Iterable[int] = ()) -> "StragglerDetector":
        """From a validated ``gba.switch`` block (:class:`gba_engine.config.SwitchConfig`); confirms over ``window``."""
        return cls(num_workers, slow_ratio=switch.slow_ratio, recover_ratio=switch.recover_ratio,
                   window=switch.window, min_dwell_steps=switch.min_dwell_steps, mode=mode, slow=slow)

    def observe(self, times: Sequence[float]) -> Decision:
        """Add one step time per worker (nan or None: nothing new from that worker) and decide."""
        if len(times) != self.num_workers:
            raise ValueError(f"need {self.num_workers} step times, got {len(times)}")
        self.step += 1
        for w, t in enumerate(times):
            if t is not None and not math.isnan(t):
                if t < 0:
                    raise ValueError(f"step time of worker {w} is negative: {t}")
                self._times[w].append(float(t))
        full = [w for w in range(self.num_workers) if len(self._times[w]) >= max(1, (self.window + 1) // 2)]
        ratios = [math.nan] * self.num_workers
        reference = math.nan
        if len(full) == self.num_workers or (full and len(full) >= 2):
            medians = {w: _median(self._times[w]) for w in full}
            ordered = sorted(medians.values())
            reference = max(ordered[(len(ordered) - 1) // 2], 1e-9)  # lower median: robust to one slow worker of two
            peer_bar = self._peer_bar(medians)
            for w, m in medians.items():
                ratios[w] = m / reference
                if peer_bar is None:
                    mad = _median([abs(t - m) for t in self._times[w]])
                    significant = m - reference > _MAD_SIGMAS * _MAD_TO_SIGMA * mad
                else:
                    significant = math.log(max(m, 1e-12) / reference) > peer_bar
                fresh = times[w] is not None and not math.isnan(times[w])
                over = ratios[w] > self.slow_ratio and significant
                if w not in self.slow and over:
                    self._over[w] += 1 if fresh else 0
                    if self._over[w] >= self.confirm_steps:
                        self.slow.add(w)
                elif w not in self.slow:
                    self._over[w] = 0
                if w in self.slow and ratios[w] < self.recover_ratio:
                    self._under[w] += 1 if fresh else 0
                    if self._under[w] >= self.recover_steps:
                        self.slow.discard(w)
                        self._over[w] = self._under[w] = 0
                elif w in self.slow:
                    self._under[w] = 0
        wanted = "gba" if self.slow else "sync"
        switched = False
        warm = all(len(d) >= self.window for d in self._times) or self.step >= self.window
        if wanted != self.mode and warm and self.step - self.last_switch_step >= self.min_dwell_steps:
            self.mode, self.last_switch_step, switched = wanted, self.step, True
        return Decision(step=self.step, mode=self.mode, switched=switched, slow=frozenset(self.slow),
                        ratios=tuple(ratios), reference_s=reference)

    def _peer_bar(self, medians: dict) -> float | None:
        """Log-ratio a worker's median must exceed, from the spread of all medians; None below 64 workers.

        The spread is the scaled MAD of the log-medians (robust while fewer than half the workers
        straggle); it is the null spread of a windowed median, whatever the jitter and window.
        """
        if len(medians) < _PEER_TEST_WORKERS:
            return None
        logs = [math.log(max(m, 1e-12)) for m in medians.values()]
        center = _median(logs)
        spread = _MAD_TO_SIGMA * _median([abs(v - center) for v in logs])
        return self._peer_sigmas * spread

    def force(self, mode: str) -> None:
        """Record a mode change made for another reason (e.g. a lost worker pins gba); restarts the dwell."""
        if mode not in ("sync", "gba"):
            raise ValueError(f"mode must be 'sync' or 'gba', got {mode!r}")
        if mode != self.mode:
            self.mode, self.last_switch_step = mode, self.step
