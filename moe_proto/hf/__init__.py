"""Hugging Face ``transformers`` bridge: Mixtral-style MoE blocks on :class:`moe_proto.MoE`.

Needs the optional extra (``pip install -e .[hf]``: transformers 5.x and accelerate);
``import moe_proto`` alone does not import it.

Example::

    from moe_proto.hf import replace_moe_blocks
    replace_moe_blocks(model)   # a MixtralForCausalLM built locally; returns the number of blocks
"""
from .convert import copy_grouped_experts_to_hf, grouped_experts_from_hf, hf_expert_shapes, load_hf_expert_weights
from .mixtral import (MoEProtoSparseMoeBlock, RouterLogitsTap, check_same_output, hf_block_from_moe,
                      hf_equivalent_moe_kwargs, moe_block_from_hf, replace_moe_blocks, restore_hf_blocks)

__all__ = [
    "MoEProtoSparseMoeBlock",
    "RouterLogitsTap",
    "replace_moe_blocks",
    "restore_hf_blocks",
    "moe_block_from_hf",
    "hf_block_from_moe",
    "hf_equivalent_moe_kwargs",
    "check_same_output",
    "grouped_experts_from_hf",
    "load_hf_expert_weights",
    "copy_grouped_experts_to_hf",
    "hf_expert_shapes",
]
