"""The ``gba`` block of a DeepSpeed config: training mode, parameter servers, staleness policy.

    >>> GBAConfig.model_validate({"mode": "auto", "num_servers": 1, "staleness": {"threshold": 4}})
"""
from __future__ import annotations

from typing import Literal

from pydantic import Field, NonNegativeInt, PositiveFloat, PositiveInt, model_validator

from sparse_core.blocks import StrictBlock

HEARTBEAT_LEASE = 5  # a rank whose heartbeat did not move for this many periods (the lease) is presumed lost


class StalenessConfig(StrictBlock):
    """How gradients computed on an old model version are weighed."""

    threshold: int = Field(
        4, ge=0, description="Staleness tau = version now - token (in model versions) up to which a gradient keeps "
                             "its full weight; above it the weight falls as decay says.")
    # "drop" by default: the paper's token control discards severely stale gradients outright.
    decay: Literal["drop", "inverse", "exponential"] = Field(
        "drop", description='Weight above threshold, with excess = tau - threshold: "drop" 0 (the gradient does not '
                            'count toward M), "inverse" 1 / (1 + excess), "exponential" rate ** excess.')
    rate: PositiveFloat = Field(
        0.5, description='Base of the exponential decay, weight = rate ** (tau - threshold); read only by decay '
                         '"exponential", which needs rate < 1.')

    @model_validator(mode="after")
    def _decaying_rate(self) -> "StalenessConfig":
        """decay "exponential" needs rate < 1 (rate >= 1 would never decay)."""
        if self.decay == "exponential" and self.rate >= 1.0:
            raise ValueError(f"decay 'exponential' needs 0 < rate < 1 (rate >= 1 would never decay), got {self.rate!r}")
        return self


class SwitchConfig(StrictBlock):
    """The straggler detector that drives ``mode: auto``."""

    slow_ratio: float = Field(
        1.5, gt=1.0, description="A worker turns slow when the median of its last window step times exceeds "
                                 "slow_ratio x the reference (the lower median of the workers' medians) and the "
                                 "gap is significant: below 64 workers more than 3 scaled MADs of its own jitter, "
                                 "from 64 workers on more than a bar over the spread of all workers' log-medians "
                                 "that grows with N (5.5 sigmas at 64, 6.0 at 1,024), for window consecutive "
                                 "steps (so CPU contention that slows a worker for a few steps is not a straggler).")
    recover_ratio: float = Field(
        1.2, gt=1.0, description="A slow worker recovers when its median step time falls below recover_ratio x the "
                                 "reference (hysteresis) for window // 2 consecutive steps; auto goes back to sync "
                                 "when no worker is slow.")
    window: PositiveInt = Field(  # step times per worker in the robust statistic
        8, description="Recent step times per worker whose median and MAD the detector compares; no switch before "
                       "this many steps are seen.")
    min_dwell_steps: PositiveInt = Field(
        20, description="Steps that must pass after a mode switch before the next one, so the job does not flap "
                        "between modes.")

    @model_validator(mode="after")
    def _hysteresis(self) -> "SwitchConfig":
        """recover_ratio must be below slow_ratio"""
        if self.recover_ratio >= self.slow_ratio:
            raise ValueError(f"recover_ratio={self.recover_ratio} must be below slow_ratio={self.slow_ratio}")
        return self


class GBAConfig(StrictBlock):
    """Validated ``"gba"`` block."""

    mode: Literal["sync", "gba", "auto"] = Field(
        "sync", description='Training mode: "sync" DeepSpeed\'s all-reduce over the workers, "gba" global-batch '
                            'gradient aggregation on the parameter servers, "auto" starts in sync and switches '
                            'between the two as the straggler detector (switch) decides.')
    num_servers: PositiveInt = Field(
        1, description="Parameter-server ranks, the last num_servers of the launch (the other ranks are workers); "
                       "they hold the dense parameters' shards in gba phases and the server tables' rows (row id on "
                       "server id % num_servers).")
    staleness: StalenessConfig = Field(
        StalenessConfig(), description="How gradients computed on an old model version are weighed.")
    switch: SwitchConfig = Field(SwitchConfig(), description="The straggler detector that drives ``mode: auto``.")
    timeout_s: PositiveFloat = Field(
        60.0, description="Deadline in seconds of every wait on the control plane and on a server reply; a server "
                          "that dies, freezes or stops answering stops the job within it (ServerLostError naming "
                          "the server). Must exceed the lease (5 x heartbeat_s) and stay below the launcher's and "
                          "DeepSpeed's own timeouts.")
    heartbeat_s: PositiveFloat = Field(
        2.0, description="Period in seconds of each rank's heartbeat; a rank whose heartbeat did not move for 5 "
                         "periods (the lease) is presumed lost. 5 x heartbeat_s must be below timeout_s.")
    max_lead: NonNegativeInt | None = Field(
        None, description="None: fully asynchronous GBA; k: a worker's n-th pull of a phase waits for version >= "
                          "start + n - k (bounded staleness, SSP-style); 0 is lockstep, where a gba step equals a "
                          "sync step exactly.")
    grads_per_update: PositiveInt | None = Field(
        None, description="Gradients the servers aggregate per update (M); None: one per worker, i.e. the sync "
                          "global batch, which is GBA's tuning-free setting; 1 is plain asynchronous PS training.")
    sync_tables: Literal["workers", "servers"] = Field(
        "workers", description='Where the server tables\' rows live during the sync phases of mode "auto": '
                               '"workers" (each worker holds every row with its row optimizer, the rows\' gradients '
                               'are all-gathered over the workers, and the tables are handed to the servers at a '
                               'switch to gba and back at the return, as the dense part is) or "servers" (every '
                               'step pulls and pushes its rows through the servers; for tables too large for a '
                               'worker). Other modes keep the rows on the servers.')
    control_file: str | None = Field(
        None, description="Where the first server writes HOST:PORT of the control plane, for a restarted worker to "
                          "rejoin (gba_engine.rejoin); None: not written (the address is still logged by the first "
                          "server).")

    @model_validator(mode="after")
    def _timeout_hierarchy(self) -> "GBAConfig":
        """heartbeat_s < lease (5 x heartbeat_s) < timeout_s: a lost peer must be found before any wait gives up."""
        lease = HEARTBEAT_LEASE * self.heartbeat_s
        if lease >= self.timeout_s:
            raise ValueError(
                f"heartbeat_s={self.heartbeat_s:g} gives a lease of {HEARTBEAT_LEASE} x {self.heartbeat_s:g} = "
                f"{lease:g}s (a rank silent that long is presumed lost), which must be below timeout_s="
                f"{self.timeout_s:g}: a frozen server would otherwise not be told from a slow one before the "
                f"deadline; lower heartbeat_s below {self.timeout_s / HEARTBEAT_LEASE:g} or raise timeout_s above "
                f"{lease:g} (docs/gba.md, 'Timeouts and lost servers')")
        return self
