"""What a GBA job checks and builds before its first step: the config, DeepSpeed's worker-only ``mpu``.

Every config mistake is one clear ValueError raised on every rank before any collective.

Example::

    ds, gba, source = load_config("ds_configs/gba_cpu.json")
    spec = check_config(ds, gba, world=4, source=source)      # the servers' OptimizerSpec
    schedule = server_schedule(ds, spec)                     # None without a scheduler block
    tables = with_schedule_peaks(tables, ds, spec)           # own table optimizers scaled by the schedule
"""
from __future__ import annotations

import dataclasses
import logging
import math
import os
from typing import Any, Mapping, Sequence

import torch
import torch.distributed as dist

from sparse_core.config_file import read_config_file, split_config, validate_model

from .config import GBAConfig
from .ps import OptimizerSpec, layout
from .ps.schedule import ServerLRSchedule
from .ps.sharding import ServerTableSpec


class WorkerMPU:
    """The minimal ``mpu`` DeepSpeed needs so that its data-parallel group is the workers only.

    Example::

        deepspeed.initialize(model=net, config=ds, mpu=WorkerMPU(rt.worker_group, own_group))
    """

    def __init__(self, group: dist.ProcessGroup, own: dist.ProcessGroup) -> None:
        self.group = group
        self.own = own  # a group of this rank alone: DeepSpeed's model-parallel reductions must not reach the servers

    def get_data_parallel_group(self) -> dist.ProcessGroup:
        return self.group

    def get_data_parallel_rank(self) -> int:
        return dist.get_rank(group=self.group)

    def get_data_parallel_world_size(self) -> int:
        return dist.get_world_size(group=self.group)

    def get_model_parallel_rank(self) -> int:
        return 0

    def get_model_parallel_world_size(self) -> int:
        return 1

    def get_model_parallel_group(self) -> dist.ProcessGroup:
        return self.own


def load_config(config: str | os.PathLike | Mapping[str, Any]) -> tuple[dict, GBAConfig, str]:
    """The DeepSpeed dict, its validated ``"gba"`` block (defaults when absent) and where it came from.

    Only the ``gba`` block is validated here (the job layer, ``sparse_scale.config``, checks the
    others); every plugin block is left out of the DeepSpeed dict and misspelt block names are errors.

    Example::

        ds, gba, source = load_config({"optimizer": {...}, "gba": {"mode": "auto"}})    # source "<dict>"
    """
    if isinstance(config, Mapping):
        data, source = dict(config), "<dict>"
    else:
        source = str(config)
        data = read_config_file(config)
    ds, blocks = split_config(data, source)
    gba = validate_model("gba", GBAConfig, blocks["gba"], source) if "gba" in blocks else GBAConfig()
    return ds, gba, source


def check_config(ds: dict, gba: GBAConfig, world: int | None, source: str) -> OptimizerSpec:
    """Every config mistake as one clear ValueError; returns the servers' optimizer.

    ``world=None`` (a restarted worker, before it knows the launch) skips the layout check.

    Example::

        spec = check_config(ds, gba, world=dist.get_world_size(), source="ds_configs/gba_cpu.json")
    """
    try:
        if world is not None:
            layout(world, gba.num_servers)
    except ValueError as exc:
        raise ValueError(f"{source}: {exc}") from None
    if "optimizer" not in ds:
        raise ValueError(f"{source}: gba needs an \"optimizer\" block: the servers run the same optimizer as DeepSpeed")
    try:
        spec = OptimizerSpec.from_deepspeed(ds["optimizer"])
    except ValueError as exc:
        raise ValueError(f"{source}: optimizer: {exc}") from None
    if gba.mode != "sync" and "scheduler" in ds:
        try:
            server_schedule(ds, spec)
        except ValueError as exc:
            raise ValueError(f"{source}: scheduler: {exc}") from None
    stage = int((ds.get("zero_optimization") or {}).get("stage", 0))
    if gba.mode != "sync" and stage > 1:
        raise ValueError(f"{source}: gba.mode={gba.mode!r} supports zero_optimization.stage 0 or 1, got {stage} "
                         "(stage 2 reduces gradients inside backward, which gba mode must keep local)")
    if gba.mode != "sync" and (ds.get("fp16", {}).get("enabled") or ds.get("bf16", {}).get("enabled")):
        raise ValueError(f"{source}: gba.mode={gba.mode!r} needs fp32 training (the servers hold fp32 state)")
    clip = ds.get("gradient_clipping", 0.0)
    if isinstance(clip, bool) or not isinstance(clip, (int, float)) or clip < 0:
        raise ValueError(f"{source}: gradient_clipping must be a number >= 0 (0: off), got {clip!r}")
    return spec


def clip_norm(ds: dict) -> float:
    """The max norm DeepSpeed clips the global-batch gradient to (its own default when the key is absent).

    Example::

        clip_norm({"gradient_clipping": 0.5})     # 0.5
    """
    from deepspeed.runtime.constants import GRADIENT_CLIPPING_DEFAULT

    return float(ds.get("gradient_clipping", GRADIENT_CLIPPING_DEFAULT))


def server_schedule(ds: dict, spec: OptimizerSpec) -> ServerLRSchedule | None:
    """The servers' copy of the config's learning-rate schedule (None without a scheduler block).

    Example::

        server_schedule({"scheduler": {"type": "WarmupLR", "params": {...}}}, spec).lr(version=10)
    """
    if "scheduler" not in ds:
        return None
    return ServerLRSchedule(ds["scheduler"], base_lr=float(spec.kwargs.get("lr", 1e-3)))


def schedule_peak(ds: dict, spec: OptimizerSpec) -> float | None:
    """The peak lr of the config's DeepSpeed scheduler, as picasso_ops reads it (None: no scheduler, or none known).

    Example::

        schedule_peak({"scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 0.01}}}, spec)     # 0.01
    """
    if "scheduler" not in ds:
        return None
    from deepspeed.runtime import lr_schedules

    from picasso_ops.distributed.step import schedule_peak_lr

    block = ds["scheduler"]
    holder = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=float(spec.kwargs.get("lr", 1e-3)))
    quiet = logging.getLogger("DeepSpeed")
    level = quiet.level
    quiet.setLevel(logging.ERROR)  # its constructor warns that iteration -1 comes "before it has started"
    try:
        scheduler = getattr(lr_schedules, str(block.get("type")))(holder, **dict(block.get("params") or {}))
    except (AttributeError, TypeError) as exc:
        raise ValueError(f"scheduler {block.get('type')!r}: {exc}") from None
    finally:
        quiet.setLevel(level)
    peak = schedule_peak_lr(scheduler)
    return peak if peak is not None and peak > 0 and math.isfinite(peak) else None  # picasso: factor 1 then


def with_schedule_peaks(tables: Sequence[ServerTableSpec], ds: dict, spec: OptimizerSpec) -> list[ServerTableSpec]:
    """``tables`` with every own optimizer on a ``"deepspeed"`` lr schedule told the config's schedule peak.

    Example::

        with_schedule_peaks([ServerTableSpec("p", 10, 4, optimizer=TableOptimizerSpec.of("sgd", lr=0.1,
                            lr_schedule="deepspeed"))], ds, spec)[0].optimizer.schedule_peak      # e.g. 0.001
    """
    scheduled = [t.optimizer is not None and t.optimizer.lr_schedule == "deepspeed" for t in tables]
    if not any(scheduled):
        return list(tables)
    peak = schedule_peak(ds, spec)
    return [dataclasses.replace(t, optimizer=t.optimizer.with_peak(peak)) if s else t
            for t, s in zip(tables, scheduled)]


def batch_shape(ds: dict) -> tuple[int, int]:
    """``(train_micro_batch_size_per_gpu, gradient_accumulation_steps)`` with DeepSpeed's defaults of 1.

    Example::

        batch_shape({"train_micro_batch_size_per_gpu": 8})     # (8, 1)
    """
    return int(ds.get("train_micro_batch_size_per_gpu", 1)), int(ds.get("gradient_accumulation_steps", 1))
