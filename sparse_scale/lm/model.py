"""The LM job's model side: model arguments from the config file and the optimizer's parameter groups.

    model_args, ds = model_args_from_config("ds_configs/moe_lm_cpu.json")
    model = MoETransformerLM(model_args)
    deepspeed.initialize(model=model, model_parameters=optimizer_param_groups(model), config=ds)
"""
from __future__ import annotations

from typing import Any

import torch

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


def optimizer_param_groups(model: torch.nn.Module) -> list[dict[str, Any]]:
    """Parameter groups with the experts apart (``moe: True``), as DeepSpeed's ZeRO 1/2 require for MoE models.

    Example::

        groups = optimizer_param_groups(model)      # [{"name": "parameters", ...}, {"moe": True, ...}]
    """
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    return split_params_into_different_moe_groups_for_optimizer(
        {"params": list(model.parameters()), "name": "parameters"})
