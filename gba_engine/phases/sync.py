"""The sync phase: DeepSpeed's all-reduce over the workers; the server tables' rows on the servers or the workers.

Rows on the servers: each global batch, every worker pushes its rows' gradients (tables only, no
dense part) and the servers apply all N at once, so the rows follow the same global batch as the
dense model. Rows on the workers (mode auto, ``gba.sync_tables: "workers"``; ``worker_tables.py``):
each worker reads its own copy and the rows' gradients are all-gathered over the workers and applied
as the servers would; the servers are idle until the next switch.

Example::

    phase = SyncPhase(ctx)
    phase.open()                          # the servers start a tables-only phase (when there are tables)
    loss = loss_fn(phase.forward(x), y); phase.backward(loss); phase.step()
"""
from __future__ import annotations

import time
from typing import Any, Mapping

import torch
import torch.distributed as dist

from ..protocol import Serve
from ..ps import PSClient
from ..switch import TrainState, state_into_deepspeed
from ..sync_faults import explain_collective_failure
from .base import Phase


class SyncPhase(Phase):
    """DeepSpeed trains; the servers serve the rows of server tables, one update per global batch."""

    name = "sync"

    def __init__(self, ctx) -> None:
        super().__init__(ctx)
        self.token = None  # the rows' token of this step (taken by the first lookup)

    def open(self) -> None:
        """With server tables: the servers serve the rows (no dense part), one update per global batch."""
        ctx = self.ctx
        if not ctx.tables or ctx.tables_here:  # rows on the workers: nothing for the servers to serve
            return
        if ctx.is_first:
            ctx.commands.send(Serve(m=ctx.num_workers, dense=False))  # acknowledged when the phase ends
        self.client = PSClient(ctx.rt, ctx.dense_numel, ctx.tables, tables_only=True)

    def close(self) -> None:
        self.close_client()  # the servers' phase ends once every worker said goodbye

    def adopt(self, state: TrainState) -> None:
        """Continue from ``state`` (the servers' hand-back, equal on every worker): DeepSpeed, clocks, claims; opens."""
        ctx = self.ctx
        state_into_deepspeed(ctx.ds_engine, state, ctx.spec)
        position_scheduler(ctx.ds_engine, state.version)
        for p in ctx.module.parameters():
            p.grad = None
        if ctx.claims is not None:  # the sync phase starts after every number anybody took in gba
            free = torch.tensor([ctx.claims.next_free], dtype=torch.int64)
            dist.all_reduce(free, op=dist.ReduceOp.MAX, group=ctx.rt.worker_group)
            ctx.claims.enter_sync(int(free))
        ctx.version, ctx.truth = state.version, "workers"
        self.open()

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.ctx.ds_engine(*args, **kwargs)

    def backward(self, loss: torch.Tensor) -> None:
        self.ctx.ds_engine.backward(loss)

    def step(self) -> bool:
        ctx = self.ctx
        boundary = ctx.ds_engine.is_gradient_accumulation_boundary()
        ctx.ds_engine.step()
        if boundary:
            self._push_rows()
            ctx.version += 1
        return boundary

    def is_boundary(self) -> bool:
        return self.ctx.ds_engine.is_gradient_accumulation_boundary()

    def fetch_rows(self, ids: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Waits for the update of this worker's previous global batch, so every worker reads what sync would."""
        ctx = self.ctx
        if ctx.tables_here:  # this worker's copy holds every update of the previous global batches
            return ctx.worker_tables.rows(ids)
        if self.client is None:
            raise RuntimeError("server tables need the parameter servers' client: none is open (after close()?)")
        t0 = time.perf_counter()
        if ctx.row_cache is not None and ctx.module.training:
            need = (ctx.version,) * ctx.rt.layout.num_servers
            # sync: only rows read at this very version are served; the rest are validated at it (exact)
            rows, token = ctx.row_cache.fetch(self.client, ids, need=need, max_age=0, min_version=ctx.version)
            token = token or need  # every row was current: the servers are at this version (they wait for our push)
        else:
            got = self.client.pull(dict(ids), dense=False, min_version=ctx.version)
            rows, token = got.rows, got.token
        ctx.clock.add_blocked(time.perf_counter() - t0)  # waiting on peers is not this worker's slowness
        if self.token is None and ctx.module.training:
            self.token = token
        return rows

    def prefetch_rows(self, ids: Mapping[str, torch.Tensor]) -> None:
        """Pull ahead what the next lookup reads: after this step's update when called before its boundary push."""
        ctx = self.ctx
        if ctx.row_cache is None or self.client is None or ctx.tables_here:
            return
        ahead = self.token is not None and self.is_boundary()  # the push of this global batch is still to come
        ctx.row_cache.prefetch(self.client, ids, min_version=ctx.version + (1 if ahead else 0))

    def table_rows(self, table: str, ids: torch.Tensor) -> torch.Tensor:
        if self.ctx.tables_here:
            return self.ctx.worker_tables.rows({table: ids.reshape(-1)})[table].view(*ids.shape, -1)
        if self.client is None:
            raise RuntimeError("no parameter-server client is open: call table_rows during training, before close()")
        # after this worker's last global batch
        return self.client.pull({table: ids}, dense=False, min_version=self.ctx.version).rows[table]

    def _push_rows(self) -> None:
        """This worker's row gradients of the global batch (the servers apply all N at once)."""
        ctx = self.ctx
        if not ctx.tables:
            return
        if ctx.tables_here:
            self._step_worker_tables()
            return
        if self.token is None:  # no lookup this step: the servers still count this worker's share of the batch
            self.token = self.client.pull({}, dense=False, min_version=ctx.version).token
        ids, rows = ctx.take_row_grads()
        with ctx.clock.blocked():  # the servers apply the batch once every worker pushed
            self.client.push(None, ids, rows, self.token, num_samples=ctx.local_samples)
        self.token = None

    def _step_worker_tables(self) -> None:
        """The global batch's update of the workers' tables: row gradients all-gathered, applied as the servers would."""
        ctx = self.ctx
        ids, rows = ctx.take_row_grads()
        try:
            with ctx.clock.blocked():  # the exchange waits on the peers; the update itself is short
                ctx.worker_tables.step(ids, rows, ctx.version, ctx.local_samples, ctx.rt.worker_group)
        except RuntimeError as exc:  # gloo's errors; a lost peer is named
            explain_collective_failure(ctx.rt, ctx.worker_live, "all_gather of the tables' row gradients", exc)
            raise


def position_scheduler(ds_engine, version: int) -> None:
    """Set DeepSpeed's scheduler and step/sample clocks to update ``version`` (binds ``ds_engine``'s clocks).

    DeepSpeed's next optimizer step is update ``version``: its scheduler must sit at iteration
    ``version - 1``, and its step/sample clocks (checkpoint tags, the monitor's x-axis) must
    count the servers' updates too.

    Example::

        position_scheduler(ds_engine, 40)      # ds_engine.global_steps == 40
    """
    sched = ds_engine.lr_scheduler
    if sched is not None and version > 0:
        sched.step(version - 1)
    ds_engine.global_steps = version
    ds_engine.global_samples = version * ds_engine.train_batch_size()
