"""One reader (and writer) of DeepSpeed's ZeRO stage 3 parameter and optimizer state, per parameter.

The stage 3 neighbour of :mod:`sparse_core.zero_state` (stages 1 and 2): full values in,
full values out, one parameter at a time, for per-tensor checkpoints (``moe_proto.checkpoint``
of ``moe_proto.ZeRO3MoE`` layers).

Stage 3 keeps, per sub-group ``g`` of the inner optimizer, one flat fp32 partition
(``optimizer.fp32_partitioned_groups_flat[g]``, Adam's state keyed by it) and the bit16
partition of each parameter (``param.ds_tensor``); ``optimizer.grad_position[id]`` gives a
parameter's ``(g, offset, partition_numel)``, and its partition rank is its rank in
``param.ds_process_group`` (the expert-data-parallel group for experts). Partitions are
padded at the end of the last ranks', which DeepSpeed 0.19.8's ``safe_set_full_fp32_param``
does not allow for (it narrows the unpadded value past its end), hence the writer here.

This module imports torch and deepspeed only, never a package of this project.

Example::

    exp_avg = read_full_state(engine, model.moe.experts.w1, "exp_avg")      # collective over its partition group
    write_full_state(engine, model.moe.experts.w1, exp_avg, "exp_avg")       # this rank's slice back
"""
from __future__ import annotations

from typing import Any, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import Tensor


def is_zero3_param(param: Tensor) -> bool:
    """Whether ZeRO-3 has partitioned ``param`` (it then carries a ``ds_id``).

    Example::

        is_zero3_param(engine.module.moe.experts.w1)   # True under stage 3
    """
    return hasattr(param, "ds_id")


def gathered_value(param: Tensor) -> Tensor:
    """A detached copy of the whole parameter; a collective over its partition group under ZeRO-3.

    Example::

        w1 = gathered_value(engine.module.moe.experts.w1)   # [local experts, d, ffn]
    """
    if not is_zero3_param(param):
        return param.detach().clone()
    from deepspeed.runtime.zero.partition_parameters import GatheredParameters

    with GatheredParameters([param]):
        return param.detach().clone()


def _position(engine: Any, param: Tensor) -> Tuple[Tensor, int, int]:
    optimizer = engine.optimizer
    group, offset, numel = optimizer.grad_position[optimizer.get_param_id(param)]
    if optimizer._swappable_optimizer_subgroup(group):
        raise ValueError("moe_proto checkpoints under ZeRO-3 do not support NVMe-swapped optimizer state "
                         "(zero_optimization.offload_optimizer.device=nvme)")
    return optimizer.fp32_partitioned_groups_flat[group], offset, numel


def read_full_state(engine: Any, param: Tensor, key: Optional[str] = None) -> Tensor:
    """Full fp32 value (key None) or optimizer state ``key`` of a ZeRO-3 parameter, on the CPU.

    A collective over the parameter's partition group (every rank of it calls this, in the
    same parameter order). A state the optimizer has not created yet (before the first step)
    and the state of a frozen parameter read as zeros. Example::

        exp_avg = read_full_state(engine, model.moe.experts.w1, "exp_avg")
    """
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    if not param.requires_grad:  # not in the optimizer: the bit16 value is the value
        value = gathered_value(param).float().cpu()
        return value if key is None else torch.zeros_like(value)
    if key is None:
        return safe_get_full_fp32_param(param).detach().float().cpu()
    flat, _, _ = _position(engine, param)
    if key not in engine.optimizer.optimizer.state.get(flat, {}):
        return torch.zeros(param.ds_shape, dtype=torch.float32)
    return safe_get_full_optimizer_state(param, key).detach().float().cpu()


def write_full_state(engine: Any, param: Tensor, value: Tensor, key: Optional[str] = None) -> None:
    """Write this rank's partition of a full ``value`` into a ZeRO-3 parameter (key None) or state ``key``.

    The value goes to the fp32 master partition and the bit16 partition (``ds_tensor``); a
    state goes to the optimizer's flat state, which must exist (``moe_proto.checkpoint.load_checkpoint``
    creates it first).
    Not a collective. Example::

        write_full_state(engine, model.moe.experts.w1, saved["exp_avg"], "exp_avg")
    """
    if tuple(value.shape) != tuple(param.ds_shape):
        raise ValueError(f"checkpoint tensor of shape {tuple(value.shape)} for a ZeRO-3 parameter of shape "
                         f"{tuple(param.ds_shape)}")
    numel = param.partition_numel()
    start = dist.get_rank(group=param.ds_process_group) * numel
    real = max(0, min(numel, param.ds_numel - start))  # the rest of the partition is padding
    if real == 0:  # this rank's partition is all padding (a small tensor over many ranks)
        return
    source = value.detach().flatten().narrow(0, start, real)
    with torch.no_grad():
        if key is None:
            param.ds_tensor.data.narrow(0, 0, real).copy_(source.to(param.ds_tensor.dtype))
        if not param.requires_grad:
            return
        flat, offset, _ = _position(engine, param)
        target = flat if key is None else engine.optimizer.optimizer.state[flat][key]
        target.narrow(0, offset, real).copy_(source.to(target.device, target.dtype))


def flat_groups(engine: Any) -> List[List[Tensor]]:
    """Per param group of the inner optimizer, its ZeRO-3 flat fp32 partitions (the keys of its state).

    Example::

        steps = [engine.optimizer.optimizer.state[f[0]]["step"] for f in flat_groups(engine) if f]
    """
    optimizer = engine.optimizer
    out: List[List[Tensor]] = [[] for _ in optimizer.optimizer.param_groups]
    for sub_group, flat in enumerate(optimizer.fp32_partitioned_groups_flat):
        out[optimizer.sub_group_to_group_id[sub_group]].append(flat)
    return out
