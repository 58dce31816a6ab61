"""Server tables held by the workers in the sync phases of mode auto, and handed to the servers at a switch.

In a sync phase the servers have nothing to do with the dense part (DeepSpeed's all-reduce); with
the tables' rows on the servers, every step would still pull and push its rows through them. A
:class:`WorkerTables` keeps every server table whole on each worker instead, with the very row
optimizer the servers run (``ServerTableSpec.optimizer`` or the job's, built by the same
``build_rows``) and the servers' lr schedule. At the accumulation boundary each worker's row
gradients are all-gathered over the workers and applied as the servers apply one global batch:
per id, the sum of every worker's gradient times its samples, over the batch's samples; one
optimizer step per table per update, present rows or not. So the replicas stay equal and a sync
phase trains the rows exactly as the servers would, without a server round trip per step.

At a switch to gba the first worker sends each server its shard of every table (rows ``id % S``,
their optimizer state and the step count: the servers' checkpoint layout, ``RowOptimizer.state_dict``)
with :func:`send_tables`; at the return it receives them back (:func:`recv_tables`) and broadcasts
them to the other workers (:meth:`WorkerTables.broadcast`).

Example::

    held = WorkerTables(specs, job_spec, num_servers=2, schedule=None)
    rows = held.rows({"deep0": torch.tensor([3, 7])})["deep0"]          # [2, dim]
    held.step({"deep0": ids}, {"deep0": grads}, version=10, local_samples=256, group=worker_group)
    shard = held.shard(server=1, num_servers=2)                         # {"deep0": {"weight": ..., "steps": 10}}
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from picasso_ops.distributed.comm import all_gather_varsize, pack_rows, unpack_rows

from .protocol import GetTables, PutTables
from .ps.optim import OptimizerSpec, RowOptimizer
from .ps.schedule import ServerLRSchedule
from .ps.sharding import ServerTableSpec

if TYPE_CHECKING:
    from .phases.base import WorkerContext

logger = logging.getLogger(__name__)

TableState = dict[str, "Tensor | int"]  # RowOptimizer.state_dict(): weight, per-row state tensors, steps


class WorkerTables:
    """Every server table, whole, with its row optimizer, on this worker (the same on every worker).

    Args:
        specs: the job's server tables (their rows start as the servers' would: ``initial_table``).
        job_spec: the job's optimizer (tables without an own optimizer use its row form, as the servers do).
        num_servers: the servers a table is sharded over (row ``id`` on server ``id % num_servers``).
        schedule: the servers' copy of DeepSpeed's lr schedule (None: constant lr).

    Example::

        held = WorkerTables([ServerTableSpec("t", 10, 4)], OptimizerSpec.of("sgd", lr=0.1), 1, None)
        held.rows({"t": torch.tensor([1])})["t"].shape       # torch.Size([1, 4])
    """

    def __init__(self, specs: Sequence[ServerTableSpec], job_spec: OptimizerSpec, num_servers: int,
                 schedule: ServerLRSchedule | None) -> None:
        if num_servers < 1:
            raise ValueError(f"num_servers must be >= 1, got {num_servers}")
        self.specs = {s.name: s for s in specs}
        self.schedule = schedule
        self.num_servers = num_servers
        self.tables: dict[str, RowOptimizer] = {
            s.name: (s.optimizer or job_spec).build_rows(s.initial_table(num_servers)) for s in specs}

    @property
    def nbytes(self) -> int:
        """Bytes of every table's rows and row optimizer state (what a hand-over moves)."""
        return sum(v.numel() * v.element_size() for t in self.tables.values()
                   for v in t.state_dict().values() if isinstance(v, Tensor))

    def rows(self, ids: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """The current rows of unique ``ids`` per table, ``[len(ids), dim]`` (copies)."""
        out = {}
        for name, t in ids.items():
            if name not in self.tables:
                raise KeyError(f"no server table {name!r} among {sorted(self.tables)}")
            self.specs[name].check_ids(t)
            out[name] = self.tables[name].weight.index_select(0, t)
        return out

    @torch.no_grad()
    def step(self, ids: Mapping[str, Tensor], grads: Mapping[str, Tensor], version: int, local_samples: int,
             group: dist.ProcessGroup | None) -> None:
        """One global-batch update of every table from every worker's row gradients (collective over ``group``).

        ``ids``/``grads``: this worker's rows of the step and their gradients (a mean-loss gradient of
        ``local_samples`` samples); ``version``: the update's number (its lr under a schedule).
        """
        names = sorted(self.tables)
        mine = {}
        for name in names:
            dim = self.specs[name].dim
            t_ids = ids.get(name, torch.zeros(0, dtype=torch.int64))
            t_grads = grads.get(name, torch.zeros(0, dim)).to(torch.float32)
            if t_grads.shape != (t_ids.numel(), dim):
                raise ValueError(f"table {name!r}: gradient shape {tuple(t_grads.shape)} != ({t_ids.numel()}, {dim})")
            mine[name] = (t_ids, t_grads)
        world = dist.get_world_size(group) if group is not None else 1
        counts = torch.tensor([[mine[n][0].numel() for n in names]], dtype=torch.int64)
        if world > 1:
            parts = [torch.empty_like(counts) for _ in range(world)]
            dist.all_gather(parts, counts, group=group)
            counts = torch.cat(parts)
        per_table = counts.t().tolist()  # one host read for every table: [table][worker]
        lr = self.schedule.lr(version) if self.schedule is not None else None
        for i, name in enumerate(names):
            t_ids, t_grads = mine[name]
            # as the servers' global batch: each worker's gradient weighed by its samples, over the batch's samples
            packed = pack_rows(t_ids, t_grads * float(local_samples))
            got = all_gather_varsize(packed, per_table[i], group) if world > 1 else packed
            all_ids, all_rows = unpack_rows(got, self.specs[name].dim)
            table = self.tables[name]
            if all_ids.numel():
                uniq, inverse = torch.unique(all_ids, return_inverse=True)
                summed = torch.zeros(uniq.numel(), all_rows.shape[1]).index_add_(0, inverse, all_rows)
                summed /= float(local_samples * world)
            else:
                uniq, summed = all_ids, all_rows
            if lr is not None:
                opt = self.specs[name].optimizer
                table.lr = lr if opt is None else opt.scheduled_lr(lr)
            table.step(uniq, summed)

    def shard(self, server: int, num_servers: int) -> dict[str, TableState]:
        """Server ``server``'s part of every table (rows ``server, server + S, ...``): what it holds in a gba phase."""
        out: dict[str, TableState] = {}
        for name, table in self.tables.items():
            st = table.state_dict()
            out[name] = {k: (v[server::num_servers].contiguous() if isinstance(v, Tensor) else v) for k, v in st.items()}
        return out

    def shard_like(self, server: int, num_servers: int) -> dict[str, TableState]:
        """The shapes of :meth:`shard` as meta tensors (what :func:`recv_tables` reads; no copy)."""
        return {name: {k: (torch.empty((v[server::num_servers]).shape, device="meta") if isinstance(v, Tensor) else v)
                       for k, v in {"weight": t.weight, **t._state_tensors(), "steps": t.steps}.items()}
                for name, t in self.tables.items()}

    def install(self, server: int, num_servers: int, shard: Mapping[str, TableState]) -> None:
        """Write server ``server``'s part of every table (and the step counts) into the whole tables."""
        if set(shard) != set(self.tables):
            raise ValueError(f"server {server} sent tables {sorted(shard)}, this job has {sorted(self.tables)}")
        for name, state in shard.items():
            table = self.tables[name]
            mine = {"weight": table.weight, **table._state_tensors()}
            if set(state) != {*mine, "steps"}:
                raise ValueError(f"table {name!r} from server {server}: keys {sorted(state)}, expected "
                                 f"{sorted({*mine, 'steps'})}")
            for key, full in mine.items():
                full[server::num_servers] = state[key]
            table.steps = int(state["steps"])

    def broadcast(self, src: int, group: dist.ProcessGroup | None) -> None:
        """Overwrite every worker's tables with rank ``src``'s (a collective over ``group``)."""
        if group is None or dist.get_world_size(group) == 1:
            return
        for name in sorted(self.tables):
            table = self.tables[name]
            for tensor in (table.weight, *(v for _, v in sorted(table._state_tensors().items()))):
                dist.broadcast(tensor, src=src, group=group)
            steps = torch.tensor([table.steps], dtype=torch.int64)
            dist.broadcast(steps, src=src, group=group)
            table.steps = int(steps.item())


# ----------------------------------------------------------------------------- hand-overs
def tables_to_servers(ctx: "WorkerContext", keep: bool = False) -> int:
    """The first worker sends every server its shard of the workers' tables; returns the bytes handed over.

    Every worker calls it at the same point (the others only note that the servers now hold the
    rows, unless ``keep``: a checkpoint, after which the workers train on). The servers take the
    command between phases.
    """
    held = ctx.worker_tables
    if ctx.is_first:
        servers = ctx.rt.layout.servers
        sends = [send_tables(held.shard(i, len(servers)), s, ctx.rt.ps_group) for i, s in enumerate(servers)]
        ctx.commands.wait_acks(ctx.commands.send(PutTables(src=ctx.rt.rank, version=ctx.version)))
        for works in sends:
            wait_tables(works)
    ctx.tables_here = keep
    return held.nbytes


def tables_from_servers(ctx: "WorkerContext") -> int:
    """Every worker takes the servers' tables back (the first receives, then broadcasts: a collective); returns bytes."""
    held = ctx.worker_tables
    servers = ctx.rt.layout.servers
    if ctx.is_first:
        ctx.commands.wait_acks(ctx.commands.send(GetTables(src=ctx.rt.rank)))  # acknowledged once the sends are posted
        for i, s in enumerate(servers):
            held.install(i, len(servers), recv_tables(s, ctx.rt.ps_group, held.shard_like(i, len(servers))))
    held.broadcast(ctx.workers[0], ctx.rt.worker_group)
    ctx.tables_here = True
    return held.nbytes


# ----------------------------------------------------------------------------- transfers
def table_layout(tables: Mapping[str, TableState]) -> list[tuple[str, str, tuple[int, ...]]]:
    """``(table, key, shape)`` of every tensor of ``tables`` in wire order (tables by name, weight first).

    Example::

        table_layout({"t": {"weight": torch.zeros(5, 4), "momentum1": torch.zeros(5), "steps": 3}})
        # [('t', 'weight', (5, 4)), ('t', 'momentum1', (5,))]
    """
    out = []
    for name in sorted(tables):
        keys = ["weight"] + sorted(k for k in tables[name] if k not in ("weight", "steps"))
        out += [(name, k, tuple(tables[name][k].shape)) for k in keys]  # type: ignore[union-attr]
    return out


def send_tables(tables: Mapping[str, TableState], dst: int, group: dist.ProcessGroup) -> list:
    """Post the isends of table shards (a header of step counts and sizes, then every float); wait with :func:`wait_tables`."""
    layout = table_layout(tables)
    header = torch.tensor([len(layout), *(int(tables[n]["steps"]) for n in sorted(tables)),
                           *(int(torch.Size(s).numel()) for _, _, s in layout)], dtype=torch.int64)
    floats = torch.cat([tables[n][k].reshape(-1).to(torch.float32) for n, k, _ in layout])  # type: ignore[union-attr]
    return [dist.isend(header, dst=dst, group=group), dist.isend(floats, dst=dst, group=group), header, floats]


def wait_tables(works: list) -> None:
    """Wait the sends of :func:`send_tables`."""
    for w in works[:2]:
        w.wait()


def recv_tables(src: int, group: dist.ProcessGroup, like: Mapping[str, TableState]) -> dict[str, TableState]:
    """Receive table shards of the shapes of ``like`` from ``src`` (sent by :func:`send_tables`); a mismatch is named."""
    layout = table_layout(like)
    names = sorted(like)
    header = torch.empty(1 + len(names) + len(layout), dtype=torch.int64)
    dist.recv(header, src=src, group=group)
    sizes = header[1 + len(names):].tolist()
    want = [int(torch.Size(s).numel()) for _, _, s in layout]
    if int(header[0]) != len(layout) or sizes != want:
        raise RuntimeError(f"tables from rank {src}: {int(header[0])} tensors of sizes {sizes}, expected "
                           f"{len(layout)} of {want} ({[(n, k) for n, k, _ in layout]}): do both ends have the same "
                           "server tables and num_servers?")
    floats = torch.empty(sum(want))
    dist.recv(floats, src=src, group=group)
    out: dict[str, TableState] = {n: {"steps": int(header[1 + i])} for i, n in enumerate(names)}
    for (name, key, shape), part in zip(layout, floats.split(want)):
        out[name][key] = part.view(shape)
    return out
