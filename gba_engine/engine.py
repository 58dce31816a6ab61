"""``GBAEngine``: DeepSpeedEngine's training surface over the phases of a GBA job (build it with ``initialize``).

The engine is a facade. What a step does lives in the current phase (``phases/sync.py``:
DeepSpeed's all-reduce; ``phases/gba.py``: through the parameter servers under token control),
when to move between them in the mode's switch policy (``phases/auto.py``), what goes over the
control plane in ``protocol.py``, and what the servers run in ``server_loop.py``. The engine
keeps the public surface, the two hand-overs (``switch_to_gba`` / ``switch_to_sync``) and the
checkpoints, which must know where the truth lives.

Example::

    engine = gba_engine.initialize(model=net, config="ds_configs/gba_cpu.json")
    out = engine(x); engine.backward(loss_fn(out, y)); engine.step()
    engine.mode, engine.version, engine.summary()
"""
from __future__ import annotations

import atexit
import logging
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping, Sequence

import torch
import torch.distributed as dist

from .checkpoint import find_checkpoint, load_client_state, load_worker_state, save_meta, save_worker_state
from .claims import BatchClaims
from .commands import ServerCommands
from .config import GBAConfig
from .gather import gather_live
from .phases import GBAPhase, Phase, SwitchPolicy, SyncPhase, WorkerContext, position_scheduler, start
from .protocol import (FLAG, Leave, LoadShards, SaveShards, decode_float, decode_stats, done_key, encode_float,
                       rate_key, stats_key)
from .ps import OptimizerSpec, PSClient, PSRuntime
from .ps.schedule import ServerLRSchedule
from .ps.sharding import ServerTableSpec
from .row_cache import ServerRowCache
from .step_clock import PeerWaits
from .switch import state_from_deepspeed, state_into_deepspeed
from .sync_faults import ServerWatch, explain_collective_failure
from .worker_tables import WorkerTables, tables_from_servers, tables_to_servers

if TYPE_CHECKING:
    from picasso_ops.config import CacheConfig

logger = logging.getLogger(__name__)
CACHE_EVENT_EVERY = 50  # optimizer steps between row-cache points on the monitor


class GBAEngine:
    """DeepSpeedEngine's training surface over sync / gba / auto modes (build it with :func:`initialize`).

    The work is done by the current phase (``phases/sync.py``, ``phases/gba.py``), moved by the
    mode's switch policy (``phases/auto.py``); the engine keeps the surface and the hand-overs.

    Example::

        out = engine(x); engine.backward(loss_fn(out, y)); engine.step()
        engine.mode, engine.version, engine.summary()
    """

    def __init__(self, rt: PSRuntime, gba: GBAConfig, spec: OptimizerSpec, ds_engine, module: torch.nn.Module,
                 micro: int, gas: int, server_stats: dict | None = None,
                 tables: list[ServerTableSpec] | None = None, joined_phase: int | None = None,
                 row_cache: "CacheConfig | None" = None, on_close: Sequence[Callable[[], None]] = (),
                 table_schedule: ServerLRSchedule | None = None) -> None:
        self.rt, self.gba, self.spec, self.ds_engine, self.module = rt, gba, spec, ds_engine, module
        self._on_close = tuple(on_close)  # the job's guards on this rank (collective_guard.py), ended by close()
        self.tables = list(tables or [])
        self.micro_batch, self.gas = micro, gas
        self.server_stats = server_stats
        self.is_server = rt.is_server
        self.workers = rt.layout.workers
        self.num_workers = len(self.workers)
        self.monitor = ds_engine.monitor if ds_engine is not None else None
        self.rejoined = joined_phase is not None  # a restarted process (rejoin): gba only, no DeepSpeed engine
        self._closed = self.is_server
        if self.is_server:  # served the whole job already: no phase, nothing to train
            self.ctx: WorkerContext | None = None
            self.phase: Phase | None = None
            self.policy: SwitchPolicy | None = None
            return
        cache = (ServerRowCache(self.tables, row_cache, rt.layout.num_servers)
                 if row_cache is not None and self.tables else None)
        self.ctx = WorkerContext(rt=rt, gba=gba, spec=spec, ds_engine=ds_engine, module=module, tables=self.tables,
                                 micro_batch=micro, gas=gas, row_cache=cache)
        if gba.mode == "auto" and gba.sync_tables == "workers" and self.tables and ds_engine is not None \
                and joined_phase is None:  # sync phases keep the rows on the workers (worker_tables.py)
            self.ctx.worker_tables = WorkerTables(self.tables, spec, rt.layout.num_servers, table_schedule)
            self.ctx.tables_here = True
        self.phase, self.policy = start(self.ctx)
        # DeepSpeed's collectives are waits on peers, not this worker's time (step_clock.py)
        self._peer_waits = (PeerWaits.attach(self.ctx.clock, on_error=self._collective_failed)
                            if ds_engine is not None else None)
        # a lost server is noticed in sync phases too (sync_faults.py): auto mode's fallback, the tables' rows
        self._server_watch = ServerWatch(rt, self.ctx.server_live, needs_servers=gba.mode == "auto" or bool(self.tables))
        self.ctx.observer.mode = self.phase.name  # the observer counts steps per phase from the first one
        if joined_phase is not None:
            self.phase = GBAPhase(self.ctx, kept=True)
            self.ctx.observer.mode = "gba"
            self.ctx.commands = ServerCommands.continuing(rt)  # a restarted first worker continues the sequence
            self.phase.join(joined_phase)
            self.policy.on_entered("gba")
        atexit.register(self.close)
        if isinstance(self.phase, SyncPhase):
            self.phase.open()

    # ------------------------------------------------------------------ state the job reads
    @property
    def mode(self) -> str:
        """The current phase: ``"sync"`` or ``"gba"`` (a server rank reports its config's starting one)."""
        if self.phase is None:
            return "gba" if self.gba.mode == "gba" else "sync"
        return self.phase.name

    @property
    def gathers_over_control_plane(self) -> bool:
        """Whether end-of-job gathers must use :meth:`gather_live`: in a gba phase a worker may die or rejoin."""
        return self.mode == "gba"

    @property
    def version(self) -> int:
        """Global updates applied to the model."""
        return 0 if self.ctx is None else self.ctx.version

    @property
    def global_steps(self) -> int:
        """Local optimizer steps of this worker."""
        return 0 if self.ctx is None else self.ctx.global_steps

    @property
    def job_step(self) -> int:
        """The job step this worker last trained (from 0): the step of every switch message and summary line.

        With :meth:`claim_batches` its batch number // workers, else its optimizer steps - 1 (docs/gba.md).
        """
        return 0 if self.ctx is None else self.ctx.job_step

    @property
    def global_samples(self) -> int:
        """Samples of the global batches applied so far (DeepSpeed's ``global_samples``)."""
        return self.version * self.micro_batch * self.gas * self.num_workers

    @property
    def truth(self) -> str:
        """Where the current parameters live: ``"workers"`` (DeepSpeed) or ``"servers"``."""
        return "servers" if self.ctx is None else self.ctx.truth

    @property
    def observer(self):
        """This worker's :class:`~gba_engine.observe.Observer`."""
        return None if self.ctx is None else self.ctx.observer

    @property
    def client(self) -> PSClient | None:
        """The parameter servers' client of the current phase (None when none is open)."""
        return None if self.phase is None else self.phase.client

    @property
    def worker_group(self) -> dist.ProcessGroup | None:
        """The workers' process group (DeepSpeed's data-parallel group); None on server ranks.

        Example::

            dist.all_reduce(t, group=engine.worker_group)     # a collective the servers take no part in
        """
        return self.rt.worker_group

    # ------------------------------------------------------------------ DeepSpeedEngine surface
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward(*args, **kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The module's forward; in gba mode the first micro-batch of a step pulls fresh parameters first."""
        self._worker_only("forward")
        self._open_gba()
        return self.phase.forward(*args, **kwargs)

    def backward(self, loss: torch.Tensor) -> None:
        """Local backward (gba) or DeepSpeed's backward with its all-reduce (sync)."""
        self._worker_only("backward")
        self.phase.backward(loss)

    def step(self) -> None:
        """Optimizer step at the accumulation boundary: DeepSpeed's (sync) or a push to the servers (gba)."""
        self._worker_only("step")
        if self.phase.step():
            self._after_update()
            self.ctx.clock.restart()  # the next step starts after the policy's exchange and any hand-over

    def train(self, mode: bool = True) -> "GBAEngine":
        """Training mode of the module (like DeepSpeedEngine.train)."""
        self.module.train(mode)
        return self

    def eval(self) -> "GBAEngine":
        """Evaluation mode; in gba mode the module first gets the servers' latest parameters."""
        self.module.eval()
        if self.phase is not None:
            self.phase.refresh_for_eval()
        return self

    def is_gradient_accumulation_boundary(self) -> bool:
        """Whether the next :meth:`step` ends an accumulation window (DeepSpeedEngine's contract)."""
        return self.phase.is_boundary()

    def _after_update(self) -> None:
        ctx = self.ctx
        local = ctx.clock.lap()  # the whole step minus waits on peers and servers (step_clock.py)
        if isinstance(self.phase, SyncPhase):
            self._server_watch.check()  # a gba phase's own waits on the servers have their deadlines
        ctx.global_steps += 1
        ctx.observer.on_step(ctx.local_samples, local, ctx.version)
        if ctx.row_cache is not None and ctx.global_steps % CACHE_EVENT_EVERY == 0:
            st = ctx.row_cache.stats
            ctx.observer.write_cache(st.hits / max(st.lookups, 1), st.refreshes, self.ps_bytes()["pulled"])
        ctx.rt.store.set(rate_key(ctx.rt.rank), encode_float(ctx.observer.samples_per_s))
        self.policy.after_update(self, local)

    # ------------------------------------------------------------------ batches
    def claim_batches(self, total: int, start: int = 0) -> Iterator[int]:
        """Job-wide batch numbers for this worker until ``total`` are taken (use it in gba and auto modes).

        Sync: worker w of N takes ``start + k*N + w`` (lockstep). gba: the next free number
        (fast workers take more). Each number must be trained with one full step (``gas``
        micro-batches) before asking for the next. Every worker sees the end at the same
        point of the job, so it is safe to run collectives (evaluation, checkpoints) after
        the loop; in gba mode the loop ends only once every live worker has pushed its last
        gradient, so parameters pulled afterwards are the final ones. Resume with
        ``start=`` :attr:`batches_taken` of the checkpoint.

        Example::

            for index in engine.claim_batches(total=steps * engine.num_workers):
                x, y = dataset[index]
                engine.backward(loss_fn(engine(x), y)); engine.step()
        """
        self._worker_only("claim_batches")
        if not 0 <= start <= total:
            raise ValueError(f"start={start} must be in [0, total={total}]")
        claims = self.ctx.claims = BatchClaims(self.rt.store, self.num_workers, self.workers.index(self.rt.rank), total)
        if self.rejoined:
            claims.join_gba(self.phase.number)
        elif isinstance(self.phase, GBAPhase):
            self._open_gba()  # numbers a gba phase on every worker, so enter it before the first claim
            claims.enter_gba(self.phase.number, start)
        else:
            claims.enter_sync(start)
        while (index := self._next_claim()) is not None:
            yield index

    @property
    def batches_taken(self) -> int:
        """Batches handed out job-wide by :meth:`claim_batches` so far (0 before it starts)."""
        return 0 if self.ctx is None or self.ctx.claims is None else self.ctx.claims.taken

    def _next_claim(self) -> int | None:
        index = self.ctx.claims.next()
        if index is not None:
            self.ctx.last_batch = index
        if index is not None or self.ctx.claims.mode == "sync":
            return index
        # gba phase out of batches: nobody may wait for pushes of a worker that stopped
        end = self.phase.data_ran_out(vote=self.policy.votes_on_phase_end)
        if isinstance(end, Leave):  # the first worker asked for sync before the data ran out: join it
            self.switch_to_sync(reason=end.reason)
            return self._next_claim()
        self.phase.wait_for_peers_out()
        return None

    def gather_live(self, name: str, obj: Any, timeout_s: float | None = None) -> dict[int, Any]:
        """``obj`` of every live worker, by worker rank, over the control plane: no collective, so a
        dead worker is left out and a restarted one (:func:`rejoin`) takes part.

        Every live worker calls it with the same ``name`` (a new name per gather). It waits
        while a missing worker's heartbeat moves, at most ``timeout_s`` (default: the gba
        block's), then raises TimeoutError naming the workers that never answered. ``obj``
        travels pickled through the store: keep it to a few MB.

        Example::

            parts = engine.gather_live("eval/scores", scores)        # {0: tensor, 1: tensor}
            scores = torch.cat([parts[w] for w in sorted(parts)])
        """
        self._worker_only("gather_live")
        return gather_live(self.rt, self.workers, self.ctx.worker_live, name, obj, timeout_s)

    # ------------------------------------------------------------------ tables on the servers (every mode)
    def fetch_rows(self, ids: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Rows of unique ``ids`` per server table (what a bound ``ServerEmbeddingBagCollection`` asks for).

        Sync: waits for the update of this worker's previous global batch (``min_version``),
        so every worker reads the rows sync training would. gba: the servers' current rows.
        The wait is not counted as this worker's step time (it waits on its peers).
        """
        self._worker_only("fetch_rows")
        self._open_gba()
        return self.phase.fetch_rows(ids)

    def prefetch_rows(self, ids: Mapping[str, torch.Tensor]) -> None:
        """Start pulling the rows of unique ``ids`` per table that the next training lookup reads; returns at once.

        With a row cache (``initialize(row_cache=...)`` with ``prefetch`` on) the pull overlaps
        this step's compute and its rows enter the cache, where the consistency rule still
        decides what a lookup may serve; without one it does nothing. Call it once per lookup,
        after the current step's lookup (e.g. after its forward), with the next batch's ids.

        Example::

            out = engine(x, ids, offsets); engine.prefetch_rows(next_unique_ids)
            engine.backward(loss(out)); engine.step()
        """
        self._worker_only("prefetch_rows")
        self._open_gba()
        self.phase.prefetch_rows(ids)

    @property
    def row_cache(self) -> ServerRowCache | None:
        """This worker's cache of server rows (None without ``row_cache=`` or server tables)."""
        return None if self.ctx is None else self.ctx.row_cache

    def record_rows(self, table: str, ids: torch.Tensor, rows: torch.Tensor) -> None:
        """Keep a pulled leaf; its gradient goes to the servers at the step boundary."""
        self.ctx.pulled_rows.append((table, ids, rows))

    def table_rows(self, table: str, ids: torch.Tensor) -> torch.Tensor:
        """The servers' rows of ``table`` for ``ids`` (evaluation, export, tests): ``ids.shape + (dim,)``.

        Sync: the rows after this worker's last global batch; gba: the servers' current rows.

        Example::

            engine.table_rows("user", torch.arange(10))       # [10, dim]
        """
        self._worker_only("table_rows")
        return self.phase.table_rows(table, ids)

    # ------------------------------------------------------------------ hand-overs between phases
    def _open_gba(self) -> None:
        """Mode gba enters its phase lazily (after a possible load_checkpoint): at the first forward, claim or lookup."""
        if isinstance(self.phase, GBAPhase) and not self.phase.is_open:
            self.switch_to_gba()

    def switch_to_gba(self, reason: str = "mode gba", slow: frozenset = frozenset()) -> None:
        """Hand the workers' state to the servers (collective over the workers) and continue in a gba phase."""
        t0 = time.perf_counter()
        self.phase.close()  # a sync phase's tables-only serving ends once every worker said goodbye
        if not isinstance(self.phase, GBAPhase) or self.phase.number:
            self.phase = GBAPhase(self.ctx, kept=self.policy.keeps_gba)
        nbytes = self.phase.enter()
        self.policy.on_entered("gba", slow)
        self._record_switch(self.ctx.observer.mode, t0, nbytes, reason)
        self.ctx.clock.restart()  # a hand-over is no step's time

    def switch_to_sync(self, reason: str) -> None:
        """Take the servers' state back into DeepSpeed (collective over the workers) and continue in sync."""
        t0 = time.perf_counter()
        state = self.phase.hand_back()
        nbytes = state.nbytes
        if self.ctx.worker_tables is not None:  # the rows, with their optimizer state, back to the workers
            nbytes += tables_from_servers(self.ctx)
        self.phase = SyncPhase(self.ctx)
        self.phase.adopt(state)
        self.policy.on_entered("sync")
        self._record_switch("gba", t0, nbytes, reason)
        self.ctx.clock.restart()

    def _record_switch(self, src: str, t0: float, nbytes: int, reason: str) -> None:
        dst, observer = self.phase.name, self.ctx.observer
        if src != dst:
            observer.on_switch(self.ctx.job_step, src, dst, time.perf_counter() - t0, nbytes, reason)
        else:
            observer.mode = dst

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, save_dir: str | os.PathLike, tag: str | None = None,
                        client_state: dict | None = None) -> str:
        """Save where the truth lives: the workers' full state (sync) or the server shards (gba); returns the folder.

        Server tables are saved by the servers in every mode (rows, their optimizer state, the
        version). In sync mode every worker must call it (ZeRO state is gathered over the
        workers); in gba mode only the first worker waits for the servers, the others return at once.
        """
        self._worker_only("save_checkpoint")
        ctx = self.ctx
        tag = tag or f"global_step{ctx.global_steps}"
        folder = Path(save_dir) / tag
        if ctx.truth == "workers":
            # not DeepSpeed's save_checkpoint: it ends in a barrier over all ranks, which the servers never enter
            st = state_from_deepspeed(self.ds_engine, self.spec, ctx.version)  # collective over the workers
            if ctx.is_first:
                save_worker_state(st, folder)
        if ctx.tables_here:  # rows on the workers: the servers save the copy the first worker hands them now
            if ctx.is_first:
                tables_to_servers(ctx, keep=True)
                ctx.commands.wait_acks(ctx.commands.send(SaveShards(path=str(folder))))
        elif ctx.is_first and (ctx.truth == "servers" or self.tables):
            # sync: the servers save once the rows hold the last global batch (every worker has pushed it)
            ctx.commands.save_during_phase(str(folder), min_version=ctx.version if isinstance(self.phase, SyncPhase) else 0)
        if ctx.is_first:
            save_meta(save_dir, tag, truth=ctx.truth, mode=self.mode, version=ctx.version,
                      num_servers=self.rt.layout.num_servers, tables=[t.name for t in self.tables],
                      client_state=client_state)
        return str(folder)

    def load_checkpoint(self, load_dir: str | os.PathLike, tag: str | None = None) -> tuple[str | None, dict]:
        """Restore a checkpoint written by :meth:`save_checkpoint`; call it before training or in sync mode."""
        self._worker_only("load_checkpoint")
        if self.rejoined:
            raise RuntimeError("a rejoined worker trains on the running job's state; it cannot load a checkpoint")
        if isinstance(self.phase, GBAPhase) and self.phase.is_open:
            raise RuntimeError("load_checkpoint must be called before training starts or in sync mode, not in gba")
        folder, meta = find_checkpoint(load_dir, tag)
        if folder is None:
            return None, {}
        if bool(meta.get("tables")) != bool(self.tables):
            raise ValueError(f"{folder}: checkpoint {'has' if meta.get('tables') else 'has no'} server tables, this "
                             f"model {'has' if self.tables else 'has none'}")
        ctx = self.ctx
        self.phase.close()  # the servers read commands only between phases
        if ctx.row_cache is not None:
            ctx.row_cache.clear()  # the restored rows and versions replace what the cache read
        if meta["truth"] == "workers":
            st = load_worker_state(folder)
            state_into_deepspeed(self.ds_engine, st, self.spec)
            position_scheduler(self.ds_engine, st.version)
            ctx.version, ctx.truth = st.version, "workers"
            if self.tables:
                self._load_on_servers(folder)
                if ctx.worker_tables is not None and isinstance(self.phase, SyncPhase):
                    tables_from_servers(ctx)  # the restored rows to the workers, who hold them in sync phases
                if isinstance(self.phase, SyncPhase):
                    self.phase.open()
            return str(folder), load_client_state(folder)
        self._load_on_servers(folder)
        ctx.tables_here = False  # the restored rows are on the servers (switch_to_sync brings them to the workers)
        ctx.version, ctx.truth = int(meta["version"]), "servers"
        if isinstance(self.phase, SyncPhase):  # bring the restored state into DeepSpeed
            self.switch_to_gba("restore")
            self.switch_to_sync("restore")
        return str(folder), load_client_state(folder)

    def _load_on_servers(self, folder: Path) -> None:
        if self.ctx.is_first:
            self.ctx.commands.wait_acks(self.ctx.commands.send(LoadShards(path=str(folder))))
        dist.barrier(group=self.rt.worker_group)  # nobody pulls before the servers hold the restored state

    # ------------------------------------------------------------------ end of job
    def summary(self) -> dict:
        """Mode, switches and their cost, staleness histogram, decayed/dropped, per-worker samples/s."""
        if self.ctx is None:
            raise RuntimeError(f"summary() on parameter-server rank {self.rt.rank}: its stats are engine.server_stats")
        store = self.rt.store
        servers = [decode_stats(store.get(stats_key(s))) for s in range(self.rt.layout.num_servers)
                   if store.check([stats_key(s)])]
        rates = {w: decode_float(store.get(rate_key(w))) for w in self.workers if store.check([rate_key(w)])}
        out = self.ctx.observer.summary(servers, rates)
        out["ps_bytes"] = self.ps_bytes()
        if self.ctx.row_cache is not None:
            out["row_cache"] = self.ctx.row_cache.stats.as_dict()
        return out

    def ps_bytes(self) -> dict[str, int]:
        """Bytes this worker sent to (``pushed``: requests and gradients) and got from (``pulled``) the servers."""
        sent, received = self.ctx.ps_bytes["sent"], self.ctx.ps_bytes["received"]
        client = self.client
        if client is not None:
            sent, received = sent + client.bytes_sent, received + client.bytes_received
        return {"pushed": sent, "pulled": received}

    def close(self) -> None:
        """Leave the job: goodbye to the servers; the servers stop once every worker closed (or died)."""
        if self._closed:
            return
        self._closed = True
        try:
            self.phase.close()
            self.rt.store.set(done_key(self.rt.rank), FLAG)
        except Exception as exc:  # the servers may already be gone after a failure: nothing left to tell
            logger.info("rank %d: close could not reach the servers: %s", self.rt.rank, exc)
        finally:
            if self._peer_waits is not None:
                self._peer_waits.detach()
            for end in self._on_close:
                end()
        self.rt.close()

    def _collective_failed(self, what: str, exc: BaseException) -> None:
        """A collective of this sync phase raised: name the lost worker or server if the control plane knows it.

        Only in a sync phase: in a gba phase a lost worker is dropped and the job goes on, so a failed
        collective there is the caller's own (its error is raised as it is).
        """
        if self.ctx is not None and not self._closed and isinstance(self.phase, SyncPhase):
            explain_collective_failure(self.rt, self.ctx.worker_live, f"collective {what}", exc)

    def _worker_only(self, what: str) -> None:
        if self.is_server:
            raise RuntimeError(f"{what}() on parameter-server rank {self.rt.rank}: servers have already served the "
                               "job inside initialize(); skip the training loop when engine.is_server")
        if self._closed:
            raise RuntimeError(f"{what}() after close()")
