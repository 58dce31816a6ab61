"""The MoE layer's router: gate weight, noise, random token selection and balance, from one declaration.

:class:`RouterConfig` declares every routing option once (DeepSpeed's gate arguments and this
package's additions) and validates it once, when it is built; :class:`Router` is the
``nn.Module`` built from it: the gate weight ``[E, d]``, the expert balance state
(:class:`~moe_proto.balance.ExpertBalance`, aux-loss-free bias and global-batch loads) and the
training-time randomness (input jitter, RSample / second-expert Gumbel noise, random token
selection). The routing maths itself stays in :mod:`moe_proto.routing`, pure functions over
explicit tensors: the router only draws the random tensors and picks the arguments.

The layer (:class:`moe_proto.MoE`) builds its router from its arguments
(``MoEArgs`` derives from :class:`RouterConfig`, so both share these fields), and a
``moe_proto`` config block becomes a :class:`RouterConfig` through
:func:`moe_proto.from_block.router_config` (the block names ``k`` ``top_k``). A new routing
option is one field here plus its check in :meth:`RouterConfig.__post_init__`; the layer's
constructor must then list it (``tests/moe_proto/test_router.py`` fails until it does).

Example::

    router = Router(64, RouterConfig(num_experts=8, k=2, use_rts=False))
    out = router.route(torch.randn(32, 64))
    out.record.expert_index.shape       # torch.Size([32, 2])
    router(torch.randn(32, 64)).shape   # logits, as the nn.Linear gate it replaces: torch.Size([32, 8])
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Dict, NamedTuple, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd.function import once_differentiable

from . import dispatch as dispatch_ops
from . import routing
from .balance import ExpertBalance
from .buffer_pool import default_pool
from .ops import cpu_ops_for
from .routing import AUX_LOSS_SCOPES, DROP_POLICIES, SCORE_FUNCTIONS, RoutingRecord

NOISY_GATE_POLICIES = (None, "None", "Jitter", "RSample")
JITTER_EPS = 1e-2  # DeepSpeed's multiplicative_jitter default


def _is_int(value: Any, low: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass(frozen=True, kw_only=True)
class RoutingOptions:
    """The opt-in routing options (docs/moe.md, "Routing options"); off by default.

    Also a base of the LM's arguments (:class:`moe_proto.models.MoETransformerArgs`), which
    carry them to the layers. Example::

        RoutingOptions(score_function="sigmoid", normalize_routes=True)
    """

    expert_bias_update_rate: float = 0.0
    score_function: str = "softmax"
    normalize_routes: Optional[bool] = None
    aux_loss_scope: str = "micro_batch"


@dataclass(frozen=True, kw_only=True)
class RouterConfig(RoutingOptions):
    """Every routing option of an MoE layer, validated when built (a ``ValueError`` names the field).

    Attributes (DeepSpeed's ``MoE`` arguments, same names and defaults):
        num_experts: E, all experts of the layer.
        k: experts chosen per prototype (top-k'); a token has ``num_prototypes * k`` routes.
        capacity_factor / eval_capacity_factor: used in ``train()`` / ``eval()`` mode.
        min_capacity: lower bound on each expert's capacity, in routes.
        noisy_gate_policy: None, ``"Jitter"`` (router input x U(0.99, 1.01)) or ``"RSample"``
            (Gumbel noise on the logits for choosing experts); training only.
        drop_tokens: False is dropless (same as ``dropless=True``).
        use_rts: random token selection for capacity drops, training only (eval uses ``drop_policy``).
        top2_2nd_expert_sampling: Gumbel-sample choices after the first (k >= 2), training only.

    Attributes (this package's):
        num_prototypes: expert prototyping groups (P); 1 is plain top-k.
        dropless: no capacity, nothing dropped.
        drop_policy: ``"probs"`` (default) or ``"position"``; see :func:`moe_proto.routing.route`.
        z_loss_coef: weight of the router z-loss added to the returned ``l_aux``.
        deepspeed_compat: reproduce DeepSpeed 0.19.8 ``top1gating``/``top2gating`` routing.
        expert_bias_update_rate, score_function, normalize_routes, aux_loss_scope: :class:`RoutingOptions`.

    Example::

        RouterConfig(num_experts=16, k=1, num_prototypes=2, use_rts=False).routes_per_token   # 2
    """

    num_experts: int = 1
    k: int = 1
    capacity_factor: float = 1.0
    eval_capacity_factor: float = 1.0
    min_capacity: int = 4
    noisy_gate_policy: Optional[str] = None
    drop_tokens: bool = True
    use_rts: bool = True
    top2_2nd_expert_sampling: bool = True
    num_prototypes: int = 1
    dropless: bool = False
    drop_policy: Optional[str] = None
    z_loss_coef: float = 0.0
    deepspeed_compat: bool = False

    def __post_init__(self) -> None:
        self._check_sizes()
        self._check_capacity()
        self._check_noise()
        self._check_routing_options()
        if self.deepspeed_compat:
            self._check_compat()

    # -------------------------------------------------------------- derived values
    @property
    def is_dropless(self) -> bool:
        return self.dropless or not self.drop_tokens

    @property
    def routes_per_token(self) -> int:
        return self.num_prototypes * self.k

    @property
    def noise_policy(self) -> Optional[str]:
        return None if self.noisy_gate_policy in (None, "None") else self.noisy_gate_policy

    @property
    def effective_drop_policy(self) -> str:
        return self.drop_policy or "probs"

    @property
    def uses_expert_bias(self) -> bool:
        return self.expert_bias_update_rate > 0

    @property
    def default_routing(self) -> bool:
        """True when none of the opt-in routing options is on."""
        return (not self.uses_expert_bias and self.score_function == "softmax" and self.normalize_routes is None
                and self.aux_loss_scope == "micro_batch")

    def router_config(self) -> "RouterConfig":
        """Just the routing fields, as a :class:`RouterConfig` (for a record that derives from it)."""
        if type(self) is RouterConfig:
            return self
        return RouterConfig(**router_fields(self))

    # -------------------------------------------------------------- checks, one per field family
    def _check_sizes(self) -> None:
        for name in ("num_experts", "k", "num_prototypes"):
            value = getattr(self, name)
            if not _is_int(value, 1):
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.num_experts % self.num_prototypes:
            raise ValueError(f"num_experts={self.num_experts} is not divisible by "
                             f"num_prototypes={self.num_prototypes}")
        per_prototype = self.num_experts // self.num_prototypes
        if self.k > per_prototype:
            raise ValueError(f"k={self.k} exceeds the {per_prototype} experts of each prototype "
                             f"(num_experts={self.num_experts}, num_prototypes={self.num_prototypes})")

    def _check_capacity(self) -> None:
        for name in ("capacity_factor", "eval_capacity_factor"):
            value = getattr(self, name)
            if not _is_number(value) or value <= 0:
                raise ValueError(f"{name} must be a number > 0, got {value!r}")
        if not _is_int(self.min_capacity, 0):
            raise ValueError(f"min_capacity must be an integer >= 0, got {self.min_capacity!r}")
        for name in ("drop_tokens", "dropless", "use_rts", "top2_2nd_expert_sampling", "deepspeed_compat"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.drop_policy is not None and self.drop_policy not in DROP_POLICIES:
            raise ValueError(f"drop_policy={self.drop_policy!r} is not one of {DROP_POLICIES}")
        if self.drop_policy is not None and self.is_dropless:
            raise ValueError(f"drop_policy={self.drop_policy!r} has no effect in dropless mode "
                             f"(dropless={self.dropless}, drop_tokens={self.drop_tokens}); leave it None")
        if not _is_number(self.z_loss_coef) or self.z_loss_coef < 0:
            raise ValueError(f"z_loss_coef must be a number >= 0, got {self.z_loss_coef!r}")

    def _check_noise(self) -> None:
        if self.noisy_gate_policy not in NOISY_GATE_POLICIES:
            raise ValueError(f"noisy_gate_policy={self.noisy_gate_policy!r} is not one of {NOISY_GATE_POLICIES}")

    def _check_routing_options(self) -> None:
        rate = self.expert_bias_update_rate
        if not _is_number(rate) or rate < 0:
            raise ValueError(f"expert_bias_update_rate must be a number >= 0, got {rate!r}")
        if self.score_function not in SCORE_FUNCTIONS:
            raise ValueError(f"score_function={self.score_function!r} is not one of {SCORE_FUNCTIONS}")
        if self.aux_loss_scope not in AUX_LOSS_SCOPES:
            raise ValueError(f"aux_loss_scope={self.aux_loss_scope!r} is not one of {AUX_LOSS_SCOPES}")
        if self.normalize_routes not in (None, True, False):
            raise ValueError(f"normalize_routes must be None, True or False, got {self.normalize_routes!r}")
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


ROUTER_FIELDS: Tuple[str, ...] = tuple(f.name for f in dataclasses.fields(RouterConfig))
# A config block's key where it differs from the RouterConfig field, and the fields a block fixes: its routing
# follows the config alone (no random token selection, no second-expert sampling).
BLOCK_KEYS: Dict[str, str] = {"k": "top_k"}
BLOCK_FIXED: Dict[str, Any] = {"use_rts": False, "top2_2nd_expert_sampling": False}
ROUTING_OPTION_FIELDS: Tuple[str, ...] = tuple(f.name for f in dataclasses.fields(RoutingOptions))


def router_fields(source: Any) -> Dict[str, Any]:
    """The :class:`RouterConfig` fields read from any object that has them as attributes.

    Example::

        MoE(64, None, ffn_hidden_size=128, **router_fields(RouterConfig(num_experts=8, k=2)))
    """
    return {name: getattr(source, name) for name in ROUTER_FIELDS}


def router_config_of_block(block: Any) -> RouterConfig:
    """The :class:`RouterConfig` a ``moe_proto`` config block (or the LM's arguments) describes, validated.

    Every field is read from the block attribute of the same name (``k`` from ``top_k``); fields
    the block does not have keep their defaults, ``use_rts`` and ``top2_2nd_expert_sampling`` are
    off, and ``drop_policy`` is None when ``dropless``. Example::

        router_config_of_block(MoEProtoConfig(num_experts=8, top_k=2)).k   # 2
    """
    values: Dict[str, Any] = {}
    for name in ROUTER_FIELDS:
        key = BLOCK_KEYS.get(name, name)
        if hasattr(block, key):
            values[name] = getattr(block, key)
    values.update(BLOCK_FIXED)
    if values.get("dropless") or not values.get("drop_tokens", True):
        values["drop_policy"] = None
    return RouterConfig(**values)


class RouterOutput(NamedTuple):
    """What :meth:`Router.route` returns: the routing record and how to dispatch the input.

    ``dispatch_input`` is ``x`` itself, or (fp32 input, no jitter) the router's view of it
    together with ``grad_handoff``, so that one backward node writes both gradients of ``x``.
    """

    record: RoutingRecord
    dispatch_input: Tensor
    grad_handoff: Optional[dispatch_ops.DispatchGradHandoff]


class Router(nn.Module):
    """Gate weight, balance state and routing randomness of one MoE layer (see the module docstring).

    ``weight`` is the gate ``[num_experts, hidden_size]`` (the key ``gate.weight`` of the layer,
    initialised as ``nn.Linear(hidden_size, num_experts, bias=False)`` is); ``balance`` the
    :class:`~moe_proto.balance.ExpertBalance` when ``expert_bias_update_rate > 0`` or
    ``aux_loss_scope="global_batch"``, else None. ``forward(x)`` returns the logits (like the
    ``nn.Linear`` gate); :meth:`route` routes.

    Example::

        router = Router(16, RouterConfig(num_experts=4, use_rts=False))
        record = router.route(torch.randn(8, 16)).record
    """

    def __init__(self, hidden_size: int, config: RouterConfig) -> None:
        super().__init__()
        if not _is_int(hidden_size, 1):
            raise ValueError(f"hidden_size must be an integer >= 1, got {hidden_size!r}")
        if not isinstance(config, RouterConfig):
            raise TypeError(f"Router needs a RouterConfig, got {type(config).__name__}")
        self.config = config  # a RouterConfig, or a record deriving it (the layer's MoEArgs): validated already
        self.hidden_size = hidden_size
        self.weight = nn.Parameter(torch.empty(config.num_experts, hidden_size))
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))  # nn.Linear's initialisation, same random draws
        if config.uses_expert_bias or config.aux_loss_scope == "global_batch":
            self.balance: Optional[ExpertBalance] = ExpertBalance(
                config.num_experts, config.num_prototypes, config.expert_bias_update_rate,
                global_batch=config.aux_loss_scope == "global_batch")
        else:
            self.balance = None

    def extra_repr(self) -> str:
        c = self.config
        return (f"hidden_size={self.hidden_size}, num_experts={c.num_experts}, k={c.k}, "
                f"num_prototypes={c.num_prototypes}, "
                + ("dropless" if c.is_dropless else f"capacity_factor={c.capacity_factor}"))

    def forward(self, x: Tensor) -> Tensor:
        """Router logits ``x @ weight.T`` (what the ``nn.Linear`` gate returned)."""
        return F.linear(x, self.weight)

    def route(self, x: Tensor, used_token: Optional[Tensor] = None,
              sequence_length: Optional[int] = None) -> RouterOutput:
        """Route the rows of ``x`` ``[S, d]``: fp32 logits (input jitter in training), then :func:`routing.route`.

        Non-finite logits (a NaN/inf input or router weight) raise ``FloatingPointError``.
        ``used_token`` (``[S]``) masks tokens out; ``sequence_length`` is the tokens per
        sequence for ``aux_loss_scope="sequence"``.
        """
        config = self.config
        gate_input = x.float()
        if self.training and config.noise_policy == "Jitter":
            gate_input = routing.multiplicative_jitter(gate_input, JITTER_EPS)
        handoff = dispatch_ops.DispatchGradHandoff() if gate_input is x else None
        logits, router_input = _RouterLogits.apply(gate_input, self.weight.float(), handoff)
        self._check_finite(x, logits, used_token)
        record = self.route_logits(logits, used_token, sequence_length)
        return RouterOutput(record, router_input if gate_input is x else x, handoff)

    def route_logits(self, logits: Tensor, used_token: Optional[Tensor] = None,
                     sequence_length: Optional[int] = None) -> RoutingRecord:
        """The routing record of fp32 ``logits`` ``[S, E]``: draws the training noise and picks the arguments.

        Example::

            rec = router.route_logits(router(x).float())
        """
        config = self.config
        capacity_factor = None if config.is_dropless else (
            config.capacity_factor if self.training else config.eval_capacity_factor)
        if config.deepspeed_compat:
            if config.k == 1:
                return routing.route_deepspeed_top1(logits, capacity_factor, config.min_capacity, used_token)
            if used_token is not None:
                raise ValueError("deepspeed_compat=True with k=2: DeepSpeed's top2gating ignores used_token; "
                                 "use deepspeed_compat=False to mask tokens")
            return routing.route_deepspeed_top2(logits, capacity_factor, config.min_capacity)

        noise, noise_from_choice = None, 0
        if self.training and config.noise_policy == "RSample":
            noise = routing.gumbel_noise(logits.shape, logits.device)
        elif self.training and config.top2_2nd_expert_sampling and config.k >= 2:
            noise, noise_from_choice = routing.gumbel_noise(logits.shape, logits.device), 1
        rts = None
        if self.training and config.use_rts and capacity_factor is not None:
            rts = torch.rand(logits.shape[0], config.routes_per_token, device=logits.device)
        scope = config.aux_loss_scope
        global_load_fn = None
        if scope == "global_batch" and self.training:
            global_load_fn = self.balance.add_global_load  # a collective over the DP ranks in every training forward
        return routing.route(logits, top_k=config.k, num_prototypes=config.num_prototypes,
                             capacity_factor=capacity_factor, min_capacity=config.min_capacity,
                             drop_policy=config.effective_drop_policy, used_token=used_token, rts_priority=rts,
                             selection_noise=noise, noise_from_choice=noise_from_choice,
                             score_function=config.score_function,
                             expert_bias=self.balance.bias if config.uses_expert_bias else None,
                             normalize_routes=config.normalize_routes, aux_loss_scope=scope,
                             sequence_length=sequence_length, global_load_fn=global_load_fn)

    def add_step_load(self, record: RoutingRecord) -> None:
        """Count a training forward's routes for the aux-loss-free bias (no-op without it)."""
        if self.training and self.config.uses_expert_bias:
            self.balance.add_step_load(record.routed_per_expert)

    def _check_finite(self, x: Tensor, logits: Tensor, used_token: Optional[Tensor]) -> None:
        """Refuse NaN/inf router logits (always on: one ``isfinite`` over the small ``[tokens, E]`` logits).

        A non-finite logit would route garbage and spread NaN into every expert's gradient; the
        error says whether the layer's input or its router weight holds the NaN/inf.
        """
        if bool(torch.isfinite(logits.sum())):  # one reduction (measured 35x cheaper than the per-token check)
            return
        finite = torch.isfinite(logits).all(dim=-1)  # the sum overflowed or a logit is NaN/inf: find which
        if used_token is not None:  # masked tokens are never routed
            finite = finite | (used_token.reshape(-1) == 0)
        if bool(finite.all()):
            return
        bad = (~finite).nonzero()[:, 0]
        bad_inputs = int((~torch.isfinite(x).all(dim=-1)).sum())
        cause = (f"the layer's input (hidden_states) holds NaN/inf in {bad_inputs} of {x.shape[0]} tokens"
                 if bad_inputs else "the router weight (gate.weight) holds NaN/inf"
                 if not bool(torch.isfinite(self.weight).all()) else "the logits overflowed")
        raise FloatingPointError(
            f"MoE layer (hidden_size {self.hidden_size}, {self.config.num_experts} experts): router logits are "
            f"not finite for {bad.numel()} of {x.shape[0]} tokens (first: token {int(bad[0])}): {cause}")


class _RouterLogits(torch.autograd.Function):
    """``(x @ w.T, x)`` for the router (``w`` is ``[E, d]``, E small): the logits, and ``x`` again as a view.

    Dispatching that second output instead of ``x`` makes this one node receive both
    gradients of ``x`` (the router's and the dispatch's), so its backward writes
    ``dispatch's + g @ w`` in one pass over ``[S, d]`` (C++, :mod:`moe_proto.ops`) where autograd
    would write ``g @ w`` to a new tensor and then add the two. With a
    :class:`~moe_proto.dispatch.DispatchGradHandoff` shared with the dispatch, the dispatch's own
    backward (the gather-sum of the buffer rows) runs inside that pass too.
    The weight gradient is ``g.T @ x``: the same product autograd's ``linear`` takes as
    ``x.T @ g`` and transposes, faster on a cold input.
    """

    @staticmethod
    def forward(ctx, x: Tensor, w: Tensor,  # type: ignore[override]
                grad_handoff: Optional[dispatch_ops.DispatchGradHandoff] = None) -> Tuple[Tensor, Tensor]:
        ctx.save_for_backward(x, w)
        ctx.set_materialize_grads(False)
        ctx.grad_handoff = grad_handoff
        return x @ w.t(), x.view_as(x)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: Optional[Tensor], grad_x: Optional[Tensor]):  # type: ignore[override]
        x, w = ctx.saved_tensors
        deposit = None
        if ctx.grad_handoff is not None:
            deposit, grad_x = ctx.grad_handoff.take(grad_x)
        dx = dw = None
        if ctx.needs_input_grad[0]:
            if deposit is not None:
                dx = _router_input_grad_from_buffer(deposit, grad, w, x)
                if grad_x is not None:
                    dx.add_(grad_x)
            elif grad is None:
                dx = grad_x
            elif grad_x is None:
                dx = torch.mm(grad.contiguous(), w, out=default_pool().empty(x.shape, x.dtype, x.device))
            else:
                dx = _add_router_input_grad(grad_x, grad, w)
        if ctx.needs_input_grad[1] and grad is not None:
            dw = grad.t() @ x
        return dx, dw, None


def _add_router_input_grad(grad_x: Tensor, grad: Tensor, w: Tensor) -> Tensor:
    """``grad_x + grad @ w`` into a pooled buffer: one C++ pass over the rows for fp32 CPU tensors."""
    ops = cpu_ops_for(grad_x, grad, w)
    if ops is None:
        return torch.addmm(grad_x, grad, w)
    out = default_pool().empty(grad_x.shape, grad_x.dtype, grad_x.device)
    ops.add_router_input_grad(grad_x.contiguous(), grad.contiguous(), w.contiguous(), out)
    return out


def _router_input_grad_from_buffer(deposit: Tuple[Tensor, Tensor, Tensor], grad: Optional[Tensor], w: Tensor,
                                   x: Tensor) -> Tensor:
    """x's gradient from the dispatch buffer's (gathered and summed per token) plus ``grad @ w``, one C++ pass."""
    buffer_grad, route_row, route_offsets = deposit
    if grad is None:  # the logits took no gradient: the router's term is zero
        grad = x.new_zeros(x.shape[0], w.shape[0])
    ops = cpu_ops_for(buffer_grad, grad, w)  # the dispatch deposited only where this holds
    out = default_pool().empty(x.shape, x.dtype, x.device)
    ops.add_router_input_grad(buffer_grad, grad.contiguous(), w.contiguous(), out, route_row.contiguous(),
                              route_offsets.contiguous())
    return out
