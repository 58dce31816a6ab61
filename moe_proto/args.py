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
from .routing import AUX_LOSS_SCOPES, DROP_POLICIES, SCORE_FUNCTIONS

NOISY_GATE_POLICIES = (None, "None", "Jitter", "RSample")


@dataclass(frozen=True, kw_only=True)
class RoutingOptions:
    """The routing options (docs/moe.md, "Routing options"), shared by the layer's and the LM's arguments.

    Example::

        routing_options_of(block)   # {"expert_bias_update_rate": 0.0, "score_function": "softmax", ...}
    """

    expert_bias_update_rate: float = 0.0
    score_function: str = "softmax"
    normalize_routes: Optional[bool] = None
    aux_loss_scope: str = "micro_batch"
    num_shared_experts: int = 0
    shared_expert_ffn_hidden_size: Optional[int] = None


ROUTING_OPTION_NAMES = tuple(f.name for f in fields(RoutingOptions))


def routing_options_of(source: Any) -> Dict[str, Any]:
    """The routing options read from anything that has them as attributes (a config block, an args record).

    Example::

        MoE(64, None, num_experts=8, ffn_hidden_size=128, **routing_options_of(block))
    """
    return {name: getattr(source, name) for name in ROUTING_OPTION_NAMES}


@dataclass(frozen=True)
class MoEArgs(RoutingOptions):
    """Arguments of one MoE layer.

    Attributes (DeepSpeed's):
        k: experts chosen per prototype (top-k'); a token has ``num_prototypes * k`` routes.
        capacity_factor / eval_capacity_factor: used in ``train()`` / ``eval()`` mode.
        noisy_gate_policy: None, ``"Jitter"`` (router input x U(0.99, 1.01)) or ``"RSample"``
            (Gumbel noise on the logits for choosing experts); training only.
        drop_tokens: False is dropless (same as ``dropless=True``).
        use_rts: random token selection for capacity drops, training only (eval uses ``drop_policy``).
        top2_2nd_expert_sampling: Gumbel-sample choices after the first (k >= 2), training only.
        use_tutel: True logs a warning and falls back (as DeepSpeed does without Tutel installed).
        enable_expert_tensor_parallelism: as in DeepSpeed, it matters only with a tensor-parallel
            ``groups.mpu``; without one the layer trains as with False. With a tensor-parallel mpu the
            layer refuses it when bound (``MoE.set_deepspeed_parallelism``).

    Attributes (this package's):
        num_prototypes: expert prototyping groups (P); 1 is plain top-k.
        dropless: no capacity, nothing dropped.
        drop_policy: ``"probs"`` (default) or ``"position"``; see :func:`moe_proto.routing.route`.
        z_loss_coef: weight of the router z-loss added to the returned ``l_aux``.
        activation: expert activation when the layer builds its own experts (default ``"gelu"``).
        ffn_hidden_size: expert hidden size when the layer builds its own experts.
        deepspeed_compat: reproduce DeepSpeed 0.19.8 ``top1gating``/``top2gating`` routing.
        expert_bias_update_rate: aux-loss-free balancing step (0: off); see :mod:`moe_proto.balance`.
        score_function: ``"softmax"`` or ``"sigmoid"`` router scores.
        normalize_routes: divide a prototype's selected gates by their sum (None: when k > 1).
        aux_loss_scope: ``"micro_batch"``, ``"sequence"`` or ``"global_batch"`` load-balancing loss.
        num_shared_experts: dense experts every token goes through, added to the routed output.
        shared_expert_ffn_hidden_size: hidden width of each shared expert (None: the routed experts').
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
        self._check_routing_options()
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
        for name in ("use_tutel", "enable_expert_tensor_parallelism"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")

    @property
    def uses_expert_bias(self) -> bool:
        return self.expert_bias_update_rate > 0

    @property
    def default_routing(self) -> bool:
        """True when none of the routing options is on (the layer then does exactly what it did before)."""
        return (not self.uses_expert_bias and self.score_function == "softmax" and self.normalize_routes is None
                and self.aux_loss_scope == "micro_batch")

    def _check_routing_options(self) -> None:
        rate = self.expert_bias_update_rate
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) or rate < 0:
            raise ValueError(f"expert_bias_update_rate must be a number >= 0, got {rate!r}")
        if self.score_function not in SCORE_FUNCTIONS:
            raise ValueError(f"score_function={self.score_function!r} is not one of {SCORE_FUNCTIONS}")
        if self.aux_loss_scope not in AUX_LOSS_SCOPES:
            raise ValueError(f"aux_loss_scope={self.aux_loss_scope!r} is not one of {AUX_LOSS_SCOPES}")
        if self.normalize_routes not in (None, True, False):
            raise ValueError(f"normalize_routes must be None, True or False, got {self.normalize_routes!r}")
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
        if self.deepspeed_compat and not self.default_routing:
            raise ValueError("deepspeed_compat=True reproduces DeepSpeed's softmax top1/top2 gating: leave "
                             "expert_bias_update_rate 0, score_function 'softmax', normalize_routes None and "
                             "aux_loss_scope 'micro_batch'")
        if self.uses_expert_bias and (self.noise_policy == "RSample" or (self.k >= 2 and
                                                                         self.top2_2nd_expert_sampling)):
            raise ValueError("expert_bias_update_rate > 0 biases the expert choice; noisy choice "
                             "(noisy_gate_policy='RSample' or top2_2nd_expert_sampling with k >= 2) cannot be "
                             "combined with it: turn the noise off")

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
