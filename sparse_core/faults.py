"""The project's one fault injector: slow a rank down, kill it, or freeze it, at given steps.

Used by the rec job's ``--straggler`` / ``--crash`` flags (``sparse_scale.rec.faults``) and by the
GBA chaos plans (``gba_engine.chaos``), which only say *which* faults a process gets; this module
does them. A :class:`FaultInjector` is one process's view, driven by the training loop's hooks:

* :meth:`FaultInjector.before_backward` sleeps a :class:`Straggler`'s delay: ``(factor - 1)`` times
  the median forward+backward of the first :data:`CALIBRATION_STEPS` micro-steps (fed by
  :meth:`FaultInjector.after_backward`), fixed for the run, since a live step time would include
  all-reduce waits for another slow rank;
* :meth:`FaultInjector.after_step` does the :class:`Fault` planned after that step: a kill
  (``os._exit`` with the fault's exit code: no goodbye, no cleanup, an in-flight push may be lost)
  or a freeze (``SIGSTOP``, woken by a detached ``kill -CONT`` after ``seconds``). With ``record``,
  each fault first leaves a JSON line (flushed and synced, with the batches trained) in
  ``record/faults-<rank>.jsonl``, so a supervisor can tell a planned death from any other.

``sleep``, ``exit`` and ``freeze`` are injectable, so the injector can be tested without sleeping,
dying or stopping.

Example::

    faults = FaultInjector(rank=1, faults=[Fault(1, 0, step=80, exit_code=17)],
                           stragglers=[Straggler(1, 4.0, start=20, end=60)])
    for step in range(1, steps + 1):
        loss = forward(); faults.before_backward(step)   # sleeps 3x the calibrated compute in [20, 60)
        backward(); faults.after_backward(compute_s)      # the first 3 micro-steps calibrate
        faults.after_step(step)                           # exits with code 17 after step 80
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import statistics
import subprocess
import time
from pathlib import Path
from typing import Callable, Iterable, Literal, Optional, Sequence

logger = logging.getLogger(__name__)

__all__ = ["CALIBRATION_STEPS", "CHAOS_EXIT_CODE", "CRASH_EXIT_CODE", "Fault", "FaultInjector", "Straggler"]

CALIBRATION_STEPS = 3  # undelayed micro-steps whose median forward+backward a straggler factor scales
CRASH_EXIT_CODE = 17  # the rec job's --crash
CHAOS_EXIT_CODE = 19  # a chaos plan's kill


@dataclasses.dataclass(frozen=True)
class Straggler:
    """Rank ``rank`` runs ``factor`` times slower for optimizer steps ``start`` up to ``end`` (exclusive; None: on).

    Example::

        Straggler(1, 4.0).delay_s(rank=1, step=0, compute_s=0.1)   # 0.3
    """

    rank: int
    factor: float
    start: int = 0
    end: int | None = None

    def delay_s(self, rank: int, step: int, compute_s: float) -> float:
        """Seconds to sleep on ``rank`` at optimizer step ``step`` for a step of ``compute_s`` compute."""
        if rank != self.rank or step < self.start or (self.end is not None and step >= self.end):
            return 0.0
        return (self.factor - 1.0) * compute_s


@dataclasses.dataclass(frozen=True)
class Fault:
    """Process ``incarnation`` of ``rank`` is killed (or frozen for ``seconds``) after its step ``step``.

    ``incarnation``: 0 for the launched process, 1 for its first replacement, ...; ``exit_code``: what
    a kill exits with.

    Example::

        Fault(rank=1, incarnation=0, step=12, kind="freeze", seconds=0.5)
    """

    rank: int
    incarnation: int
    step: int  # counted from 1
    kind: Literal["kill", "freeze"] = "kill"
    seconds: float = 0.0
    exit_code: int = CHAOS_EXIT_CODE

    def __post_init__(self) -> None:
        if self.rank < 0 or self.incarnation < 0 or self.step < 1:
            raise ValueError(f"{self}: rank and incarnation must be >= 0 and step >= 1")
        if self.kind not in ("kill", "freeze"):
            raise ValueError(f"{self}: kind must be 'kill' or 'freeze'")
        if self.kind == "freeze" and not self.seconds > 0:
            raise ValueError(f"{self}: a freeze needs seconds > 0")


def _freeze(seconds: float) -> None:
    # a detached waker: this process cannot wake itself while stopped
    subprocess.Popen(["sh", "-c", f"sleep {seconds:.3f}; kill -CONT {os.getpid()}"], start_new_session=True)
    os.kill(os.getpid(), signal.SIGSTOP)


class FaultInjector:
    """One process's faults and stragglers (those of other ranks or incarnations are dropped); see the module doc.

    Example::

        faults = FaultInjector(0, stragglers=[Straggler(0, 2.0)])
        for _ in range(3): faults.after_backward(0.01)
        faults.before_backward(step=5)   # sleeps 0.01 s
    """

    def __init__(self, rank: int, faults: Iterable[Fault] = (), stragglers: Sequence[Straggler] = (), *,
                 incarnation: int = 0, record: Optional[Path] = None,
                 sleep: Callable[[float], None] = time.sleep, exit: Callable[[int], None] = os._exit,
                 freeze: Callable[[float], None] = _freeze) -> None:
        self.rank, self.incarnation = rank, incarnation
        self.stragglers = tuple(s for s in stragglers if s.rank == rank)
        self.pending = sorted((f for f in faults if (f.rank, f.incarnation) == (rank, incarnation)),
                              key=lambda f: (f.step, f.kind != "freeze"))
        self.record = None if record is None else Path(record)
        self.trained: list[int] = []
        self._sleep, self._exit, self._freeze = sleep, exit, freeze
        self._calibration: list[float] = []

    @property
    def calibrated(self) -> bool:
        """Whether the compute time a straggler factor scales is fixed yet."""
        return len(self._calibration) >= CALIBRATION_STEPS

    def before_backward(self, step: int) -> float:
        """Sleep this rank's straggler delay at optimizer step ``step``; returns it (0 while calibrating).

        Before backward: an engine that times its worker counts the delay as this worker's own compute.
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

    def after_step(self, step: int, batch: Optional[int] = None) -> None:
        """After optimizer step ``step`` (of batch number ``batch``): do the faults planned for it, in order.

        Faults planned for an earlier step (a run resumed past them) are dropped.
        """
        if batch is not None:
            self.trained.append(int(batch))
        while self.pending and self.pending[0].step <= step:
            fault = self.pending.pop(0)
            if fault.step < step:
                continue
            self._note(fault)
            if fault.kind == "freeze":
                logger.warning("fault injection: freezing rank %d (incarnation %d) for %.1f s after its step %d",
                               self.rank, self.incarnation, fault.seconds, step)
                self._freeze(fault.seconds)
            else:
                logger.warning("fault injection: killing rank %d (incarnation %d) after its step %d (exit code %d)",
                               self.rank, self.incarnation, step, fault.exit_code)
                self._exit(fault.exit_code)

    def _note(self, fault: Fault) -> None:
        if self.record is None:
            return
        self.record.mkdir(parents=True, exist_ok=True)
        line = json.dumps({**dataclasses.asdict(fault), "pid": os.getpid(), "trained": self.trained,
                           "at": time.time()})
        with open(self.record / f"faults-{self.rank}.jsonl", "a") as f:
            f.write(line + "\n")
            f.flush()
            os.fsync(f.fileno())
