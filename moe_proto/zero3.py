"""The MoE layer under ZeRO stage 3: moe_proto's stages in the class DeepSpeed's ZeRO-3 engine accepts.

DeepSpeed 0.19.8 refuses ``deepspeed.moe.layer.MoE`` (which :class:`moe_proto.MoE` derives
from) under stage 3 (``runtime/engine.py`` ``_validate_zero3_moe_compatibility``: "Native
DeepSpeed MoE is not supported with ZeRO Stage 3") and accepts instances of
``deepspeed.module_inject.auto_ep_layer.AutoEPMoELayer``, the layer of its AutoEP route.
:class:`ZeRO3MoE` is such an instance. It does not run AutoEP's constructor (that one
converts a Hugging Face block through a preset); it runs moe_proto's own route, dispatch,
compute and combine (the very functions of :class:`moe_proto.MoE`, so top-k, capacity,
dropless, k top-1 prototypes and every routing option behave identically) and carries the
markers the engine reads from AutoEP's experts:

* ``allreduce=False``, ``group_name="ep_size_N"`` (every expert parameter, as in ZeRO 0-2);
* ``ds_zero_placement_family="autoep_expert"`` and ``ds_zero_partition_group_name="ep_size_N"``:
  ``engine._resolve_zero3_param_placement`` then partitions each expert stack over its
  expert-data-parallel group (``partition_parameters.py`` reads
  ``ds_zero_partition_process_group``), and ZeRO-3 averages expert gradients over the full
  data-parallel size and adds the expert-parallel group to the gradient norm (``stage3.py``
  ``_autoep_expert_parallel_group``). Router, shared experts and the PR-MoE MLP stay
  ``"replicated"`` (partitioned over all data-parallel ranks).

The layer is a ZeRO-3 leaf module (``_z3_leaf``): ZeRO gathers all of its parameters before
its forward, in one go, instead of per child module: the stages read ``gate.weight`` without
calling ``gate`` (a per-child hook would leave it partitioned), and one gather per layer
cannot diverge between ranks that route to different experts (the hang of DeepSpeed #4808).

Expert parallelism uses DeepSpeed's ``ep_size_N`` groups (``groups._create_expert_and_data_parallel``),
created when ``deepspeed.initialize`` calls :meth:`ZeRO3MoE.set_deepspeed_parallelism`, as for
:class:`moe_proto.MoE`. ``isinstance(layer, moe_proto.MoE)`` is true, so stats, checkpoints
and the planner treat both classes alike.

Refused when the layer is built or bound: building it inside ``deepspeed.zero.Init`` (the
engine must place the expert parameters itself) and AutoEP's tensor-parallel folding. Not
supported: DeepSpeed's own ``engine.save_checkpoint`` (it expects AutoEP's ``w1/w2/w3``
experts; use :func:`moe_proto.checkpoint.save_checkpoint`). The class also trains under
ZeRO 0-2, like any AutoEP layer, but :class:`moe_proto.MoE` is the one tested there.

Example::

    moe = MoE(64, None, num_experts=8, ep_size=2, num_prototypes=2, ffn_hidden_size=128, use_rts=False,
              zero_stage=3)                    # a ZeRO3MoE
    engine, *_ = deepspeed.initialize(model=net, model_parameters=net.parameters(),
                                      config={..., "zero_optimization": {"stage": 3}})
"""
from __future__ import annotations

import logging
from typing import Any, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import Tensor, nn

from .experts import GroupedExperts
from .layer import MoE

try:  # the engine's isinstance check for layers it allows under ZeRO-3
    from deepspeed.module_inject.auto_ep_layer import AutoEPMoELayer as _AutoEPMoELayer
except ImportError:  # pragma: no cover - DeepSpeed is a dependency; without it nothing runs ZeRO-3 anyway
    _AutoEPMoELayer = nn.Module

logger = logging.getLogger(__name__)

EXPERT_PLACEMENT_FAMILY = "autoep_expert"  # engine._resolve_zero3_param_placement / stage3 read this value
REPLICATED_PLACEMENT_FAMILY = "replicated"


class ZeRO3MoE(_AutoEPMoELayer):
    """:class:`moe_proto.MoE` for ZeRO stage 3 (same arguments, forward, outputs and attributes).

    Build it with ``moe_proto.MoE(..., zero_stage=3)`` or directly; see the module docstring.

    Example::

        moe = ZeRO3MoE(16, None, num_experts=4, ep_size=2, k=1, ffn_hidden_size=32, use_rts=False)
        out, l_aux, exp_counts = moe(x)        # after deepspeed.initialize (ep_size > 1 needs its groups)
    """

    _z3_leaf = True  # ZeRO-3 gathers the whole layer at its pre-forward hook (deepspeed.utils.z3_leaf_module)
    _moe_proto_layer = True  # isinstance(self, moe_proto.MoE) is true (layer._MoEFamily)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        stage = kwargs.pop("zero_stage", 3)
        if stage != 3:
            raise ValueError(f"ZeRO3MoE is the ZeRO stage 3 layer, got zero_stage={stage}: use moe_proto.MoE "
                             "for stages 0-2")
        MoE.__init__(self, *args, **kwargs)  # nn.Module.__init__ plus moe_proto's layer; not AutoEP's constructor
        self._mark_for_zero3()

    def _mark_for_zero3(self) -> None:
        if any(is_zero3_param(p) for p in self.parameters()):
            # zero.Init partitions over all ranks; the engine (_resolve_zero3_param_placement) would refuse it later.
            raise ValueError("ZeRO3MoE built inside deepspeed.zero.Init: its experts must be partitioned over their "
                             "expert-data-parallel group, which the engine does; build the model outside zero.Init")
        _refuse_module_experts(self)
        self.ep_group_name = self.expert_group_name  # the name AutoEP's layer and the engine's EP code use
        self.zero_stage = 3
        self.state_dict_layout = "stacked"  # DeepSpeed's save splits only ZeRO 0-2 layers; moe_proto.checkpoint here
        for param in self.parameters():
            param.ds_zero_placement_family = REPLICATED_PLACEMENT_FAMILY
        for param in self.experts.parameters():
            # allreduce=False / group_name are already set by GroupedExperts.
            param.ds_zero_placement_family = EXPERT_PLACEMENT_FAMILY
            param.ds_zero_partition_group_name = self.expert_group_name
        logger.info("ZeRO3MoE: ZeRO-3 partitions the experts over the %s expert-data-parallel group",
                    self.expert_group_name)

    def set_deepspeed_parallelism(self, use_data_before_expert_parallel_: bool = False,
                                  folding_group_handles: Optional[Any] = None) -> None:
        """Create (or reuse) DeepSpeed's ``ep_size_{ep_size}`` groups and join this layer's.

        ``deepspeed.initialize`` calls this (with AutoEP's signature); ``folding_group_handles``
        (AutoEP + AutoTP folding) is refused. Example::

            moe.set_deepspeed_parallelism()
        """
        if folding_group_handles is not None:
            raise ValueError("ZeRO3MoE does not support AutoEP tensor-parallel folding (tensor_parallel.autotp_size "
                             "> 1 with expert_parallel): leave tensor_parallel.autotp_size at 1")
        MoE.set_deepspeed_parallelism(self, use_data_before_expert_parallel_)

    def _create_process_groups(self, use_data_before_expert_parallel_: bool = False) -> None:
        # DeepSpeed MoE's name for the same step, as on moe_proto.MoE.
        self.set_deepspeed_parallelism(use_data_before_expert_parallel_)


def to_zero3(layer: MoE) -> "ZeRO3MoE":
    """Make a built :class:`moe_proto.MoE` the ZeRO stage 3 layer in place (same weights); returns it.

    For a model built without ``zero_stage=3`` that meets a stage 3 config (``sparse_scale.initialize``
    calls it before ``deepspeed.initialize``). A :class:`ZeRO3MoE` is returned as it is.

    Example::

        layer = to_zero3(MoE(16, None, num_experts=4, ffn_hidden_size=32, use_rts=False))
    """
    if isinstance(layer, ZeRO3MoE):
        return layer
    if type(layer) is not MoE:
        raise TypeError(f"to_zero3 converts moe_proto.MoE layers, got {type(layer).__name__}")
    _refuse_module_experts(layer)
    layer.__class__ = ZeRO3MoE  # the stages are MoE's own functions (see _share_members); only markers differ
    layer._mark_for_zero3()
    return layer


def _refuse_module_experts(layer: Any) -> None:
    if not isinstance(layer.experts, GroupedExperts):
        raise ValueError(f"the expert module takes the per-expert path ({type(layer.experts).__name__}); the "
                         "ZeRO-3 layer supports stacked experts only (Linear -> GELU/ReLU/SiLU -> Linear, or "
                         "expert=None with ffn_hidden_size): use ZeRO stage 0-2 for this expert module")


def _share_members(target: type, source: type) -> None:
    """Give ``target`` every method/property of ``source`` it does not define itself (dunders excluded).

    One implementation of the stages: moe_proto.MoE's own functions (none calls ``super()``,
    so they work on any class with the same attributes), including methods added to it later.
    """
    for name, member in vars(source).items():
        if not (name.startswith("__") and name.endswith("__")) and name not in vars(target):
            setattr(target, name, member)


_share_members(ZeRO3MoE, MoE)


# ZeRO-3 state access for moe_proto.checkpoint: full values in, full values out, per parameter.
#
# Stage 3 keeps, per sub-group ``g`` of the inner optimizer, one flat fp32 partition
# (``optimizer.fp32_partitioned_groups_flat[g]``, Adam's state keyed by it) and the bit16
# partition of each parameter (``param.ds_tensor``); ``optimizer.grad_position[id]`` gives a
# parameter's ``(g, offset, partition_numel)``, and its partition rank is its rank in
# ``param.ds_process_group`` (the expert-data-parallel group for experts). Partitions are
# padded at the end of the last ranks', which DeepSpeed 0.19.8's ``safe_set_full_fp32_param``
# does not allow for (it narrows the unpadded value past its end), hence the writer here.


def is_zero3_param(param: Tensor) -> bool:
    """Whether ZeRO-3 has partitioned ``param`` (it then carries a ``ds_id``).

    Example::

        is_zero3_param(engine.module.moe.experts.w1)   # True under stage 3
    """
    return hasattr(param, "ds_id")


def gathered_value(param: Tensor) -> Tensor:
    """A detached copy of the whole parameter; a collective over its partition group under ZeRO-3.

    Example::

        w1 = gathered_value(engine.module.moe.experts.w1)   # [local experts, d, ffn]
    """
    if not is_zero3_param(param):
        return param.detach().clone()
    from deepspeed.runtime.zero.partition_parameters import GatheredParameters

    with GatheredParameters([param]):
        return param.detach().clone()


def _position(engine: Any, param: Tensor) -> Tuple[Tensor, int, int]:
    optimizer = engine.optimizer
    group, offset, numel = optimizer.grad_position[optimizer.get_param_id(param)]
    if optimizer._swappable_optimizer_subgroup(group):
        raise ValueError("moe_proto checkpoints under ZeRO-3 do not support NVMe-swapped optimizer state "
                         "(zero_optimization.offload_optimizer.device=nvme)")
    return optimizer.fp32_partitioned_groups_flat[group], offset, numel


def read_full_state(engine: Any, param: Tensor, key: Optional[str] = None) -> Tensor:
    """Full fp32 value (key None) or optimizer state ``key`` of a ZeRO-3 parameter, on the CPU.

    A collective over the parameter's partition group (every rank of it calls this, in the
    same parameter order). A state the optimizer has not created yet (before the first step)
    and the state of a frozen parameter read as zeros. Example::

        exp_avg = read_full_state(engine, model.moe.experts.w1, "exp_avg")
    """
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    if not param.requires_grad:  # not in the optimizer: the bit16 value is the value
        value = gathered_value(param).float().cpu()
        return value if key is None else torch.zeros_like(value)
    if key is None:
        return safe_get_full_fp32_param(param).detach().float().cpu()
    flat, _, _ = _position(engine, param)
    if key not in engine.optimizer.optimizer.state.get(flat, {}):
        return torch.zeros(param.ds_shape, dtype=torch.float32)
    return safe_get_full_optimizer_state(param, key).detach().float().cpu()


def write_full_state(engine: Any, param: Tensor, value: Tensor, key: Optional[str] = None) -> None:
    """Write this rank's partition of a full ``value`` into a ZeRO-3 parameter (key None) or state ``key``.

    The value goes to the fp32 master partition and the bit16 partition (``ds_tensor``); a
    state goes to the optimizer's flat state, which must exist (``moe_proto.checkpoint.load_checkpoint``
    creates it first).
    Not a collective. Example::

        write_full_state(engine, model.moe.experts.w1, saved["exp_avg"], "exp_avg")
    """
    if tuple(value.shape) != tuple(param.ds_shape):
        raise ValueError(f"checkpoint tensor of shape {tuple(value.shape)} for a ZeRO-3 parameter of shape "
                         f"{tuple(param.ds_shape)}")
    numel = param.partition_numel()
    start = dist.get_rank(group=param.ds_process_group) * numel
    real = max(0, min(numel, param.ds_numel - start))  # the rest of the partition is padding
    if real == 0:  # this rank's partition is all padding (a small tensor over many ranks)
        return
    source = value.detach().flatten().narrow(0, start, real)
    with torch.no_grad():
        if key is None:
            param.ds_tensor.data.narrow(0, 0, real).copy_(source.to(param.ds_tensor.dtype))
        if not param.requires_grad:
            return
        flat, offset, _ = _position(engine, param)
        target = flat if key is None else engine.optimizer.optimizer.state[flat][key]
        target.narrow(0, offset, real).copy_(source.to(target.device, target.dtype))


def flat_groups(engine: Any) -> List[List[Tensor]]:
    """Per param group of the inner optimizer, its ZeRO-3 flat fp32 partitions (the keys of its state).

    Example::

        steps = [engine.optimizer.optimizer.state[f[0]]["step"] for f in flat_groups(engine) if f]
    """
    optimizer = engine.optimizer
    out: List[List[Tensor]] = [[] for _ in optimizer.optimizer.param_groups]
    for sub_group, flat in enumerate(optimizer.fp32_partitioned_groups_flat):
        out[optimizer.sub_group_to_group_id[sub_group]].append(flat)
    return out
