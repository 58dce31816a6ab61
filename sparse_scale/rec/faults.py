"""The rec job's fault flags: ``--straggler`` slows a rank, ``--crash`` kills one.

This module parses the flags and hands them to the project's one fault injector,
:class:`sparse_core.faults.FaultInjector` (the GBA chaos plans use the same one). The training
loop measures its forward+backward compute and calls the injector's three hooks; it never looks
at the options itself.

Example::

    faults = FaultInjector(rank=1, stragglers=[parse_straggler("1:4:20-60")], crash=parse_crash("1:80"))
    for step in ...:
        loss = forward(); faults.before_backward(step)      # sleeps (factor - 1) x compute once calibrated
        backward(); faults.after_backward(compute_s)         # the first 3 micro-steps calibrate
        faults.after_step(step + 1)                          # exits with code 17 after step 80
"""
from __future__ import annotations

import dataclasses
import math
import os
import time
from typing import Callable, Sequence

from sparse_core import faults as _faults
from sparse_core.faults import CALIBRATION_STEPS, CRASH_EXIT_CODE, Straggler

__all__ = ["CALIBRATION_STEPS", "CRASH_EXIT_CODE", "Crash", "FaultInjector", "Straggler", "parse_crash",
           "parse_straggler"]


@dataclasses.dataclass(frozen=True)
class Crash:
    """One ``--crash RANK:STEP`` option: ``rank`` exits (code 17) right after its optimizer step ``step``."""

    rank: int
    step: int

    def fault(self) -> _faults.Fault:
        """The injector's fault: a kill of ``rank`` after ``step`` with exit code 17.

        Example::

            Crash(1, 3).fault().exit_code   # 17
        """
        return _faults.Fault(self.rank, 0, self.step, "kill", exit_code=CRASH_EXIT_CODE)


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


class FaultInjector(_faults.FaultInjector):
    """This rank's ``--straggler`` and ``--crash`` faults: :class:`sparse_core.faults.FaultInjector` built from the flags.

    ``sleep`` and ``exit`` are injectable so the component can be tested without sleeping or dying.

    Example::

        faults = FaultInjector(0, [Straggler(0, 2.0)], None)
        faults.after_backward(0.01) x 3; faults.before_backward(step=5)   # sleeps 0.01 s
    """

    def __init__(self, rank: int, stragglers: Sequence[Straggler], crash: Crash | None,
                 sleep: Callable[[float], None] = time.sleep, exit: Callable[[int], None] = os._exit) -> None:
        crash = crash if crash is not None and crash.rank == rank else None
        super().__init__(rank, () if crash is None else (crash.fault(),), stragglers, sleep=sleep, exit=exit)
        self.crash = crash
