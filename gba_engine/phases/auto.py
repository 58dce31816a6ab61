"""When to move between phases: the switch policies (``gba.mode`` picks one; changing a policy touches this file).

* :class:`FixedPhase` (modes ``sync`` and ``gba``): never switches.
* :class:`AutoSwitch` (mode ``auto``): a :class:`~gba_engine.straggler.StragglerDetector` on the
  workers' local step times. In sync every worker all-gathers the times and reaches the same
  decision; to gba when a worker straggles. In gba the first worker reads the times from the
  control plane and, when the stragglers recovered, sets the phase's end to
  ``Leave(target)``: every worker leaves after ``target`` pushes of the phase (exact under
  ``max_lead``). A lost worker (or a lost first worker) keeps the job in gba for good
  (``Kept``, which loses to a ``Leave`` set first), where a restarted worker may join.

Example::

    policy = AutoSwitch(ctx)             # or FixedPhase()
    policy.after_update(engine, local_s=0.12)   # may call engine.switch_to_gba(...) / switch_to_sync(...)
"""
from __future__ import annotations

import abc
import math
from typing import ClassVar

import torch
import torch.distributed as dist

from ..protocol import Leave, PhaseEnd, StepTime, end_key, step_time_key
from ..straggler import StragglerDetector
from ..sync_faults import explain_collective_failure
from .base import PhaseHost, WorkerContext
from .gba import GBAPhase


class SwitchPolicy(abc.ABC):
    """Decides, after each local update, whether the engine moves to the other phase."""

    votes_on_phase_end: ClassVar[bool]  # whether a gba phase may end by a Leave (so its end is agreed on the store)
    keeps_gba: bool = False  # whether a gba phase, once entered, is never left (a restarted worker may join it)

    @abc.abstractmethod
    def after_update(self, host: PhaseHost, local_s: float) -> None:
        """Look at this worker's last local step time (seconds) and switch ``host`` if the policy says so."""

    def on_entered(self, mode: str, slow: frozenset = frozenset()) -> None:
        """The engine entered phase ``mode``; ``slow``: the workers that made it switch to gba."""


class FixedPhase(SwitchPolicy):
    """Modes ``sync`` and ``gba``: the job stays in its phase (``keeps_gba``: mode gba's phase is joinable)."""

    votes_on_phase_end = False

    def __init__(self, keeps_gba: bool = False) -> None:
        self.keeps_gba = keeps_gba

    def after_update(self, host: PhaseHost, local_s: float) -> None:
        return None


class AutoSwitch(SwitchPolicy):
    """Mode ``auto``: sync until a worker straggles, gba until it recovers (see the module docstring)."""

    votes_on_phase_end = True

    def __init__(self, ctx: WorkerContext) -> None:
        self.ctx = ctx
        self.detector = StragglerDetector.from_config(ctx.gba.switch, ctx.num_workers, mode="sync")
        self._times_seen: dict[int, int] = {}  # worker -> the step count of the last time read from it

    def on_entered(self, mode: str, slow: frozenset = frozenset()) -> None:
        # the workers that made us switch stay slow until a full window of their own times says otherwise
        self.detector = StragglerDetector.from_config(self.ctx.gba.switch, self.ctx.num_workers, mode=mode, slow=slow)

    def after_update(self, host: PhaseHost, local_s: float) -> None:
        if isinstance(host.phase, GBAPhase):
            self._in_gba(host, host.phase, local_s)
        else:
            self._in_sync(host, local_s)

    def _in_sync(self, host: PhaseHost, local_s: float) -> None:
        ctx = self.ctx
        mine = torch.tensor([local_s], dtype=torch.float64)
        gathered = [torch.zeros(1, dtype=torch.float64) for _ in range(ctx.num_workers)]
        try:
            dist.all_gather(gathered, mine, group=ctx.rt.worker_group)  # same rows on every worker: same decision
        except Exception as exc:
            explain_collective_failure(ctx.rt, ctx.worker_live, "step-time all_gather", exc)
            raise
        d = self.detector.observe([float(t) for t in gathered])
        if d.switched and d.mode == "gba":
            host.switch_to_gba(reason=f"slow workers {sorted(d.slow)}, ratios {[round(r, 2) for r in d.ratios]}",
                               slow=d.slow)

    def _in_gba(self, host: PhaseHost, phase: GBAPhase, local_s: float) -> None:
        ctx = self.ctx
        store = ctx.rt.store
        store.set(step_time_key(ctx.rt.rank), StepTime(ctx.global_steps, local_s).encode())
        end = end_key(phase.number)
        if ctx.is_first and not phase.kept and not store.check([end]):
            times = []
            for w in ctx.workers:
                key = step_time_key(w)
                seen = StepTime.decode(store.get(key)) if store.check([key]) else StepTime(0, math.nan)
                fresh = seen.count != self._times_seen.get(w)
                self._times_seen[w] = seen.count
                times.append(seen.seconds if fresh else math.nan)
            lost = ctx.worker_live.poll()
            if lost:  # DeepSpeed's all-reduce cannot run without them: stay in gba
                phase.keep(f"workers {sorted(lost)} are gone")
            else:
                d = self.detector.observe(times)
                if d.switched and d.mode == "sync":  # loses to a Finished some worker set first
                    leave = Leave(self._leave_target(phase), f"recovered, ratios {[round(r, 2) for r in d.ratios]}")
                    store.compare_set(end, "", leave.encode())
        elif not ctx.is_first and not phase.kept and ctx.first_live.poll():
            # the first worker alone asks for sync: without it the job stays in gba, where a restarted one may join
            phase.keep(f"the first worker {ctx.workers[0]} is gone")
        if store.check([end]):
            decided = PhaseEnd.decode(store.get(end))
            if isinstance(decided, Leave) and phase.pushes >= decided.target:
                lost = ctx.worker_live.poll()
                if lost:  # the hand-back is a collective over every launched worker: it cannot complete
                    raise RuntimeError(
                        f"gba: workers {sorted(lost)} died after the job decided to leave gba phase {phase.number} "
                        f"for sync ({decided.reason}); sync needs every worker DeepSpeed launched: restart the "
                        "job from its last checkpoint")
                host.switch_to_sync(reason=decided.reason)

    def _leave_target(self, phase: GBAPhase) -> int:
        """Pushes of this phase after which every worker leaves gba (decided by the first worker).

        Under ``max_lead = k`` another worker can be at most k + 1 pushes ahead of this one
        and every worker can reach the target without waiting on a worker that left, so all
        leave after the same number of steps (lockstep: the switch is exact). Fully async
        workers leave at their next step boundary (nobody ever waits in a pull).
        """
        lead = self.ctx.gba.max_lead
        return 0 if lead is None else phase.pushes + lead + 1

