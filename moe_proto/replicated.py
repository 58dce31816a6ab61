"""An MoE layer whose experts are plain dense parameters, for engines that must not see an MoE layer (GBA).

Example::

    >>> from moe_proto.layer import MoE
    >>> m = ReplicatedMoE(MoE(8, None, num_experts=4, ffn_hidden_size=8, use_rts=False))
    >>> sorted(k for k, _ in m.named_parameters())
    ['experts.w1', 'experts.w2', 'gate.weight']
"""
from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from .layer import MoEBase


class ReplicatedMoE(nn.Module):
    """Every rank holds every expert; DeepSpeed sees no MoE layer, so experts are all-reduced like dense weights.

    It holds the layer outside its children (its gate and experts become this module's
    children, so the state_dict keys are the layer's own) and marks the expert weights as
    all-reduced like any dense weight. For ``ep_size`` 1 only. Under ``gba_engine`` the
    servers aggregate the experts with the other dense parameters.
    """

    def __init__(self, layer: MoEBase) -> None:
        super().__init__()
        if layer.ep_size != 1:
            raise ValueError(f"a replicated MoE layer holds every expert: ep_size must be 1, got {layer.ep_size}")
        object.__setattr__(self, "layer", layer)  # not a child: DeepSpeed's isinstance(module, MoE) scan misses it
        for name, child in layer.named_children():
            self.add_module(name, child)
        for param in layer.experts.parameters():
            param.allreduce = True  # DeepSpeed's marker: reduced over the data-parallel group with the dense ones

    @property
    def last_stats(self) -> Any:
        """The layer's routing stats of its last forward (``moe_proto.routing.RoutingStats``)."""
        return self.layer.last_stats

    def train(self, mode: bool = True) -> "ReplicatedMoE":
        super().train(mode)
        self.layer.training = mode  # the layer's own flag picks the capacity factor (its children are ours)
        return self

    def forward(self, hidden_states: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        return self.layer(hidden_states)
