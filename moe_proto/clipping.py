"""Gradient clipping that counts every expert exactly once under expert parallelism (DeepSpeed #8475).

Dense gradients are identical on every rank after the data-parallel reduction; an expert's
gradient is identical across its expert-data-parallel replicas but differs between the ranks
of its expert-parallel group. The global L2 norm therefore sums dense squares locally and
expert squares over each expert-parallel group.

* :func:`global_grad_norm` / :func:`clip_grad_norm_`: the norm and the clip, for any loop;
* :func:`bind_expert_aware_clipping`: binds that clip into a DeepSpeed engine without ZeRO,
  whose own fp32 clip gets the norm wrong under expert parallelism (ZeRO 1/2 are right).

Example::

    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    bind_expert_aware_clipping(engine)      # binds, like initialize binds the optimizer; no-op under ZeRO
    loss = engine(x); engine.backward(loss); engine.step()
    engine.get_global_grad_norm()           # every expert counted once
"""
from __future__ import annotations

import logging
from typing import Any, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

logger = logging.getLogger(__name__)


def global_grad_norm(parameters: Sequence[torch.nn.Parameter], norm_type: float = 2.0) -> Tensor:
    """L2 norm of all gradients with every expert counted exactly once (DeepSpeed #8475).

    Call after the data-parallel gradient reduction (e.g. after ``engine.backward``
    without ZeRO): dense gradients are then identical on every rank and are counted
    locally; expert gradients (``allreduce=False``, ``group_name``) are identical across
    their expert-data-parallel replicas, so their squares are summed over the expert-
    parallel group only. Collective over the EP groups.

    Example::

        norm = global_grad_norm(list(model.parameters()))
    """
    if float(norm_type) != 2.0:
        raise ValueError(f"only the L2 norm is supported, got norm_type={norm_type}")
    dense = torch.zeros((), dtype=torch.float64)
    experts: dict = {}
    for p in parameters:
        if p.grad is None:
            continue
        sq = p.grad.detach().double().square().sum().cpu()
        if getattr(p, "allreduce", True) is False and hasattr(p, "group_name"):
            experts[p.group_name] = experts.get(p.group_name, torch.zeros((), dtype=torch.float64)) + sq
        else:
            dense = dense + sq
    total = dense
    if experts:
        from deepspeed.utils import groups

        for name in sorted(experts):  # same order on every rank: one all-reduce per expert group
            part = experts[name].clone()
            dist.all_reduce(part, group=groups._get_expert_parallel_group(name))
            total = total + part
    return total.sqrt().float()


def clip_grad_norm_(parameters: Sequence[torch.nn.Parameter], max_norm: float) -> Tensor:
    """Scale gradients in place so that :func:`global_grad_norm` is at most ``max_norm``; return the norm.

    Same clip coefficient as DeepSpeed (``max_norm / (norm + 1e-6)``, capped at 1). Example::

        norm = clip_grad_norm_(list(model.parameters()), 1.0)
    """
    parameters = [p for p in parameters if p.grad is not None]
    norm = global_grad_norm(parameters)
    coef = min(1.0, float(max_norm) / (float(norm) + 1e-6))
    if coef < 1.0:
        for p in parameters:
            p.grad.detach().mul_(coef)
    return norm


def bind_expert_aware_clipping(engine: Any) -> bool:
    """Bind :func:`clip_grad_norm_` as the fp32 gradient clip of a DeepSpeed engine without ZeRO (in place).

    DeepSpeed 0.19.8's fp32 path (``engine.clip_fp32_gradients`` ->
    ``runtime.utils.clip_grad_norm_``) averages each rank's local norm over the
    data-parallel group, which under expert parallelism neither counts every expert
    once nor equals the global norm, and it never sets ``get_global_grad_norm()``. This
    binds a replacement method on this engine instance only (the way
    ``deepspeed.initialize`` binds the optimizer to the engine it returns); the engine
    then clips by :func:`global_grad_norm` and reports that norm. ZeRO 1/2 compute the
    norm in their optimizer and need nothing (checked in tests/moe_proto/test_deepspeed.py):
    the engine is left untouched. Returns whether the clip was bound.

    Example::

        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        bind_expert_aware_clipping(engine)      # True without ZeRO
    """
    if engine.zero_optimization_stage() != 0:
        return False

    def clip_fp32_gradients() -> None:
        engine._global_grad_norm = float(clip_grad_norm_(list(engine.module.parameters()),
                                                         engine.gradient_clipping()))

    engine.clip_fp32_gradients = clip_fp32_gradients
    logger.debug("bound expert-aware gradient clipping (max norm %s) to the engine", engine.gradient_clipping())
    return True
