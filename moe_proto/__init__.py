"""moe_proto: MoE layers with top-k routing, capacity and expert prototyping for DeepSpeed.

Example::

    from moe_proto import MoE
    moe = MoE(hidden_size=256, num_experts=16, num_prototypes=2, ffn_hidden_size=1024, use_rts=False)
    out, l_aux, exp_counts = moe(x)
"""
from .args import MoEArgs
from .dispatch import DispatchPlan, permute, plan_dispatch, unpermute
from .experts import GroupedExperts, grouped_matmul, grouped_mm_supported
from .layer import MoE
from .routing import (RoutingRecord, RoutingStats, expert_capacity, multiplicative_jitter, route,
                      route_deepspeed_top1, route_deepspeed_top2, router_z_loss)

__all__ = [
    "MoE",
    "MoEArgs",
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
]
