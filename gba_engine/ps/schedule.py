"""DeepSpeed's ``"scheduler"`` block as a function of the update number, for the parameter servers.

DeepSpeed steps its scheduler after every optimizer step, so optimizer step ``u`` (0-based)
runs with the learning rate of scheduler iteration ``u - 1`` (the constructor sets
iteration -1). The servers apply update ``u`` when their version is ``u``, so they ask
DeepSpeed's own scheduler class for iteration ``version - 1``: sync, gba and every switch
between them follow one learning-rate curve, with DeepSpeed's formulas, not copies.

The supported schedules are pure functions of the iteration (``WarmupLR``,
``WarmupDecayLR``, ``WarmupCosineLR``, ``LRRangeTest``); ``OneCycle`` also cycles the
optimizer's momentum, which the servers' optimizers do not follow, so it is refused.

Example::

    sched = ServerLRSchedule({"type": "WarmupLR", "params": {"warmup_max_lr": 0.01, "warmup_num_steps": 100}},
                             base_lr=0.01)
    sched.lr(0), sched.lr(50)        # the learning rates of DeepSpeed's optimizer steps 0 and 50
"""
from __future__ import annotations

import logging
from typing import Any, Mapping

import torch

SUPPORTED = ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "LRRangeTest")


class ServerLRSchedule:
    """Learning rate of optimizer step ``u`` under a DeepSpeed scheduler block (see the module docstring)."""

    def __init__(self, block: Mapping[str, Any], base_lr: float) -> None:
        from deepspeed.runtime import lr_schedules

        kind = block.get("type")
        if kind not in SUPPORTED:
            raise ValueError(f"scheduler type {kind!r} cannot run on the parameter servers; supported: "
                             f"{', '.join(SUPPORTED)} (OneCycle also cycles momentum, which the servers do not)")
        self.type = kind
        # a one-element optimizer that only carries the learning rate DeepSpeed's class writes
        self._holder = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=base_lr)
        quiet = logging.getLogger("DeepSpeed")
        level = quiet.level
        quiet.setLevel(logging.ERROR)  # its constructor warns that iteration -1 comes "before it has started"
        try:
            self._sched = getattr(lr_schedules, kind)(self._holder, **dict(block.get("params") or {}))
        except TypeError as exc:
            raise ValueError(f"scheduler {kind!r}: {exc}") from None
        finally:
            quiet.setLevel(level)
        self._first = float(self._holder.param_groups[0]["lr"])

    def lr(self, update: int) -> float:
        """The learning rate of optimizer step ``update`` (0-based), as DeepSpeed's engine would use it."""
        if update < 0:
            raise ValueError(f"update must be >= 0, got {update}")
        if update == 0:
            return self._first
        self._sched.step(update - 1)
        return float(self._holder.param_groups[0]["lr"])
