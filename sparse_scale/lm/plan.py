"""Plan a (trillion-parameter) MoE LM config onto GPUs before renting them: counts, memory, traffic.

The ``sparse-plan`` command:

    sparse-plan ds_configs/m6t_1t.json --gpus 480 --gpu-mem 32
    python -m sparse_scale.lm.plan ds_configs/m6t_1t.json --gpus 480 --gpu-mem 32

Exit status 0 when the config fits as configured, 1 when it does not. The planning itself is
:func:`moe_proto.plan.plan_blocks`; this module reads the config file (``sparse_scale.config``,
so errors name the file and key) and prints.

Example::

    plan = plan_config("ds_configs/m6t_1t.json", gpus=480, gpu_mem_gb=32)
    plan.base.fits, plan.counts.total
"""
from __future__ import annotations

import argparse
from typing import List, Optional

from moe_proto.plan import DEFAULT_RESERVE_GB, Plan, format_plan, plan_blocks
from sparse_scale.config import ConfigError, load_config


def plan_config(path: str, gpus: int, gpu_mem_gb: float, reserve_gb: float = DEFAULT_RESERVE_GB) -> Plan:
    """Plan the config file at ``path`` on ``gpus`` GPUs of ``gpu_mem_gb`` GB each.

    Example::

        plan = plan_config("ds_configs/m6t_1t.json", gpus=480, gpu_mem_gb=32)
    """
    job = load_config(path)
    model_cfg = job.blocks.get("moe_model")
    if model_cfg is None:
        raise ConfigError(f"{path}: no 'moe_model' block to plan")
    moe_cfg = job.blocks.get("moe_proto")
    ep_size = moe_cfg.ep_size if moe_cfg is not None else 1
    if gpus % ep_size:
        raise ConfigError(f"{path}: ep_size={ep_size} does not divide --gpus {gpus}")
    return plan_blocks(job.ds, model_cfg, moe_cfg, gpus, gpu_mem_gb, reserve_gb, source=str(path))


def main(argv: Optional[List[str]] = None) -> int:
    """Plan the config named on the command line and print the plan; 0 if it fits, else 1.

    Example::

        main(["ds_configs/m6t_1t.json", "--gpus", "480", "--gpu-mem", "32"])     # 0
    """
    parser = argparse.ArgumentParser(prog="sparse-plan", description=__doc__.splitlines()[0])
    parser.add_argument("config", help="DeepSpeed JSON with moe_model and moe_proto blocks")
    parser.add_argument("--gpus", type=int, required=True, help="number of GPUs")
    parser.add_argument("--gpu-mem", type=float, required=True, help="memory per GPU in GB")
    parser.add_argument("--reserve-gb", type=float, default=DEFAULT_RESERVE_GB,
                        help="per-GPU memory kept for CUDA context, NCCL and fragmentation")
    ns = parser.parse_args(argv)
    plan = plan_config(ns.config, ns.gpus, ns.gpu_mem, ns.reserve_gb)
    print(format_plan(plan))
    return 0 if plan.base.fits else 1


if __name__ == "__main__":
    raise SystemExit(main())
