"""The MoE layer a validated ``moe_proto`` block describes: one mapping from block keys to layer arguments.

The routing fields come from :func:`moe_proto.router.router_config_of_block` (the router's
one declaration, :class:`~moe_proto.router.RouterConfig`); the rest are the layer's own.

Example::

    >>> from moe_proto.config import MoEProtoConfig
    >>> block = MoEProtoConfig(num_experts=4, num_prototypes=2, top_k=1)
    >>> layer = moe_layer(block, hidden_size=16, ffn_hidden_size=32)
    >>> layer.num_experts, layer.args.num_prototypes, layer.aux_loss_coef
    (4, 2, 0.01)
"""
from __future__ import annotations

import dataclasses
from typing import Any, Dict, Optional

from torch import nn

from .config import MoEProtoConfig
from .layer import moe_class
from .replicated import ReplicatedMoE
from .router import router_config_of_block


def layer_kwargs(block: MoEProtoConfig) -> Dict[str, Any]:
    """``MoE(...)`` keyword arguments for ``block`` (routing noise off: routing follows the block alone).

    Example::

        >>> layer_kwargs(MoEProtoConfig(num_experts=8, top_k=2))["k"]
        2
    """
    return dict(dataclasses.asdict(router_config_of_block(block)), ep_size=block.ep_size,
                num_shared_experts=block.num_shared_experts,
                shared_expert_ffn_hidden_size=block.shared_expert_ffn_hidden_size)


def moe_layer(block: MoEProtoConfig, hidden_size: int, *, expert: Optional[nn.Module] = None,
              ffn_hidden_size: Optional[int] = None, activation: Optional[str] = None,
              zero_stage: Optional[int] = None, replicated: bool = False, **overrides: Any) -> nn.Module:
    """The layer of ``block`` over ``hidden_size``; ``aux_loss_coef`` is the block's weight for its ``l_aux``.

    ``replicated``: every rank holds every expert as a dense parameter (:class:`ReplicatedMoE`, for
    engines such as GBA's that must not see an MoE layer; needs ``ep_size`` 1). ``zero_stage=3``
    builds the class DeepSpeed accepts under ZeRO stage 3 (:func:`moe_proto.moe_class`).
    ``overrides`` replace block-derived arguments.

    Example::

        moe = moe_layer(block, hidden_size=256, ffn_hidden_size=1024)
        out, l_aux, counts = moe(x); loss = loss + moe.aux_loss_coef * l_aux
    """
    if replicated and block.ep_size != 1:
        raise ValueError(f"moe_proto.ep_size={block.ep_size}: replicated experts (a gba job) need ep_size 1")
    kwargs = {**layer_kwargs(block), "ffn_hidden_size": ffn_hidden_size, "activation": activation, **overrides}
    layer: nn.Module = moe_class(zero_stage)(hidden_size, expert, **kwargs)
    if replicated:
        layer = ReplicatedMoE(layer)
    layer.aux_loss_coef = float(block.aux_loss_coef)
    return layer
