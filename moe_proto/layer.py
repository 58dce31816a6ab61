"""The MoE layer: :class:`MoE`, a drop-in for ``deepspeed.moe.layer.MoE`` with expert prototyping.

One class tree, no construction tricks:

* :class:`MoEBase` - the constructor (every argument, typed, with DeepSpeed's order and
  defaults), the parts and the four stages, each its own method so that expert parallelism
  (an all-to-all between dispatch and compute, and back before combine) slots in:

  1. :meth:`MoEBase.route` - the router (:class:`~moe_proto.router.Router`, fp32 logits) ->
     :class:`~moe_proto.routing.RoutingRecord`
  2. :meth:`MoEBase.dispatch` - index plan + gather into an expert-major buffer
  3. :meth:`MoEBase.compute` - the experts over the filled rows only; with ``ep_size > 1`` the
     rows go to the experts' owners and back (:mod:`moe_proto.parallel`)
  4. :meth:`MoEBase.combine` - gate-weighted scatter-add back to the tokens

* :class:`MoE` (``MoEBase`` + ``deepspeed.moe.layer.MoE``) - the layer for ZeRO stages 0-2;
* :class:`moe_proto.zero3.ZeRO3MoE` (``MoEBase`` + DeepSpeed's AutoEP layer class) - the
  same layer for ZeRO stage 3; :func:`moe_class` picks one from a stage.

Example::

    moe = MoE(hidden_size=256, num_experts=16, k=1, num_prototypes=2, ffn_hidden_size=1024,
              capacity_factor=1.25, use_rts=False)
    out, l_aux, exp_counts = moe(x)          # x: [batch, seq, 256]
    loss = task_loss + 0.01 * l_aux
    moe.last_stats.drop_rate                 # for logging
"""
from __future__ import annotations

import dataclasses
import logging
import warnings
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import dispatch as dispatch_ops
from . import ds_layout
from . import parallel
from . import tensor_parallel
from .args import MoEArgs
from .dispatch import DispatchPlan
from .experts import GroupedExperts
from .module_experts import ModuleExperts
from .router import Router
from .routing import RoutingRecord, RoutingStats

try:  # deriving from DeepSpeed's class is how its engine recognises MoE layers (isinstance checks)
    from deepspeed.moe.layer import MoE as _DeepSpeedMoE
except ImportError:  # pragma: no cover - DeepSpeed is a dependency; keep the layer usable without it
    _DeepSpeedMoE = nn.Module

logger = logging.getLogger(__name__)

ZERO_STAGES = (None, 0, 1, 2, 3)


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


def _tensor_parallel_of(groups: object) -> Tuple[int, int, Optional[object]]:
    """``(size, rank, group)`` of the tensor-parallel ``groups.mpu`` (``(1, 0, None)`` without one)."""
    mpu = getattr(groups, "mpu", None)
    if mpu is None:
        return 1, 0, None
    from deepspeed.utils.bwc import (bwc_tensor_model_parallel_group, bwc_tensor_model_parallel_rank,
                                     bwc_tensor_model_parallel_world_size)

    size = bwc_tensor_model_parallel_world_size(mpu)
    if size <= 1:
        return 1, 0, None
    return size, bwc_tensor_model_parallel_rank(mpu), bwc_tensor_model_parallel_group(mpu)


class MoEBase(nn.Module):
    """The MoE layer's arguments, parts and stages, shared by :class:`MoE` and :class:`~moe_proto.zero3.ZeRO3MoE`.

    Not built directly: :class:`MoE` is the layer (ZeRO stages 0-2, a ``deepspeed.moe.layer.MoE``
    to DeepSpeed's engine) and :class:`moe_proto.zero3.ZeRO3MoE` the same layer in the class
    DeepSpeed accepts under ZeRO stage 3 (an AutoEP layer). Both take exactly these arguments
    and run these stages; ``isinstance(m, MoEBase)`` finds the layers of either class
    (DeepSpeed refuses its own MoE class under ZeRO-3, so the ZeRO-3 class cannot derive
    :class:`MoE`). Subclasses may override any stage and call ``super()``.

    Parts: ``gate`` (:class:`~moe_proto.router.Router`: gate weight, balance state, routing
    noise), ``experts`` (:class:`~moe_proto.experts.GroupedExperts` or
    :class:`~moe_proto.module_experts.ModuleExperts`), ``mlp`` / ``coefficient`` (PR-MoE) and
    ``shared_experts``. Stages: :meth:`route`, :meth:`dispatch`, :meth:`compute`, :meth:`combine`.

    Example::

        isinstance(MoE(16, None, num_experts=4, ffn_hidden_size=32), MoEBase)   # True
    """

    _binds_deepspeed_layout = True  # set_deepspeed_parallelism switches the state dict to DeepSpeed's keys
    _supports_tensor_parallel_mpu = True  # a tensor-parallel groups.mpu (moe_proto.tensor_parallel)

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
        if type(self) is MoEBase:
            raise TypeError("MoEBase holds the shared stages: build moe_proto.MoE (ZeRO 0-2) or "
                            "moe_proto.ZeRO3MoE (ZeRO stage 3)")
        if zero_stage not in ZERO_STAGES:
            raise ValueError(f"zero_stage={zero_stage!r}: expected None, 0, 1, 2 or 3 (the DeepSpeed config's "
                             "zero_optimization.stage)")
        self._check_zero_stage(zero_stage)
        nn.Module.__init__(self)  # DeepSpeed's MoE.__init__ would build its own gate and experts
        given = locals()
        self.args = MoEArgs(**{f.name: given[f.name] for f in dataclasses.fields(MoEArgs)})
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
        # Tensor-parallel mpu (set when bound; moe_proto.tensor_parallel): size, rank, group, expert TP.
        self.tp_size, self.tp_rank, self.tp_group = 1, 0, None
        self.expert_tensor_parallel = False
        self.gate = Router(hidden_size, args)  # key gate.weight, as the nn.Linear gate it replaces
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
        self.last_stats: Optional[RoutingStats] = None
        # DeepSpeed's keys (ds_layout.py) for a layer built like DeepSpeed's, and once bound to its engine
        # (set_deepspeed_parallelism), so that engine.save_checkpoint/load_checkpoint work; else the stacked keys.
        self.state_dict_layout = "deepspeed" if expert is not None else "stacked"
        self._register_state_dict_hook(ds_layout.to_deepspeed_keys)
        self._register_load_state_dict_pre_hook(ds_layout.from_deepspeed_keys, with_module=True)
        self._register_load_state_dict_pre_hook(_balance_keys_of_before, with_module=False)
        logger.info("MoE layer: %d experts (%d local), %d prototype(s), top-%d per prototype, %s", num_experts,
                    args.num_local_experts, num_prototypes, k,
                    "dropless" if args.is_dropless else f"capacity factor {capacity_factor}")
        self._finish_init(zero_stage)

    def _check_zero_stage(self, zero_stage: Optional[int]) -> None:
        """Refuse a ``zero_stage`` this class cannot train under (called before anything is built)."""

    def _finish_init(self, zero_stage: Optional[int]) -> None:
        """The class's last construction step (ZeRO-3 markers; the deprecated ``MoE(..., zero_stage=3)``)."""

    @property
    def router(self) -> Router:
        """The layer's :class:`~moe_proto.router.Router` (registered as ``gate``, DeepSpeed's name)."""
        return self.gate

    @property
    def balance(self):
        """The router's :class:`~moe_proto.balance.ExpertBalance` (None when no option needs one)."""
        return self.gate.balance

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
        record, dispatch_input, grad_handoff = self.gate.route(x, used_token, sequence_length)
        buffer, plan = self.dispatch(dispatch_input, record, grad_handoff)
        expert_output = self.compute(buffer, plan)
        output = self.combine(expert_output, plan, x.shape[0]).view_as(hidden_states)
        if self.args.use_residual:
            output = self._mix_residual(hidden_states, output)
        if self.args.num_shared_experts:
            output = output + self._shared_output(x).view_as(hidden_states)
        self.gate.add_step_load(record)
        self.last_stats = record.stats()
        l_aux = record.aux_loss
        if self.args.z_loss_coef:
            l_aux = l_aux + self.args.z_loss_coef * record.z_loss
        return output, l_aux, record.routed_per_expert

    def route(self, x: Tensor, used_token: Optional[Tensor] = None,
              sequence_length: Optional[int] = None) -> RoutingRecord:
        """Stage 1: fp32 router logits (input jitter in training) -> routing record (:meth:`Router.route`).

        Non-finite logits (a NaN/inf input or router weight) raise ``FloatingPointError``.

        ``sequence_length``: tokens per sequence of ``x`` (``aux_loss_scope="sequence"`` only).
        """
        return self.gate.route(x, used_token, sequence_length).record

    def dispatch(self, x: Tensor, record: RoutingRecord,
                 grad_handoff: Optional[dispatch_ops.DispatchGradHandoff] = None) -> Tuple[Tensor, DispatchPlan]:
        """Stage 2: index plan and the expert-major buffer ``[kept routes, hidden]``.

        ``grad_handoff``: the router's (see :meth:`forward`), when ``x`` is its view of the input.
        """
        plan = dispatch_ops.plan_dispatch(record)
        return dispatch_ops.permute(x, plan, grad_handoff), plan

    def compute(self, buffer: Tensor, plan: DispatchPlan) -> Tensor:
        """Stage 3: every expert over its rows, one grouped matmul per projection.

        With ``ep_size > 1`` the rows travel to the ranks owning their experts and back. Under a
        tensor-parallel mpu each tensor-parallel rank sends only its share of the rows, and the
        shares are all-gathered after (:mod:`moe_proto.tensor_parallel`, as DeepSpeed's MOELayer).
        """
        if self.tp_size == 1:
            return self._compute_rows(buffer, plan.tokens_per_expert, plan.capacity)
        split = tensor_parallel.RowSplit.of(plan.tokens_per_expert, self.tp_size, self.tp_rank)
        share = tensor_parallel.keep_share(buffer, split, self.tp_group)
        capacity = None if plan.capacity is None else -(-plan.capacity // self.tp_size)
        counts = split.counts[self.tp_rank].to(plan.tokens_per_expert.device)
        return tensor_parallel.gather_shares(self._compute_rows(share, counts, capacity), split, self.tp_group)

    def _compute_rows(self, rows: Tensor, tokens_per_expert: Tensor, capacity: Optional[int]) -> Tensor:
        if self.args.ep_size == 1 and not self.expert_tensor_parallel:
            return self.experts(rows, tokens_per_expert)
        if self.args.ep_size == 1:
            return self._run_experts(rows, tokens_per_expert.unsqueeze(0))
        group = self._expert_parallel_group()
        exchange = parallel.plan_exchange(tokens_per_expert, group, hidden_size=self.args.hidden_size,
                                          dtype=rows.dtype, capacity=capacity, fixed_splits=self.ep_fixed_splits)
        local = parallel.dispatch_to_experts(rows, exchange, group)
        return parallel.combine_from_experts(self._run_experts(local, exchange.recv_counts), exchange, group)

    def _run_experts(self, local: Tensor, recv_counts: Tensor) -> Tensor:
        """The local experts over received rows (``recv_counts [blocks, L]``); with expert tensor parallelism
        over the rows of every rank of the tensor-parallel group (the expert modules are tensor-parallel)."""
        if not self.expert_tensor_parallel:
            return self.experts(local, recv_counts)
        every = tensor_parallel.gather_counts(recv_counts, self.tp_group)            # [tp, blocks, L]
        sizes = [int(c) for c in every.sum(dim=(1, 2))]
        rows = tensor_parallel.gather_slices(local, sizes, self.tp_rank, self.tp_group)
        out = self.experts(rows, every.reshape(-1, every.shape[-1]).to(recv_counts.device))
        return tensor_parallel.keep_slice(out, sizes, self.tp_rank, self.tp_group)

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

        self.tp_size, self.tp_rank, self.tp_group = _tensor_parallel_of(groups)
        if self.tp_size > 1 and not self._supports_tensor_parallel_mpu:  # the mpu is everyone's: every rank raises
            raise ValueError(f"{type(self).__name__} under a tensor-parallel mpu (size {self.tp_size}): not "
                             "supported; tensor parallelism with MoE layers is tested with moe_proto.MoE (ZeRO 0-2)")
        if self._binds_deepspeed_layout:  # ZeRO-3 layers keep their stacked keys (moe_proto.checkpoint)
            self.state_dict_layout = "deepspeed"  # what DeepSpeed's save_checkpoint/load_checkpoint split per expert
        if self.expert_group_name not in groups._get_expert_parallel_group_dict():
            logger.info("creating DeepSpeed expert-parallel groups %s", self.expert_group_name)
            if self.tp_size > 1 and self.enable_expert_tensor_parallelism:
                # Expert-parallel groups of equal tensor-parallel rank; each expert is tensor-parallel itself.
                groups._create_expert_data_and_model_parallel(
                    self.ep_size, mpu=groups.mpu, use_data_before_expert_parallel_=use_data_before_expert_parallel_)
            else:
                groups._create_expert_and_data_parallel(
                    self.ep_size, use_data_before_expert_parallel_=use_data_before_expert_parallel_)
        # As DeepSpeed's MOELayer: the groups (the first layer that created them) decide, not this layer's flag.
        self.expert_tensor_parallel = self.tp_size > 1 and groups._get_expert_model_parallel_world_size() > 1
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


def _balance_keys_of_before(state: dict, prefix: str, local_metadata: object, strict: bool, missing_keys: list,
                            unexpected_keys: list, error_msgs: list) -> None:
    """Load pre-hook: the expert-balance buffers were the layer's ``balance.*`` before the router held them."""
    old, new = prefix + "balance.", prefix + "gate.balance."
    for key in [k for k in state if k.startswith(old)]:
        state[new + key[len(old):]] = state.pop(key)


class MoE(MoEBase, _DeepSpeedMoE):
    """Mixture-of-Experts FFN layer with top-k routing, expert prototyping and capacity (ZeRO stages 0-2).

    A ``deepspeed.moe.layer.MoE`` to DeepSpeed's engine (it derives that class without
    running its constructor), so ``deepspeed.initialize`` sees an MoE layer, calls
    :meth:`set_deepspeed_parallelism` (which creates the ``ep_size_{ep_size}`` expert /
    expert-data-parallel groups) and reduces expert gradients over the expert-data-parallel
    group only. EP rank r holds experts ``r*E/ep_size .. (r+1)*E/ep_size - 1``. For ZeRO stage 3
    build :class:`moe_proto.zero3.ZeRO3MoE` (same arguments; DeepSpeed refuses this class there).

    The positional arguments and defaults are those of ``deepspeed.moe.layer.MoE``; the
    keyword-only ones are additions (see :class:`~moe_proto.args.MoEArgs` and
    :class:`~moe_proto.router.RouterConfig` for all of them). ``expert`` may be any
    ``nn.Module``, copied into every expert like DeepSpeed's deep copy: ``Linear -> activation
    -> Linear`` and SwiGLU FFNs as stacked weights (:class:`~moe_proto.experts.GroupedExperts`),
    anything else as per-expert modules (:class:`~moe_proto.module_experts.ModuleExperts`); or
    None, in which case the layer builds independently initialised experts of width
    ``ffn_hidden_size`` with ``activation``.

    ``state_dict_layout``: ``"deepspeed"`` (DeepSpeed's keys, :mod:`moe_proto.ds_layout`) for a
    layer built from an expert module and once ``deepspeed.initialize`` binds it (ZeRO 0-2),
    else ``"stacked"``; ``load_state_dict`` takes both.

    ``forward(hidden_states, used_token=None)`` returns ``(output, l_aux, exp_counts)``
    like DeepSpeed: ``l_aux`` is the unscaled load-balancing loss plus
    ``z_loss_coef * z_loss``, ``exp_counts`` the per-expert routes before drops.

    ``ep_fixed_splits=True`` (capacity mode, ``ep_size > 1``) pads every expert to its
    capacity in the all-to-all so message sizes are static; the default sends only kept
    rows after exchanging per-expert counts.

    Under a tensor-parallel ``mpu`` (``deepspeed.initialize(..., mpu=...)``) each tensor-parallel
    rank sends only its share of the rows; ``enable_expert_tensor_parallelism=True`` runs
    tensor-parallel expert modules over the rows of the whole tensor-parallel group, as
    DeepSpeed's MOELayer (:mod:`moe_proto.tensor_parallel`).

    Differences from DeepSpeed, on purpose: eval routing is deterministic (RTS and
    second-expert sampling act in training only), the logits are never modified in
    place, and the default drop order (``drop_policy="probs"``) keeps the highest-gate
    tokens. ``deepspeed_compat=True`` reproduces DeepSpeed's top-1/top-2 decisions.

    Routing options (off by default; docs/moe.md "Routing options"): ``expert_bias_update_rate``
    (aux-loss-free balancing: ``self.balance`` holds the bias; call
    :func:`moe_proto.update_expert_biases` after each optimizer step), ``score_function``,
    ``normalize_routes``, ``aux_loss_scope`` and ``num_shared_experts`` /
    ``shared_expert_ffn_hidden_size`` (``self.shared_experts``, a replicated dense FFN).

    ``zero_stage``: None or 0-2. ``3`` is deprecated here (it converts the layer into a
    :class:`~moe_proto.zero3.ZeRO3MoE` with a ``DeprecationWarning``): build ``ZeRO3MoE(...)``,
    or ``moe_proto.moe_class(zero_stage)(...)`` when the stage comes from a config.

    Example::

        mlp = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
        moe = MoE(64, mlp, num_experts=8, k=2, use_rts=False, top2_2nd_expert_sampling=False)
        out, l_aux, exp_counts = moe(torch.randn(4, 32, 64))
        loss = task_loss + 0.01 * l_aux
        moe.last_stats.drop_rate                 # for logging
    """

    def _check_zero_stage(self, zero_stage: Optional[int]) -> None:
        if zero_stage == 3 and type(self) is not MoE:  # a subclass: it derives DeepSpeed's MoE, refused by ZeRO-3
            raise ValueError(f"zero_stage=3 with {type(self).__name__}, a subclass of moe_proto.MoE: DeepSpeed refuses "
                             "deepspeed.moe.layer.MoE under ZeRO stage 3; subclass moe_proto.zero3.ZeRO3MoE instead")

    def _finish_init(self, zero_stage: Optional[int]) -> None:
        if zero_stage == 3:
            warnings.warn("moe_proto.MoE(..., zero_stage=3) is deprecated and will be removed in the next release: "
                          "build moe_proto.ZeRO3MoE(...) (same arguments), or moe_proto.moe_class(zero_stage)(...)",
                          DeprecationWarning, stacklevel=3)
            from .zero3 import to_zero3

            to_zero3(self)


def moe_class(zero_stage: Optional[int] = None) -> type:
    """The layer class for a DeepSpeed config's ``zero_optimization.stage``: :class:`MoE` for None or 0-2,
    :class:`moe_proto.zero3.ZeRO3MoE` for 3 (DeepSpeed accepts only that class there).

    Example::

        layer = moe_class(ds_config["zero_optimization"]["stage"])(64, None, num_experts=8, ffn_hidden_size=128)
    """
    if zero_stage not in ZERO_STAGES:
        raise ValueError(f"zero_stage={zero_stage!r}: expected None, 0, 1, 2 or 3 (the DeepSpeed config's "
                         "zero_optimization.stage)")
    if zero_stage == 3:
        from .zero3 import ZeRO3MoE

        return ZeRO3MoE
    return MoE
