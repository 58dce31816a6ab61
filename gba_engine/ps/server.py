"""The parameter server: one shard of the dense vector and of every table, GBA token control, the optimizer.

Server ``s`` of ``S`` owns the dense range ``DenseSharding(numel, S).bounds[s]`` and the
rows ``id % S == s`` of every table. It runs a single-threaded event loop:

1. pop the next doorbell from its TCPStore inbox (a deadline of ``heartbeat_s``; an idle
   tick checks heartbeats and stalls);
2. receive that worker's announced message over gloo (header, then payloads);
3. ``PULL``: reply with the dense shard and/or the asked rows and the current version
   (the token), or keep the request until ``version >= min_version``;
   ``PUSH``: weigh the gradient by ``decay(version - token)`` and add it to the
   global-batch buffer; after M admitted gradients apply their weighted mean once with
   the optimizer, ``version += 1``, and answer the pulls that waited for it;
   ``PUT``: overwrite dense values / rows; ``BYE``: the worker is done.

No barrier among workers: whoever pushes next is served next, so a fast worker makes
more pushes than a slow one. A worker that dies (its gloo pair closes) or stops
heartbeating is dropped; its in-flight token is simply never seen and the others fill
M. A restarted process of that worker rings a ``join`` doorbell: the server builds a pair
group with it (``PSRuntime.accept_join``) and serves it from then on like any worker.
After ``until_version`` the server answers pulls with the final parameters and a
finished flag and drains pushes until every worker has said goodbye or is gone.

Example::

    rt = init_runtime(cfg)                               # on every rank
    if rt.is_server:
        ps = ParameterServer(rt, cfg, dense_numel=n, embedding_specs=specs,
                             optimizer_spec=OptimizerSpec.of("sgd", lr=0.1), dense_init=flat0)
        stats = ps.serve(until_version=100)              # ServeStats(version=100, ...)
"""
from __future__ import annotations

import collections
import dataclasses
import enum
import logging
import math
import time
from typing import Callable, Mapping, Sequence

import torch
from torch import Tensor

from ..config import GBAConfig
from ..decay import StalenessDecay
from ..protocol import decode_float, encode_float, encode_int, norm_key, version_key
from ..tokens import GlobalBatchBuffer, TokenControl
from .optim import OptimizerSpec, RowOptimizer
from .runtime import Liveness, PSConnectionError, PSRuntime, late
from .schedule import ServerLRSchedule
from .sharding import DenseSharding, ServerTableSpec, local_index
from .wire import (FLAG_DENSE, FLAG_FINISHED, FLAG_PREFETCH, FLAG_STALLED, FLAG_VALIDATE, Header, Kind, Outgoing,
                   ProtocolError, pack_floats, pack_ints, pack_mask, recv_message, schema_id, send_message,
                   unpack_floats, unpack_ints)

logger = logging.getLogger(__name__)


class PeerState(enum.Enum):
    """What the server knows of one worker process."""

    ACTIVE = "active"
    SILENT = "silent"  # heartbeat lapsed; comes back to ACTIVE if it talks again
    BYE = "bye"
    DEAD = "dead"  # its gloo pair broke: this process can never talk again (a restarted one may join)


def serve_is_over(peers: Sequence[PeerState], finished: bool, idle_s: float, timeout_s: float) -> bool:
    """Whether a serve loop may end: no worker is active and none can come back within ``timeout_s``.

    ``idle_s``: seconds since a worker was last active. A silent worker may only be slow and a dead
    one may be replaced by a restarted process (rejoin), so either keeps the serve open for
    ``timeout_s``, also when every worker died at once. Once the phase is finished only a silent
    worker is waited for: it may still be inside the phase, and a pull of it that reached the
    next phase would fail there.

        serve_is_over([PeerState.DEAD, PeerState.DEAD], finished=False, idle_s=2.0, timeout_s=15.0)   # False
    """
    states = set(peers)
    if PeerState.ACTIVE in states:
        return False
    waiting_for = {PeerState.SILENT} if finished else {PeerState.SILENT, PeerState.DEAD}
    return not (states & waiting_for and idle_s < timeout_s)


@dataclasses.dataclass(frozen=True)
class _PendingPull:
    src: int
    seq: int
    min_version: int
    want_dense: bool
    rows: tuple[Tensor, ...]  # local row indices per table
    known: tuple[Tensor, ...] | None = None  # FLAG_VALIDATE: the row stamps the worker holds (-1: none) per table
    prefetch: bool = False  # asked ahead of need: waiting on it alone is no stall


@dataclasses.dataclass
class ShardState:
    """One server's dense shard with its optimizer state: what :meth:`ParameterServer.export_state` returns.

    Example::

        st = ps.export_state()          # ShardState(params=[n], optimizer={'exp_avg': [n], ...}, step=3, version=3)
    """

    params: Tensor
    optimizer: dict[str, Tensor]  # per-element optimizer tensors by torch's names (exp_avg, exp_avg_sq, sum, ...)
    step: int  # the dense optimizer's step count (Adam's bias-correction clock)
    version: int  # updates applied (the token clock)


@dataclasses.dataclass
class ServeStats:
    """What one :meth:`ParameterServer.serve` call did (plain data, picklable)."""

    server: int
    version: int
    updates: int
    tokens: dict  # TokenStats.as_dict(): received/counted/dropped/decayed/rejected/staleness histogram
    pushes: dict  # worker rank -> pushes received before finishing
    drained: int  # pushes received after finishing (discarded)
    lost_workers: list  # workers that died or stopped heartbeating (and did not rejoin)
    rejoined: list  # restarted workers accepted during this serve (a worker per join)
    stalls: int  # times every live worker waited for a version nobody could produce
    seconds: float


class ParameterServer:
    """One parameter-server shard; call :meth:`serve` on a server rank.

    ``grads_per_update`` is M (default: the number of workers, i.e. global batch =
    workers x local batch). ``dense_init`` is the full flat dense vector (the server keeps
    its range); ``table_init`` maps a table name to its full initial table (the server
    keeps rows ``id % S == s``); tables without one start N(0, init_std) from the spec's seed.

    Example::

        ps = ParameterServer(rt, GBAConfig(), 1000, [ServerTableSpec("user", 10_000, 16)],
                             OptimizerSpec.of("adamw", lr=1e-3), grads_per_update=4)
        ps.serve(until_version=500)
    """

    def __init__(
        self,
        runtime: PSRuntime,
        config: GBAConfig,
        dense_numel: int,
        embedding_specs: Sequence[ServerTableSpec],
        optimizer_spec: OptimizerSpec,
        *,
        grads_per_update: int | None = None,
        dense_init: Tensor | None = None,
        table_init: Mapping[str, Tensor] | None = None,
        on_tick: Callable[["ParameterServer"], None] | None = None,
        lr_schedule: ServerLRSchedule | None = None,
        clip_norm: float = 0.0,
    ) -> None:
        if not runtime.is_server:
            raise ValueError(f"rank {runtime.rank} is a worker; ParameterServer runs on {runtime.layout.servers}")
        names = [s.name for s in embedding_specs]
        if len(set(names)) != len(names):
            raise ValueError(f"embedding table names must be unique, got {names}")
        unknown = set(table_init or {}) - set(names)
        if unknown:
            raise ValueError(f"table_init names {sorted(unknown)} are not among the tables {names}")
        self.rt = runtime
        self.optimizer_spec = optimizer_spec
        self._lr_schedule = lr_schedule  # DeepSpeed's scheduler as a function of the version (None: constant lr)
        self._on_tick = on_tick  # called every heartbeat_s of serve(), idle or busy (control-plane work of an owner)
        if clip_norm < 0:
            raise ValueError(f"clip_norm must be >= 0 (0: no clipping), got {clip_norm}")
        # DeepSpeed's gradient_clipping on the global-batch dense gradient (norm over every server's shard)
        self.clip_norm = float(clip_norm)
        self.clipped = 0  # updates whose dense gradient was scaled down
        self._phase_id = 0  # begin_phase calls: keys of the norm exchange never collide after a restore
        self.index = runtime.layout.server_index(runtime.rank)
        self.num_servers = runtime.layout.num_servers
        self.specs = tuple(embedding_specs)
        self.workers = runtime.layout.workers
        self.schema = schema_id(dense_numel, self.specs)
        self.dense_numel = dense_numel
        start, end = DenseSharding(dense_numel, self.num_servers).bounds[self.index]
        self.dense_range = (start, end)
        if dense_init is not None and dense_init.shape != (dense_numel,):
            raise ValueError(f"dense_init must have shape ({dense_numel},), got {tuple(dense_init.shape)}")
        shard = (dense_init[start:end] if dense_init is not None else torch.zeros(end - start)).detach()
        self._dense = torch.nn.Parameter(shard.to(torch.float32).clone())
        self._dense_opt = optimizer_spec.build_dense([self._dense]) if end > start else None
        self._tables: dict[str, RowOptimizer] = {}
        for spec in self.specs:  # a table with its own optimizer (a picasso block's) uses it instead of the job's
            self._tables[spec.name] = (spec.optimizer or optimizer_spec).build_rows(
                self._initial_rows(spec, (table_init or {}).get(spec.name)))
        # the row clock: bumped by every update or overwrite of rows; a row's stamp is the clock when it last
        # changed, so a worker's cached row read at clock c is current while its stamp stays <= c (row_cache.py)
        self._row_clock = 0
        self._row_stamps = {name: torch.zeros(t.weight.shape[0], dtype=torch.int64) for name, t in self._tables.items()}
        m = len(self.workers) if grads_per_update is None else grads_per_update
        self.control = TokenControl(m, StalenessDecay.from_config(config.staleness))
        self._buffer = GlobalBatchBuffer(end - start, {s.name: s.dim for s in self.specs})
        self._peers = {w: PeerState.ACTIVE for w in self.workers}
        self._silent_since: dict[int, float] = {}
        self._next_seq = {w: 0 for w in self.workers}
        self._outgoing: dict[int, list[Outgoing]] = {w: [] for w in self.workers}
        self._deferred: list[_PendingPull] = []
        self._rejoined: list[int] = []
        self._pushes: collections.Counter = collections.Counter()
        self._drained = 0
        self._stalls = 0
        self._finished = False
        self.data_ended = False  # after end_of_data(): pulls no longer wait for a min_version
        self._dense_active = True  # False in a tables-only phase (sync mode: DeepSpeed owns the dense part)
        logger.info("PS %d (rank %d): dense [%d, %d), tables %s, M=%d", self.index, runtime.rank, start, end,
                    {s.name: s.local_rows(self.index, self.num_servers) for s in self.specs}, m)

    def _initial_rows(self, spec: ServerTableSpec, full: Tensor | None) -> Tensor:
        if full is not None:
            if full.shape != (spec.num_rows, spec.dim):
                raise ValueError(f"table_init[{spec.name!r}] must be [{spec.num_rows}, {spec.dim}], got {tuple(full.shape)}")
            return full[self.index::self.num_servers]
        return spec.initial_shard(self.index, self.num_servers)

    @property
    def lost_workers(self) -> list[int]:
        """Workers presumed lost now: dead (their link broke) or silent (heartbeat stopped), and not rejoined."""
        return sorted(w for w, p in self._peers.items() if p in (PeerState.DEAD, PeerState.SILENT))

    @property
    def rejoined(self) -> list[int]:
        """Restarted workers accepted in the current serve, in order (a worker once per join)."""
        return list(self._rejoined)

    @property
    def version(self) -> int:
        """Updates applied by this shard."""
        return self.control.version

    def dense_shard(self) -> Tensor:
        """A copy of this server's dense range."""
        return self._dense.detach().clone()

    def table_shard(self, name: str) -> Tensor:
        """A copy of this server's rows of table ``name`` (local row i is id ``i * S + s``)."""
        return self._tables[name].weight.clone()

    def export_state(self) -> ShardState:
        """A copy of the dense shard, its per-element optimizer state, the optimizer step and the version.

        Example::

            st = ps.export_state(); st.version, st.optimizer.keys()      # 3, dict_keys(['exp_avg', 'exp_avg_sq'])
        """
        dense = self._dense
        state = self._dense_opt.state.get(dense, {}) if self._dense_opt is not None else {}
        per_element = {k: v.detach().reshape(-1).clone() for k, v in state.items()
                       if isinstance(v, Tensor) and v.numel() == dense.numel() and k != "step"}
        step = state.get("step", 0)
        return ShardState(dense.detach().clone(), per_element, int(step.item() if isinstance(step, Tensor) else step),
                          self.version)

    def import_state(self, state: ShardState) -> None:
        """Install a dense shard with optimizer state and version (before :meth:`serve` or between updates).

        Raises ValueError for a shard of the wrong size and RuntimeError while gradients of
        an unfinished global batch are buffered (they were computed against the old state).

        Example::

            ps.import_state(ShardState(params, {"exp_avg": m, "exp_avg_sq": v}, step=6, version=6))
        """
        dense = self._dense
        if state.params.numel() != dense.numel():
            raise ValueError(f"PS {self.index}: shard of {state.params.numel()} elements for a range of {dense.numel()}")
        bad = {k: v.numel() for k, v in state.optimizer.items() if v.numel() != dense.numel()}
        if bad:
            raise ValueError(f"PS {self.index}: optimizer tensors {bad} do not match the range of {dense.numel()}")
        if self.control.pending:
            raise RuntimeError(f"PS {self.index}: import_state with {self.control.pending} gradients of an unfinished "
                               "global batch buffered")
        with torch.no_grad():
            dense.copy_(state.params.reshape(-1))
        if self._dense_opt is not None:
            if state.optimizer or state.step:
                opt_state: dict = {k: v.detach().reshape(-1).clone().to(torch.float32) for k, v in state.optimizer.items()}
                if self.optimizer_spec.type != "sgd":  # torch's SGD keeps no step; Adam/Adagrad a float32 scalar
                    opt_state["step"] = torch.tensor(float(state.step))
                self._dense_opt.state[dense] = opt_state
            else:
                self._dense_opt.state.pop(dense, None)
        stats = self.control.stats
        self.control = TokenControl(self.control.m, self.control.decay, version=state.version)
        self.control.stats = stats  # the token history of this server survives a restore
        self.rt.store.set(version_key(self.rt.rank), encode_int(state.version))

    def export_tables(self) -> dict[str, dict]:
        """Copies of every table shard with its row optimizer state and step count (for checkpoints).

        Example::

            ps.export_tables()["user"].keys()      # dict_keys(['weight', 'exp_avg', 'exp_avg_sq', 'steps'])
        """
        return {name: table.state_dict() for name, table in self._tables.items()}

    def table_views(self) -> dict[str, dict]:
        """Every table shard's live tensors and step count, keyed as :meth:`export_tables` (no copy: shapes, sends)."""
        return {name: {"weight": t.weight, **t._state_tensors(), "steps": t.steps} for name, t in self._tables.items()}

    def import_tables(self, tables: Mapping[str, dict]) -> None:
        """Install :meth:`export_tables` output; the table names must be exactly this server's."""
        if set(tables) != set(self._tables):
            raise ValueError(f"PS {self.index}: checkpoint has tables {sorted(tables)}, this job {sorted(self._tables)}")
        for name, state in tables.items():
            try:
                self._tables[name].load_state_dict(state)
                self._touch_rows(name, None)
            except ValueError as exc:
                raise ValueError(f"PS {self.index}, table {name!r}: {exc}") from exc

    def begin_phase(self, grads_per_update: int, dense: bool = True) -> None:
        """Prepare one more :meth:`serve` on this shard (the engine serves one per training phase).

        ``dense=False`` serves the tables only (sync mode: DeepSpeed all-reduces the dense
        parameters, the servers update the rows once per global batch of M pushes); pushes
        then carry no dense gradient. Workers that said goodbye connect again with new
        clients; dead ones stay dead. Gradients of an unfinished global batch are discarded.

        Example::

            ps.begin_phase(grads_per_update=4, dense=False); ps.serve()     # a sync phase
        """
        if self.control.pending:
            logger.warning("PS %d: discarding %d gradients of an unfinished global batch at version %d",
                           self.index, self.control.pending, self.version)
        self.control = TokenControl(grads_per_update, self.control.decay, version=self.version)
        self._dense_active = dense
        start, end = self.dense_range
        self._buffer = GlobalBatchBuffer(end - start if dense else 0, {s.name: s.dim for s in self.specs})
        for w, peer in self._peers.items():
            if peer is not PeerState.DEAD:
                self._peers[w], self._next_seq[w] = PeerState.ACTIVE, 0
        self._silent_since.clear()
        self._deferred, self._pushes, self._drained, self._stalls = [], collections.Counter(), 0, 0
        self._rejoined = []
        self._finished = self.data_ended = False
        self._phase_id += 1

    # ----------------------------------------------------------------- event loop
    def serve(self, until_version: int | None = None, max_seconds: float | None = None) -> ServeStats:
        """Serve until ``until_version`` updates are applied, then until every live worker said goodbye.

        With ``until_version=None`` it serves until no worker is left (all said goodbye, or died or
        stayed silent and no replacement joined for ``timeout_s``). Raises PSConnectionError when no live worker is left before ``until_version``
        (silent ones get ``timeout_s`` to come back), TimeoutError after ``max_seconds``.
        Every wait is bounded by ``heartbeat_s``.
        """
        t0 = time.monotonic()
        start_version = self.version
        live = Liveness(self.rt, self.workers)
        next_check = last_active = t0
        self._finish_if_done(until_version)
        while not self._should_stop(until_version, time.monotonic() - last_active):
            if max_seconds is not None and time.monotonic() - t0 > max_seconds:
                raise TimeoutError(f"PS {self.index}: serve() passed max_seconds={max_seconds} at version {self.version}")
            bell = self.rt.wait_doorbell(self.rt.heartbeat_s)
            if bell is not None and bell.join:
                self._on_join(bell.src, bell.incarnation)
            elif bell is not None:
                self._handle(bell.src, until_version)
            now = time.monotonic()
            if bell is None or now >= next_check:
                next_check = now + self.rt.heartbeat_s
                self._check_liveness(live)
                self._check_stall()
                if self._on_tick is not None:
                    self._on_tick(self)
            if any(p is PeerState.ACTIVE for p in self._peers.values()):
                last_active = now
        self._flush_outgoing()
        stats = ServeStats(
            server=self.index, version=self.version, updates=self.version - start_version, tokens=self.control.stats.as_dict(),
            pushes=dict(self._pushes), drained=self._drained,
            lost_workers=self.lost_workers,
            rejoined=list(self._rejoined),
            stalls=self._stalls, seconds=time.monotonic() - t0,
        )
        logger.info("PS %d done: %s", self.index, stats)
        return stats

    def _should_stop(self, until_version: int | None, idle_s: float) -> bool:
        if not serve_is_over(list(self._peers.values()), self._finished, idle_s, self.rt.timeout_s):
            return False
        if self._finished or until_version is None:
            return True  # an open-ended serve is over: every worker said goodbye or is lost past timeout_s
        raise PSConnectionError(
            f"PS {self.index}: no live worker at version {self.version} (until_version={until_version}); "
            f"peers: { {w: p.value for w, p in self._peers.items()} }"
        )

    def _handle(self, src: int, until_version: int | None) -> None:
        if src not in self._peers:
            raise ProtocolError(f"PS {self.index}: doorbell from rank {src}, which is not a worker")
        if self._peers[src] is PeerState.DEAD:
            logger.warning("PS %d: ignoring a doorbell from dead worker %d", self.index, src)
            return
        try:
            self._reap(src)
            header, ints, floats = recv_message(self.rt.channel(src), src)
        except RuntimeError as exc:
            if isinstance(exc, ProtocolError):
                raise
            self._mark_dead(src, exc)
            return
        if self._peers[src] is PeerState.SILENT:
            logger.info("PS %d: worker %d is back", self.index, src)
            self._silent_since.pop(src, None)
        if self._peers[src] is PeerState.BYE and header.seq == 0:
            logger.info("PS %d: worker %d is back with a new client", self.index, src)
            self._next_seq[src] = 0
        self._peers[src] = PeerState.ACTIVE
        if header.seq != self._next_seq[src]:
            raise ProtocolError(f"PS {self.index}: worker {src} sent seq {header.seq}, expected {self._next_seq[src]}")
        self._next_seq[src] += 1
        if header.schema != self.schema:
            raise ProtocolError(
                f"PS {self.index}: worker {src} has a different parameter layout (schema {header.schema:#x} vs "
                f"{self.schema:#x}): dense_numel and embedding specs must match on every rank"
            )
        if header.kind is Kind.PULL:
            self._on_pull(src, header, ints)
        elif header.kind is Kind.PUSH:
            self._on_push(src, header, ints, floats, until_version)
        elif header.kind is Kind.PUT:
            self._on_put(header, ints, floats)
        elif header.kind is Kind.BYE:
            self._peers[src] = PeerState.BYE
            waiting = [p for p in self._deferred if p.src == src]
            self._deferred = [p for p in self._deferred if p.src != src]
            for pull in waiting:  # every request gets one reply (a leaving worker reads them all, then goes)
                self._reply(pull)
        else:
            raise ProtocolError(f"PS {self.index}: worker {src} sent a {header.kind.name}, which only servers send")

    def _rows_of(self, ints: Tensor) -> tuple[Tensor, ...]:
        blocks = unpack_ints(ints, len(self.specs)) if self.specs else []
        out = []
        for spec, ids in zip(self.specs, blocks):
            if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= spec.num_rows
                                or bool(((ids % self.num_servers) != self.index).any())):
                raise ProtocolError(f"PS {self.index}: ids for table {spec.name!r} outside this shard")
            out.append(local_index(ids, self.num_servers))
        return tuple(out)

    def end_of_data(self) -> None:
        """The training data ran out: answer waiting and future pulls at once, whatever their min_version.

        Under a bounded lead a worker's pull waits for pushes of the others; once they have no
        batches left those pushes never come, so the last pulls must not wait for them.

        Example::

            ps.end_of_data()      # called by the owner's tick when a worker reports the data exhausted
        """
        self.data_ended = True
        self._answer_deferred()

    def _on_pull(self, src: int, header: Header, ints: Tensor) -> None:
        if header.flags & FLAG_DENSE and not self._dense_active:
            raise ProtocolError(f"PS {self.index}: worker {src} asked for dense parameters in a tables-only phase, "
                                "where the servers' dense copy is stale (DeepSpeed holds the current one)")
        known = None
        if header.flags & FLAG_VALIDATE:  # ids, then as many stamps: split the payload's 2T blocks
            if header.flags & FLAG_DENSE:
                raise ProtocolError(f"PS {self.index}: worker {src} sent a validating pull asking for the dense part")
            blocks = unpack_ints(ints, 2 * len(self.specs))
            ids, known = blocks[:len(self.specs)], tuple(blocks[len(self.specs):])
            if [b.numel() for b in ids] != [k.numel() for k in known]:
                raise ProtocolError(f"PS {self.index}: validating pull of worker {src} has ids and stamps that differ "
                                    "in length")
            ints = torch.cat([ints[:len(self.specs)], *ids])
        pull = _PendingPull(src=src, seq=header.seq, min_version=header.min_version,
                            want_dense=bool(header.flags & FLAG_DENSE), rows=self._rows_of(ints), known=known,
                            prefetch=bool(header.flags & FLAG_PREFETCH))
        if self._finished or self.data_ended or pull.min_version <= self.version:
            self._reply(pull)
        else:
            self._deferred.append(pull)

    def _on_push(self, src: int, header: Header, ints: Tensor, floats: Tensor, until_version: int | None) -> None:
        if self._finished:
            self._drained += 1
            return
        self._pushes[src] += 1
        rows = self._rows_of(ints)
        dense, grads = unpack_floats(floats, self._buffer.dense_numel, [r.numel() for r in rows],
                                     [s.dim for s in self.specs])
        if header.num_samples < 1:
            raise ProtocolError(f"PS {self.index}: worker {src} pushed a gradient of {header.num_samples} samples")
        try:
            verdict = self.control.admit(header.version)
        except ValueError as exc:  # a token newer than this shard (client bug, restored older state): count it, go on
            logger.error("PS %d: rejected a push from worker %d: %s", self.index, src, exc)
            return
        if not verdict.counted:
            logger.debug("PS %d: dropped a gradient of staleness %d from worker %d", self.index, verdict.tau, src)
            return
        self._buffer.add(verdict.weight, header.num_samples, dense,
                         {s.name: r for s, r in zip(self.specs, rows)}, {s.name: g for s, g in zip(self.specs, grads)})
        if verdict.ready:
            self._apply()
            self._finish_if_done(until_version)
            self._answer_deferred()

    def _on_put(self, header: Header, ints: Tensor, floats: Tensor) -> None:
        rows = self._rows_of(ints)
        dense_n = self._buffer.dense_numel if header.flags & FLAG_DENSE else 0
        dense, values = unpack_floats(floats, dense_n, [r.numel() for r in rows], [s.dim for s in self.specs])
        if dense_n:
            with torch.no_grad():
                self._dense.copy_(dense)
        for spec, r, v in zip(self.specs, rows, values):
            if r.numel():
                self._tables[spec.name].put(r, v)
                self._touch_rows(spec.name, r)

    def _apply(self) -> None:
        batch = self._buffer.mean()
        self._buffer.clear()
        if self._lr_schedule is not None:  # update number `version` runs at DeepSpeed's lr of that step
            lr = self._lr_schedule.lr(self.version)
            for group in self._dense_opt.param_groups if self._dense_opt is not None else ():
                group["lr"] = lr
            for spec in self.specs:  # own optimizers scale their lr by the schedule (TableOptimizerSpec)
                self._tables[spec.name].lr = lr if spec.optimizer is None else spec.optimizer.scheduled_lr(lr)
        if self._dense_opt is not None and self._dense_active:
            if self.clip_norm:
                self._clip(batch.dense)
            self._dense.grad = batch.dense
            self._dense_opt.step()
            self._dense.grad = None
        for name, table in self._tables.items():
            table.step(batch.ids[name], batch.rows[name])
            self._touch_rows(name, batch.ids[name])  # lazy row optimizers change only the batch's rows
        version = self.control.commit()
        self.rt.store.set(version_key(self.rt.rank), encode_int(version))  # for monitors and the auto-mode switcher

    def _clip(self, grad: Tensor) -> None:
        """Scale the global-batch dense gradient as DeepSpeed's clipping would: by max_norm / (norm + 1e-6) if < 1."""
        sumsq = float(grad.pow(2).sum())
        if self.num_servers > 1:  # the norm is over the whole vector: add every shard's share for this update
            keys = [norm_key(self._phase_id, self.version, s) for s in range(self.num_servers)]
            self.rt.store.set(keys[self.index], encode_float(sumsq))
            since, deadline = time.time(), time.monotonic() + self.rt.timeout_s
            servers = self.rt.layout.servers
            live, next_poll = Liveness(self.rt, [r for r in servers if r != self.rt.rank]), time.monotonic()
            what = f"the other servers' gradient norms of update {self.version} (gradient_clipping)"
            while not self.rt.store.check(keys):
                now = time.monotonic()
                if now >= next_poll or now > deadline:  # a frozen peer server is told from a slow one by its heartbeat
                    next_poll = now + self.rt.heartbeat_s
                    missing = [servers[s] for s in range(self.num_servers) if not self.rt.store.check([keys[s]])]
                    lost = live.poll() & set(missing)
                    if lost:
                        r = min(lost)
                        raise self.rt.server_lost(r, live.silence(r), what, since)
                    if now > deadline and missing:
                        raise self.rt.server_lost(missing[0], late(self.rt.timeout_s), what, since)
                time.sleep(0.002)
            sumsq = sum(decode_float(self.rt.store.get(k)) for k in keys)
        coef = self.clip_norm / (math.sqrt(sumsq) + 1e-6)
        if coef < 1.0:
            grad.mul_(coef)
            self.clipped += 1

    def _finish_if_done(self, until_version: int | None) -> None:
        if until_version is not None and self.version >= until_version and not self._finished:
            self._finished = True
            logger.info("PS %d reached version %d: answering with final parameters, draining pushes",
                        self.index, self.version)

    def _answer_deferred(self) -> None:
        ready, waiting = [], []
        for p in self._deferred:
            (ready if self._finished or self.data_ended or p.min_version <= self.version else waiting).append(p)
        self._deferred = waiting
        for pull in ready:
            self._reply(pull)

    def _reply(self, pull: _PendingPull, extra_flags: int = 0) -> None:
        if self._peers.get(pull.src) is PeerState.DEAD:
            return
        ints, blocks = self._reply_rows(pull)
        # pack_floats concatenates into a new tensor: later updates cannot touch data still being sent
        floats = pack_floats(self._dense.detach() if pull.want_dense else None, blocks)
        flags = (FLAG_FINISHED if self._finished else 0) | extra_flags
        header = Header(kind=Kind.REPLY, seq=pull.seq, src=self.rt.rank, schema=self.schema, version=self.version,
                        flags=flags, n_ints=0 if ints is None else ints.numel(), n_floats=floats.numel(),
                        stamp=self._row_clock)
        try:
            self._outgoing[pull.src].append(send_message(header, ints, floats, self.rt.channel(pull.src)))
            self.rt.ring(pull.src)
        except RuntimeError as exc:
            self._mark_dead(pull.src, exc)

    def _reply_rows(self, pull: _PendingPull) -> tuple[Tensor | None, list[Tensor]]:
        """The rows a reply carries: all asked ones, or (validating pull) those changed since the worker's stamp."""
        if pull.known is None:
            return None, [self._tables[s.name].weight[r] for s, r in zip(self.specs, pull.rows)]
        changed = [self._row_stamps[s.name][r] > k for s, r, k in zip(self.specs, pull.rows, pull.known)]
        rows = [self._tables[s.name].weight[r[c]] for s, r, c in zip(self.specs, pull.rows, changed)]
        return pack_ints([pack_mask(c) for c in changed]), rows  # which asked rows follow: one bit each

    def _touch_rows(self, name: str, rows: Tensor | None) -> None:
        """Tick the row clock and stamp ``rows`` of table ``name`` (None: every row) as changed now."""
        self._row_clock += 1
        if rows is None:
            self._row_stamps[name].fill_(self._row_clock)
        elif rows.numel():
            self._row_stamps[name][rows] = self._row_clock

    def _reap(self, src: int) -> None:
        # forget the replies the worker has received; one it has not read yet (a prefetch's, read when the worker
        # next waits) is kept: waiting for it here would stall every worker on this one
        self._outgoing[src] = [out for out in self._outgoing[src] if not out.done()]

    def _flush_outgoing(self) -> None:
        for w, outs in self._outgoing.items():
            if self._peers[w] is PeerState.BYE:
                try:
                    for out in outs:
                        out.wait()
                except RuntimeError as exc:
                    logger.warning("PS %d: last reply to worker %d failed: %s", self.index, w, exc)
            self._outgoing[w] = []

    def _on_join(self, worker: int, incarnation: int) -> None:
        """A restarted process of ``worker`` asks in: link to it, forget what the dead one left behind."""
        if worker not in self._peers:
            logger.error("PS %d: ignoring a join of rank %d, which is not a worker", self.index, worker)
            return
        t0 = time.monotonic()
        try:
            self.rt.accept_join(worker, incarnation)
        except (RuntimeError, ValueError) as exc:  # the new process vanished mid-join: it stays lost
            logger.warning("PS %d: worker %d (incarnation %d) could not join: %s", self.index, worker, incarnation,
                           str(exc).splitlines()[0][:200])
            return
        self._peers[worker], self._next_seq[worker], self._outgoing[worker] = PeerState.ACTIVE, 0, []
        self._silent_since.pop(worker, None)
        self._deferred = [p for p in self._deferred if p.src != worker]  # pulls of the dead process
        self._rejoined.append(worker)
        logger.warning("PS %d: worker %d rejoined as incarnation %d at version %d (link built in %.2fs)", self.index,
                       worker, incarnation, self.version, time.monotonic() - t0)
        if self._on_tick is not None:
            self._on_tick(self)  # the owner publishes the rejoin now, not at the next heartbeat tick

    def _mark_dead(self, worker: int, exc: BaseException) -> None:
        logger.warning("PS %d: worker %d is gone (%s); continuing with the others at version %d",
                       self.index, worker, str(exc).splitlines()[0][:200], self.version)
        self._peers[worker] = PeerState.DEAD
        self._outgoing[worker] = []
        self._deferred = [p for p in self._deferred if p.src != worker]

    def _check_liveness(self, live: Liveness) -> None:
        for w in live.poll():
            if self._peers[w] is PeerState.ACTIVE:
                logger.warning("PS %d: worker %d missed heartbeats for %.1fs; presumed lost", self.index, w,
                               live.lease_s)
                self._peers[w] = PeerState.SILENT  # its deferred pulls stay: it may come back for them
                self._silent_since[w] = time.monotonic()

    def _check_stall(self) -> None:
        # every live worker waits for a newer version, so no push can come: tell them instead of hanging
        active = {w for w, p in self._peers.items() if p is PeerState.ACTIVE}
        waiting = {p.src for p in self._deferred if not p.prefetch}  # a prefetch is answered once the push comes
        now = time.monotonic()
        # a worker silent for less than timeout_s may only be slow and could still push: not a stall yet
        maybe_back = any(self._peers[w] is PeerState.SILENT and now - t < self.rt.timeout_s
                         for w, t in self._silent_since.items())
        if self._deferred and not self._finished and active and active <= waiting and not maybe_back:
            self._stalls += 1
            logger.error("PS %d: workers %s all wait for a version > %d with %d of M=%d gradients buffered",
                         self.index, sorted(active), self.version, self.control.pending, self.control.m)
            stalled, self._deferred = self._deferred, []
            for pull in stalled:
                self._reply(pull, extra_flags=FLAG_STALLED)
