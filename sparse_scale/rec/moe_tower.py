"""An MoE tower for the rec models: the deep MLP (wide-and-deep) or top MLP (DLRM) with moe_proto FFNs.

A ``moe_proto`` block in a train_rec config makes the model's MLP a :class:`MoETower`: the
same ``Linear -> ReLU`` hidden layers, and after hidden layer ``i`` (0-based) with
``(i + 1) % moe_every == 0`` a residual MoE FFN ``h = h + MoE(h)`` over the ``[B, width]``
rows (each sample is one token). Every expert is ``Linear(width, width) -> ReLU -> Linear(width,
width)``. The block's keys mean what they mean for the LM (experts, prototypes, top_k, capacity,
dropless, drop_policy, ep_size, aux_loss_coef, z_loss_coef); ``moe_every`` counts the tower's
hidden layers instead of transformer layers.

Training adds ``aux_loss_coef x`` the mean of the tower's load-balancing loss (plus any z-loss)
over the step's forwards to the loss: the tower hands it over explicitly through
:meth:`MoETower.take_aux_loss` (see :func:`plus_aux_loss`). Expert load (routes and kept rows per
expert, dropped fraction) accumulates over the training forwards: :func:`load_events` for the
monitor, :func:`expert_load_summary` for summary.json.

Two ways to hold the experts:

* expert-parallel (no gba block): the MoE layers are DeepSpeed MoE layers, so
  ``deepspeed.initialize`` creates the ``ep_size`` expert groups, reduces expert gradients over
  the expert-data-parallel group only; ``sparse_scale.initialize`` gives ZeRO the experts as their own
  param groups, counts every expert once in the clip and saves them with ``moe_proto.checkpoint``.
* replicated (gba block, ``ep_size`` 1, ``moe_proto.replicated.ReplicatedMoE``): every worker holds
  every expert and the experts are
  ordinary dense parameters, pushed to and pulled from the parameter servers like the rest of the
  MLP. DeepSpeed must not see MoE layers there: its expert groups span every rank of the launch,
  the servers included, which never join the workers' collectives.

Example::

    tower = MoETower(width=429, hidden=(256, 128), block=MoEProtoConfig(num_experts=4))
    logits = tower(rows)                       # [B, 1]
    loss = bce(logits.squeeze(-1), labels) + tower.take_aux_loss()
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import math
from typing import TYPE_CHECKING, Any, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from moe_proto.buffer_pool import HostBufferPool, use_buffer_pool
from moe_proto.checkpoint import load_full_state_dict
from moe_proto.config import MoEProtoConfig
from moe_proto.from_block import moe_layer
from moe_proto.param_groups import has_moe_layers
from picasso_ops.models.layers import TowerFactory, check_dropout
from sparse_scale.rec.config import RecJobError
from sparse_scale.rec.engines import MonitorEvent

if TYPE_CHECKING:
    from sparse_scale.rec.engines import RecEngine
    from sparse_scale.rec.job import RecJob

logger = logging.getLogger(__name__)

EXPERT_ACTIVATION = "relu"  # the tower's own activation, so an expert is a wider copy of a hidden layer


def moe_layer_indices(num_hidden: int, moe_every: int) -> list[int]:
    """The hidden layers (0-based) followed by an MoE FFN: ``(i + 1) % moe_every == 0``.

    Example::

        >>> moe_layer_indices(2, 2), moe_layer_indices(3, 1)
        ([1], [0, 1, 2])
    """
    return [i for i in range(num_hidden) if (i + 1) % moe_every == 0]


@dataclasses.dataclass(frozen=True)
class LayerLoad:
    """One MoE layer's routing over the training forwards counted so far.

    Attributes:
        routed_per_expert: ``[E]`` routes that chose each expert (before capacity drops).
        tokens_per_expert: ``[E]`` routes each expert computed (kept).
    """

    routed_per_expert: Tensor
    tokens_per_expert: Tensor

    @property
    def dropped_fraction(self) -> float:
        """Routes dropped by capacity over routes (0 when nothing was routed)."""
        routed = float(self.routed_per_expert.sum())
        return (routed - float(self.tokens_per_expert.sum())) / routed if routed else 0.0

    @property
    def load_max(self) -> float:
        """The busiest expert's routes over the mean (1.0: balanced)."""
        routed = self.routed_per_expert.double()
        return float(routed.max() / routed.mean()) if float(routed.sum()) else 0.0


class MoETower(nn.Module):
    """``[B, width] -> [B, 1]``: a ReLU MLP whose hidden layers ``i`` with ``(i + 1) % moe_every == 0`` add an MoE FFN.

    Args:
        width: input width (the model's concatenated embeddings and dense features).
        hidden: hidden widths (wide-and-deep's ``hidden``, DLRM's ``top``).
        block: the validated ``moe_proto`` block.
        replicated: hold every expert as a dense parameter (``moe_proto.replicated.ReplicatedMoE``; gba jobs).
        dropout: after each hidden ReLU (before that layer's MoE FFN), in training only; 0: none.

    State names: ``hidden.{i}`` (Linear), ``moe.{i}`` (the MoE layer after hidden layer ``i``),
    ``head`` (the last Linear). With ``ep_size > 1`` the expert groups are created here
    (torch.distributed must be up) and every rank takes its experts' rows from one full
    initialisation, so the model starts the same at every ``ep_size``.

    Example::

        >>> tower = MoETower(16, (8, 8), MoEProtoConfig(num_experts=4, num_prototypes=2))
        >>> tower(torch.randn(32, 16)).shape, float(tower.take_aux_loss()) > 0
        (torch.Size([32, 1]), True)
    """

    def __init__(self, width: int, hidden: Sequence[int], block: MoEProtoConfig, replicated: bool = False,
                 dropout: float = 0.0) -> None:
        super().__init__()
        self.dropout = check_dropout(dropout, "MoETower dropout")
        hidden = tuple(int(h) for h in hidden)
        where = moe_layer_indices(len(hidden), block.moe_every)
        if not where:
            raise ValueError(f"moe_proto.moe_every={block.moe_every}: the tower's {len(hidden)} hidden layers "
                             f"{hidden} get no MoE layer (hidden layer i has one when (i + 1) % moe_every == 0)")
        if replicated and block.ep_size != 1:
            raise ValueError(f"replicated experts need moe_proto.ep_size 1, got {block.ep_size}")
        if block.aux_loss_scope == "sequence":
            raise ValueError("moe_proto.aux_loss_scope='sequence': the rec tower's rows [batch, width] have no "
                             "sequence dim; use 'micro_batch' or 'global_batch'")
        self.aux_loss_coef = float(block.aux_loss_coef)
        self.hidden = nn.ModuleList()
        self.moe = nn.ModuleDict()
        for i, h in enumerate(hidden):
            self.hidden.append(nn.Linear(width, h))
            if i in where:
                self.moe[str(i)] = self._moe_layer(h, block, replicated)
            width = h
        self.head = nn.Linear(width, 1)
        use_buffer_pool(self, HostBufferPool(max_bytes=block.host_buffer_pool_mb << 20))
        self._pending_aux: list[Tensor] = []
        self._routed = {name: torch.zeros(block.num_experts, dtype=torch.long) for name in self.moe}
        self._kept = {name: torch.zeros(block.num_experts, dtype=torch.long) for name in self.moe}

    @staticmethod
    def _moe_layer(width: int, block: MoEProtoConfig, replicated: bool) -> nn.Module:
        full = moe_layer(block, width, ffn_hidden_size=width, activation=EXPERT_ACTIVATION, replicated=replicated,
                         ep_size=1)
        if replicated or block.ep_size == 1:
            return full
        with torch.random.fork_rng():  # the full layer drew the init; the sharded one must not move the RNG
            sharded = moe_layer(block, width, ffn_hidden_size=width, activation=EXPERT_ACTIVATION)
        sharded.set_deepspeed_parallelism()  # the groups give this rank's expert range
        load_full_state_dict(sharded, full.state_dict())
        return sharded

    def forward(self, rows: Tensor) -> Tensor:
        h, aux = rows, rows.new_zeros((), dtype=torch.float32)
        for i, linear in enumerate(self.hidden):
            h = F.relu(linear(h))
            if self.dropout > 0.0:
                h = F.dropout(h, self.dropout, self.training)
            layer = self.moe[str(i)] if str(i) in self.moe else None
            if layer is not None:
                out, l_aux, _ = layer(h)
                h, aux = h + out, aux + l_aux
        if self.training and torch.is_grad_enabled():
            self._pending_aux.append(aux)
            for name, layer in self.moe.items():
                stats = layer.last_stats
                self._routed[name] += stats.routed_per_expert.detach().cpu().long()
                self._kept[name] += stats.tokens_per_expert.detach().cpu().long()
        return self.head(h)

    def take_aux_loss(self) -> Tensor | None:
        """``aux_loss_coef x`` the mean aux loss of the training forwards since the last call (None: none ran).

        Interleaved micro-batches run the tower once each: their losses are averaged like their
        BCE terms. Clears what it returns, so each step's loss gets its own forwards' term.
        """
        if not self._pending_aux:
            return None
        pending, self._pending_aux = self._pending_aux, []
        return self.aux_loss_coef * torch.stack(pending).mean()

    def moe_layers(self) -> dict[str, nn.Module]:
        """The MoE layers by their state name (``moe.1``, ...)."""
        return {f"moe.{name}": layer for name, layer in self.moe.items()}

    def expert_load(self) -> dict[str, LayerLoad]:
        """This rank's routing per MoE layer over the training forwards so far."""
        return {f"moe.{name}": LayerLoad(self._routed[name].clone(), self._kept[name].clone()) for name in self.moe}


def towers_of(module: nn.Module) -> list[tuple[str, MoETower]]:
    """``(name, tower)`` of every :class:`MoETower` in ``module`` (empty for a model without one)."""
    return [(name, m) for name, m in module.named_modules() if isinstance(m, MoETower)]


def plus_aux_loss(loss: Tensor, towers: Sequence[tuple[str, MoETower]]) -> Tensor:
    """``loss`` plus every tower's :meth:`~MoETower.take_aux_loss` (``loss`` itself without towers).

    Example::

        towers = towers_of(engine.module)
        loss = plus_aux_loss(bce(engine(dense, values, lengths), labels), towers)
    """
    for _, tower in towers:
        aux = tower.take_aux_loss()
        if aux is not None:
            loss = loss + aux
    return loss


def _hidden_widths(job: "RecJob") -> tuple[int, ...]:
    return tuple(job.model_args.top if job.config.model == "dlrm" else job.model_args.hidden)


def moe_block(job: "RecJob") -> MoEProtoConfig | None:
    """The validated ``moe_proto`` block of the job's config, or None."""
    return job.config.loaded.blocks.get("moe_proto")


def tower_factory(job: "RecJob") -> TowerFactory | None:
    """The model's MLP factory for the job's ``moe_proto`` block (None without one: the plain MLP).

    Experts are replicated with a gba block and expert-parallel otherwise. ``ep_size > 1``
    needs torch.distributed up and every worker running the same forwards, evaluation
    included (the experts' all-to-alls): the synthetic held-out batches must split evenly.

    Example::

        WideAndDeep(job.model_args, deep_tower=tower_factory(job))
    """
    block = moe_block(job)
    if block is None:
        return None
    where = f"{job.config.config}: moe_proto"
    hidden = _hidden_widths(job)
    if not moe_layer_indices(len(hidden), block.moe_every):
        raise RecJobError(f"{where}.moe_every={block.moe_every}: --model {job.config.model}'s tower has "
                          f"{len(hidden)} hidden layers {hidden}; hidden layer i gets an MoE FFN when "
                          f"(i + 1) % moe_every == 0, so none would: use moe_every <= {len(hidden)}")
    if block.ep_size > 1:
        if job.synthetic is None:
            raise RecJobError(f"{where}.ep_size={block.ep_size} with --data {job.config.data}: every worker must "
                              "run the same forwards (the experts' all-to-alls), and held-out file shards differ "
                              "in length; use ep_size 1 (experts replicated on each rank)")
        batches = math.ceil(job.config.eval_samples / job.micro_batch)
        if batches % job.workers:
            raise RecJobError(f"{where}.ep_size={block.ep_size}: the {batches} held-out batches of "
                              f"--eval-samples {job.config.eval_samples} do not split evenly over {job.workers} "
                              "workers, and every worker must run the same forwards (the experts' all-to-alls); "
                              f"use a multiple of {job.micro_batch * job.workers} samples")
        if not dist.is_initialized() or dist.get_world_size() % block.ep_size:
            world = dist.get_world_size() if dist.is_initialized() else 1
            raise RecJobError(f"{where}.ep_size={block.ep_size} does not divide the launch's {world} ranks")
    if job.rank == 0:
        logger.info("MoE tower: %d experts, %d prototype(s) x top-%d, %s, after hidden layers %s of %s (%s)",
                    block.num_experts, block.num_prototypes, block.top_k,
                    "dropless" if block.dropless else f"capacity factor {block.capacity_factor}",
                    moe_layer_indices(len(hidden), block.moe_every), hidden,
                    "replicated" if job.gba is not None else f"ep_size {block.ep_size}")
    return functools.partial(MoETower, hidden=hidden, block=block, replicated=job.gba is not None,
                             dropout=job.config.dropout)


def load_events(towers: Sequence[tuple[str, MoETower]], x: int) -> list[MonitorEvent]:
    """This rank's expert load so far for the monitor: ``moe/<layer>/dropped_fraction``, ``load_max``, ``load/e<i>``.

    No collective (gba workers run at their own pace): rank 0's monitor shows rank 0's routing.
    """
    events: list[MonitorEvent] = []
    for tower_name, tower in towers:
        for layer, load in tower.expert_load().items():
            base = f"moe/{tower_name}.{layer}"
            routed = load.routed_per_expert.double()
            share = routed / routed.sum().clamp(min=1)
            events += [(f"{base}/dropped_fraction", load.dropped_fraction, x), (f"{base}/load_max", load.load_max, x)]
            events += [(f"{base}/load/e{e}", float(v), x) for e, v in enumerate(share)]
    return events


def expert_load_summary(engine: "RecEngine", block: MoEProtoConfig | None) -> dict[str, Any] | None:
    """summary.json's ``moe`` part: the experts' settings and each layer's load over the job's training forwards.

    Sums every worker's counts (over the control plane in gba mode, else an all-reduce over the
    worker group), so every worker must call it. None without a ``moe_proto`` block.

    Example::

        expert_load_summary(engine, moe_block(job))["layers"]["mlp.moe.1"]["dropped_fraction"]
    """
    if block is None:
        return None
    towers = towers_of(engine.module)
    local = {f"{t}.{layer}": torch.stack([load.routed_per_expert, load.tokens_per_expert])
             for t, tower in towers for layer, load in tower.expert_load().items()}
    if engine.gathers_live:
        parts = list(engine.gather_live("moe/load", local).values())
        total = {name: sum(p[name] for p in parts) for name in local}
    else:
        total = {name: counts.clone() for name, counts in local.items()}
        if dist.is_initialized():
            for name in sorted(total):  # same order on every rank
                dist.all_reduce(total[name], group=engine.worker_group)
    layers = {}
    for name, counts in total.items():
        load = LayerLoad(counts[0], counts[1])
        layers[name] = {"routed_per_expert": load.routed_per_expert.tolist(),
                        "tokens_per_expert": load.tokens_per_expert.tolist(),
                        "dropped_fraction": load.dropped_fraction, "load_max": load.load_max}
    return {"num_experts": block.num_experts, "num_prototypes": block.num_prototypes, "top_k": block.top_k,
            "ep_size": block.ep_size, "experts": "replicated" if not has_moe_layers(engine.module)
            else "expert-parallel", "aux_loss_coef": block.aux_loss_coef, "layers": layers}
