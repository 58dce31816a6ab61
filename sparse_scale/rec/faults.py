"""Fault injection for demos and tests: ``--straggler`` slows a rank, ``--crash`` kills one.

A :class:`FaultInjector` plugs into the training loop through three hooks and owns all of
the timing: the loop measures its forward+backward compute and calls the hooks, it never
looks at the options itself.

Example::

    faults = FaultInjector(rank=1, stragglers=[parse_straggler("1:4:20-60")], crash=parse_crash("1:80"))
    for step in ...:
        loss = forward(); faults.before_backward(step)      # sleeps (factor - 1) x compute once calibrated
        backward(); faults.after_backward(compute_s)         # the first 3 micro-steps calibrate
        faults.after_step(step + 1)                          # exits with code 17 after step 80
"""
from __future__ import annotations

import dataclasses
import logging
import math
import os
import statistics
import time
from typing import Callable, Sequence

logger = logging.getLogger(__name__)

CALIBRATION_STEPS = 3  # undelayed micro-steps whose median forward+backward a --straggler factor scales
CRASH_EXIT_CODE = 17


@dataclasses.dataclass(frozen=True)
class Straggler:
    """One ``--straggler RANK:FACTOR[:START-END]`` option."""

    rank: int
    factor: float
    start: int = 0
    end: int | None = None  # exclusive; None: until the end

    def delay_s(self, rank: int, step: int, compute_s: float) -> float:
        """Seconds to sleep on ``rank`` at optimizer step ``step`` for a step of ``compute_s`` compute.

        Example::

            Straggler(1, 4.0).delay_s(rank=1, step=0, compute_s=0.1)   # 0.3
        """
        if rank != self.rank or step < self.start or (self.end is not None and step >= self.end):
            return 0.0
        return (self.factor - 1.0) * compute_s


@dataclasses.dataclass(frozen=True)
class Crash:
    """One ``--crash RANK:STEP`` option: ``rank`` exits right after its optimizer step ``step``."""

    rank: int
    step: int


def parse_straggler(text: str) -> Straggler:
    """``"1:4"`` (rank 1, 4x slower throughout) or ``"1:4:20-60"`` (only for steps 20..59); ValueError if malformed.

    Example::

        parse_straggler("1:4:20-60")      # Straggler(rank=1, factor=4.0, start=20, end=60)
    """
    parts = text.split(":")
    try:
        if len(parts) not in (2, 3):
            raise ValueError("expected RANK:FACTOR or RANK:FACTOR:START-END")
        rank, factor = int(parts[0]), float(parts[1])
        start, end = 0, None
        if len(parts) == 3:
            a, _, b = parts[2].partition("-")
            start, end = int(a), int(b)
            if end <= start:
                raise ValueError(f"empty step window {start}-{end}")
        if rank < 0 or not (math.isfinite(factor) and factor >= 1.0):  # NaN would compare False and slip through
            raise ValueError("RANK must be >= 0 and FACTOR a finite number >= 1")
    except ValueError as exc:
        raise ValueError(f"--straggler {text!r}: {exc}") from None
    return Straggler(rank, factor, start, end)


def parse_crash(text: str) -> Crash:
    """``"1:3"``: rank 1 exits after its optimizer step 3; ValueError if malformed.

    Example::

        parse_crash("1:3")      # Crash(rank=1, step=3)
    """
    try:
        rank, step = (int(x) for x in text.split(":"))
        if rank < 0 or step < 1:
            raise ValueError("RANK must be >= 0 and STEP >= 1")
    except ValueError as exc:
        raise ValueError(f"--crash {text!r}: {exc} (expected RANK:STEP)") from None
    return Crash(rank, step)


class FaultInjector:
    """This rank's injected faults, driven by the training loop's hooks.

    The time a straggler factor scales is the median forward+backward of this rank's first
    ``CALIBRATION_STEPS`` micro-steps, when nobody is slowed yet, fixed for the run (a live
    step time would include all-reduce waits for another slow rank). ``sleep`` and ``exit``
    are injectable so the component can be tested without sleeping or dying.

    Example::

        faults = FaultInjector(0, [Straggler(0, 2.0)], None)
        faults.after_backward(0.01) x 3; faults.before_backward(step=5)   # sleeps 0.01 s
    """

    def __init__(self, rank: int, stragglers: Sequence[Straggler], crash: Crash | None,
                 sleep: Callable[[float], None] = time.sleep, exit: Callable[[int], None] = os._exit) -> None:
        self.rank = rank
        self.stragglers = tuple(s for s in stragglers if s.rank == rank)
        self.crash = crash if crash is not None and crash.rank == rank else None
        self._sleep, self._exit = sleep, exit
        self._calibration: list[float] = []

    @property
    def calibrated(self) -> bool:
        """Whether the compute time a straggler factor scales is fixed yet."""
        return len(self._calibration) >= CALIBRATION_STEPS

    def before_backward(self, step: int) -> float:
        """Sleep this rank's straggler delay at optimizer step ``step`` (job-wide with a gba block); returns it.

        Before backward: the engine counts the delay as this worker's own compute.
        """
        if not self.calibrated:
            return 0.0
        base = statistics.median(self._calibration)
        delay = sum(s.delay_s(self.rank, step, base) for s in self.stragglers)
        if delay:
            self._sleep(delay)
        return delay

    def after_backward(self, compute_s: float) -> None:
        """Record an undelayed micro-step's forward+backward seconds while calibrating."""
        if self.stragglers and not self.calibrated:
            self._calibration.append(compute_s)

    def after_step(self, step: int) -> None:
        """Exit at once (code 17, no goodbye to the servers, no cleanup) if this is the crash step."""
        if self.crash is not None and self.crash.step == step:
            logger.debug("--crash: rank %d exits after step %d", self.rank, step)
            self._exit(CRASH_EXIT_CODE)
