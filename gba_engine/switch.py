"""Hand-over of parameters and optimizer state between sync mode (DeepSpeed) and gba mode (parameter servers).

The state travels as a :class:`TrainState`: the flat fp32 dense vector in
``module.parameters()`` order, the optimizer's per-element state (Adam's ``exp_avg`` /
``exp_avg_sq``, SGD's ``momentum_buffer``, Adagrad's ``sum``) as flat vectors of the same
length, the optimizer's step count and the model version (global updates applied).

* :func:`state_from_deepspeed` reads it from a DeepSpeed engine; with ZeRO stage 1/2 each
  worker holds one partition of the fp32 master weights and moments, so the partitions
  are all-gathered over the data-parallel group first (a collective: every worker calls it).
  DeepSpeed's ZeRO internals are read through :mod:`sparse_core.zero_state` (shared
  with ``moe_proto.checkpoint``).
* :func:`state_into_deepspeed` writes it back (each ZeRO rank keeps its own partition).
* :func:`state_from_server` / :func:`state_into_server` do the same for one parameter
  server shard; :func:`send_state` / :func:`recv_state` move a shard over the PS group with
  the doorbell discipline of ``ps/wire.py`` (sends posted before the receiver is told).

Example::

    st = state_from_deepspeed(ds_engine, spec)          # every worker (collective under ZeRO)
    shard = st.shard(*bounds)                           # worker 0 -> server s
    state_into_deepspeed(ds_engine, st_back, spec)      # after gba -> sync
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Sequence

import torch
import torch.distributed as dist
from torch import Tensor
from torch.nn.utils import parameters_to_vector

from sparse_core.zero_state import (base_optimizer, bind_partition_state, flat_partitions, gather_flat,
                                         partition_state, step_of, zero_stage)

from .ps.optim import OptimizerSpec

logger = logging.getLogger(__name__)

_STEP_KEYS = {"adam": True, "adamw": True, "adagrad": True, "sgd": False}


def moment_names(spec: OptimizerSpec) -> tuple[str, ...]:
    """The per-element optimizer state tensors of ``spec`` (torch's names).

    Example::

        moment_names(OptimizerSpec.of("adamw", lr=1e-3))    # ('exp_avg', 'exp_avg_sq')
    """
    if spec.type in ("adam", "adamw"):
        return ("exp_avg", "exp_avg_sq")
    if spec.type == "adagrad":
        return ("sum",)
    return ("momentum_buffer",) if spec.kwargs.get("momentum", 0.0) else ()


@dataclasses.dataclass
class TrainState:
    """Dense parameters + optimizer state + version, flat (or one server's contiguous range of them)."""

    params: Tensor
    moments: dict[str, Tensor]
    step: int  # optimizer steps taken (Adam's bias-correction clock)
    version: int  # global updates applied to the model

    @property
    def nbytes(self) -> int:
        """Bytes of tensor data (what a hand-over moves)."""
        return (self.params.numel() + sum(m.numel() for m in self.moments.values())) * 4

    def shard(self, start: int, end: int) -> "TrainState":
        """The range ``[start, end)`` of every vector (views)."""
        return TrainState(self.params[start:end], {k: v[start:end] for k, v in self.moments.items()},
                          self.step, self.version)

    @classmethod
    def join(cls, shards: Sequence["TrainState"]) -> "TrainState":
        """Concatenate server shards in server order; step and version must agree."""
        steps, versions = {s.step for s in shards}, {s.version for s in shards}
        if len(steps) != 1 or len(versions) != 1:
            raise RuntimeError(f"server shards disagree: steps {sorted(steps)}, versions {sorted(versions)}")
        return cls(torch.cat([s.params for s in shards]),
                   {k: torch.cat([s.moments[k] for s in shards]) for k in shards[0].moments},
                   steps.pop(), versions.pop())

    def equal(self, other: "TrainState") -> bool:
        """Bitwise equality of every tensor, step and version."""
        return (self.step == other.step and self.version == other.version and torch.equal(self.params, other.params)
                and self.moments.keys() == other.moments.keys()
                and all(torch.equal(v, other.moments[k]) for k, v in self.moments.items()))


# ----------------------------------------------------------------------------- DeepSpeed side
def state_from_deepspeed(ds_engine, spec: OptimizerSpec, version: int) -> TrainState:
    """Full flat state of a DeepSpeed engine (ZeRO 0, 1, 2); a collective over its DP group under ZeRO."""
    names = moment_names(spec)
    params = [p for p in ds_engine.module.parameters()]
    flat = parameters_to_vector([p.detach().float() for p in params]).clone()
    stage = zero_stage(ds_engine)
    if stage == 0:
        opt = base_optimizer(ds_engine)
        moments, step = {}, 0
        for name in names:
            parts = []
            for p in params:
                st = opt.state.get(p, {})
                parts.append(st[name].reshape(-1).float() if name in st else torch.zeros(p.numel()))
                step = max(step, step_of(st))
            moments[name] = torch.cat(parts) if parts else torch.zeros(0)
        if not names:
            step = max((step_of(opt.state.get(p, {})) for p in params), default=0)
        return TrainState(flat, moments, step, version)
    if stage > 2:
        raise NotImplementedError("gba hand-over supports ZeRO stages 0, 1 and 2 (stage 3 partitions parameters)")
    index = {id(p): i for i, p in enumerate(params)}
    offsets = torch.tensor([0] + [p.numel() for p in params]).cumsum(0).tolist()
    moments = {name: torch.zeros(flat.numel()) for name in names}
    step = 0
    partitions = flat_partitions(ds_engine)
    for part in partitions:
        st = partition_state(ds_engine, part)
        step = max(step, step_of(st))
        for name in names:
            local = st[name].float().reshape(-1) if name in st else torch.zeros(part.flat.numel())
            full = gather_flat(part, local)
            for p, start, end in part.param_spans():
                i = index[id(p)]
                moments[name][offsets[i]:offsets[i + 1]] = full[start:end]
    step_t = torch.tensor([step], dtype=torch.int64)
    dist.all_reduce(step_t, op=dist.ReduceOp.MAX, group=partitions[0].group)  # ranks with empty partitions
    return TrainState(flat, moments, int(step_t.item()), version)


def _torch_state(spec: OptimizerSpec, step: int, moments: dict[str, Tensor]) -> dict:
    st: dict = {k: v.clone() for k, v in moments.items()}
    if _STEP_KEYS[spec.type]:
        st["step"] = torch.tensor(float(step))  # torch keeps the step as a float32 scalar tensor on CPU
    return st


def state_into_deepspeed(ds_engine, state: TrainState, spec: OptimizerSpec) -> None:
    """Install a full flat state into a DeepSpeed engine (every DP rank calls it with the same state)."""
    params = [p for p in ds_engine.module.parameters()]
    offsets = torch.tensor([0] + [p.numel() for p in params]).cumsum(0).tolist()
    if offsets[-1] != state.params.numel():
        raise ValueError(f"state has {state.params.numel()} elements, the model {offsets[-1]}")
    stage = zero_stage(ds_engine)
    with torch.no_grad():
        for i, p in enumerate(params):
            p.copy_(state.params[offsets[i]:offsets[i + 1]].view_as(p))
    if stage == 0:
        opt = base_optimizer(ds_engine)
        for i, p in enumerate(params):
            if p.requires_grad:
                opt.state[p] = _torch_state(spec, state.step, {k: v[offsets[i]:offsets[i + 1]].view_as(p).clone()
                                                               for k, v in state.moments.items()})
        return
    index = {id(p): i for i, p in enumerate(params)}
    for part in flat_partitions(ds_engine):
        size = part.flat.numel()
        full = {k: torch.zeros(size * part.world_size) for k in ["params", *state.moments]}
        for p, start, end in part.param_spans():
            i = index[id(p)]
            full["params"][start:end] = state.params[offsets[i]:offsets[i + 1]]
            for k, v in state.moments.items():
                full[k][start:end] = v[offsets[i]:offsets[i + 1]]
        mine = part.own_range()
        with torch.no_grad():
            part.flat.copy_(full["params"][mine])
        own = _torch_state(spec, state.step, {k: full[k][mine] for k in state.moments})
        bind_partition_state(ds_engine, part, own)


# ----------------------------------------------------------------------------- server side
def state_from_server(ps, version: int | None = None) -> TrainState:
    """One :class:`~gba_engine.ps.ParameterServer` shard's dense state (a copy, via its ``export_state``).

    Example::

        st = state_from_server(ps)          # TrainState of the server's range; moments named as moment_names(spec)
    """
    names = moment_names(ps.optimizer_spec)
    ex = ps.export_state()
    moments = {k: (ex.optimizer[k] if k in ex.optimizer else torch.zeros(ex.params.numel())) for k in names}
    return TrainState(ex.params, moments, ex.step, ex.version if version is None else version)


def state_into_server(ps, state: TrainState) -> None:
    """Install a shard state into a :class:`~gba_engine.ps.ParameterServer` (values, moments, step, version).

    Example::

        state_into_server(ps, st.shard(0, ps.dense_numel))      # one server: the whole vector
    """
    from .ps.server import ShardState

    ps.import_state(ShardState(state.params, dict(state.moments), state.step, state.version))


# ----------------------------------------------------------------------------- transfers
def send_state(state: TrainState, dst: int, group) -> list:
    """Post the isends of one shard state (header, then floats); wait the returned works after the doorbell."""
    header = torch.tensor([state.params.numel(), len(state.moments), state.step, state.version], dtype=torch.int64)
    floats = torch.cat([state.params.reshape(-1).float()] + [state.moments[k].reshape(-1).float()
                                                            for k in sorted(state.moments)])
    return [dist.isend(header, dst=dst, group=group), dist.isend(floats.contiguous(), dst=dst, group=group),
            floats, header]


def recv_state(src: int, group, names: Sequence[str]) -> TrainState:
    """Receive a shard state announced by ``src`` (only after its doorbell: data already on its way)."""
    header = torch.empty(4, dtype=torch.int64)
    dist.recv(header, src=src, group=group)
    n, k, step, version = header.tolist()
    if k != len(names):
        raise RuntimeError(f"state from rank {src} has {k} optimizer tensors, expected {len(names)} ({list(names)})")
    floats = torch.empty(n * (1 + k))
    dist.recv(floats, src=src, group=group)
    parts = floats.split(n) if n else [torch.zeros(0)] * (1 + k)
    return TrainState(parts[0].clone(), {name: parts[1 + i].clone() for i, name in enumerate(sorted(names))},
                      step, version)


def wait_sent(works: list) -> None:
    """Wait the works returned by :func:`send_state`."""
    for w in works[:2]:
        w.wait()
