"""The ``moe_model`` block of a DeepSpeed config: the MoE LM's shape and the planner's memory choices.

The routing settings (experts, prototypes, capacity, ``moe_every``, ``ep_size``) stay in the
``moe_proto`` block; this block holds what the model and the planner need beyond them.

    >>> MoEModelConfig.model_validate({"num_layers": 4, "d_model": 128, "num_heads": 4, "ffn_hidden_size": 512})
"""
from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field, PositiveInt, model_validator

from sparse_core.blocks import StrictBlock

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

    num_layers: PositiveInt = Field(description="Transformer blocks (layers) of the model.")
    d_model: PositiveInt = Field(description="Hidden size: the width of the byte embeddings and of every block's "
                                             "residual stream.")
    num_heads: PositiveInt = Field(description="Attention heads per layer; each head is d_model / num_heads wide.")
    ffn_hidden_size: PositiveInt = Field(description="Hidden width of the dense FFNs (the layers without experts).")
    expert_ffn_hidden_size: Optional[PositiveInt] = Field(
        None, description="Hidden width of each expert's FFN; null: the same as ffn_hidden_size.")
    vocab_size: int = Field(
        DEFAULT_VOCAB, ge=DEFAULT_VOCAB,
        description="Rows of the byte embedding, tied to the output layer: 256 byte values + end-of-document "
                    "(may be padded up).")
    seq_len: PositiveInt = Field(
        256, description="Tokens (bytes) per training and evaluation sequence, also the length of the learned "
                         "position table.")
    positions: Literal["learned", "rotary"] = Field(
        "rotary", description='Position encoding: "rotary" rotates the queries\' and keys\' channel pairs by '
                              'position in every layer, "learned" adds a learned embedding of each position to the '
                              'input.')
    activation: Literal["gelu", "gelu_tanh", "relu", "silu", "swiglu"] = Field(
        "gelu", description='Activation of the dense and expert FFNs: "gelu" (exact), "gelu_tanh" (tanh '
                            'approximation), "relu", "silu", or "swiglu" (silu(x W1) * (x W3), a third matrix).')
    norm_eps: float = Field(1e-5, gt=0.0, description="The epsilon of every LayerNorm.")
    init_std: float = Field(
        0.02, gt=0.0, description="Standard deviation of the normal init of the embeddings and attention weights "
                                  "(the attention output projection's is divided by sqrt(2 x num_layers)).")
    precision: Literal["fp32", "fp16", "bf16"] = Field(
        "fp32", description="The dtype of parameters and gradients on the GPU that the planner sizes (mixed "
                            "precision adds fp32 master weights); it notes when DeepSpeed's fp16/bf16 section "
                            "says otherwise.")
    optimizer: Literal["adam", "adafactor"] = Field(
        "adam", description="The optimizer whose state the planner sizes: adam two fp32 moments per parameter, "
                            "adafactor factored second moments (one fp32 row and column vector per matrix).")
    offload: Literal["none", "optimizer", "optimizer_and_params"] = Field(
        "none", description='What the planner moves to CPU memory: "optimizer" master weights and moments '
                            '(ZeRO-Offload, stages 1-3), "optimizer_and_params" also the parameters (ZeRO-Infinity, '
                            'stage 3 only).')
    activation_checkpointing: bool = Field(
        False, description="Whether the planner counts activation checkpointing: each block keeps only its input "
                           "(plus one block's full activations) and the recompute repeats the forward all-to-alls.")

    @model_validator(mode="after")
    def _shapes(self) -> "MoEModelConfig":
        """d_model must be divisible by num_heads; rotary positions need an even head size d_model // num_heads."""
        if self.d_model % self.num_heads:
            raise ValueError(f"d_model={self.d_model} is not divisible by num_heads={self.num_heads}")
        if self.positions == "rotary" and (self.d_model // self.num_heads) % 2:
            raise ValueError(f"rotary positions need an even head size, got {self.d_model // self.num_heads}")
        return self

    @property
    def expert_ffn(self) -> int:
        """Width of each expert's FFN."""
        return self.expert_ffn_hidden_size or self.ffn_hidden_size
