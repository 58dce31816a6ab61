"""The ``MoE`` layer: a drop-in for ``deepspeed.moe.layer.MoE`` with expert prototyping.

Forward runs four explicit stages, each its own method so that expert parallelism
(an all-to-all between dispatch and compute, and back before combine) slots in:

1. :meth:`MoE.route` - fp32 router logits -> :class:`~moe_proto.routing.RoutingRecord`
2. :meth:`MoE.dispatch` - index plan + gather into an expert-major buffer
3. :meth:`MoE.compute` - grouped-matmul experts over the filled rows only; with
   ``ep_size > 1`` the rows go to the experts' owners and back (:mod:`moe_proto.parallel`)
4. :meth:`MoE.combine` - gate-weighted scatter-add back to the tokens

Expert parallelism uses DeepSpeed's groups: the class derives from
``deepspeed.moe.layer.MoE`` (without running its constructor) so that
``deepspeed.initialize`` sees an MoE layer, calls :meth:`MoE.set_deepspeed_parallelism`
(which creates ``ep_size_{ep_size}`` expert / expert-data-parallel groups) and reduces
expert gradients over the expert-data-parallel group only. EP rank r holds experts
``r*E/ep_size .. (r+1)*E/ep_size - 1``.

Example::

    moe = MoE(hidden_size=256, num_experts=16, k=1, num_prototypes=2, ffn_hidden_size=1024,
              capacity_factor=1.25, use_rts=False)
    out, l_aux, exp_counts = moe(x)          # x: [batch, seq, 256]
    loss = task_loss + 0.01 * l_aux
    moe.last_stats.drop_rate                 # for logging
"""
from __future__ import annotations

import logging
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd.function import once_differentiable

from . import dispatch as dispatch_ops
from . import ds_layout
from . import parallel
from . import routing
from .args import MoEArgs
from .balance import ExpertBalance
from .buffer_pool import default_pool
from .dispatch import DispatchPlan
from .experts import GroupedExperts
from .module_experts import ModuleExperts
from .ops import cpu_ops_for
from .routing import RoutingRecord, RoutingStats

try:  # deriving from DeepSpeed's class is how its engine recognises MoE layers (isinstance checks)
    from deepspeed.moe.layer import MoE as _DeepSpeedMoE
except ImportError:  # pragma: no cover - DeepSpeed is a dependency; keep the layer usable without it
    _DeepSpeedMoE = nn.Module

logger = logging.getLogger(__name__)

JITTER_EPS = 1e-2  # DeepSpeed's multiplicative_jitter default
ZERO_STAGES = (None, 0, 1, 2, 3)


def _check_zero_stage(zero_stage: Optional[int], cls: type) -> None:
    """``zero_stage`` of the layer: None/0-2 build :class:`MoE`, 3 a ``ZeRO3MoE`` (see ``MoE.__new__``)."""
    if zero_stage not in ZERO_STAGES:
        raise ValueError(f"zero_stage={zero_stage!r}: expected None, 0, 1, 2 or 3 (the DeepSpeed config's "
                         "zero_optimization.stage)")
    if zero_stage == 3:  # reached only by subclasses of MoE: they derive DeepSpeed's MoE, which ZeRO-3 refuses
        raise ValueError(f"zero_stage=3 with {cls.__name__}, a subclass of moe_proto.MoE: DeepSpeed refuses "
                         "deepspeed.moe.layer.MoE under ZeRO stage 3; subclass moe_proto.zero3.ZeRO3MoE instead")


class _RouterLogits(torch.autograd.Function):
    """``(x @ w.T, x)`` for the router (``w`` is ``[E, d]``, E small): the logits, and ``x`` again as a view.

    Dispatching that second output instead of ``x`` makes this one node receive both
    gradients of ``x`` (the router's and the dispatch's), so its backward writes
    ``dispatch's + g @ w`` in one pass over ``[S, d]`` (C++, :mod:`moe_proto.ops`) where autograd
    would write ``g @ w`` to a new tensor and then add the two. With a
    :class:`~moe_proto.dispatch.DispatchGradHandoff` shared with the dispatch, the dispatch's own
    backward (the gather-sum of the buffer rows) runs inside that pass too.
    The weight gradient is ``g.T @ x``: the same product autograd's ``linear`` takes as
    ``x.T @ g`` and transposes, 40% faster on a cold ``[4096, 256]`` input (0.48 against
    0.79 ms, one thread).
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


def _experts_from_module(expert: nn.Module, args: MoEArgs) -> nn.Module:
    """The stacked experts when the module is an FFN they copy exactly, else DeepSpeed-style deep copies."""
    try:
        experts = GroupedExperts.from_module(expert, args.num_local_experts, args.expert_group_name)
    except ValueError as why:
        logger.info("MoE layer: expert module %s takes the per-expert path (deep copies, a loop over experts): %s",
                    type(expert).__name__, why)
        return ModuleExperts(expert, args.num_local_experts, args.hidden_size, args.expert_group_name)
    logger.info("MoE layer: expert module %s takes the stacked path (grouped %s FFN)", type(expert).__name__,
                experts.activation)
    return experts


def _check_tensor_parallelism(layer: "MoE", groups: object) -> None:
    """``enable_expert_tensor_parallelism``: what DeepSpeed does with it, or a refusal on every rank.

    DeepSpeed's layer reads the flag only with a tensor-parallel ``groups.mpu`` (Megatron-style
    non-expert layers): it then builds expert groups over the tensor-parallel ranks, drops the
    duplicate tokens of the tensor-parallel ranks before the all-to-all and gathers them after.
    Without an mpu (or with tensor-parallel size 1) the flag changes nothing, here as there.
    """
    mpu = getattr(groups, "mpu", None)
    if not layer.enable_expert_tensor_parallelism or mpu is None:
        return
    from deepspeed.utils.bwc import bwc_tensor_model_parallel_world_size

    tp = bwc_tensor_model_parallel_world_size(mpu)
    if tp > 1:  # the mpu is the same object on every rank: every rank raises here
        raise ValueError(f"MoE layer with enable_expert_tensor_parallelism=True under a tensor-parallel mpu (size "
                         f"{tp}): moe_proto.MoE does not drop and re-gather the tensor-parallel ranks' duplicate "
                         "tokens nor shard its experts over them as DeepSpeed's MOELayer does; use "
                         "deepspeed.moe.layer.MoE for expert tensor parallelism, or set the flag False")


class _MoEFamily(type):
    """Metaclass of :class:`MoE`: ``isinstance(x, MoE)`` also holds for :class:`moe_proto.zero3.ZeRO3MoE`.

    That class runs the same stages but cannot derive ``MoE`` (DeepSpeed refuses
    ``deepspeed.moe.layer.MoE`` instances under ZeRO-3), so this keeps stats, checkpoints and
    the planner working for both. Example: ``isinstance(MoE(8, None, 2, ffn_hidden_size=8, zero_stage=3), MoE)``.
    """

    def __instancecheck__(cls, obj: object) -> bool:
        return type.__instancecheck__(cls, obj) or (cls is MoE and getattr(type(obj), "_moe_proto_layer", False))

    def __subclasscheck__(cls, sub: type) -> bool:
        return type.__subclasscheck__(cls, sub) or (cls is MoE and getattr(sub, "_moe_proto_layer", False))


class MoE(_DeepSpeedMoE, metaclass=_MoEFamily):
    """Mixture-of-Experts FFN layer with top-k routing, expert prototyping and capacity.

    The positional arguments and defaults are those of ``deepspeed.moe.layer.MoE``; the
    keyword-only ones are additions (see :class:`~moe_proto.args.MoEArgs` for all of
    them). ``expert`` may be any ``nn.Module``, copied into every expert like DeepSpeed's deep
    copy: ``Linear -> activation -> Linear`` and SwiGLU FFNs as stacked weights
    (:class:`~moe_proto.experts.GroupedExperts`), anything else as per-expert modules
    (:class:`~moe_proto.module_experts.ModuleExperts`); or None, in which case the layer builds
    independently initialised experts of width ``ffn_hidden_size`` with ``activation``.

    ``state_dict_layout``: ``"deepspeed"`` (DeepSpeed's keys, :mod:`moe_proto.ds_layout`) for a
    layer built from an expert module and once ``deepspeed.initialize`` binds it (ZeRO 0-2),
    else ``"stacked"``; ``load_state_dict`` takes both.

    ``forward(hidden_states, used_token=None)`` returns ``(output, l_aux, exp_counts)``
    like DeepSpeed: ``l_aux`` is the unscaled load-balancing loss plus
    ``z_loss_coef * z_loss``, ``exp_counts`` the per-expert routes before drops.

    ``ep_fixed_splits=True`` (capacity mode, ``ep_size > 1``) pads every expert to its
    capacity in the all-to-all so message sizes are static; the default sends only kept
    rows after exchanging per-expert counts.

    Differences from DeepSpeed, on purpose: eval routing is deterministic (RTS and
    second-expert sampling act in training only), the logits are never modified in
    place, and the default drop order (``drop_policy="probs"``) keeps the highest-gate
    tokens. ``deepspeed_compat=True`` reproduces DeepSpeed's top-1/top-2 decisions.

    Routing options (off by default; docs/moe.md "Routing options"): ``expert_bias_update_rate``
    (aux-loss-free balancing: ``self.balance`` holds the bias; call
    :func:`moe_proto.update_expert_biases` after each optimizer step), ``score_function``,
    ``normalize_routes``, ``aux_loss_scope`` and ``num_shared_experts`` /
    ``shared_expert_ffn_hidden_size`` (``self.shared_experts``, a replicated dense FFN).

    ``zero_stage``: the DeepSpeed config's ``zero_optimization.stage``. ``3`` returns a
    :class:`moe_proto.zero3.ZeRO3MoE` (same layer, in the class DeepSpeed accepts under
    ZeRO-3; docs/moe.md "ZeRO-3"); None or 0-2 build this class, which DeepSpeed refuses under stage 3.

    Example::

        mlp = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
        moe = MoE(64, mlp, num_experts=8, k=2, use_rts=False, top2_2nd_expert_sampling=False)
        out, l_aux, exp_counts = moe(torch.randn(4, 32, 64))
    """

    def __new__(cls, *args: object, zero_stage: Optional[int] = None, **kwargs: object) -> "MoE":
        # The selection hook: zero_stage=3 builds the layer class ZeRO-3 accepts (moe_proto/zero3.py).
        if zero_stage == 3 and cls is MoE:
            from .zero3 import ZeRO3MoE

            return ZeRO3MoE(*args, **kwargs)  # not an instance of cls: Python skips MoE.__init__
        return super().__new__(cls)

    def __init__(self,
                 hidden_size: int,
                 expert: Optional[nn.Module] = None,
                 num_experts: int = 1,
                 ep_size: int = 1,
                 k: int = 1,
                 capacity_factor: float = 1.0,
                 eval_capacity_factor: float = 1.0,
                 min_capacity: int = 4,
                 use_residual: bool = False,
                 noisy_gate_policy: Optional[str] = None,
                 drop_tokens: bool = True,
                 use_rts: bool = True,
                 use_tutel: bool = False,
                 enable_expert_tensor_parallelism: bool = False,
                 top2_2nd_expert_sampling: bool = True,
                 *,
                 num_prototypes: int = 1,
                 dropless: bool = False,
                 drop_policy: Optional[str] = None,
                 z_loss_coef: float = 0.0,
                 activation: Optional[str] = None,
                 ffn_hidden_size: Optional[int] = None,
                 deepspeed_compat: bool = False,
                 ep_fixed_splits: bool = False,
                 expert_bias_update_rate: float = 0.0,
                 score_function: str = "softmax",
                 normalize_routes: Optional[bool] = None,
                 aux_loss_scope: str = "micro_batch",
                 num_shared_experts: int = 0,
                 shared_expert_ffn_hidden_size: Optional[int] = None,
                 zero_stage: Optional[int] = None) -> None:
        _check_zero_stage(zero_stage, type(self))
        nn.Module.__init__(self)  # DeepSpeed's MoE.__init__ would build its own gate and experts
        self.args = MoEArgs(hidden_size=hidden_size, num_experts=num_experts, ep_size=ep_size, k=k,
                            capacity_factor=capacity_factor, eval_capacity_factor=eval_capacity_factor,
                            min_capacity=min_capacity, use_residual=use_residual,
                            noisy_gate_policy=noisy_gate_policy, drop_tokens=drop_tokens, use_rts=use_rts,
                            use_tutel=use_tutel, enable_expert_tensor_parallelism=enable_expert_tensor_parallelism,
                            top2_2nd_expert_sampling=top2_2nd_expert_sampling, num_prototypes=num_prototypes,
                            dropless=dropless, drop_policy=drop_policy, z_loss_coef=z_loss_coef,
                            activation=activation, ffn_hidden_size=ffn_hidden_size,
                            deepspeed_compat=deepspeed_compat, expert_bias_update_rate=expert_bias_update_rate,
                            score_function=score_function, normalize_routes=normalize_routes,
                            aux_loss_scope=aux_loss_scope, num_shared_experts=num_shared_experts,
                            shared_expert_ffn_hidden_size=shared_expert_ffn_hidden_size)
        args = self.args
        if use_tutel:
            logger.warning("MoE layer: use_tutel=True: moe_proto dispatches by index (sort + gather) and does not "
                           "use Tutel; proceeding without it (DeepSpeed does the same when Tutel is not installed)")
        if ep_fixed_splits and args.is_dropless:
            raise ValueError("ep_fixed_splits=True pads every expert to its capacity; dropless routing has no "
                             "capacity: leave ep_fixed_splits False")
        # The attributes DeepSpeed's engine and checkpoint code read from an MoE layer.
        self.num_experts = num_experts
        self.ep_size = ep_size
        self.num_local_experts = args.num_local_experts
        self.expert_group_name = args.expert_group_name
        self.enable_expert_tensor_parallelism = enable_expert_tensor_parallelism
        self.ep_fixed_splits = ep_fixed_splits
        self.ep_group: Optional[object] = None
        self.ep_rank = 0
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)
        if expert is None:
            if ffn_hidden_size is None:
                raise ValueError("expert=None: pass ffn_hidden_size (and optionally activation) so the layer "
                                 "can build its experts")
            self.experts = GroupedExperts(args.num_local_experts, hidden_size, ffn_hidden_size,
                                          activation=activation or "gelu",
                                          expert_group_name=args.expert_group_name)
        else:
            if ffn_hidden_size is not None or activation is not None:
                raise ValueError("ffn_hidden_size/activation describe experts the layer builds itself; with an "
                                 "expert module they come from the module: leave them None")
            self.experts = _experts_from_module(expert, args)
            if self.experts.hidden_size != hidden_size:
                raise ValueError(f"expert module works on width {self.experts.hidden_size}, "
                                 f"hidden_size is {hidden_size}")
        if use_residual:
            # PR-MoE: a dense MLP mixed in by a learned 2-way softmax, as in DeepSpeed.
            self.mlp = expert if expert is not None else GroupedExperts(
                1, hidden_size, ffn_hidden_size, activation=activation or "gelu")
            self.coefficient = nn.Linear(hidden_size, 2)
        if num_shared_experts:
            # n shared experts of width w are one dense FFN of width n*w (their sum); replicated, reduced over DP.
            width = shared_expert_ffn_hidden_size or self.experts.ffn_hidden_size
            if width is None:
                raise ValueError(f"num_shared_experts={num_shared_experts}: the expert module "
                                 f"{type(expert).__name__} has no FFN width to copy; pass "
                                 "shared_expert_ffn_hidden_size")
            self.shared_experts = GroupedExperts(1, hidden_size, num_shared_experts * width,
                                                 activation=self.experts.activation or "gelu")
        if args.uses_expert_bias or aux_loss_scope == "global_batch":
            self.balance = ExpertBalance(num_experts, num_prototypes, expert_bias_update_rate,
                                         global_batch=aux_loss_scope == "global_batch")
        else:
            self.balance = None
        self.last_stats: Optional[RoutingStats] = None
        # DeepSpeed's keys (ds_layout.py) for a layer built like DeepSpeed's, and once bound to its engine
        # (set_deepspeed_parallelism), so that engine.save_checkpoint/load_checkpoint work; else the stacked keys.
        self.state_dict_layout = "deepspeed" if expert is not None else "stacked"
        self._register_state_dict_hook(ds_layout.to_deepspeed_keys)
        self._register_load_state_dict_pre_hook(ds_layout.from_deepspeed_keys, with_module=True)
        logger.info("MoE layer: %d experts (%d local), %d prototype(s), top-%d per prototype, %s", num_experts,
                    args.num_local_experts, num_prototypes, k,
                    "dropless" if args.is_dropless else f"capacity factor {capacity_factor}")

    def forward(self, hidden_states: Tensor, used_token: Optional[Tensor] = None) -> Tuple[Tensor, Tensor, Tensor]:
        """``[..., hidden]`` -> ``(output [..., hidden], l_aux, exp_counts [E])``.

        ``used_token`` (optional, one entry per token) marks tokens to route; the others
        get a zero expert output and take no capacity.
        """
        if hidden_states.shape[-1] != self.args.hidden_size:
            raise ValueError(f"hidden_states last dim {hidden_states.shape[-1]} != hidden_size "
                             f"{self.args.hidden_size}")
        x = hidden_states.reshape(-1, self.args.hidden_size)
        sequence_length = None
        if self.args.aux_loss_scope == "sequence":
            if hidden_states.dim() != 3:
                raise ValueError(f"aux_loss_scope='sequence' needs [batch, seq, hidden] inputs to find the "
                                 f"sequences, got shape {tuple(hidden_states.shape)}")
            sequence_length = hidden_states.shape[1]
        record, dispatch_input, grad_handoff = self._route(x, used_token, sequence_length)
        buffer, plan = self.dispatch(dispatch_input, record, grad_handoff)
        expert_output = self.compute(buffer, plan)
        output = self.combine(expert_output, plan, x.shape[0]).view_as(hidden_states)
        if self.args.use_residual:
            output = self._mix_residual(hidden_states, output)
        if self.args.num_shared_experts:
            output = output + self._shared_output(x).view_as(hidden_states)
        if self.training and self.args.uses_expert_bias:
            self.balance.add_step_load(record.routed_per_expert)
        self.last_stats = record.stats()
        l_aux = record.aux_loss
        if self.args.z_loss_coef:
            l_aux = l_aux + self.args.z_loss_coef * record.z_loss
        return output, l_aux, record.routed_per_expert

    def route(self, x: Tensor, used_token: Optional[Tensor] = None,
              sequence_length: Optional[int] = None) -> RoutingRecord:
        """Stage 1: fp32 router logits (input jitter in training) -> routing record.

        Non-finite logits (a NaN/inf input or router weight) raise ``FloatingPointError``.

        ``sequence_length``: tokens per sequence of ``x`` (``aux_loss_scope="sequence"`` only).
        """
        return self._route(x, used_token, sequence_length)[0]

    def _route(self, x: Tensor, used_token: Optional[Tensor],
               sequence_length: Optional[int]
               ) -> Tuple[RoutingRecord, Tensor, Optional[dispatch_ops.DispatchGradHandoff]]:
        """:meth:`route`, the tensor to dispatch and the handoff to dispatch it with: ``x`` itself and None or,
        when the router reads ``x`` as it is (fp32, no jitter), the router's view of it and a handoff, so that
        one backward node writes both gradients of ``x`` in one pass."""
        args = self.args
        gate_input = x.float()
        if self.training and args.noise_policy == "Jitter":
            gate_input = routing.multiplicative_jitter(gate_input, JITTER_EPS)
        handoff = dispatch_ops.DispatchGradHandoff() if gate_input is x else None
        logits, router_input = _RouterLogits.apply(gate_input, self.gate.weight.float(), handoff)
        self._check_finite(x, logits, used_token)
        return self._route_logits(logits, x, used_token, sequence_length), \
            router_input if gate_input is x else x, handoff

    def _route_logits(self, logits: Tensor, x: Tensor, used_token: Optional[Tensor],
                      sequence_length: Optional[int]) -> RoutingRecord:
        args = self.args
        capacity_factor = None if args.is_dropless else (
            args.capacity_factor if self.training else args.eval_capacity_factor)
        if args.deepspeed_compat:
            if args.k == 1:
                return routing.route_deepspeed_top1(logits, capacity_factor, args.min_capacity, used_token)
            if used_token is not None:
                raise ValueError("deepspeed_compat=True with k=2: DeepSpeed's top2gating ignores used_token; "
                                 "use deepspeed_compat=False to mask tokens")
            return routing.route_deepspeed_top2(logits, capacity_factor, args.min_capacity)

        noise, noise_from_choice = None, 0
        if self.training and args.noise_policy == "RSample":
            noise = routing.gumbel_noise(logits.shape, logits.device)
        elif self.training and args.top2_2nd_expert_sampling and args.k >= 2:
            noise, noise_from_choice = routing.gumbel_noise(logits.shape, logits.device), 1
        rts = None
        if self.training and args.use_rts and capacity_factor is not None:
            rts = torch.rand(x.shape[0], args.routes_per_token, device=logits.device)
        scope = args.aux_loss_scope
        global_load_fn = None
        if scope == "global_batch" and self.training:
            global_load_fn = self.balance.add_global_load  # a collective over the DP ranks in every training forward
        return routing.route(logits, top_k=args.k, num_prototypes=args.num_prototypes,
                             capacity_factor=capacity_factor, min_capacity=args.min_capacity,
                             drop_policy=args.effective_drop_policy, used_token=used_token, rts_priority=rts,
                             selection_noise=noise, noise_from_choice=noise_from_choice,
                             score_function=args.score_function,
                             expert_bias=self.balance.bias if args.uses_expert_bias else None,
                             normalize_routes=args.normalize_routes, aux_loss_scope=scope,
                             sequence_length=sequence_length, global_load_fn=global_load_fn)

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
                 if not bool(torch.isfinite(self.gate.weight).all()) else "the logits overflowed")
        raise FloatingPointError(
            f"MoE layer (hidden_size {self.args.hidden_size}, {self.args.num_experts} experts): router logits are "
            f"not finite for {bad.numel()} of {x.shape[0]} tokens (first: token {int(bad[0])}): {cause}")

    def dispatch(self, x: Tensor, record: RoutingRecord,
                 grad_handoff: Optional[dispatch_ops.DispatchGradHandoff] = None) -> Tuple[Tensor, DispatchPlan]:
        """Stage 2: index plan and the expert-major buffer ``[kept routes, hidden]``.

        ``grad_handoff``: the router's (see :meth:`forward`), when ``x`` is its view of the input.
        """
        plan = dispatch_ops.plan_dispatch(record)
        return dispatch_ops.permute(x, plan, grad_handoff), plan

    def compute(self, buffer: Tensor, plan: DispatchPlan) -> Tensor:
        """Stage 3: every expert over its rows, one grouped matmul per projection.

        With ``ep_size > 1`` the rows travel to the ranks owning their experts and back.
        """
        if self.args.ep_size == 1:
            return self.experts(buffer, plan.tokens_per_expert)
        group = self._expert_parallel_group()
        exchange = parallel.plan_exchange(plan.tokens_per_expert, group, hidden_size=self.args.hidden_size,
                                          dtype=buffer.dtype, capacity=plan.capacity,
                                          fixed_splits=self.ep_fixed_splits)
        local = parallel.dispatch_to_experts(buffer, exchange, group)
        return parallel.combine_from_experts(self.experts(local, exchange.recv_counts), exchange, group)

    @property
    def expert_range(self) -> Tuple[int, int]:
        """Global ids ``[first, last)`` of the experts this rank holds."""
        first = self.ep_rank * self.num_local_experts
        return first, first + self.num_local_experts

    def set_deepspeed_parallelism(self, use_data_before_expert_parallel_: bool = False) -> None:
        """Create (or reuse) DeepSpeed's ``ep_size_{ep_size}`` groups and join this layer's.

        ``deepspeed.initialize`` calls this on every module that has it; call it yourself
        only when running without the engine (after ``deepspeed.init_distributed()``).

        Example::

            moe.set_deepspeed_parallelism()
        """
        from deepspeed.utils import groups

        _check_tensor_parallelism(self, groups)
        if getattr(self, "zero_stage", None) != 3:  # ZeRO-3 layers keep their stacked keys (moe_proto.checkpoint)
            self.state_dict_layout = "deepspeed"  # what DeepSpeed's save_checkpoint/load_checkpoint split per expert
        if self.expert_group_name not in groups._get_expert_parallel_group_dict():
            logger.info("creating DeepSpeed expert-parallel groups %s", self.expert_group_name)
            groups._create_expert_and_data_parallel(
                self.ep_size, use_data_before_expert_parallel_=use_data_before_expert_parallel_)
        self.set_expert_parallel_group(groups._get_expert_parallel_group(self.expert_group_name))

    def _create_process_groups(self, use_data_before_expert_parallel_: bool = False) -> None:
        # DeepSpeed's name for the same step; kept so code written against its MoE still works.
        self.set_deepspeed_parallelism(use_data_before_expert_parallel_)

    def set_expert_parallel_group(self, group: Optional[object]) -> None:
        """Use ``group`` (a torch process group of ``ep_size`` ranks) for the expert exchange.

        Example::

            moe.set_expert_parallel_group(torch.distributed.new_group([0, 1]))
        """
        import torch.distributed as dist

        size = dist.get_world_size(group)
        if size != self.ep_size:
            raise ValueError(f"expert-parallel group has {size} ranks, the layer was built with "
                             f"ep_size={self.ep_size}")
        self.ep_group = group
        self.ep_rank = dist.get_rank(group)

    def _expert_parallel_group(self) -> object:
        if self.ep_group is None:
            raise RuntimeError(f"MoE with ep_size={self.ep_size} has no expert-parallel group: wrap the model with "
                               "deepspeed.initialize, or call moe.set_deepspeed_parallelism() / "
                               "moe.set_expert_parallel_group(group) first")
        return self.ep_group

    def combine(self, expert_output: Tensor, plan: DispatchPlan, num_tokens: int) -> Tensor:
        """Stage 4: gate-weighted scatter-add back to ``[num_tokens, hidden]``."""
        return dispatch_ops.unpermute(expert_output, plan, num_tokens)

    def _shared_output(self, x: Tensor) -> Tensor:
        counts = torch.tensor([x.shape[0]], device=x.device)
        return self.shared_experts(x, counts)

    def _mix_residual(self, hidden_states: Tensor, moe_output: Tensor) -> Tensor:
        if isinstance(self.mlp, GroupedExperts):
            flat = hidden_states.reshape(-1, self.args.hidden_size)
            counts = torch.tensor([flat.shape[0]], device=flat.device)
            mlp_output = self.mlp(flat, counts).view_as(hidden_states)
        else:
            mlp_output = self.mlp(hidden_states)
            mlp_output = mlp_output[0] if isinstance(mlp_output, tuple) else mlp_output
        coef = F.softmax(self.coefficient(hidden_states), dim=-1)
        return moe_output * coef[..., 0:1] + mlp_output * coef[..., 1:]
