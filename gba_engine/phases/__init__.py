"""The phases a GBA worker trains in and the policies that move it between them.

=========  ==========================  ==============================================
``mode``   first phase                 switch policy
=========  ==========================  ==============================================
``sync``   :class:`SyncPhase`          :class:`FixedPhase`
``gba``    :class:`GBAPhase` (kept)    :class:`FixedPhase`
``auto``   :class:`SyncPhase`          :class:`AutoSwitch` (``phases/auto.py``)
=========  ==========================  ==============================================

A new mode is a new phase module plus one row of :data:`MODES`; a new switch policy is a
new :class:`SwitchPolicy` in ``phases/auto.py``.

Example::

    phase, policy = start(ctx)           # the first phase of ctx.gba.mode (not yet open) and its policy
"""
from __future__ import annotations

from typing import Callable

from .auto import AutoSwitch, FixedPhase, SwitchPolicy
from .base import Phase, PhaseHost, WorkerContext
from .gba import GBAPhase
from .sync import SyncPhase, position_scheduler

MODES: dict[str, tuple[Callable[[WorkerContext], Phase], Callable[[WorkerContext], SwitchPolicy]]] = {
    "sync": (SyncPhase, lambda ctx: FixedPhase(keeps_gba=False)),
    "gba": (lambda ctx: GBAPhase(ctx, kept=True), lambda ctx: FixedPhase(keeps_gba=True)),
    "auto": (SyncPhase, AutoSwitch),
}


def start(ctx: WorkerContext) -> tuple[Phase, SwitchPolicy]:
    """The first phase (not yet open) and the switch policy of ``ctx.gba.mode``."""
    first_phase, policy = MODES[ctx.gba.mode]
    return first_phase(ctx), policy(ctx)


__all__ = ["AutoSwitch", "FixedPhase", "GBAPhase", "MODES", "Phase", "PhaseHost", "SwitchPolicy", "SyncPhase",
           "WorkerContext", "position_scheduler", "start"]
