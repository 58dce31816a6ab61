"""Fault injection for chaos runs, in the style of TorchFT's: kill or freeze a worker at a step.

A :class:`ChaosPlan` is a fixed list of faults, each for one process of a worker slot: its
``incarnation`` (0: the launched process, 1: its first replacement, ...) and the step of that
process after which it happens. The plan is plain data, so every process of a job (and the
test that checks the outcome) builds the same one from the same arguments. A
:class:`ChaosInjector` is one process's view: call :meth:`ChaosInjector.after_step` after each
optimizer step; it kills the process (``os._exit``, no goodbye: its in-flight push may be lost)
or freezes it (``SIGSTOP``, woken by a detached ``kill -CONT`` after ``seconds``).

Example::

    plan = ChaosPlan.random_kills(ranks=[0, 1], kills=5, mtbf_steps=30, seed=3).freeze_at(1, 12, 0.5)
    injector = ChaosInjector(plan, rank=1, incarnation=engine.rt.incarnation, record=Path("run/chaos"))
    for index in engine.claim_batches(total):
        train(index); injector.after_step(index)     # may never return
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import random
import signal
import subprocess
import time
from pathlib import Path
from typing import Iterable, Literal

logger = logging.getLogger(__name__)

CHAOS_EXIT_CODE = 19  # a killed process's exit code (``--crash`` uses 17)

__all__ = ["CHAOS_EXIT_CODE", "ChaosInjector", "ChaosPlan", "Fault"]


@dataclasses.dataclass(frozen=True)
class Fault:
    """Process ``incarnation`` of worker ``rank`` is killed (or frozen for ``seconds``) after its step ``step``."""

    rank: int
    incarnation: int
    step: int  # counted from 1 within that process
    kind: Literal["kill", "freeze"] = "kill"
    seconds: float = 0.0

    def __post_init__(self) -> None:
        if self.rank < 0 or self.incarnation < 0 or self.step < 1:
            raise ValueError(f"{self}: rank and incarnation must be >= 0 and step >= 1")
        if self.kind == "freeze" and not self.seconds > 0:
            raise ValueError(f"{self}: a freeze needs seconds > 0")


@dataclasses.dataclass(frozen=True)
class ChaosPlan:
    """The faults of a job (see the module docstring); build with the class methods, extend with the others."""

    faults: tuple[Fault, ...] = ()

    def __post_init__(self) -> None:
        kills = [(f.rank, f.incarnation) for f in self.faults if f.kind == "kill"]
        if len(kills) != len(set(kills)):
            raise ValueError("a process can be killed once: two kills name the same rank and incarnation")

    @classmethod
    def random_kills(cls, ranks: Iterable[int], kills: int, mtbf_steps: float, seed: int) -> "ChaosPlan":
        """``kills`` kills spread over ``ranks`` (each rank at least once when ``kills >= len(ranks)``).

        Each process lives an exponential number of steps with mean ``mtbf_steps`` (at least 1).
        Seeded: the same arguments give the same plan in every process.
        """
        ranks = sorted(set(ranks))
        if not ranks or kills < 0 or not mtbf_steps > 0:
            raise ValueError(f"random_kills needs ranks, kills >= 0 and mtbf_steps > 0, got {ranks}, {kills}, "
                             f"{mtbf_steps}")
        rng = random.Random(seed)
        victims = [ranks[i % len(ranks)] for i in range(kills)]
        rng.shuffle(victims)
        seen: dict[int, int] = {}
        faults = []
        for rank in victims:
            incarnation = seen[rank] = seen.get(rank, -1) + 1
            faults.append(Fault(rank, incarnation, max(1, round(rng.expovariate(1.0 / mtbf_steps)))))
        return cls(tuple(faults))

    def fail_at(self, rank: int, step: int, incarnation: int = 0) -> "ChaosPlan":
        """This plan plus a kill of ``rank``'s process ``incarnation`` after its step ``step``."""
        return ChaosPlan(self.faults + (Fault(rank, incarnation, step),))

    def freeze_at(self, rank: int, step: int, seconds: float, incarnation: int = 0) -> "ChaosPlan":
        """This plan plus a freeze (SIGSTOP, then SIGCONT after ``seconds``) of that process after ``step``."""
        return ChaosPlan(self.faults + (Fault(rank, incarnation, step, "freeze", seconds),))

    def kills_of(self, rank: int) -> int:
        """How many processes of worker ``rank`` the plan kills (so how many replacements it needs)."""
        return sum(1 for f in self.faults if f.rank == rank and f.kind == "kill")

    def for_process(self, rank: int, incarnation: int) -> tuple[Fault, ...]:
        """The faults of one process, in step order."""
        return tuple(sorted((f for f in self.faults if (f.rank, f.incarnation) == (rank, incarnation)),
                            key=lambda f: (f.step, f.kind != "freeze")))


class ChaosInjector:
    """One process's faults of a :class:`ChaosPlan`; ``record``: a folder where each fault leaves a JSON line.

    The record of a kill is written (and flushed) before the process dies, with the batches it
    trained, so a supervisor can tell a death from the plan from any other and account for them.
    """

    def __init__(self, plan: ChaosPlan, rank: int, incarnation: int, record: Path | None = None) -> None:
        self.rank, self.incarnation = rank, incarnation
        self.pending = list(plan.for_process(rank, incarnation))
        self.record = record
        self.steps = 0
        self.trained: list[int] = []

    def after_step(self, batch: int | None = None) -> None:
        """Count one optimizer step (of batch number ``batch``); kill or freeze the process if the plan says so."""
        self.steps += 1
        if batch is not None:
            self.trained.append(int(batch))
        while self.pending and self.pending[0].step == self.steps:
            fault = self.pending.pop(0)
            self._note(fault)
            if fault.kind == "freeze":
                self._freeze(fault.seconds)
            else:
                logger.warning("chaos: killing worker %d (incarnation %d) after its step %d", self.rank,
                               self.incarnation, self.steps)
                os._exit(CHAOS_EXIT_CODE)

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

    @staticmethod
    def _freeze(seconds: float) -> None:
        # a detached waker: this process cannot wake itself while stopped
        subprocess.Popen(["sh", "-c", f"sleep {seconds:.3f}; kill -CONT {os.getpid()}"], start_new_session=True)
        os.kill(os.getpid(), signal.SIGSTOP)
