"""The ``moe_model`` block of a DeepSpeed config: the MoE LM's shape and the planner's memory choices.

The routing settings (experts, prototypes, capacity, ``moe_every``, ``ep_size``) stay in the
``moe_proto`` block; this block holds what the model and the planner need beyond them.

    >>> MoEModelConfig.model_validate({"num_layers": 4, "d_model": 128, "num_heads": 4, "ffn_hidden_size": 512})
"""
from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field, PositiveInt, model_validator

from sparse_scale.base.blocks import StrictBlock

BYTE_VOCAB = 256  # one token per byte value
END_OF_DOCUMENT = 256  # the one special token, written between documents
DEFAULT_VOCAB = BYTE_VOCAB + 1


class MoEModelConfig(StrictBlock):
    """Validated ``"moe_model"`` block.

    ``precision`` is the dtype of parameters and gradients on the GPU (mixed precision
    keeps fp32 master weights in the optimizer); ``optimizer`` and ``offload`` are what
    the planner sizes. ``offload="optimizer"`` is ZeRO-Offload (stages 1-3),
    ``"optimizer_and_params"`` is ZeRO-Infinity (stage 3 only).
    """


    num_layers: PositiveInt
    d_model: PositiveInt
    num_heads: PositiveInt
    ffn_hidden_size: PositiveInt  # dense FFN width
    expert_ffn_hidden_size: Optional[PositiveInt] = None  # expert FFN width; None: same as ffn_hidden_size
    vocab_size: int = Field(DEFAULT_VOCAB, ge=DEFAULT_VOCAB)  # bytes + end-of-document (may be padded up)
    seq_len: PositiveInt = 256
    positions: Literal["learned", "rotary"] = "rotary"
    activation: Literal["gelu", "gelu_tanh", "relu", "silu", "swiglu"] = "gelu"
    norm_eps: float = Field(1e-5, gt=0.0)
    init_std: float = Field(0.02, gt=0.0)
    precision: Literal["fp32", "fp16", "bf16"] = "fp32"
    optimizer: Literal["adam", "adafactor"] = "adam"
    offload: Literal["none", "optimizer", "optimizer_and_params"] = "none"
    activation_checkpointing: bool = False

    @model_validator(mode="after")
    def _shapes(self) -> "MoEModelConfig":
        if self.d_model % self.num_heads:
            raise ValueError(f"d_model={self.d_model} is not divisible by num_heads={self.num_heads}")
        if self.positions == "rotary" and (self.d_model // self.num_heads) % 2:
            raise ValueError(f"rotary positions need an even head size, got {self.d_model // self.num_heads}")
        return self

    @property
    def expert_ffn(self) -> int:
        """Width of each expert's FFN."""
        return self.expert_ffn_hidden_size or self.ffn_hidden_size
