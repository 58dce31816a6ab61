"""The ``moe_proto`` block of a DeepSpeed config: experts, prototypes, capacity, expert parallelism.

    >>> MoEProtoConfig.model_validate({"num_experts": 16, "num_prototypes": 2, "ep_size": 2})
"""
from __future__ import annotations

from typing import Literal

from pydantic import Field, PositiveFloat, PositiveInt, model_validator

from sparse_scale.base.blocks import StrictBlock


class MoEProtoConfig(StrictBlock):
    """Validated ``"moe_proto"`` block."""


    num_experts: PositiveInt
    num_prototypes: PositiveInt = 1
    top_k: PositiveInt = 1  # routes per prototype
    capacity_factor: PositiveFloat = 1.25
    eval_capacity_factor: PositiveFloat = 2.0
    min_capacity: int = Field(4, ge=0)
    dropless: bool = False
    drop_policy: Literal["probs", "position"] = "probs"
    ep_size: PositiveInt = 1
    aux_loss_coef: float = Field(0.01, ge=0.0)
    z_loss_coef: float = Field(0.0, ge=0.0)
    moe_every: PositiveInt = 2  # an MoE FFN every n transformer layers

    @model_validator(mode="after")
    def _divisible(self) -> "MoEProtoConfig":
        if self.num_experts % self.num_prototypes:
            raise ValueError(f"num_experts={self.num_experts} is not divisible by num_prototypes={self.num_prototypes}")
        if self.num_experts % self.ep_size:
            raise ValueError(f"num_experts={self.num_experts} is not divisible by ep_size={self.ep_size}")
        if self.top_k > self.num_experts // self.num_prototypes:
            raise ValueError(
                f"top_k={self.top_k} exceeds the {self.num_experts // self.num_prototypes} experts of a prototype"
            )
        return self
