"""Reference models for moe_proto: the byte-level MoE transformer LM (M6-T style).

Example::

    from moe_proto.models import MoETransformerArgs, MoETransformerLM
    model = MoETransformerLM(MoETransformerArgs(num_layers=2, d_model=64, num_heads=4, ffn_hidden_size=256,
                                                num_experts=4))
"""
from .config import BYTE_VOCAB, DEFAULT_VOCAB, END_OF_DOCUMENT, MoEModelConfig
from .transformer import (Block, CausalSelfAttention, DenseFFN, LMOutput, MoETransformerArgs, MoETransformerLM,
                          apply_rotary, rotary_tables)

__all__ = [
    "MoEModelConfig",
    "MoETransformerArgs",
    "MoETransformerLM",
    "LMOutput",
    "Block",
    "CausalSelfAttention",
    "DenseFFN",
    "rotary_tables",
    "apply_rotary",
    "BYTE_VOCAB",
    "DEFAULT_VOCAB",
    "END_OF_DOCUMENT",
]
