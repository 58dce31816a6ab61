"""The LM job's model side: model arguments from the config file.

    model_args, ds = model_args_from_config("ds_configs/moe_lm_cpu.json")
    model = MoETransformerLM(model_args)
    sparse_scale.initialize(model=model, config="ds_configs/moe_lm_cpu.json")   # experts in their own groups
"""
from __future__ import annotations

from typing import Any

from moe_proto.models import MoETransformerArgs
from sparse_scale.config import ConfigError, load_config


def model_args_from_config(path: str) -> tuple[MoETransformerArgs, dict[str, Any]]:
    """``(model args, DeepSpeed dict)`` from a config file; a missing ``moe_model`` block is an error.

    Example::

        args, ds = model_args_from_config("ds_configs/moe_lm_cpu.json")    # args.num_experts == 8
    """
    job = load_config(path)
    model_cfg = job.blocks.get("moe_model")
    if model_cfg is None:
        raise ConfigError(f"{path}: no 'moe_model' block (num_layers, d_model, num_heads, ffn_hidden_size, ...)")
    stage = (job.ds.get("zero_optimization") or {}).get("stage", 0)
    zero_stage = 3 if stage == 3 else None  # DeepSpeed accepts MoE layers under ZeRO-3 only as ZeRO3MoE
    return MoETransformerArgs.from_configs(model_cfg, job.blocks.get("moe_proto"), zero_stage=zero_stage), dict(job.ds)
