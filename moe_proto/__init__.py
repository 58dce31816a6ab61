"""moe_proto: MoE layers with top-k routing, capacity and expert prototyping for DeepSpeed.

Example::

    from moe_proto import MoE
    moe = MoE(hidden_size=256, num_experts=16, num_prototypes=2, ffn_hidden_size=1024, use_rts=False)
    out, l_aux, exp_counts = moe(x)

The submodules' public API is re-exported here: expert parallelism (``parallel``),
expert-aware gradient clipping (``clipping``), topology-free checkpoints (``checkpoint``),
the ZeRO stage 3 layer class (``zero3``), routing statistics (``stats``) and the reference LM
(``models``). They are imported eagerly: ``layer`` already needs torch and DeepSpeed, and the
others add little to ``import moe_proto`` (check with ``python -X importtime``).
"""
from .args import MoEArgs
from .router import Router, RouterConfig
from .dispatch import DispatchPlan, permute, plan_dispatch, unpermute
from .experts import GroupedExperts, grouped_matmul, grouped_mm_supported
from .layer import MoE, MoEBase, moe_class
from .zero3 import ZeRO3MoE
from .balance import ExpertBalance, reset_expert_loads, update_expert_biases
from .routing import (RoutingRecord, RoutingStats, expert_capacity, multiplicative_jitter, route,
                      route_deepspeed_top1, route_deepspeed_top2, router_z_loss)
from .checkpoint import (expert_params, full_state_dict, iter_expert_files, load_checkpoint, load_full_state_dict,
                         relink_zero_optimizer_states, save_checkpoint)
from .models import LMOutput, MoEModelConfig, MoETransformerArgs, MoETransformerLM
from .upcycle import upcycle_dense_ffn, upcycle_experts, upcycle_lm, zero_router_gate_sum
from .clipping import bind_expert_aware_clipping, clip_grad_norm_, global_grad_norm
from .parallel import (ExchangePlan, ExpertParallelMismatch, check_group_agreement, combine_from_experts,
                       dispatch_to_experts, plan_exchange)
from .stats import LayerStats, MoEStatsLogger, collect_moe_stats, stats_events

__all__ = [
    "MoE",
    "MoEBase",  # the shared constructor and stages of MoE and ZeRO3MoE: isinstance(m, MoEBase) finds both
    "ZeRO3MoE",  # the same layer in the class DeepSpeed accepts under ZeRO stage 3
    "moe_class",  # MoE or ZeRO3MoE for a zero_optimization.stage
    "MoEArgs",
    "Router",
    "RouterConfig",
    # balance
    "ExpertBalance",
    "update_expert_biases",
    "reset_expert_loads",
    "RoutingRecord",
    "RoutingStats",
    "route",
    "route_deepspeed_top1",
    "route_deepspeed_top2",
    "expert_capacity",
    "router_z_loss",
    "multiplicative_jitter",
    "DispatchPlan",
    "plan_dispatch",
    "permute",
    "unpermute",
    "GroupedExperts",
    "grouped_matmul",
    "grouped_mm_supported",
    # parallel
    "ExchangePlan",
    "ExpertParallelMismatch",
    "check_group_agreement",
    "plan_exchange",
    "dispatch_to_experts",
    "combine_from_experts",
    # clipping
    "global_grad_norm",
    "clip_grad_norm_",
    "bind_expert_aware_clipping",
    # checkpoint
    "save_checkpoint",
    "load_checkpoint",
    "full_state_dict",
    "load_full_state_dict",
    "expert_params",
    "iter_expert_files",
    "relink_zero_optimizer_states",
    # stats
    "LayerStats",
    "MoEStatsLogger",
    "collect_moe_stats",
    "stats_events",
    # models
    "MoEModelConfig",
    "MoETransformerArgs",
    "MoETransformerLM",
    "LMOutput",
    # upcycling (the Hugging Face bridge, moe_proto.hf, needs the optional extra and is imported on its own)
    "upcycle_lm",
    "upcycle_dense_ffn",
    "upcycle_experts",
    "zero_router_gate_sum",
]
