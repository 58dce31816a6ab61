"""One reader (and writer) of DeepSpeed's ZeRO-1/2 optimizer internals, shared by every package.

Under ZeRO stage 1 or 2 DeepSpeed (0.19.8) keeps, per optimizer param group ``g``, the
fp32 master weights of the group's parameters as one flat vector split over the
data-parallel ranks: this rank holds ``optimizer.single_partition_of_fp32_groups[g]``,
the torch optimizer inside (``optimizer.optimizer``) keys its state (Adam's ``exp_avg``,
``exp_avg_sq``, ``step``) by that partition, the group's parameters in flat order are
``optimizer.bit16_groups[g]`` (padding only at the end, no round robin) and the ranks that
share the group are ``optimizer.real_dp_process_group[g]``. Each parameter also carries an
``_hp_mapping`` that says which slice of which partition holds which slice of it.

Two views of the same storage are offered here:

* per flat partition (:func:`flat_partitions`, :func:`partition_state`,
  :func:`bind_partition_state`, :func:`gather_flat`): what a whole-model hand-over needs
  (``gba_engine.switch``);
* per parameter (:func:`read_full_param`, :func:`write_param_fragment`): what a
  per-tensor checkpoint needs (``moe_proto.checkpoint``).

This module imports torch and deepspeed only, never a package of this project.

Example::

    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    if is_partitioned(engine):
        for part in flat_partitions(engine):
            moments = partition_state(engine, part)            # {"exp_avg": ..., "step": ...} of this rank's slice
            full = gather_flat(part, moments["exp_avg"])       # the whole flat group (collective over part.group)
        exp_avg = read_full_param(engine, model.weight, "exp_avg")   # one parameter's full moment (collective)
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Any, Iterator, Mapping, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn

logger = logging.getLogger(__name__)


def zero_stage(engine: Any) -> int:
    """The ZeRO stage a DeepSpeed engine runs (0 without ZeRO).

    Example::

        zero_stage(engine)      # 1 for {"zero_optimization": {"stage": 1}}
    """
    return int(engine.zero_optimization_stage()) if engine.zero_optimization() else 0


def is_partitioned(engine: Any) -> bool:
    """Whether the engine keeps fp32 master weights and optimizer state in flat partitions (ZeRO 1 or 2).

    Example::

        is_partitioned(engine)  # False for stage 0 (state per parameter) and stage 3 (not read here)
    """
    return zero_stage(engine) in (1, 2)


def base_optimizer(engine: Any) -> torch.optim.Optimizer:
    """The torch optimizer that holds the state: inside ZeRO 1/2's wrapper, else the engine's own.

    Example::

        base_optimizer(engine).param_groups[0]["lr"]
    """
    return engine.optimizer.optimizer if is_partitioned(engine) else engine.optimizer


def step_of(state: Mapping[str, Any]) -> int:
    """The ``step`` of one torch optimizer state entry as an int (0 when absent; torch keeps a tensor).

    Example::

        step_of(base_optimizer(engine).state[p])    # 3 after three Adam steps
    """
    s = state.get("step", 0)
    return int(s.item()) if isinstance(s, Tensor) else int(s)


@dataclasses.dataclass(frozen=True)
class FlatPartition:
    """This rank's slice of one ZeRO 1/2 param group's flat fp32 vector.

    ``flat`` is DeepSpeed's live tensor (writing into it changes the master weights);
    ``params`` are the group's model parameters in flat order; ``group`` is the process
    group the flat vector is split over, this rank being ``rank`` of ``world_size``.
    """

    index: int
    flat: Tensor
    params: tuple[nn.Parameter, ...]
    group: Any
    rank: int
    world_size: int

    def own_range(self) -> slice:
        """This rank's elements within the whole (gathered) flat vector."""
        size = self.flat.numel()
        return slice(self.rank * size, (self.rank + 1) * size)

    def param_spans(self) -> Iterator[tuple[nn.Parameter, int, int]]:
        """``(param, start, end)`` of each parameter within the whole flat vector (padding only at the end)."""
        pos = 0
        for p in self.params:
            yield p, pos, pos + p.numel()
            pos += p.numel()


def flat_partitions(engine: Any) -> list[FlatPartition]:
    """This rank's flat fp32 partitions of a ZeRO 1/2 engine, one per optimizer param group.

    Example::

        [part.flat.numel() for part in flat_partitions(engine)]    # elements this rank holds per group
    """
    if not is_partitioned(engine):
        raise ValueError(f"flat fp32 partitions exist under ZeRO stages 1 and 2, this engine runs stage "
                         f"{zero_stage(engine)}")
    zopt = engine.optimizer
    parts = []
    for g, flat in enumerate(zopt.single_partition_of_fp32_groups):
        group = zopt.real_dp_process_group[g]
        parts.append(FlatPartition(g, flat, tuple(zopt.bit16_groups[g]), group, dist.get_rank(group=group),
                                   dist.get_world_size(group=group)))
    return parts


def partition_state(engine: Any, part: FlatPartition) -> dict:
    """The torch optimizer's state of one flat partition (DeepSpeed's live dict; empty before the first step).

    Example::

        partition_state(engine, flat_partitions(engine)[0]).get("exp_avg")
    """
    return base_optimizer(engine).state.get(part.flat, {})


def bind_partition_state(engine: Any, part: FlatPartition, state: dict) -> None:
    """Bind ``state`` as the optimizer state of one flat partition (replaces the engine's entry in place).

    ``state`` is installed as given (not copied): pass tensors the engine may own.

    Example::

        bind_partition_state(engine, part, {"exp_avg": m, "exp_avg_sq": v, "step": torch.tensor(3.0)})
    """
    base_optimizer(engine).state[part.flat] = state


def gather_flat(part: FlatPartition, local: Tensor) -> Tensor:
    """Concatenate every rank's ``local`` slice of a flat partition (collective over ``part.group``).

    Example::

        full_exp_avg = gather_flat(part, partition_state(engine, part)["exp_avg"].float().reshape(-1))
    """
    gathered = [torch.empty_like(local) for _ in range(part.world_size)]
    dist.all_gather(gathered, local.contiguous(), group=part.group)
    return torch.cat(gathered)


def relink_zero_optimizer_states(engine: Any) -> bool:
    """Re-link ZeRO 1/2's per-parameter views of the optimizer state once every param group has state.

    DeepSpeed 0.19.8 links them (``_lazy_init_hp_params_optimizer_state``) right after the
    *first* param group's step, before a later group (e.g. MoE experts' ``moe: True``
    group) has any state, and never again: those parameters' views stay empty, so
    ``deepspeed.utils.safe_get_full_optimizer_state(p, "exp_avg")`` raises ``KeyError`` for
    them. Binds the views on the engine's optimizer (in place). Returns whether they are
    linked (False without ZeRO 1/2, or before the first step).

    Example::

        engine.step(); relink_zero_optimizer_states(engine)
        safe_get_full_optimizer_state(model.moe.experts.w1, "exp_avg")   # now a tensor
    """
    optimizer = getattr(engine, "optimizer", None)
    if not is_partitioned(engine) or not hasattr(optimizer, "_hp_optimizer_states_linked"):
        return False
    state = optimizer.optimizer.state
    ready = all(len(state.get(flat, {})) > 0 for flat in optimizer.single_partition_of_fp32_groups)
    # Unlinked, DeepSpeed links again after the next step; linking empty state now would stick.
    optimizer._hp_optimizer_states_linked = False
    if ready:
        optimizer._lazy_init_hp_params_optimizer_state()
    return ready


def _fragment_source(engine: Any, param: nn.Parameter, key: Optional[str]) -> Optional[Tensor]:
    """This rank's flat fp32 partition (key None) or its optimizer state ``key``, holding part of ``param``."""
    mapping = getattr(param, "_hp_mapping", None)
    if mapping is None:
        return None
    flat = engine.optimizer.single_partition_of_fp32_groups[mapping.param_group_index]
    if key is None:
        return flat
    # Read the optimizer state itself: ZeRO's optim_fragment views are linked lazily and can be stale.
    return engine.optimizer.optimizer.state.get(flat, {}).get(key)


def read_full_param(engine: Any, param: nn.Parameter, key: Optional[str] = None) -> Tensor:
    """Full fp32 value (key None) or optimizer state ``key`` of a ZeRO-1/2 parameter, on the CPU.

    Every rank contributes its fragment and the rest is zeros, summed over the
    parameter's data-parallel group (a collective: every rank of it calls this, in the
    same parameter order). A state ``key`` the optimizer does not have yet reads as zeros.

    Example::

        exp_avg = read_full_param(engine, model.weight, "exp_avg")     # shape of model.weight
    """
    buf = torch.zeros(param.numel(), dtype=torch.float32, device=param.device)
    source = _fragment_source(engine, param, key)
    if source is not None:
        lp, hp = param._hp_mapping.lp_fragment_address, param._hp_mapping.hp_fragment_address
        buf.narrow(0, lp.start, lp.numel).copy_(source.narrow(0, hp.start, hp.numel))
    dist.all_reduce(buf, group=param._dp_group)
    return buf.view(param.shape).cpu()


def write_param_fragment(engine: Any, param: nn.Parameter, value: Tensor, key: Optional[str] = None) -> None:
    """Write this rank's fragment of a full ``value`` into the ZeRO-1/2 partition (key None) or state ``key``.

    Writes in place into the engine's tensors; ranks holding no fragment (or no state
    ``key`` yet) write nothing. Not a collective.

    Example::

        write_param_fragment(engine, model.weight, saved_exp_avg, "exp_avg")
    """
    target = _fragment_source(engine, param, key)
    if target is None:
        return
    lp, hp = param._hp_mapping.lp_fragment_address, param._hp_mapping.hp_fragment_address
    with torch.no_grad():
        target.narrow(0, hp.start, hp.numel).copy_(value.to(target.device).flatten().narrow(0, lp.start, lp.numel))
