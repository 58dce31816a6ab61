"""Staleness decay: the weight a gradient keeps when it was computed on an old model version.

A gradient's staleness is ``tau = version now - token`` (the token is the version its
batch started from). Up to ``threshold`` the gradient keeps its full weight; above it
the weight falls according to ``kind``, measured from the threshold so the curve is
continuous there (``excess = tau - threshold``):

* ``"drop"``        weight 0: the gradient is discarded (and does not count toward M).
* ``"inverse"``     ``1 / (1 + excess)``; with ``threshold=0`` this is the usual ``1/(1+tau)``.
* ``"exponential"`` ``rate ** excess`` with ``0 < rate < 1``.

Default: ``drop`` with ``threshold=4`` (the ``"gba"`` block's defaults). The paper's token
control "decays the gradients with severe staleness" and keeps the global batch of
fresh-enough gradients equal to the synchronous one; dropping is the choice that keeps
every applied update a plain mean over M admitted gradients (the tuning-free property
holds by construction), while the two soft decays are kept for users who would rather
not waste a straggler's work. The exact function in the paper's section 3 could not be
read (research/gba_anchors.md); change the default only against that text.

Example::

    decay = StalenessDecay("inverse", threshold=2)
    decay(1), decay(3), decay(5)            # (1.0, 0.5, 0.25)
    decay.weights(torch.tensor([0, 4]))     # tensor([1.0000, 0.3333])
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Literal

import torch
from torch import Tensor

if TYPE_CHECKING:
    from .config import StalenessConfig

DecayKind = Literal["drop", "inverse", "exponential"]
DECAY_KINDS: tuple[str, ...] = ("drop", "inverse", "exponential")


@dataclasses.dataclass(frozen=True)
class StalenessDecay:
    """``decay(tau) -> weight in [0, 1]``; 1 up to ``threshold``, then falling with ``kind``.

    Example::

        StalenessDecay("exponential", threshold=0, rate=0.5)(3)   # 0.125
    """

    kind: DecayKind = "drop"
    threshold: int = 4
    rate: float = 0.5  # only read by "exponential"

    def __post_init__(self) -> None:
        if self.kind not in DECAY_KINDS:
            raise ValueError(f"staleness decay must be one of {DECAY_KINDS}, got {self.kind!r}")
        if isinstance(self.threshold, bool) or not isinstance(self.threshold, int) or self.threshold < 0:
            raise ValueError(f"staleness threshold must be an integer >= 0, got {self.threshold!r}")
        if self.kind == "exponential" and not 0.0 < self.rate < 1.0:
            raise ValueError(f"exponential decay needs 0 < rate < 1 (rate=1 would never decay), got {self.rate!r}")

    @classmethod
    def from_config(cls, staleness: "StalenessConfig") -> "StalenessDecay":
        """The decay of a validated ``gba.staleness`` block.

        Example::

            StalenessDecay.from_config(GBAConfig().staleness)   # StalenessDecay('drop', 4, 0.5)
        """
        return cls(kind=staleness.decay, threshold=staleness.threshold, rate=staleness.rate)

    def __call__(self, tau: int) -> float:
        """Weight of one gradient of staleness ``tau`` (an int >= 0)."""
        if isinstance(tau, bool) or not isinstance(tau, int):
            raise TypeError(f"staleness must be an int, got {type(tau).__name__}")
        if tau < 0:
            raise ValueError(f"staleness must be >= 0 (a token cannot be newer than the model), got {tau}")
        excess = tau - self.threshold
        if excess <= 0:
            return 1.0
        if self.kind == "drop":
            return 0.0
        if self.kind == "inverse":
            return 1.0 / (1.0 + excess)
        return float(self.rate ** excess)

    def weights(self, taus: Tensor) -> Tensor:
        """Vectorised ``__call__`` over an integer tensor of staleness values; returns float32.

        Example::

            StalenessDecay("drop", threshold=1).weights(torch.tensor([0, 1, 2]))   # [1., 1., 0.]
        """
        if taus.dtype.is_floating_point or taus.dtype == torch.bool:
            raise TypeError(f"staleness values must be an integer tensor, got {taus.dtype}")
        if taus.numel() and int(taus.min()) < 0:
            raise ValueError(f"staleness must be >= 0, got min {int(taus.min())}")
        excess = (taus.to(torch.float64) - self.threshold).clamp_min(0.0)
        if self.kind == "drop":
            out = (excess == 0).to(torch.float64)
        elif self.kind == "inverse":
            out = 1.0 / (1.0 + excess)
        else:
            out = torch.pow(torch.tensor(self.rate, dtype=torch.float64), excess)
        return out.to(torch.float32)
