"""The ``moe_proto`` block of a DeepSpeed config: experts, prototypes, capacity, expert parallelism.

    >>> MoEProtoConfig.model_validate({"num_experts": 16, "num_prototypes": 2, "ep_size": 2})
"""
from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field, PositiveFloat, PositiveInt, model_validator

from sparse_core.blocks import StrictBlock


class MoEProtoConfig(StrictBlock):
    """Validated ``"moe_proto"`` block."""

    num_experts: PositiveInt = Field(
        description="Experts E of each MoE FFN layer, over all prototypes and expert-parallel ranks together.")
    num_prototypes: PositiveInt = Field(
        1, description="Expert prototypes P: the E experts form P groups of E/P consecutive experts, each routes every "
                       "token among its own experts, and the P outputs are summed (1: plain top-k routing).")
    top_k: PositiveInt = Field(
        1, description="Routes per token within each prototype, so a token has num_prototypes x top_k routes.")
    capacity_factor: PositiveFloat = Field(
        1.25, description="Training capacity multiplier: each expert keeps at most C = max(ceil(capacity_factor x "
                          "routes per token x tokens / num_experts), min_capacity) routes (unused when dropless).")
    eval_capacity_factor: PositiveFloat = Field(
        2.0, description="Capacity multiplier used in eval mode in place of capacity_factor (unused when dropless).")
    min_capacity: int = Field(4, ge=0,
                              description="Lower bound on each expert's capacity C, in routes (rows), whatever the "
                                          "capacity factor gives.")
    dropless: bool = Field(
        False, description="Keep every route: no capacity limit and no drops (the capacity factors and drop_policy "
                           "are then unused).")
    drop_policy: Literal["probs", "position"] = Field(
        "probs", description='Which routes an expert over capacity keeps: "probs" those with the highest gate '
                             'probability, "position" those of the lowest token indices (ties: lower token index).')
    ep_size: PositiveInt = Field(
        1, description="Expert-parallel size: each rank holds num_experts / ep_size experts of every MoE layer and "
                       "the routed rows travel by all-to-all within DeepSpeed's expert groups (1: off).")
    aux_loss_coef: float = Field(
        0.01, ge=0.0, description="Weight of the MoE layers' l_aux (load-balancing loss plus any z-loss) in the "
                                  "training loss: cross-entropy (LM) or BCE (rec tower) + aux_loss_coef x the sum "
                                  "over MoE layers.")
    z_loss_coef: float = Field(
        0.0, ge=0.0, description="Weight of the router z-loss (mean over tokens of logsumexp(router logits)^2, "
                                 "ST-MoE) added to each MoE layer's l_aux (0: off).")
    moe_every: PositiveInt = Field(
        2, description="An MoE FFN every n transformer layers: layer i (0-based) has one when (i + 1) % moe_every "
                       "== 0, the others a dense FFN (rec job: the MoE tower's hidden layers, docs/rec_job.md).")

    expert_bias_update_rate: float = Field(
        0.0, ge=0.0, description="Aux-loss-free load balancing (DeepSeek-V3): a per-expert bias added to the router "
                                 "scores for choosing experts only (gates use the unbiased scores), moved after every "
                                 "optimizer step by rate x sign(mean load - expert load), loads summed over the "
                                 "step's micro-batches and all ranks, the mean within each prototype (0: off).")
    score_function: Literal["softmax", "sigmoid"] = Field(
        "softmax", description='Router scores: "softmax" over the experts of each prototype, or "sigmoid" of each '
                               'logit (DeepSeek-V3, usually with normalize_routes and expert_bias_update_rate).')
    normalize_routes: Optional[bool] = Field(
        None, description="Divide a token's selected gate weights by their sum within each prototype: true always "
                          "(with top_k 1 and softmax every weight becomes 1), false never, null when top_k > 1.")
    aux_loss_scope: Literal["micro_batch", "sequence", "global_batch"] = Field(
        "micro_batch", description='What the load-balancing loss balances: "micro_batch" the routes of each '
                                   'forward, "sequence" each sequence apart, averaged (DeepSeek-V3; LM only), '
                                   '"global_batch" expert loads over the micro-batches of the step and all ranks '
                                   'times the mean router probabilities of this forward (Megatron global aux loss).')
    num_shared_experts: int = Field(
        0, ge=0, description="Shared experts: a dense FFN of num_shared_experts x shared_expert_ffn_hidden_size "
                             "that every token goes through, added to the routed output (replicated on every rank; "
                             "0: none).")
    shared_expert_ffn_hidden_size: Optional[PositiveInt] = Field(
        None, description="Hidden width of each shared expert; null: the routed experts' width.")
    host_buffer_pool_mb: int = Field(
        1024, ge=0, description="Most MiB of CPU memory the model's MoE layers keep between steps for reuse "
                                "(activations, saved tensors, weight gradients of 256 KiB or more): reused buffers "
                                "are not page-faulted in again every step (moe_proto/buffer_pool.py; 0: off).")

    @model_validator(mode="after")
    def _routing_options(self) -> "MoEProtoConfig":
        """shared_expert_ffn_hidden_size needs num_shared_experts > 0."""
        if self.shared_expert_ffn_hidden_size is not None and self.num_shared_experts == 0:
            raise ValueError("shared_expert_ffn_hidden_size is set but num_shared_experts is 0")
        return self

    @model_validator(mode="after")
    def _router(self) -> "MoEProtoConfig":
        """The routing fields as the layer's router reads them (moe_proto.router.RouterConfig, its checks);
        num_experts must be divisible by ep_size."""
        from .router import router_config_of_block

        router_config_of_block(self)
        if self.num_experts % self.ep_size:
            raise ValueError(f"num_experts={self.num_experts} is not divisible by ep_size={self.ep_size}")
        return self
