"""One validated arguments record for the :class:`moe_proto.MoE` layer.

The first fields mirror ``deepspeed.moe.layer.MoE`` (same names, same defaults); the
rest are this package's additions. Every unsupported or contradictory value raises a
``ValueError`` naming the argument, so nothing is silently ignored.

Example::

    args = MoEArgs(hidden_size=256, num_experts=16, k=1, num_prototypes=2, use_rts=False)
    args.routes_per_token   # 2
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Dict, Optional

from .experts import ACTIVATION_NAMES
from .router import (NOISY_GATE_POLICIES, ROUTER_FIELDS, ROUTING_OPTION_FIELDS, RouterConfig, RoutingOptions,
                     router_fields)

__all__ = ["MoEArgs", "RouterConfig", "RoutingOptions", "SharedExpertOptions", "NOISY_GATE_POLICIES",
           "ROUTING_OPTION_NAMES", "routing_options_of", "router_fields", "ROUTER_FIELDS"]


@dataclass(frozen=True, kw_only=True)
class SharedExpertOptions:
    """Shared experts: a dense FFN every token goes through, added to the routed output (0: none).

    Example::

        SharedExpertOptions(num_shared_experts=2, shared_expert_ffn_hidden_size=64)
    """

    num_shared_experts: int = 0
    shared_expert_ffn_hidden_size: Optional[int] = None


ROUTING_OPTION_NAMES = ROUTING_OPTION_FIELDS + tuple(f.name for f in fields(SharedExpertOptions))


def routing_options_of(source: Any) -> Dict[str, Any]:
    """The opt-in routing and shared-expert options read from anything that has them (a config block, an args record).

    Example::

        MoE(64, None, num_experts=8, ffn_hidden_size=128, **routing_options_of(block))
    """
    return {name: getattr(source, name) for name in ROUTING_OPTION_NAMES}


@dataclass(frozen=True, kw_only=True)
class MoEArgs(RouterConfig, SharedExpertOptions):
    """Arguments of one MoE layer: the router's (:class:`~moe_proto.router.RouterConfig`, validated there)
    plus the layer's own.

    Attributes (the layer's, DeepSpeed's names):
        hidden_size: model width d.
        ep_size: expert-parallel size (each rank holds ``num_experts / ep_size`` experts).
        use_residual: PR-MoE's dense MLP mixed in by a learned coefficient.
        use_tutel: True logs a warning and falls back (as DeepSpeed does without Tutel installed).
        enable_expert_tensor_parallelism: as in DeepSpeed, it matters only with a tensor-parallel
            ``groups.mpu``; without one the layer trains as with False. With a tensor-parallel mpu the
            layer refuses it when bound (``MoE.set_deepspeed_parallelism``).

    Attributes (this package's):
        activation: expert activation when the layer builds its own experts (default ``"gelu"``).
        ffn_hidden_size: expert hidden size when the layer builds its own experts.
        num_shared_experts / shared_expert_ffn_hidden_size: :class:`SharedExpertOptions`.
    """

    hidden_size: int
    ep_size: int = 1
    use_residual: bool = False
    use_tutel: bool = False
    enable_expert_tensor_parallelism: bool = False
    activation: Optional[str] = None
    ffn_hidden_size: Optional[int] = None

    def __post_init__(self) -> None:
        super().__post_init__()  # the routing fields, checked once in RouterConfig
        self._check_layer()

    @property
    def num_local_experts(self) -> int:
        return self.num_experts // self.ep_size

    @property
    def expert_group_name(self) -> str:
        return f"ep_size_{self.ep_size}"

    def _check_layer(self) -> None:
        for name in ("hidden_size", "ep_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.num_experts % self.ep_size:
            raise ValueError(f"num_experts={self.num_experts} must be divisible by ep_size={self.ep_size}")
        if self.ffn_hidden_size is not None and (not isinstance(self.ffn_hidden_size, int)
                                                 or self.ffn_hidden_size < 1):
            raise ValueError(f"ffn_hidden_size must be an integer >= 1, got {self.ffn_hidden_size!r}")
        if self.activation is not None and self.activation not in ACTIVATION_NAMES:
            raise ValueError(f"activation={self.activation!r} is not one of {ACTIVATION_NAMES}")
        for name in ("use_residual", "use_tutel", "enable_expert_tensor_parallelism"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if isinstance(self.num_shared_experts, bool) or not isinstance(self.num_shared_experts, int) \
                or self.num_shared_experts < 0:
            raise ValueError(f"num_shared_experts must be an integer >= 0, got {self.num_shared_experts!r}")
        width = self.shared_expert_ffn_hidden_size
        if width is not None and (not isinstance(width, int) or width < 1):
            raise ValueError(f"shared_expert_ffn_hidden_size must be an integer >= 1, got {width!r}")
        if width is not None and self.num_shared_experts == 0:
            raise ValueError("shared_expert_ffn_hidden_size is set but num_shared_experts=0: set num_shared_experts")
        if self.num_shared_experts and self.use_residual:
            raise ValueError("use_residual=True (PR-MoE's mixed dense MLP) and num_shared_experts > 0 both add a "
                             "dense FFN: use one of them")
