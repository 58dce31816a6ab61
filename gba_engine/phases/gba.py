"""The gba phase: every global batch goes through the parameter servers under token control.

A worker pulls the dense vector and a token at the first micro-batch of a step, computes its
local gradient and pushes it at the accumulation boundary; the servers apply the mean of M
gradients (``gba.grads_per_update``, default N) per update. Entering the phase hands the
workers' state to the servers when they hold the truth (:meth:`GBAPhase.enter`); leaving it
hands the servers' state back (:meth:`GBAPhase.hand_back`).

A phase is *kept* when the job will not leave it (mode ``gba``, a restarted worker, or auto
mode after a lost worker): then the job publishes ``joinable`` and a restarted worker may
join it.

Example::

    phase = GBAPhase(ctx, kept=True)
    nbytes = phase.enter()                 # state to the servers, Serve(m=N), client open
    loss = loss_fn(phase.forward(x), y); phase.backward(loss); phase.step()
"""
from __future__ import annotations

import logging
import time
from typing import Any, Mapping, Union

import torch
import torch.distributed as dist
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from ..protocol import (FLAG, Finished, GetState, Kept, Leave, PhaseEnd, PutState, Serve, decode_int, encode_int,
                        end_key, exhausted_key, joinable_key, out_key, version_key)
from ..ps import PSClient
from ..ps.sharding import DenseSharding
from ..switch import TrainState, moment_names, recv_state, send_state, state_from_deepspeed, wait_sent
from ..worker_tables import tables_to_servers
from .base import Phase, WorkerContext

logger = logging.getLogger(__name__)

POLL_S = 0.02


class GBAPhase(Phase):
    """Training through the servers; ``number`` is the job-wide gba phase number once entered (0 before)."""

    name = "gba"

    def __init__(self, ctx: WorkerContext, kept: bool) -> None:
        super().__init__(ctx)
        self.kept = kept  # the job never leaves this phase
        self.number = 0
        self.token = None  # the token of this step's pull (None between steps)
        self.micro = 0  # micro-batches of the current step
        self.start_version = 0  # the version when this worker entered (max_lead counts pulls from it)
        self.pushes = 0  # pushes of this worker in this phase

    # ------------------------------------------------------------------ entering and leaving
    def enter(self) -> int:
        """Start a new gba phase on every worker (collective); returns the bytes handed to the servers."""
        ctx = self.ctx
        nbytes = 0
        if ctx.truth == "workers":
            st = state_from_deepspeed(ctx.ds_engine, ctx.spec, ctx.version)  # collective under ZeRO
            nbytes = st.nbytes
            if ctx.is_first:
                bounds = DenseSharding(st.params.numel(), ctx.rt.layout.num_servers).bounds
                sends = [send_state(st.shard(a, b), s, ctx.rt.ps_group)
                         for s, (a, b) in zip(ctx.rt.layout.servers, bounds)]
                ctx.commands.wait_acks(ctx.commands.send(PutState(src=ctx.rt.rank)))
                for works in sends:
                    wait_sent(works)
            if ctx.tables_here:  # the sync phase's rows, with their optimizer state, to the servers
                nbytes += tables_to_servers(ctx)
            if ctx.tables and len(ctx.workers) > 1:
                # The servers take PutState only once the sync phase's tables-only serve has ended (every
                # goodbye). A worker that pulled for gba before then would land in that phase (a loaded CI
                # machine: "dense parameters in a tables-only phase"), so every worker waits for the ack.
                dist.barrier(group=ctx.rt.worker_group)
            ctx.truth = "servers"
        if ctx.is_first:  # acknowledged when the phase ends
            ctx.commands.send(Serve(m=ctx.gba.grads_per_update or ctx.num_workers))
        ctx.gba_phases += 1
        self.number = ctx.gba_phases
        if ctx.is_first and self.kept:  # the job never leaves this phase: a restarted worker may join it
            ctx.rt.store.set(joinable_key(), encode_int(self.number))
        self.start_version, self.pushes, self.token, self.micro = ctx.version, 0, None, 0
        if ctx.claims is not None:
            ctx.claims.enter_gba(self.number, ctx.claims.taken)  # sync lockstep: the same base everywhere
        self.client = PSClient(ctx.rt, ctx.dense_numel, ctx.tables)
        return nbytes

    def join(self, number: int) -> None:
        """A restarted worker enters the job's running gba phase ``number`` (which it never leaves)."""
        ctx = self.ctx
        store = ctx.rt.store
        self.number = ctx.gba_phases = number
        ctx.truth = "servers"
        versions = [decode_int(store.get(version_key(s))) if store.check([version_key(s)]) else 0
                    for s in ctx.rt.layout.servers]
        self.start_version = ctx.version = min(versions)  # max_lead counts this worker's pulls from here
        self.client = PSClient(ctx.rt, ctx.dense_numel, ctx.tables)

    def keep(self, why: str) -> bool:
        """Try to keep the job in this phase for good, where a restarted worker may join; False if it already ends.

        A compare_set on the phase's end: a ``Leave`` (or ``Finished``) set first wins, so the job
        never publishes ``joinable`` for a phase it is about to leave.
        """
        store = self.ctx.rt.store
        end = PhaseEnd.decode(store.compare_set(end_key(self.number), "", Kept(why).encode()))
        if not isinstance(end, Kept):
            return False
        self.kept = True
        store.set(joinable_key(), encode_int(self.number))
        logger.warning("gba: %s; auto mode stays in gba", why)
        return True

    def hand_back(self) -> TrainState:
        """Leave the phase: the servers' state, the same on every worker (collective over the workers)."""
        ctx = self.ctx
        self.close()
        workers, group = ctx.workers, ctx.rt.worker_group
        if ctx.is_first:
            seq = ctx.commands.send(GetState(src=ctx.rt.rank))
            ctx.commands.wait_acks(seq)
            st = TrainState.join([recv_state(s, ctx.rt.ps_group, moment_names(ctx.spec)) for s in ctx.rt.layout.servers])
            meta = torch.tensor([st.params.numel(), st.step, st.version], dtype=torch.int64)
            flat = torch.cat([st.params] + [st.moments[k] for k in sorted(st.moments)])
        else:
            meta = torch.zeros(3, dtype=torch.int64)
        dist.broadcast(meta, src=workers[0], group=group)
        n, step, version = meta.tolist()
        names = sorted(moment_names(ctx.spec))
        if not ctx.is_first:
            flat = torch.empty(n * (1 + len(names)))
        dist.broadcast(flat, src=workers[0], group=group)
        parts = flat.split(n)
        return TrainState(parts[0], {k: parts[1 + i] for i, k in enumerate(names)}, step, version)

    def close(self) -> None:
        self.close_client()

    # ------------------------------------------------------------------ training
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The first micro-batch of a step pulls fresh parameters; evaluation uses those ``refresh_for_eval`` got."""
        ctx = self.ctx
        if ctx.module.training and self.token is None:
            t0 = time.perf_counter()
            self._pull()
            ctx.clock.add_blocked(time.perf_counter() - t0)  # waiting for the servers is not this worker's slowness
        return ctx.module(*args, **kwargs)

    def backward(self, loss: torch.Tensor) -> None:
        (loss / self.ctx.gas).backward()

    def step(self) -> bool:
        self.micro += 1
        boundary = self.micro == self.ctx.gas
        if boundary:
            self._push()
        return boundary

    def is_boundary(self) -> bool:
        return self.micro + 1 == self.ctx.gas

    def fetch_rows(self, ids: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The servers' current rows."""
        ctx = self.ctx
        t0 = time.perf_counter()
        if ctx.row_cache is not None and ctx.module.training and self.token is not None:
            # a cached row is served while at most `threshold` versions older than this step's dense token
            rows, _ = ctx.row_cache.fetch(self.client, ids, need=self.token, max_age=ctx.gba.staleness.threshold,
                                          min_version=None)
        else:
            rows = self.client.pull(dict(ids), dense=False, min_version=None).rows
        ctx.clock.add_blocked(time.perf_counter() - t0)
        return rows

    def prefetch_rows(self, ids: Mapping[str, torch.Tensor]) -> None:
        """Pull the servers' current rows of the next lookup ahead (the staleness rule applies when it reads them)."""
        if self.ctx.row_cache is not None and self.client is not None:
            self.ctx.row_cache.prefetch(self.client, ids, min_version=None)

    def table_rows(self, table: str, ids: torch.Tensor) -> torch.Tensor:
        if self.client is None:
            raise RuntimeError("no parameter-server client is open: call table_rows during training, before close()")
        return self.client.pull({table: ids}, dense=False, min_version=None).rows[table]

    def refresh_for_eval(self) -> None:
        if self.client is not None and self.token is None:
            got = self.client.pull(dense=True)
            with torch.no_grad():
                vector_to_parameters(got.dense, self.ctx.module.parameters())

    def _pull(self) -> None:
        ctx = self.ctx
        lead = ctx.gba.max_lead
        min_version = None if lead is None else max(0, self.start_version + self.pushes - lead)
        got = self.client.pull(dense=True, min_version=min_version)
        with torch.no_grad():
            vector_to_parameters(got.dense, ctx.module.parameters())
        self.token = got.token
        ctx.version = min(got.token)

    def _push(self) -> None:
        ctx = self.ctx
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in ctx.module.parameters()]
        ids, rows = ctx.take_row_grads()
        flat = parameters_to_vector(grads)
        with ctx.clock.blocked():  # talking to the servers is not this worker's slowness
            self.client.push(flat, ids, rows, self.token, num_samples=ctx.local_samples)
        for p in ctx.module.parameters():
            p.grad = None
        self.token, self.micro = None, 0
        self.pushes += 1

    # ------------------------------------------------------------------ end of the phase's data
    def data_ran_out(self, vote: bool) -> Union[Leave, Finished, None]:
        """This worker found no batch left: tell the servers; with ``vote`` (auto mode) also claim the phase end.

        Returns the phase's end when ``vote`` (a ``Leave`` set before the data ran out wins), else None.
        """
        store = self.ctx.rt.store
        store.set(exhausted_key(self.number), FLAG)
        if not vote:
            return None
        return PhaseEnd.decode(store.compare_set(end_key(self.number), "", Finished().encode()))

    def wait_for_peers_out(self) -> None:
        """Say this worker pushes nothing more; wait until every live worker said so (a dead one is dropped)."""
        ctx = self.ctx
        store = ctx.rt.store
        store.set(out_key(self.number, ctx.rt.rank), FLAG)
        waiting = set(ctx.workers)
        while waiting:  # a dead worker is dropped by its missing heartbeat, so this cannot hang
            waiting = {w for w in waiting - ctx.worker_live.poll() if not store.check([out_key(self.number, w)])}
            if waiting:
                time.sleep(POLL_S)
