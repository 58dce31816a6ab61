"""The ``gba`` block of a DeepSpeed config: training mode, parameter servers, staleness policy.

    >>> GBAConfig.model_validate({"mode": "auto", "num_servers": 1, "staleness": {"threshold": 4}})
"""
from __future__ import annotations

from typing import Literal

from pydantic import Field, NonNegativeInt, PositiveFloat, PositiveInt, model_validator

from sparse_scale.base.blocks import StrictBlock



class StalenessConfig(StrictBlock):
    """How gradients computed on an old model version are weighed."""

    threshold: int = Field(4, ge=0)
    # "drop" by default: the paper's token control discards severely stale gradients outright.
    decay: Literal["drop", "inverse", "exponential"] = "drop"
    rate: PositiveFloat = 0.5  # base of the exponential decay


class SwitchConfig(StrictBlock):
    """The straggler detector that drives ``mode: auto``."""

    slow_ratio: float = Field(1.5, gt=1.0)  # a worker is slow above ratio x the median step time
    recover_ratio: float = Field(1.2, gt=1.0)  # hysteresis: back to sync below this
    window: PositiveInt = 8  # step times per worker in the robust statistic
    min_dwell_steps: PositiveInt = 20

    @model_validator(mode="after")
    def _hysteresis(self) -> "SwitchConfig":
        if self.recover_ratio >= self.slow_ratio:
            raise ValueError(f"recover_ratio={self.recover_ratio} must be below slow_ratio={self.slow_ratio}")
        return self


class GBAConfig(StrictBlock):
    """Validated ``"gba"`` block."""

    mode: Literal["sync", "gba", "auto"] = "sync"
    num_servers: PositiveInt = 1
    staleness: StalenessConfig = StalenessConfig()
    switch: SwitchConfig = SwitchConfig()
    timeout_s: PositiveFloat = 60.0
    heartbeat_s: PositiveFloat = 2.0
    # None: fully asynchronous GBA; k: a worker's n-th pull of a phase waits for version >= start + n - k
    # (bounded staleness, SSP-style); 0 is lockstep, where a gba step equals a sync step exactly.
    max_lead: NonNegativeInt | None = None
    # Gradients the servers aggregate per update (M). None: one per worker, i.e. the sync global
    # batch, which is GBA's tuning-free setting; 1 is plain asynchronous PS training.
    grads_per_update: PositiveInt | None = None
    # Where the first server writes HOST:PORT of the control plane, for a restarted worker to rejoin
    # (gba_engine.rejoin); None: not written (the address is still logged by the first server).
    control_file: str | None = None
