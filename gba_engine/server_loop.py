"""The loop a server rank runs for the whole job: the first worker's commands, dispatched through a table.

Commands (``protocol.Command``) arrive in sequence on the control plane; each is handled by
the entry of :class:`CommandTable` for its type and acknowledged (``protocol.Ack``) after the
server publishes its stats. During a phase (``Serve``) the parameter server calls
:meth:`ServerLoop.tick`, which answers save requests and publishes live stats. The loop ends
when every worker has closed or is presumed lost.

Example::

    loop = ServerLoop(rt, gba, spec, flat0, schedule=None, tables=[], clip_norm=1.0)
    totals = loop.run()          # {"received": ..., "counted": ..., "staleness": {...}, "version": ...}
"""
from __future__ import annotations

import json
import logging
import time
from typing import Callable, Mapping, Sequence

import torch

from .checkpoint import load_shard, load_tables, save_shard
from .collective_guard import raise_if_stuck
from .config import GBAConfig
from .protocol import (FLAG, Ack, Command, GetState, GetTables, LoadShards, PutState, PutTables, SaveRequest,
                       SaveShards, Serve, ack_key, command_key, decode_command, done_key, encode_stats, exhausted_key,
                       save_done_key, save_request_key, stats_key)
from .ps import OptimizerSpec, ParameterServer, PSRuntime
from .ps.runtime import Liveness
from .ps.schedule import ServerLRSchedule
from .ps.sharding import DenseSharding, ServerTableSpec
from .switch import TrainState, moment_names, recv_state, send_state, state_from_server, state_into_server, wait_sent
from .sync_faults import WorkerLostError, lost_worker_record, rank_host
from .worker_tables import recv_tables, send_tables, wait_tables

logger = logging.getLogger(__name__)

POLL_S = 0.02
_COUNTS = ("received", "counted", "dropped", "decayed")


class UnknownCommandError(RuntimeError):
    """A command no handler of the server's table knows."""


def empty_stats() -> dict:
    """A server's totals before any phase."""
    return {"received": 0, "counted": 0, "dropped": 0, "decayed": 0, "staleness": {}, "lost_workers": [],
            "rejoined": [], "version": 0, "pushes": {}}


def merged_stats(totals: Mapping, tokens: Mapping | None = None, lost_workers: Sequence[int] = (),
                 rejoined: Sequence[int] = (), pushes: Mapping[int, int] | None = None) -> dict:
    """A new totals dict: ``totals`` plus one phase's token tallies, lost/rejoined workers and pushes.

    Example::

        merged_stats(empty_stats(), {"received": 4, "counted": 4, "dropped": 0, "decayed": 0,
                                     "staleness": {0: 4}}, lost_workers=[2])["staleness"]    # {"0": 4}
    """
    out = json.loads(json.dumps(totals))  # a deep copy with the JSON (string) keys the store carries
    if tokens is not None:
        for k in _COUNTS:
            out[k] += tokens[k]
        for tau, n in tokens["staleness"].items():
            out["staleness"][str(tau)] = out["staleness"].get(str(tau), 0) + n
    out["lost_workers"] = sorted(set(out["lost_workers"]) | set(lost_workers))
    out["rejoined"] = out["rejoined"] + list(rejoined)
    for w, n in (pushes or {}).items():
        out["pushes"][str(w)] = out["pushes"].get(str(w), 0) + n
    return out


class CommandTable:
    """Command type -> handler ``(command, seq) -> Ack | None`` (None: the handler acknowledged it itself).

    Example::

        table = CommandTable({Serve: loop.serve})
        table.handler(Serve(m=2))        # loop.serve
        table.handler(SaveShards("x"))   # UnknownCommandError naming 'save'
    """

    def __init__(self, handlers: Mapping[type, Callable[[Command, int], Ack | None]]) -> None:
        self._handlers = dict(handlers)

    def handler(self, command: Command) -> Callable[[Command, int], Ack | None]:
        """The handler of ``command``'s type."""
        try:
            return self._handlers[type(command)]
        except KeyError:
            raise UnknownCommandError(f"no handler for command {getattr(command, 'op', type(command).__name__)!r} "
                                      f"({command!r}); known: {sorted(c.op for c in self._handlers)}") from None


class ServerLoop:
    """Runs on a server rank: executes the first worker's commands (put/get state, serve, save, load)."""

    def __init__(self, rt: PSRuntime, gba: GBAConfig, spec: OptimizerSpec, flat0: torch.Tensor,
                 schedule: ServerLRSchedule | None, tables: list[ServerTableSpec], clip_norm: float) -> None:
        self.rt, self.gba, self.spec, self.schedule = rt, gba, spec, schedule
        self.index = rt.layout.server_index(rt.rank)
        self.numel = flat0.numel()
        start, end = DenseSharding(self.numel, rt.layout.num_servers).bounds[self.index]
        self.state = TrainState(flat0[start:end].clone(), {k: torch.zeros(end - start) for k in moment_names(spec)},
                                0, 0)
        # one shard for the whole job: its tables (rows + optimizer state) persist across sync and gba phases
        self.ps = ParameterServer(rt, gba, self.numel, tables, spec, dense_init=flat0, on_tick=self.tick,
                                  lr_schedule=schedule, clip_norm=clip_norm)
        self.tables = tables
        self.totals: dict = empty_stats()
        self.last_save = 0
        self.phase = 0  # gba phases served so far (the engine numbers them the same way)
        self.dense_phase = True
        self.tables_version: int | None = None  # the version of tables put by the workers (sync phases of auto)
        self.commands = CommandTable({PutState: self._put_state, GetState: self._get_state, Serve: self._serve,
                                      SaveShards: self._save, LoadShards: self._load, PutTables: self._put_tables,
                                      GetTables: self._get_tables})

    def _publish(self, live: Mapping | None = None) -> None:
        if live is None:
            out = merged_stats(self.totals)
            out["version"] = self.state.version
        else:
            out = merged_stats(self.totals, live, self.ps.lost_workers, self.ps.rejoined)
            out["version"] = live["version"]
        out["clipped"] = self.ps.clipped
        self.rt.store.set(stats_key(self.index), encode_stats(out))

    def tick(self, ps: ParameterServer) -> None:
        """During a phase: stop if a worker is stuck in a collective, answer a pending save request, publish stats."""
        raise_if_stuck(self.rt)  # the phase's own waits end on the workers' liveness; a stuck worker still beats
        store = self.rt.store
        if store.check([save_request_key()]):
            req = SaveRequest.decode(store.get(save_request_key()))
            # sync phase: wait until the rows hold the update of the workers' last global batch
            if req.request_id > self.last_save and ps.version >= req.min_version:
                self.last_save = req.request_id
                save_shard(state_from_server(ps), req.path, self.index, self.rt.layout.num_servers,
                           tables=ps.export_tables())
                store.set(save_done_key(req.request_id, self.index), FLAG)
        if not self.dense_phase:  # a tables-only (sync) phase: no end-of-data protocol, its pushes are not gba's
            self.state.version = self.totals["version"] = ps.version
            self._publish()
            return
        if not ps.data_ended and store.check([exhausted_key(self.phase)]):
            ps.end_of_data()  # no worker may wait for pushes that will never come
        self._publish({**ps.control.stats.as_dict(), "version": ps.version})

    def _wait_command(self, seq: int) -> Command | None:
        """Command ``seq``, or None once every worker finished or is gone.

        Waiting is legitimate while any worker heartbeats (a sync job without server tables sends nothing
        for the whole job); it ends with :class:`~gba_engine.collective_guard.StuckCollectiveError` when a
        worker is found waiting in a collective the servers never join, and with ``ServerLostError`` when
        the job is aborted.
        """
        live = Liveness(self.rt, self.rt.layout.workers)
        while True:
            if self.rt.store.check([command_key(seq)]):
                return decode_command(self.rt.store.get(command_key(seq)))
            raise_if_stuck(self.rt)
            lost = live.poll()
            if all(w in lost or self.rt.store.check([done_key(w)]) for w in self.rt.layout.workers):
                self._say_why_it_ends(live, lost)
                return None  # every worker finished or is gone: the job is over
            time.sleep(POLL_S)

    def _say_why_it_ends(self, live: Liveness, lost: set) -> None:
        """Log why this server leaves the job; raise WorkerLostError when a worker was lost in a sync phase."""
        found = lost_worker_record(self.rt)
        if found is not None:
            worker, host, reason = found
            logger.error("server %d (rank %d) exits: the job stopped in a sync phase: %s", self.index, self.rt.rank,
                         reason)
            raise WorkerLostError(f"server rank {self.rt.rank}: the job stopped: {reason}", worker=worker, host=host)
        done = [w for w in self.rt.layout.workers if w not in lost]
        if lost:
            named = ", ".join(f"rank {w} (host {rank_host(self.rt, w)}: {live.silence(w)})" for w in sorted(lost))
            logger.warning("server %d (rank %d) exits: workers %s closed, workers lost: %s",
                           self.index, self.rt.rank, done, named)
        else:
            logger.info("server %d (rank %d) exits: every worker closed (%s)", self.index, self.rt.rank, done)

    def run(self) -> dict:
        """Serve commands until the job ends; returns the accumulated stats."""
        seq = 0
        while (command := self._wait_command(seq)) is not None:
            ack = self.commands.handler(command)(command, seq)
            if ack is not None:
                self._publish()
                self.rt.store.set(ack_key(seq, self.index), ack.encode())
            seq += 1
        self.totals["clipped"] = self.ps.clipped
        self._publish()
        return self.totals

    # ------------------------------------------------------------------ handlers
    def _put_state(self, command: PutState, seq: int) -> Ack:
        self.state = recv_state(command.src, self.rt.ps_group, moment_names(self.spec))
        return Ack()

    def _get_state(self, command: GetState, seq: int) -> None:
        works = send_state(self.state, command.src, self.rt.ps_group)
        self.rt.store.set(ack_key(seq, self.index), Ack().encode())  # the doorbell: our sends are posted
        wait_sent(works)
        return None

    def _put_tables(self, command: PutTables, seq: int) -> Ack:
        """The workers' tables after a sync phase (rows, row optimizer state, steps) replace this shard's."""
        self.ps.import_tables(recv_tables(command.src, self.rt.ps_group, self.ps.table_views()))
        self.tables_version = command.version
        return Ack()

    def _get_tables(self, command: GetTables, seq: int) -> None:
        works = send_tables(self.ps.table_views(), command.src, self.rt.ps_group)
        self.rt.store.set(ack_key(seq, self.index), Ack().encode())  # the doorbell: our sends are posted
        wait_tables(works)
        return None

    def _save(self, command: SaveShards, seq: int) -> Ack:
        save_shard(self.state, command.path, self.index, self.rt.layout.num_servers, tables=self.ps.export_tables())
        return Ack()

    def _load(self, command: LoadShards, seq: int) -> Ack:
        self.state = load_shard(command.path, self.index, self.rt.layout.num_servers)
        if self.tables:
            self.ps.import_tables(load_tables(command.path, self.index, self.rt.layout.num_servers))
            state_into_server(self.ps, self.state)  # the token clock of the rows: the checkpoint's version
        return Ack()

    def _serve(self, command: Serve, seq: int) -> Ack:
        """One phase: gba (dense + tables through the servers) or, with ``dense=False``, sync's tables-only serving."""
        ps = self.ps
        self.dense_phase = command.dense
        ps.begin_phase(command.m, dense=command.dense)
        if command.dense:
            self.phase += 1
            tables_at = ps.version if self.tables_version is None else self.tables_version
            if self.tables and self.state.version != tables_at:
                logger.warning("server %d: dense state at version %d, tables at %d", self.index, self.state.version,
                               ps.version)
            state_into_server(ps, self.state)
            self.tables_version = None  # the phase's updates move the tables and the dense part together
        stats = ps.serve(until_version=None)
        if not command.dense:
            self.state.version = ps.version  # the rows' updates are the job's global batches
            self.totals = {**merged_stats(self.totals, lost_workers=stats.lost_workers), "version": ps.version}
            return Ack(ps.version, tuple(stats.lost_workers))
        self.state = state_from_server(ps)
        self.totals = {**merged_stats(self.totals, stats.tokens, stats.lost_workers, stats.rejoined, stats.pushes),
                       "version": ps.version}
        return Ack(ps.version, tuple(stats.lost_workers))
