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
import math
from typing import Any, Callable, List, Mapping, Optional

from moe_proto.plan import DEFAULT_RESERVE_GB, Plan, format_plan, plan_blocks
from sparse_scale.config import ConfigError, load_config


ZERO_STAGES = (0, 1, 2, 3)


def _whole(low: int) -> Callable[[str], int]:
    """An argparse ``type=``: a whole number >= ``low`` (argparse names the flag in its error)."""
    def whole(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number >= {low}, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value
    return whole


def _gigabytes(allow_zero: bool) -> Callable[[str], float]:
    """An argparse ``type=``: a finite number of GB, > 0 (or >= 0 with ``allow_zero``)."""
    def gigabytes(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number of GB, got {text!r}") from None
        if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
            raise argparse.ArgumentTypeError(f"must be a finite number {'>=' if allow_zero else '>'} 0, got {text}")
        return value
    return gigabytes


def check_zero_stage(ds: Mapping[str, Any], source: str) -> None:
    """Refuse a ``zero_optimization.stage`` DeepSpeed does not have (0-3), naming the file and key.

    Example::

        check_zero_stage({"zero_optimization": {"stage": 7}}, "x.json")   # ConfigError: x.json: zero_optimization...
    """
    stage = (ds.get("zero_optimization") or {}).get("stage", 0)
    if isinstance(stage, bool) or stage not in ZERO_STAGES:
        raise ConfigError(f"{source}: zero_optimization.stage must be one of 0, 1, 2, 3, got {stage!r}")


def plan_config(path: str, gpus: int, gpu_mem_gb: float, reserve_gb: float = DEFAULT_RESERVE_GB,
                zero_stage: Optional[int] = None) -> Plan:
    """Plan the config file at ``path`` on ``gpus`` GPUs of ``gpu_mem_gb`` GB each.

    ``zero_stage``: plan as if the config's ``zero_optimization.stage`` were this (None: the config's).
    A count or size out of range is a ``ValueError`` naming it (the CLI checks its flags first).

    Example::

        plan = plan_config("ds_configs/m6t_1t.json", gpus=480, gpu_mem_gb=32)
    """
    if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 1:
        raise ValueError(f"gpus must be a whole number >= 1, got {gpus!r}")
    for name, value, low_ok in (("gpu_mem_gb", gpu_mem_gb, False), ("reserve_gb", reserve_gb, True)):
        if not (math.isfinite(value) and (value > 0 or (low_ok and value == 0))):
            raise ValueError(f"{name} must be a finite number {'>=' if low_ok else '>'} 0, got {value!r}")
    if reserve_gb >= gpu_mem_gb:
        raise ValueError(f"reserve_gb {reserve_gb:g} leaves nothing of gpu_mem_gb {gpu_mem_gb:g} to plan")
    if zero_stage is not None and zero_stage not in ZERO_STAGES:
        raise ValueError(f"zero_stage must be one of 0, 1, 2, 3, got {zero_stage!r}")
    job = load_config(path)
    ds = dict(job.ds)
    if zero_stage is not None:  # the what-if: the same config at another ZeRO stage
        ds["zero_optimization"] = {**(ds.get("zero_optimization") or {}), "stage": zero_stage}
    check_zero_stage(ds, str(path))
    model_cfg = job.blocks.get("moe_model")
    if model_cfg is None:
        raise ConfigError(f"{path}: no 'moe_model' block to plan")
    moe_cfg = job.blocks.get("moe_proto")
    ep_size = moe_cfg.ep_size if moe_cfg is not None else 1
    if gpus % ep_size:
        raise ConfigError(f"{path}: ep_size={ep_size} does not divide --gpus {gpus}")
    return plan_blocks(ds, model_cfg, moe_cfg, gpus, gpu_mem_gb, reserve_gb, source=str(path))


def main(argv: Optional[List[str]] = None) -> int:
    """Plan the config named on the command line and print the plan; 0 if it fits, else 1.

    Example::

        main(["ds_configs/m6t_1t.json", "--gpus", "480", "--gpu-mem", "32"])     # 0
    """
    parser = argparse.ArgumentParser(prog="sparse-plan", description=__doc__.splitlines()[0])
    parser.add_argument("config", help="DeepSpeed JSON with moe_model and moe_proto blocks")
    parser.add_argument("--gpus", type=_whole(1), required=True, help="number of GPUs (>= 1)")
    parser.add_argument("--gpu-mem", type=_gigabytes(allow_zero=False), required=True, help="memory per GPU in GB")
    parser.add_argument("--reserve-gb", type=_gigabytes(allow_zero=True), default=DEFAULT_RESERVE_GB,
                        help="per-GPU memory kept for CUDA context, NCCL and fragmentation (below --gpu-mem)")
    parser.add_argument("--zero-stage", type=int, choices=ZERO_STAGES, default=None,
                        help="plan at this ZeRO stage instead of the config's zero_optimization.stage")
    ns = parser.parse_args(argv)
    if ns.reserve_gb >= ns.gpu_mem:  # nothing left for the model: every plan would "fit" nothing
        parser.error(f"argument --reserve-gb: {ns.reserve_gb:g} GB leaves nothing of --gpu-mem {ns.gpu_mem:g} GB")
    try:
        plan = plan_config(ns.config, ns.gpus, ns.gpu_mem, ns.reserve_gb, ns.zero_stage)
    except ConfigError as exc:  # names the file and key (or --gpus against the config's ep_size)
        parser.error(str(exc))
    print(format_plan(plan))
    return 0 if plan.base.fits else 1


if __name__ == "__main__":
    raise SystemExit(main())
