"""Chaos plans, in the style of TorchFT's: which worker process is killed or frozen at which step.

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
import logging
import random
from pathlib import Path
from typing import Iterable

from sparse_core.faults import CHAOS_EXIT_CODE, Fault, FaultInjector

logger = logging.getLogger(__name__)

__all__ = ["CHAOS_EXIT_CODE", "ChaosInjector", "ChaosPlan", "Fault"]


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


class ChaosInjector(FaultInjector):
    """One process's faults of a :class:`ChaosPlan`; ``record``: a folder where each fault leaves a JSON line.

    :class:`sparse_core.faults.FaultInjector` (the project's one injector) counting the process's own
    steps from 1. The record of a kill is written (and flushed) before the process dies, with the
    batches it trained, so a supervisor can tell a death from the plan from any other and account for them.
    """

    def __init__(self, plan: ChaosPlan, rank: int, incarnation: int, record: Path | None = None) -> None:
        super().__init__(rank, plan.for_process(rank, incarnation), incarnation=incarnation, record=record)
        self.steps = 0

    def after_step(self, batch: int | None = None) -> None:  # type: ignore[override]
        """Count one optimizer step (of batch number ``batch``); kill or freeze the process if the plan says so."""
        self.steps += 1
        super().after_step(self.steps, batch)
