"""The worker side of the parameter server: pull parameters and a token, push gradients.

Every request goes to the servers as 1 to 3 gloo ``isend``s (header, ids, floats) and a
doorbell on the control-plane store; replies come back the same way. A push returns as
soon as its sends are posted (the paper's non-blocking push: a fast worker goes on to its
next batch); its sends are confirmed when the next reply arrives, by which time the
server has read them. Every wait is on the store with a deadline (``timeout_s``) and
heartbeat checks of the servers, never on an unannounced gloo recv. A server that dies
(its gloo connection breaks), freezes (its heartbeat stops for the lease) or does not answer
within ``timeout_s`` raises :class:`~.runtime.ServerLostError` naming it, the request waited
for and since when, and aborts the job (``PSRuntime.server_lost``).

Tokens are per server (``tuple[int, ...]``): each server owns a disjoint shard and
advances its own version, so no cross-server agreement is needed on the hot path.

A pull may be split in two on the same thread: :meth:`PSClient.request_rows` posts a
validating pull (the worker-side row cache's: ids with the row stamps it holds) and returns
at once; :meth:`PSClient.collect_rows` waits for its reply later, so the transfer overlaps
the caller's compute (a prefetch). Replies to other requests that arrive meanwhile are kept
until asked for; ``bytes_sent`` / ``bytes_received`` count every message on the wire.

Example::

    client = PSClient(rt, dense_numel=n, embedding_specs=specs)
    got = client.pull({"user": user_ids})               # Pulled(dense, rows, token, finished)
    ... forward/backward with got.dense and got.rows["user"] ...
    client.push(dense_grad, {"user": user_ids}, {"user": row_grads}, got.token, num_samples=512)
    client.close()
"""
from __future__ import annotations

import dataclasses
import logging
import time
from typing import Mapping, NamedTuple, Sequence

import torch
from torch import Tensor

from .runtime import Liveness, PSConnectionError, PSRuntime, ServerLostError, late
from .sharding import DenseSharding, ServerTableSpec, RowRoute
from .wire import (FLAG_DENSE, FLAG_FINISHED, FLAG_PREFETCH, FLAG_STALLED, FLAG_VALIDATE, HEADER_LEN, Header, Kind,
                   Outgoing, ProtocolError, pack_floats, pack_ints, recv_message, schema_id, send_message,
                   unpack_floats, unpack_ints, unpack_mask)

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


class RowRequest(NamedTuple):
    """A validating pull on its way (:meth:`PSClient.request_rows`); :meth:`PSClient.collect_rows` reads its reply."""

    seqs: dict[int, int]  # server rank -> sequence number of the request
    ids: dict[str, Tensor]  # table -> the unique ids asked, in the caller's order
    routes: dict[str, RowRoute]
    min_version: tuple[int, ...]  # per server; -1: answered at once


class RowReply(NamedTuple):
    """The answer to a :class:`RowRequest`: only the rows the servers changed since the stamps sent.

    ``changed[t] = (positions, rows)``: positions into the request's ``ids[t]`` and their current
    rows ``[len(positions), dim]``; every other asked row is unchanged since its stamp.
    ``versions`` / ``stamps``: each server's version and row clock when it answered.
    """

    changed: dict[str, tuple[Tensor, Tensor]]
    versions: Token
    stamps: tuple[int, ...]
    finished: bool


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
        self._outgoing: list[tuple[int, int, Outgoing]] = []  # (server, seq, sends), waited once the server replied
        self._awaiting: set[tuple[int, int]] = set()  # (server, seq) of pulls whose reply has not been read
        self._sent_at: dict[tuple[int, int], tuple[str, float]] = {}  # (server, seq) of a pull -> (what, time.time())
        self._stash: dict[tuple[int, int], tuple[Header, Tensor, Tensor]] = {}  # replies read before asked for
        self._abandoned: set[tuple[int, int]] = set()  # replies to drop when they come
        self.bytes_sent = 0  # every message to the servers: headers, ids, floats
        self.bytes_received = 0  # every reply from the servers
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
        replies = {s: (h, f) for s, (h, _, f) in self._await_replies(seqs).items()}
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

    def request_rows(self, ids: Mapping[str, Tensor], stamps: Mapping[str, Tensor], *,
                     min_version: int | Sequence[int] | None = None, prefetch: bool = False) -> RowRequest:
        """Post a validating pull, return at once: the servers answer with the rows of ``ids`` changed since ``stamps``.

        ``ids[t]``: unique 1-D ids; ``stamps[t]``: the server row clock each row was read at
        (``-1``: not held, always sent). ``min_version`` as in :meth:`pull`. ``prefetch``: asked
        ahead of need (a server does not count a worker waiting on it as stalled).

        Example::

            req = client.request_rows({"user": torch.tensor([4, 9])}, {"user": torch.tensor([-1, 17])})
            ... compute ...
            reply = client.collect_rows(req)      # reply.changed["user"]: (positions, rows)
        """
        self._usable()
        if set(ids) != set(stamps):
            raise ValueError(f"ids and stamps name different tables: {sorted(ids)} vs {sorted(stamps)}")
        mins = self._per_server(min_version, "min_version") if min_version is not None else (-1,) * self.num_servers
        routes, per_server, stamp_blocks = {}, {}, {}
        for name, t in ids.items():
            flat = self._checked(name, t)
            known = stamps[name].reshape(-1).to(torch.int64)
            if known.numel() != flat.numel():
                raise ValueError(f"table {name!r}: {flat.numel()} ids but {known.numel()} stamps")
            route = routes[name] = RowRoute.build(flat, self.num_servers)
            if route.unique.numel() != flat.numel():
                repeated = flat.numel() - route.unique.numel()
                raise ValueError(f"table {name!r}: request_rows needs unique ids, got {repeated} repeated")
            per_server[name] = route.server_ids()
            by_unique = torch.empty_like(known)
            by_unique[route.inverse] = known
            stamp_blocks[name] = route.split(by_unique)
        flags = FLAG_VALIDATE | (FLAG_PREFETCH if prefetch else 0)
        seqs = {}
        for i, s in enumerate(self.servers):
            id_blocks = [self._ids_for(per_server, n, i) for n in self._order]
            known_blocks = [stamp_blocks[n][i] if n in stamp_blocks else torch.empty(0, dtype=torch.int64)
                            for n in self._order]
            seqs[s] = self._send(s, Kind.PULL, ints=pack_ints(id_blocks + known_blocks), floats=None, flags=flags,
                                 min_version=mins[i])
        return RowRequest(seqs=seqs, ids={n: t.reshape(-1) for n, t in ids.items()}, routes=routes, min_version=mins)

    def collect_rows(self, request: RowRequest) -> RowReply:
        """Wait for the reply to ``request`` (:meth:`request_rows`) and map it back to the asked ids."""
        self._usable()
        replies = self._await_replies(request.seqs)
        parts: dict[str, tuple[list[Tensor], list[Tensor]]] = {n: ([], []) for n in request.ids}
        offsets = {n: 0 for n in request.ids}
        for i, s in enumerate(self.servers):
            header, ints, floats = replies[s]
            masks = unpack_ints(ints, len(self._order))
            asked = [request.routes[n].counts[i] if n in request.routes else 0 for n in self._order]
            positions = [unpack_mask(m, k).nonzero().squeeze(1) for m, k in zip(masks, asked)]
            _, rows = unpack_floats(floats, 0, [p.numel() for p in positions], [self.specs[n].dim for n in self._order])
            for name, pos, r in zip(self._order, positions, rows):
                if name not in request.ids:
                    continue
                route = request.routes[name]
                unique_index = route.order[offsets[name] + pos]  # position in the server's block -> unique id
                parts[name][0].append(unique_index)
                parts[name][1].append(r)
                offsets[name] += route.counts[i]
        changed = {}
        for name, (unique_index, rows) in parts.items():
            route = request.routes[name]
            asked_at = torch.empty_like(route.inverse)
            asked_at[route.inverse] = torch.arange(route.inverse.numel())  # unique index -> caller's position
            changed[name] = (asked_at[torch.cat(unique_index)], torch.cat(rows))
        return RowReply(changed=changed, versions=tuple(replies[s][0].version for s in self.servers),
                        stamps=tuple(replies[s][0].stamp for s in self.servers), finished=all(self._finished.values()))

    def abandon(self, request: RowRequest) -> None:
        """Forget ``request``: its reply is dropped when it comes (a prefetch the caller no longer needs)."""
        for s, seq in request.seqs.items():
            if (s, seq) in self._stash:
                del self._stash[(s, seq)]
                self._awaiting.discard((s, seq))
            elif (s, seq) in self._awaiting:
                self._abandoned.add((s, seq))

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
            if self.rt.aborted:  # a server is lost: no goodbye can be confirmed
                return
            for s in self.servers:
                self._send(s, Kind.BYE, ints=None, floats=None)
            if self._awaiting:  # a prefetch's reply: the server answers every request, and its send waits for us
                by_server: dict[int, list[int]] = {}
                for s, q in sorted(self._awaiting):
                    by_server.setdefault(s, []).append(q)
                while by_server:
                    self._await_replies({s: qs.pop(0) for s, qs in by_server.items()})
                    by_server = {s: qs for s, qs in by_server.items() if qs}
            for _, _, out in self._outgoing:
                out.wait()
        except RuntimeError as exc:  # a server that finished may already be gone: nothing is lost
            if isinstance(exc, ServerLostError) and exc.by != self.rt.rank:
                raise  # another rank found a server lost while this one said goodbye: the job is aborted
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
        t0 = time.time()
        try:
            self._outgoing.append((server, seq, send_message(header, ints, floats, self.rt.channel(server))))
            self.rt.ring(server)  # after the isends: the server will only recv data already on its way
        except RuntimeError as exc:
            self._broken = exc
            if isinstance(exc, PSConnectionError):
                raise
            raise self.rt.server_lost(server, "is dead or unreachable: sending to it failed",
                                      f"its {kind.name.lower()} #{seq} to be sent", t0, cause=exc,
                                      publish=not self._closed) from exc
        self._seq[server] = seq + 1
        self.bytes_sent += 8 * (HEADER_LEN + header.n_ints) + 4 * header.n_floats
        if kind is Kind.PULL:
            self._awaiting.add((server, seq))
            what = "validating pull" if flags & FLAG_VALIDATE else "pull"
            self._sent_at[(server, seq)] = (f"the reply to its {what} #{seq}", t0)
        return seq

    def _await_replies(self, seqs: Mapping[int, int]) -> dict[int, tuple[Header, Tensor, Tensor]]:
        """The replies ``{server: (header, ints, floats)}`` to requests ``seqs``; others read meanwhile are kept."""
        deadline = time.monotonic() + self.rt.timeout_s
        wanted = {(s, q) for s, q in seqs.items()}
        try:
            while not wanted <= self._stash.keys():
                remaining = deadline - time.monotonic()
                missing = sorted((s, q) for s, q in wanted if (s, q) not in self._stash)
                if remaining <= 0:
                    s, q = missing[0]
                    raise self._lost(s, q, late(self.rt.timeout_s))
                bell = self.rt.wait_doorbell(min(remaining, self.rt.heartbeat_s))
                if bell is None:
                    lost = self._liveness.poll() & {s for s, _ in missing}
                    if lost:
                        s = min(lost)
                        raise self._lost(s, min(q for m, q in missing if m == s), self._liveness.silence(s))
                    continue
                src = bell.src
                if bell.join or not any(s == src for s, _ in self._awaiting):
                    raise ProtocolError(f"rank {self.rt.rank}: unexpected doorbell {bell}")
                # the data is on its way: its recv ends by the wait's deadline (at least a heartbeat from now)
                until = max(deadline, time.monotonic() + self.rt.heartbeat_s)
                try:
                    header, ints, floats = recv_message(dataclasses.replace(self.rt.channel(src), deadline=until), src)
                except RuntimeError as exc:  # gloo: the connection broke, or timed out (a server frozen mid-send)
                    if isinstance(exc, ProtocolError):
                        raise
                    pending = [q for s, q in sorted(self._awaiting) if s == src]
                    raise self._lost(src, pending[0], self._recv_failure(src), exc) from exc
                key = (src, header.seq)
                if header.kind is not Kind.REPLY or key not in self._awaiting:
                    raise ProtocolError(f"rank {self.rt.rank}: expected a reply to one of the requests "
                                        f"{sorted(q for s, q in self._awaiting if s == src)} from rank {src}, got "
                                        f"{header.kind.name} #{header.seq}")
                self.bytes_received += 8 * (HEADER_LEN + header.n_ints) + 4 * header.n_floats
                self._reaped(src, header.seq)
                self._sent_at.pop(key, None)
                if key in self._abandoned:
                    self._abandoned.discard(key)
                    self._awaiting.discard(key)
                else:
                    self._stash[key] = (header, ints, floats)
        except (RuntimeError, TimeoutError) as exc:
            self._broken = exc
            if isinstance(exc, (PSConnectionError, ProtocolError)):
                raise
            raise PSConnectionError(f"rank {self.rt.rank}: parameter-server transfer failed: {exc}") from exc
        replies = {}
        for key in wanted:
            self._awaiting.discard(key)
            replies[key[0]] = self._stash.pop(key)
        stalled = [s for s, (h, _, _) in replies.items() if h.flags & FLAG_STALLED]
        for s, (h, _, _) in replies.items():
            self._finished[s] = bool(h.flags & FLAG_FINISHED)
        if stalled:
            raise PSStalledError(
                f"rank {self.rt.rank}: servers {stalled} report that every live worker waits for a newer version "
                "while fewer than M gradients can still arrive (a worker died under a min_version schedule?); "
                "pull without min_version to train asynchronously"
            )
        return replies

    def _recv_failure(self, server: int) -> str:
        """What a failed recv from ``server`` says about it: frozen when its heartbeat stopped, else dead or stuck."""
        if server in self._liveness.poll():
            return self._liveness.silence(server) + ", and its reply stopped mid-transfer"
        return "is dead or stuck: receiving its reply failed"

    def _lost(self, server: int, seq: int, state: str, cause: BaseException | None = None) -> ServerLostError:
        """The :class:`ServerLostError` for ``server`` while this worker waits for the reply to request ``seq``."""
        what, since = self._sent_at.get((server, seq), (f"the reply to its request #{seq}", time.time()))
        return self.rt.server_lost(server, state, what, since, cause=cause, publish=not self._closed)

    def _reaped(self, server: int, seq: int) -> None:
        """``server`` answered request ``seq``, so it has read every earlier send of ours: confirm those sends."""
        keep = []
        for entry in self._outgoing:
            if entry[0] == server and entry[1] <= seq:
                entry[2].wait()
            else:
                keep.append(entry)
        self._outgoing = keep
