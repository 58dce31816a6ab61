"""Observability: per-layer expert load, drop rate, aux and z loss, logged through DeepSpeed's monitor.

Every :class:`moe_proto.MoE` keeps the detached summary of its last routing call in
``last_stats``. :func:`collect_moe_stats` reads them (optionally summed over a process
group, e.g. the data-parallel group, so the numbers cover the global batch), and
:class:`MoEStatsLogger` turns them into ``(name, value, step)`` events for
``engine.monitor.write_events`` every ``interval`` steps (wandb, TensorBoard, CSV:
whatever the DeepSpeed config enables). Event names, for a layer named ``blocks.1.moe``::

    moe/blocks.1.moe/drop_rate      routes dropped by capacity / routes
    moe/blocks.1.moe/aux_loss       load-balancing loss (unscaled)
    moe/blocks.1.moe/z_loss         router z-loss (unscaled)
    moe/blocks.1.moe/load_max       busiest expert's share of routes x num_experts (1.0 = balanced)
    moe/blocks.1.moe/load/e3        expert 3's share of routes (before drops)

Example::

    stats_logger = MoEStatsLogger(engine, interval=engine.steps_per_print())
    for batch in data:
        loss = engine(batch); engine.backward(loss); engine.step()
        stats_logger.step()                       # every rank: the reduction is collective
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import Tensor, nn

from .layer import MoEBase

logger = logging.getLogger(__name__)

Event = Tuple[str, float, int]


@dataclass(frozen=True)
class LayerStats:
    """One MoE layer's routing summary over the tokens it saw (one rank or a whole group).

    Attributes:
        routed_per_expert: ``[E]`` routes choosing each expert before capacity drops.
        tokens_per_expert: ``[E]`` routes computed (kept).
        drop_rate: dropped / routed routes.
        aux_loss, z_loss: unscaled losses (mean over the group's ranks when reduced).
    """

    routed_per_expert: Tensor
    tokens_per_expert: Tensor
    drop_rate: float
    aux_loss: float
    z_loss: float

    @property
    def load(self) -> Tensor:
        """``[E]`` share of routes choosing each expert (sums to 1)."""
        routed = self.routed_per_expert.double()
        return routed / routed.sum().clamp(min=1)


def collect_moe_stats(model: nn.Module, group: Optional[Any] = None) -> Dict[str, LayerStats]:
    """Per MoE layer (by module name), its last routing stats; summed over ``group`` if given.

    With a group, every rank must call it (it all-reduces one small tensor per layer).
    Layers that have not run yet are skipped.

    Example::

        stats = collect_moe_stats(engine.module, group=torch.distributed.group.WORLD)
        stats["moe"].drop_rate
    """
    out: Dict[str, LayerStats] = {}
    for name, module in model.named_modules():
        if not isinstance(module, MoEBase) or module.last_stats is None:
            continue
        s = module.last_stats
        routed = s.routed_per_expert.detach().double().cpu()
        kept = s.tokens_per_expert.detach().double().cpu()
        losses = torch.stack([s.aux_loss.detach().double().cpu(), s.z_loss.detach().double().cpu()])
        if group is not None:
            # One all-reduce per layer: counts add up, losses are averaged over ranks.
            packed = torch.cat([routed, kept, losses])
            dist.all_reduce(packed, group=group)
            e = routed.numel()
            routed, kept, losses = packed[:e], packed[e:2 * e], packed[2 * e:] / dist.get_world_size(group)
        total = routed.sum()
        out[name or "moe"] = LayerStats(routed_per_expert=routed, tokens_per_expert=kept,
                                        drop_rate=float((total - kept.sum()) / total.clamp(min=1)),
                                        aux_loss=float(losses[0]), z_loss=float(losses[1]))
    return out


def stats_events(stats: Dict[str, LayerStats], step: int, prefix: str = "moe",
                 per_expert: bool = True) -> List[Event]:
    """``(name, value, step)`` events for ``monitor.write_events`` (see the module docstring for names).

    Example::

        engine.monitor.write_events(stats_events(collect_moe_stats(model), step=engine.global_steps))
    """
    events: List[Event] = []
    for layer, s in stats.items():
        base = f"{prefix}/{layer}"
        load = s.load
        events += [(f"{base}/drop_rate", s.drop_rate, step), (f"{base}/aux_loss", s.aux_loss, step),
                   (f"{base}/z_loss", s.z_loss, step),
                   (f"{base}/load_max", float(load.max()) * load.numel(), step)]
        if per_expert:
            events += [(f"{base}/load/e{e}", float(v), step) for e, v in enumerate(load)]
    return events


class MoEStatsLogger:
    """Write MoE routing stats to a DeepSpeed engine's monitor every ``interval`` steps.

    Args:
        engine: a DeepSpeed engine (its ``module``, ``monitor`` and ``global_steps`` are used).
        interval: log when ``global_steps % interval == 0``; default ``engine.steps_per_print()``.
        group: process group the stats are summed over (default: DeepSpeed's data-parallel
            group, i.e. the global batch); None-able via ``reduce=False``.
        per_expert: also log every expert's load share.

    Example::

        stats_logger = MoEStatsLogger(engine, interval=10)
        ...; engine.step(); stats_logger.step()
    """

    def __init__(self, engine: Any, interval: Optional[int] = None, group: Optional[Any] = None,
                 reduce: bool = True, per_expert: bool = True, prefix: str = "moe") -> None:
        self.engine = engine
        self.interval = int(interval if interval is not None else engine.steps_per_print())
        if self.interval < 1:
            raise ValueError(f"interval must be >= 1, got {self.interval}")
        if reduce and group is None and dist.is_initialized():
            from deepspeed.utils import groups

            group = groups._get_data_parallel_group()
        self.group = group if reduce else None
        self.per_expert = per_expert
        self.prefix = prefix

    def step(self, step: Optional[int] = None) -> Optional[List[Event]]:
        """Log if ``step`` (default ``engine.global_steps``) is on the interval; return the events written."""
        step = int(self.engine.global_steps if step is None else step)
        if step % self.interval:
            return None
        events = stats_events(collect_moe_stats(self.engine.module, self.group), step, self.prefix,
                              self.per_expert)
        monitor = getattr(self.engine, "monitor", None)
        if monitor is not None and events:
            monitor.write_events(events)
        logger.debug("step %d: wrote %d MoE stats events", step, len(events))
        return events
