"""One validated arguments record for the :class:`moe_proto.MoE` layer.

The first fields mirror ``deepspeed.moe.layer.MoE`` (same names, same defaults); the
rest are this package's additions. Every unsupported or contradictory value raises a
``ValueError`` naming the argument, so nothing is silently ignored.

Example::

    args = MoEArgs(hidden_size=256, num_experts=16, k=1, num_prototypes=2, use_rts=False)
    args.routes_per_token   # 2
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .experts import ACTIVATION_NAMES
from .routing import DROP_POLICIES

NOISY_GATE_POLICIES = (None, "None", "Jitter", "RSample")


@dataclass(frozen=True)
class MoEArgs:
    """Arguments of one MoE layer.

    Attributes (DeepSpeed's):
        k: experts chosen per prototype (top-k'); a token has ``num_prototypes * k`` routes.
        capacity_factor / eval_capacity_factor: used in ``train()`` / ``eval()`` mode.
        noisy_gate_policy: None, ``"Jitter"`` (router input x U(0.99, 1.01)) or ``"RSample"``
            (Gumbel noise on the logits for choosing experts); training only.
        drop_tokens: False is dropless (same as ``dropless=True``).
        use_rts: random token selection for capacity drops, training only (eval uses ``drop_policy``).
        top2_2nd_expert_sampling: Gumbel-sample choices after the first (k >= 2), training only.
        use_tutel, enable_expert_tensor_parallelism: accepted for signature compatibility;
            only False is supported.

    Attributes (this package's):
        num_prototypes: expert prototyping groups (P); 1 is plain top-k.
        dropless: no capacity, nothing dropped.
        drop_policy: ``"probs"`` (default) or ``"position"``; see :func:`moe_proto.routing.route`.
        z_loss_coef: weight of the router z-loss added to the returned ``l_aux``.
        activation: expert activation when the layer builds its own experts (default ``"gelu"``).
        ffn_hidden_size: expert hidden size when the layer builds its own experts.
        deepspeed_compat: reproduce DeepSpeed 0.19.8 ``top1gating``/``top2gating`` routing.
    """

    hidden_size: int
    num_experts: int = 1
    ep_size: int = 1
    k: int = 1
    capacity_factor: float = 1.0
    eval_capacity_factor: float = 1.0
    min_capacity: int = 4
    use_residual: bool = False
    noisy_gate_policy: Optional[str] = None
    drop_tokens: bool = True
    use_rts: bool = True
    use_tutel: bool = False
    enable_expert_tensor_parallelism: bool = False
    top2_2nd_expert_sampling: bool = True
    num_prototypes: int = 1
    dropless: bool = False
    drop_policy: Optional[str] = None
    z_loss_coef: float = 0.0
    activation: Optional[str] = None
    ffn_hidden_size: Optional[int] = None
    deepspeed_compat: bool = False

    def __post_init__(self) -> None:
        self._check_sizes()
        self._check_capacity()
        self._check_unsupported()
        if self.deepspeed_compat:
            self._check_compat()

    @property
    def is_dropless(self) -> bool:
        return self.dropless or not self.drop_tokens

    @property
    def routes_per_token(self) -> int:
        return self.num_prototypes * self.k

    @property
    def num_local_experts(self) -> int:
        return self.num_experts // self.ep_size

    @property
    def expert_group_name(self) -> str:
        return f"ep_size_{self.ep_size}"

    @property
    def noise_policy(self) -> Optional[str]:
        return None if self.noisy_gate_policy in (None, "None") else self.noisy_gate_policy

    @property
    def effective_drop_policy(self) -> str:
        return self.drop_policy or "probs"

    def _check_sizes(self) -> None:
        for name in ("hidden_size", "num_experts", "ep_size", "k", "num_prototypes"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.num_experts % self.ep_size:
            raise ValueError(f"num_experts={self.num_experts} must be divisible by ep_size={self.ep_size}")
        if self.num_experts % self.num_prototypes:
            raise ValueError(f"num_experts={self.num_experts} must be divisible by "
                             f"num_prototypes={self.num_prototypes}")
        per_prototype = self.num_experts // self.num_prototypes
        if self.k > per_prototype:
            raise ValueError(f"k={self.k} exceeds the {per_prototype} experts of each prototype "
                             f"(num_experts={self.num_experts}, num_prototypes={self.num_prototypes})")
        if self.ffn_hidden_size is not None and (not isinstance(self.ffn_hidden_size, int)
                                                 or self.ffn_hidden_size < 1):
            raise ValueError(f"ffn_hidden_size must be an integer >= 1, got {self.ffn_hidden_size!r}")
        if self.activation is not None and self.activation not in ACTIVATION_NAMES:
            raise ValueError(f"activation={self.activation!r} is not one of {ACTIVATION_NAMES}")

    def _check_capacity(self) -> None:
        for name in ("capacity_factor", "eval_capacity_factor"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"{name} must be a number > 0, got {value!r}")
        if not isinstance(self.min_capacity, int) or self.min_capacity < 0:
            raise ValueError(f"min_capacity must be an integer >= 0, got {self.min_capacity!r}")
        if self.drop_policy is not None and self.drop_policy not in DROP_POLICIES:
            raise ValueError(f"drop_policy={self.drop_policy!r} is not one of {DROP_POLICIES}")
        if self.drop_policy is not None and self.is_dropless:
            raise ValueError(f"drop_policy={self.drop_policy!r} has no effect in dropless mode "
                             f"(dropless={self.dropless}, drop_tokens={self.drop_tokens}); leave it None")
        if self.noisy_gate_policy not in NOISY_GATE_POLICIES:
            raise ValueError(f"noisy_gate_policy={self.noisy_gate_policy!r} is not one of {NOISY_GATE_POLICIES}")
        if not isinstance(self.z_loss_coef, (int, float)) or self.z_loss_coef < 0:
            raise ValueError(f"z_loss_coef must be a number >= 0, got {self.z_loss_coef!r}")

    def _check_unsupported(self) -> None:
        if self.use_tutel:
            raise ValueError("use_tutel=True is not supported: moe_proto already dispatches by index "
                             "(sort + gather); set use_tutel=False")
        if self.enable_expert_tensor_parallelism:
            raise ValueError("enable_expert_tensor_parallelism=True is not supported by moe_proto.MoE; "
                             "set it to False")

    def _check_compat(self) -> None:
        if self.k not in (1, 2):
            raise ValueError(f"deepspeed_compat=True reproduces top1gating/top2gating only: k must be 1 or 2, "
                             f"got {self.k}")
        if self.num_prototypes != 1:
            raise ValueError("deepspeed_compat=True has no expert prototyping: set num_prototypes=1")
        if self.use_rts:
            raise ValueError("deepspeed_compat=True reproduces DeepSpeed with RTS off: pass use_rts=False")
        if self.k == 2 and self.top2_2nd_expert_sampling:
            raise ValueError("deepspeed_compat=True with k=2 reproduces DeepSpeed without second-expert "
                             "sampling: pass top2_2nd_expert_sampling=False")
        if self.noise_policy == "RSample":
            raise ValueError("deepspeed_compat=True does not reproduce noisy_gate_policy='RSample'; "
                             "use None or 'Jitter'")
        if self.drop_policy is not None:
            raise ValueError("deepspeed_compat=True uses DeepSpeed's own drop order: leave drop_policy None")
