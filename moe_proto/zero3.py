"""The MoE layer under ZeRO stage 3: moe_proto's stages in the class DeepSpeed's ZeRO-3 engine accepts.

DeepSpeed 0.19.8 refuses ``deepspeed.moe.layer.MoE`` (which :class:`moe_proto.MoE` derives
from) under stage 3 (``runtime/engine.py`` ``_validate_zero3_moe_compatibility``: "Native
DeepSpeed MoE is not supported with ZeRO Stage 3") and accepts instances of
``deepspeed.module_inject.auto_ep_layer.AutoEPMoELayer``, the layer of its AutoEP route.
:class:`ZeRO3MoE` is such an instance. It does not run AutoEP's constructor (that one
converts a Hugging Face block through a preset): it derives
:class:`moe_proto.layer.MoEBase`, the constructor, router and stages :class:`moe_proto.MoE`
derives too (so top-k, capacity, dropless, prototypes and every routing option behave
identically), and carries the markers the engine reads from AutoEP's experts:

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
:class:`moe_proto.MoE`. It is not an instance of :class:`moe_proto.MoE` (that class derives
DeepSpeed's MoE, which stage 3 refuses); ``isinstance(layer, moe_proto.MoEBase)`` holds for both,
and stats, checkpoints and the planner look for that.

Refused when the layer is built or bound: building it inside ``deepspeed.zero.Init`` (the
engine must place the expert parameters itself) and AutoEP's tensor-parallel folding. Not
supported: DeepSpeed's own ``engine.save_checkpoint`` (it expects AutoEP's ``w1/w2/w3``
experts; use :func:`moe_proto.checkpoint.save_checkpoint`). The class also trains under
ZeRO 0-2, like any AutoEP layer, but :class:`moe_proto.MoE` is the one tested there.

Example::

    moe = ZeRO3MoE(64, None, num_experts=8, ep_size=2, num_prototypes=2, ffn_hidden_size=128, use_rts=False)
    engine, *_ = deepspeed.initialize(model=net, model_parameters=net.parameters(),
                                      config={..., "zero_optimization": {"stage": 3}})
"""
from __future__ import annotations

import logging
from typing import Any, Optional

from torch import nn

from sparse_core.zero3_state import (flat_groups, gathered_value, is_zero3_param, read_full_state,
                                           write_full_state)

from .layer import MoE, MoEBase

try:  # the engine's isinstance check for layers it allows under ZeRO-3
    from deepspeed.module_inject.auto_ep_layer import AutoEPMoELayer as _AutoEPMoELayer
except ImportError:  # pragma: no cover - DeepSpeed is a dependency; without it nothing runs ZeRO-3 anyway
    _AutoEPMoELayer = nn.Module

logger = logging.getLogger(__name__)

EXPERT_PLACEMENT_FAMILY = "autoep_expert"  # engine._resolve_zero3_param_placement / stage3 read this value
REPLICATED_PLACEMENT_FAMILY = "replicated"


class ZeRO3MoE(MoEBase, _AutoEPMoELayer):
    """The MoE layer for ZeRO stage 3: :class:`~moe_proto.layer.MoEBase`'s arguments, forward, outputs and
    attributes, in the class DeepSpeed accepts under stage 3 (see the module docstring).

    ``zero_stage`` may be left None or given as 3; ``moe_proto.moe_class(3)`` returns this class.

    Example::

        moe = ZeRO3MoE(16, None, num_experts=4, ep_size=2, k=1, ffn_hidden_size=32, use_rts=False)
        out, l_aux, exp_counts = moe(x)        # after deepspeed.initialize (ep_size > 1 needs its groups)
    """

    _z3_leaf = True  # ZeRO-3 gathers the whole layer at its pre-forward hook (deepspeed.utils.z3_leaf_module)
    _binds_deepspeed_layout = False  # DeepSpeed's save splits only ZeRO 0-2 layers; moe_proto.checkpoint here
    _supports_tensor_parallel_mpu = False  # untested with ZeRO-3's partitioning: refused when bound

    def _check_zero_stage(self, zero_stage: Optional[int]) -> None:
        if zero_stage not in (None, 3):
            raise ValueError(f"ZeRO3MoE is the ZeRO stage 3 layer, got zero_stage={zero_stage}: use moe_proto.MoE "
                             "for stages 0-2")

    def _finish_init(self, zero_stage: Optional[int]) -> None:
        self._mark_for_zero3()

    def _mark_for_zero3(self) -> None:
        if any(is_zero3_param(p) for p in self.parameters()):
            # zero.Init partitions over all ranks; the engine (_resolve_zero3_param_placement) would refuse it later.
            raise ValueError("ZeRO3MoE built inside deepspeed.zero.Init: its experts must be partitioned over their "
                             "expert-data-parallel group, which the engine does; build the model outside zero.Init")
        self.ep_group_name = self.expert_group_name  # the name AutoEP's layer and the engine's EP code use
        self.zero_stage = 3
        self.state_dict_layout = "stacked"  # DeepSpeed's save splits only ZeRO 0-2 layers; moe_proto.checkpoint here
        for param in self.parameters():
            param.ds_zero_placement_family = REPLICATED_PLACEMENT_FAMILY
        for param in self.experts.parameters():
            # allreduce=False / group_name are already set by GroupedExperts / ModuleExperts.
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
        super().set_deepspeed_parallelism(use_data_before_expert_parallel_)


def to_zero3(layer: MoE) -> "ZeRO3MoE":
    """Make a built :class:`moe_proto.MoE` the ZeRO stage 3 layer in place (same weights, parts and hooks); returns it.

    Both classes hold the same state (they share :class:`~moe_proto.layer.MoEBase`), so this
    reassigns the instance's class and adds the ZeRO-3 markers.

    For a model built without ``zero_stage=3`` that meets a stage 3 config (``sparse_scale.initialize``
    calls it before ``deepspeed.initialize``). A :class:`ZeRO3MoE` is returned as it is.

    Example::

        layer = to_zero3(MoE(16, None, num_experts=4, ffn_hidden_size=32, use_rts=False))
    """
    if isinstance(layer, ZeRO3MoE):
        return layer
    if type(layer) is not MoE:
        raise TypeError(f"to_zero3 converts moe_proto.MoE layers, got {type(layer).__name__}")
    layer.__class__ = ZeRO3MoE  # same MoEBase state and stages; only the DeepSpeed base and markers differ
    layer._mark_for_zero3()
    return layer


__all__ = ["ZeRO3MoE", "to_zero3", "EXPERT_PLACEMENT_FAMILY", "REPLICATED_PLACEMENT_FAMILY",
           # ZeRO-3 state readers (sparse_core.zero3_state), re-exported for moe_proto.checkpoint's callers
           "is_zero3_param", "gathered_value", "read_full_state", "write_full_state", "flat_groups"]
