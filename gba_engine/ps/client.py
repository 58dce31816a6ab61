"""The worker side of the parameter server: pull parameters and a token, push gradients.

Every request goes to the servers as 1 to 3 gloo ``isend``s (header, ids, floats) and a
doorbell on the control-plane store; replies come back the same way. A push returns as
soon as its sends are posted (the paper's non-blocking push: a fast worker goes on to its
next batch); its sends are confirmed when the next reply arrives, by which time the
server has read them. Every wait is on the store with a deadline (``timeout_s``) and
heartbeat checks of the servers, never on an unannounced gloo recv.

Tokens are per server (``tuple[int, ...]``): each server owns a disjoint shard and
advances its own version, so no cross-server agreement is needed on the hot path.

Example::

    client = PSClient(rt, dense_numel=n, embedding_specs=specs)
    got = client.pull({"user": user_ids})               # Pulled(dense, rows, token, finished)
    ... forward/backward with got.dense and got.rows["user"] ...
    client.push(dense_grad, {"user": user_ids}, {"user": row_grads}, got.token, num_samples=512)
    client.close()
"""
from __future__ import annotations

import logging
import time
from typing import Mapping, NamedTuple, Sequence

import torch
from torch import Tensor

from .runtime import Liveness, PSConnectionError, PSRuntime
from .sharding import DenseSharding, ServerTableSpec, RowRoute
from .wire import (FLAG_DENSE, FLAG_FINISHED, FLAG_STALLED, Header, Kind, Outgoing, ProtocolError, pack_floats,
                   pack_ints, recv_message, schema_id, send_message, unpack_floats)

logger = logging.getLogger(__name__)

Token = tuple[int, ...]


class PSStalledError(RuntimeError):
    """Every live worker waited for a model version that no pending push can produce."""


class Pulled(NamedTuple):
    """What a pull returns: parameters, the token (one version per server) and whether training is over."""

    dense: Tensor | None  # the full flat dense vector, or None when not asked for
    rows: dict[str, Tensor]  # table -> rows for the asked ids, shape ids.shape + (dim,)
    token: Token
    finished: bool  # every server reached its final version: these are the final parameters


class PSClient:
    """A worker's connection to all parameter servers of the launch.

    Example::

        client = PSClient(rt, dense_numel=1000, embedding_specs=[ServerTableSpec("user", 10_000, 16)])
        token = client.pull().token
        rows = client.get_rows("user", torch.tensor([3, 3, 9]))     # [3, 16], duplicates allowed
    """

    def __init__(self, runtime: PSRuntime, dense_numel: int, embedding_specs: Sequence[ServerTableSpec], *,
                 tables_only: bool = False) -> None:
        # tables_only: the servers serve a tables-only phase (sync mode): pushes carry no dense gradient
        if runtime.is_server:
            raise ValueError(f"rank {runtime.rank} is a parameter server; PSClient runs on workers")
        self.rt = runtime
        self.servers = runtime.layout.servers
        self.num_servers = len(self.servers)
        self.specs = {s.name: s for s in embedding_specs}
        if len(self.specs) != len(embedding_specs):
            raise ValueError(f"embedding table names must be unique, got {[s.name for s in embedding_specs]}")
        self._order = [s.name for s in embedding_specs]  # the wire order of tables
        self.dense = DenseSharding(dense_numel, self.num_servers)
        self.tables_only = tables_only
        self.schema = schema_id(dense_numel, embedding_specs)
        self._seq = {s: 0 for s in self.servers}
        self._outgoing: list[Outgoing] = []
        self._finished = {s: False for s in self.servers}
        self._broken: BaseException | None = None
        self._closed = False
        self._liveness = Liveness(runtime, self.servers)

    # ----------------------------------------------------------------- public API
    def pull(self, ids: Mapping[str, Tensor] | None = None, *, dense: bool = True,
             min_version: int | Sequence[int] | None = None) -> Pulled:
        """Fetch the dense vector (if ``dense``) and the rows of ``ids`` (any shape, duplicates allowed).

        ``min_version`` makes each server answer only once its version reaches it (an int
        for all servers or one per server): the synchronous schedule, where a worker
        waits for the update its last push belongs to. GBA training pulls without it.
        """
        self._usable()
        if dense and self.tables_only:
            raise ValueError("a tables-only client cannot pull the dense vector (DeepSpeed holds it in sync mode)")
        mins = self._per_server(min_version, "min_version") if min_version is not None else (-1,) * self.num_servers
        routes = {name: RowRoute.build(self._checked(name, t), self.num_servers) for name, t in (ids or {}).items()}
        per_server = {name: r.server_ids() for name, r in routes.items()}
        seqs = {}
        for i, s in enumerate(self.servers):
            ints = pack_ints([self._ids_for(per_server, name, i) for name in self._order])
            seqs[s] = self._send(s, Kind.PULL, ints=ints, floats=None, flags=FLAG_DENSE if dense else 0,
                                 min_version=mins[i])
        replies = self._await_replies(seqs)
        token = tuple(replies[s][0].version for s in self.servers)
        dense_shards, blocks = [], {name: [] for name in self._order}
        for i, s in enumerate(self.servers):
            header, floats = replies[s]
            counts = [self._ids_for(per_server, name, i).numel() for name in self._order]
            shard, rows = unpack_floats(floats, self.dense.size(i) if dense else 0, counts,
                                        [self.specs[n].dim for n in self._order])
            dense_shards.append(shard)
            for name, r in zip(self._order, rows):
                blocks[name].append(r)
        out_rows = {}
        for name, route in routes.items():
            unique_rows = route.merge(blocks[name])
            out_rows[name] = unique_rows[route.inverse].reshape(*ids[name].shape, self.specs[name].dim)
        return Pulled(dense=self.dense.join(dense_shards) if dense else None, rows=out_rows, token=token,
                      finished=all(self._finished.values()))

    def push(self, dense_grad: Tensor | None, ids: Mapping[str, Tensor], row_grads: Mapping[str, Tensor],
             token: Token, num_samples: int) -> None:
        """Send one local gradient (of the local *mean* loss) with its token; returns without waiting.

        ``ids[t]`` may hold duplicates (rows are summed per id here); ``row_grads[t]`` is
        ``[len(ids[t]), dim]``. Servers that have finished are skipped.
        """
        self._usable()
        tokens = self._per_server(token, "token")
        if num_samples < 1:
            raise ValueError(f"num_samples must be >= 1, got {num_samples}")
        if set(ids) != set(row_grads):
            raise ValueError(f"ids and row_grads name different tables: {sorted(ids)} vs {sorted(row_grads)}")
        shards = self._dense_parts(dense_grad)
        routes, grads = {}, {}
        for name, t in ids.items():
            flat = self._checked(name, t)
            g = row_grads[name].reshape(-1, self.specs[name].dim)
            if g.shape[0] != flat.numel():
                raise ValueError(f"table {name!r}: {flat.numel()} ids but {g.shape[0]} gradient rows")
            routes[name] = RowRoute.build(flat, self.num_servers)
            grads[name] = routes[name].split(routes[name].coalesce(g.to(torch.float32)))
        per_server = {name: r.server_ids() for name, r in routes.items()}
        for i, s in enumerate(self.servers):
            if self._finished[s]:
                continue  # it accepts no more gradients; sending would only be drained
            ints = pack_ints([self._ids_for(per_server, n, i) for n in self._order])
            row_blocks = [grads[n][i] if n in grads else torch.empty(0) for n in self._order]
            floats = pack_floats(shards[i], row_blocks)
            self._send(s, Kind.PUSH, ints=ints, floats=floats, version=tokens[i], num_samples=num_samples)

    def get_rows(self, table: str, ids: Tensor) -> Tensor:
        """Current rows of ``table`` for ``ids`` (the cache-store read): ``ids.shape + (dim,)``."""
        return self.pull({table: ids}, dense=False).rows[table]

    def put_rows(self, table: str, ids: Tensor, rows: Tensor) -> None:
        """Overwrite rows of ``table`` (the cache-store write-back); later pulls see them.

        Duplicated ids keep the last given row. Optimizer state of those rows is kept.
        """
        self._usable()
        flat = self._checked(table, ids)
        values = rows.reshape(-1, self.specs[table].dim).to(torch.float32)
        if values.shape[0] != flat.numel():
            raise ValueError(f"table {table!r}: {flat.numel()} ids but {values.shape[0]} rows")
        route = RowRoute.build(flat, self.num_servers)
        last = torch.zeros(route.unique.numel(), dtype=torch.int64).scatter_reduce_(
            0, route.inverse, torch.arange(flat.numel()), reduce="amax")  # position of each id's last occurrence
        blocks = route.split(values[last])
        per_server = route.server_ids()
        for i, s in enumerate(self.servers):
            if per_server[i].numel() == 0:
                continue
            ints = pack_ints([per_server[i] if n == table else torch.empty(0, dtype=torch.int64) for n in self._order])
            floats = pack_floats(None, [blocks[i] if n == table else torch.empty(0) for n in self._order])
            self._send(s, Kind.PUT, ints=ints, floats=floats)

    def put_dense(self, flat: Tensor) -> None:
        """Overwrite the dense vector on the servers (e.g. initial values from worker 0)."""
        self._usable()
        shards = self._dense_parts(flat)
        empty_ids = pack_ints([torch.empty(0, dtype=torch.int64) for _ in self._order])
        for i, s in enumerate(self.servers):
            self._send(s, Kind.PUT, ints=empty_ids, floats=shards[i].to(torch.float32), flags=FLAG_DENSE)

    def close(self) -> None:
        """Say goodbye to every server and confirm the last sends (best effort after a finished run)."""
        if self._closed:
            return
        self._closed = True
        if self._broken is not None:
            return
        try:
            for s in self.servers:
                self._send(s, Kind.BYE, ints=None, floats=None)
            for out in self._outgoing:
                out.wait()
        except RuntimeError as exc:  # a server that finished may already be gone: nothing is lost
            logger.info("rank %d: goodbye not confirmed by every server: %s", self.rt.rank, str(exc)[:200])
        self._outgoing = []

    # ----------------------------------------------------------------- internals
    def _usable(self) -> None:
        if self._closed:
            raise RuntimeError("this PSClient is closed")
        if self._broken is not None:
            raise PSConnectionError(f"this PSClient failed earlier and cannot be reused: {self._broken}")

    def _per_server(self, value: int | Sequence[int], what: str) -> tuple[int, ...]:
        if isinstance(value, int):
            return (value,) * self.num_servers
        out = tuple(int(v) for v in value)
        if len(out) != self.num_servers:
            raise ValueError(f"{what} needs one version per server ({self.num_servers}), got {out}")
        return out

    def _checked(self, table: str, ids: Tensor) -> Tensor:
        if table not in self.specs:
            raise KeyError(f"unknown embedding table {table!r}; tables: {self._order}")
        flat = ids.reshape(-1)
        self.specs[table].check_ids(flat)
        return flat

    @staticmethod
    def _ids_for(per_server: Mapping[str, list[Tensor]], name: str, i: int) -> Tensor:
        return per_server[name][i] if name in per_server else torch.empty(0, dtype=torch.int64)

    def _dense_parts(self, flat: Tensor | None) -> list[Tensor | None]:
        if self.dense.numel == 0 or self.tables_only:
            if flat is not None and self.dense.numel:
                raise ValueError("a tables-only client pushes row gradients only, got a dense gradient")
            return [None] * self.num_servers
        if flat is None:
            raise ValueError(f"a dense vector of {self.dense.numel} elements is required")
        return self.dense.split(flat.detach().reshape(-1).to(torch.float32))

    def _send(self, server: int, kind: Kind, ints: Tensor | None, floats: Tensor | None, flags: int = 0,
              version: int = 0, min_version: int = -1, num_samples: int = 0) -> int:
        seq = self._seq[server]
        header = Header(kind=kind, seq=seq, src=self.rt.rank, schema=self.schema, version=version,
                        min_version=min_version, num_samples=num_samples, flags=flags,
                        n_ints=0 if ints is None else ints.numel(), n_floats=0 if floats is None else floats.numel())
        try:
            self._outgoing.append(send_message(header, ints, floats, self.rt.link(server)))
            self.rt.ring(server)  # after the isends: the server will only recv data already on its way
        except RuntimeError as exc:
            self._broken = exc
            raise PSConnectionError(f"rank {self.rt.rank}: sending a {kind.name} to server rank {server} failed: {exc}") from exc
        self._seq[server] = seq + 1
        return seq

    def _await_replies(self, seqs: Mapping[int, int]) -> dict[int, tuple[Header, Tensor]]:
        deadline = time.monotonic() + self.rt.timeout_s
        replies: dict[int, tuple[Header, Tensor]] = {}
        try:
            while len(replies) < len(seqs):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    missing = sorted(set(seqs) - set(replies))
                    raise PSConnectionError(
                        f"rank {self.rt.rank}: no reply from server ranks {missing} within timeout_s={self.rt.timeout_s}"
                    )
                bell = self.rt.wait_doorbell(min(remaining, self.rt.heartbeat_s))
                if bell is None:
                    lost = self._liveness.poll() & (set(seqs) - set(replies))
                    if lost:
                        raise PSConnectionError(f"rank {self.rt.rank}: server ranks {sorted(lost)} stopped heartbeating")
                    continue
                src = bell.src
                if bell.join or src not in seqs or src in replies:
                    raise ProtocolError(f"rank {self.rt.rank}: unexpected doorbell {bell}")
                header, _, floats = recv_message(self.rt.link(src), src)
                if header.kind is not Kind.REPLY or header.seq != seqs[src]:
                    raise ProtocolError(f"rank {self.rt.rank}: expected the reply to request {seqs[src]} from rank "
                                        f"{src}, got {header.kind.name} #{header.seq}")
                replies[src] = (header, floats)
            for out in self._outgoing:  # every server has read all our earlier sends before replying
                out.wait()
            self._outgoing = []
        except (RuntimeError, TimeoutError) as exc:
            self._broken = exc
            if isinstance(exc, (PSConnectionError, ProtocolError)):
                raise
            raise PSConnectionError(f"rank {self.rt.rank}: parameter-server transfer failed: {exc}") from exc
        stalled = [s for s, (h, _) in replies.items() if h.flags & FLAG_STALLED]
        for s, (h, _) in replies.items():
            self._finished[s] = bool(h.flags & FLAG_FINISHED)
        if stalled:
            raise PSStalledError(
                f"rank {self.rt.rank}: servers {stalled} report that every live worker waits for a newer version "
                "while fewer than M gradients can still arrive (a worker died under a min_version schedule?); "
                "pull without min_version to train asynchronously"
            )
        return replies
