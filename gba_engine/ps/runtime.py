"""Roles, process groups and the TCPStore control plane of a parameter-server launch.

In one launch of W ranks the last ``num_servers`` ranks are parameter servers and the
rest are workers. :func:`init_runtime` (called by every rank, right after
``torch.distributed`` / ``deepspeed.init_distributed``) builds:

* ``ps_group``: a gloo group of all ranks used only for PS point-to-point traffic, so it
  never interleaves with DeepSpeed collectives;
* ``worker_group``: the workers only (default backend), DeepSpeed's data-parallel group
  in sync mode (``None`` on server ranks);
* a TCPStore control plane in a small process of its own (``store_host.py``) that the
  **first server rank** starts on a port the OS picks (published through the default
  store). Not the default store: its master lives in rank 0, a worker, and a worker must
  be able to die without taking the control plane with it; and not inside the server
  either: a frozen (``kill -STOP``) host would freeze every store operation of every rank,
  timeouts included. A separate client connection also gets its own timeouts without
  touching the ones c10d and DeepSpeed rely on.

The store carries (keys and encodings: ``gba_engine.protocol``) the doorbells (one queue
per rank: a sender pushes a ``DoorbellMessage`` after posting its gloo sends, the receiver
pops with a deadline and only then posts the gloo recv), heartbeats (a counter per rank, bumped by a daemon thread; observers time the
changes on their own clock, so hosts need no synchronised clocks), published versions
the close handshake and the job's ``abort`` record.

A lost parameter server (dead, frozen, or not answering within ``timeout_s``) ends the job:
the first rank to find it raises :class:`ServerLostError` naming the server, what it waited
for and since when, and publishes the reason (:meth:`PSRuntime.server_lost`); every other
rank's wait loops (all poll a :class:`Liveness`) raise the same reason within a heartbeat.
A replacement server is not supported: the servers hold the only current copy of the dense
state and the rows in a gba phase, so the recovery is a restart from the last server
checkpoint (``--resume``), which loses the updates since that checkpoint.

A worker process that died can be replaced while the job runs (:func:`join_runtime`):
gloo membership is fixed when a group is built, so the new process (incarnation k + 1 of
that worker) gets a private two-rank gloo group with each server, built over a prefix of
the control-plane store when the server pops its ``join`` doorbell. Doorbells and worker
inboxes carry the incarnation, so nothing sent to or by the dead process reaches the new one.

Example::

    dist.init_process_group("gloo")
    rt = init_runtime(GBAConfig(num_servers=1))
    if rt.is_server:
        ParameterServer(rt, ...).serve(until_version=100)
    else:
        client = PSClient(rt, ...)
    rt.close()
"""
from __future__ import annotations

import dataclasses
import datetime
import itertools
import logging
import os
import socket
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterable

import torch.distributed as dist
from torch.distributed import TCPStore

from ..config import HEARTBEAT_LEASE, GBAConfig
from .link import DelayedDoorbells, LinkModel
from ..protocol import (FLAG, AbortRecord, DoorbellMessage, LayoutRecord, StoreAddress, abort_key, closed_key,
                        heartbeat_key, host_key, inbox_key, incarnation_key, joinable_key, layout_key, pair_prefix,
                        store_address_key)

if TYPE_CHECKING:
    from .store_host import StoreHost

logger = logging.getLogger(__name__)

_GENERATION = itertools.count()  # every rank creates runtimes in the same order: a shared key suffix
NO_REPLACEMENT = ("a replacement server is not supported (in a gba phase the servers hold the only current copy of "
                  "the dense state and the rows): restart the job from the last server checkpoint with --resume; "
                  "the updates since that checkpoint are lost")


class PSConnectionError(RuntimeError):
    """A peer of the parameter-server protocol died or stopped answering within its deadline."""


class ServerLostError(PSConnectionError):
    """A parameter server died, froze or did not answer within ``timeout_s``: the job stops.

    ``server`` is the server's rank, ``index`` its server index, ``by`` the rank that found it
    (another rank than the one raising when it learnt it from the job's ``abort`` record).
    A gloo error that revealed the loss is the ``__cause__``.

    Example::

        try:
            client.pull()
        except ServerLostError as exc:
            exc.server, exc.index, exc.by        # 3, 0, 1
    """

    def __init__(self, message: str, server: int, index: int, by: int) -> None:
        super().__init__(message)
        self.server, self.index, self.by = server, index, by

    def __reduce__(self):  # picklable with its fields (multiprocessing reports it)
        return (type(self), (str(self), self.server, self.index, self.by))


@dataclasses.dataclass(frozen=True)
class Layout:
    """Which ranks of a launch are workers and which are parameter servers.

    Example::

        lay = layout(world_size=4, num_servers=1)
        lay.workers, lay.servers, lay.role(3), lay.server_index(3)   # (0, 1, 2), (3,), 'server', 0
    """

    world_size: int
    num_servers: int

    @property
    def workers(self) -> tuple[int, ...]:
        """Worker ranks (the first ``world_size - num_servers``)."""
        return tuple(range(self.world_size - self.num_servers))

    @property
    def servers(self) -> tuple[int, ...]:
        """Server ranks (the last ``num_servers``), in server-index order."""
        return tuple(range(self.world_size - self.num_servers, self.world_size))

    def role(self, rank: int) -> str:
        """``"worker"`` or ``"server"``."""
        self._check(rank)
        return "server" if rank >= self.world_size - self.num_servers else "worker"

    def server_index(self, rank: int) -> int:
        """Index 0..S-1 of a server rank (its dense range and its ids ``id % S``)."""
        if self.role(rank) != "server":
            raise ValueError(f"rank {rank} is a worker, not a server, in {self}")
        return rank - (self.world_size - self.num_servers)

    def worker_index(self, rank: int) -> int:
        """Index 0..N-1 of a worker rank (its data shard)."""
        if self.role(rank) != "worker":
            raise ValueError(f"rank {rank} is a server, not a worker, in {self}")
        return rank

    def _check(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside a launch of {self.world_size} ranks")


def layout(world_size: int, num_servers: int) -> Layout:
    """Validate and build the :class:`Layout` of a launch (raises a clear ValueError)."""
    if world_size < 1:
        raise ValueError(f"world size must be >= 1, got {world_size}")
    if num_servers < 1:
        raise ValueError(f"gba.num_servers must be >= 1, got {num_servers}")
    if num_servers >= world_size:
        raise ValueError(
            f"gba.num_servers={num_servers} leaves no worker in a launch of {world_size} ranks: the last "
            f"num_servers ranks become parameter servers, so launch at least {num_servers + 1} ranks "
            f"or lower gba.num_servers"
        )
    return Layout(world_size=world_size, num_servers=num_servers)


def late(timeout_s: float) -> str:
    """What a server that heartbeats but did not answer in time looks like, for a :meth:`PSRuntime.server_lost` state."""
    return f"is alive (its heartbeat moves) but did not answer within timeout_s={timeout_s:g}s (slow or stuck)"


def _reachable_host(master_addr: str) -> str:
    """The address of this host that peers reaching ``master_addr`` can reach too."""
    try:
        infos = socket.getaddrinfo(master_addr, None, socket.AF_INET)
        if infos and infos[0][4][0].startswith("127."):
            return "127.0.0.1"  # a loopback launch: stay on loopback (DESIGN: never the hostname -I address)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((infos[0][4][0], 9))  # UDP connect sends nothing; it only picks the outgoing interface
            return s.getsockname()[0]
    except OSError as exc:
        raise PSConnectionError(f"cannot find an address of this host that reaches the control host {master_addr}: {exc}") from exc


@dataclasses.dataclass(frozen=True)
class Link:
    """The gloo group that carries this rank's messages to/from one peer, and the peer's rank in it."""

    group: dist.ProcessGroup
    peer: int  # the peer's rank inside ``group``
    incarnation: int = 0  # the worker's restart count this link belongs to
    meter: Callable[[int], None] | None = dataclasses.field(default=None, compare=False)  # bytes sent, for a LinkModel
    deadline: float | None = dataclasses.field(default=None, compare=False)  # time.monotonic() a recv must end by

    def send(self, tensor) -> "dist.Work":
        """Post an isend of ``tensor`` to the peer."""
        if self.meter is not None:
            self.meter(tensor.numel() * tensor.element_size())
        return self.group.send([tensor], self.peer, 0)

    def recv(self, tensor) -> None:
        """Receive ``tensor`` from the peer (only after its doorbell: the data is on its way).

        Bounded by the group's timeout, or by ``deadline`` when set (a peer that froze mid-send
        must not hold the receiver past its wait's deadline).
        """
        work = self.group.recv([tensor], self.peer, 0)
        if self.deadline is None:
            work.wait()
        else:
            work.wait(timeout=datetime.timedelta(seconds=max(self.deadline - time.monotonic(), 0.001)))


def _pair_group(store: TCPStore, host: str, worker: int, server: int, incarnation: int, is_worker: bool,
                timeout: datetime.timedelta) -> dist.ProcessGroup:
    """A two-rank gloo group (worker = rank 0, server = rank 1), rendezvous under its own store prefix."""
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = timeout
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=_reachable_host(host))]
    prefix = dist.PrefixStore(pair_prefix(worker, server, incarnation), store)
    return dist.ProcessGroupGloo(prefix, 0 if is_worker else 1, 2, opts)


class _Heartbeat:
    """Daemon thread bumping this rank's heartbeat counter every period, on its own store client."""

    def __init__(self, host: str, port: int, rank: int, period_s: float, timeout_s: float) -> None:
        self._stop = threading.Event()
        self._store = TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=timeout_s))
        self._store.add(heartbeat_key(rank), 1)  # the key exists before anyone polls it
        self._thread = threading.Thread(target=self._run, args=(rank, period_s), name=f"gba-heartbeat-{rank}",
                                        daemon=True)
        self._thread.start()

    def _run(self, rank: int, period_s: float) -> None:
        while not self._stop.wait(period_s):
            try:
                self._store.add(heartbeat_key(rank), 1)
            except Exception as exc:  # the store host has shut down: nobody is listening any more
                logger.debug("heartbeat of rank %d stopped: %s", rank, exc)
                return

    def stop(self, timeout_s: float) -> None:
        self._stop.set()
        self._thread.join(timeout=timeout_s)


class Liveness:
    """Tells which ranks' heartbeats stopped moving for longer than the lease.

    Example::

        live = Liveness(rt, ranks=rt.layout.workers)
        live.poll()          # set of ranks presumed lost now
    """

    def __init__(self, runtime: "PSRuntime", ranks: Iterable[int]) -> None:
        self._rt = runtime
        now = time.monotonic()
        self._seen = {r: (-1, now) for r in ranks}  # rank -> (last counter, when it last changed)

    @property
    def lease_s(self) -> float:
        """Seconds without a heartbeat after which a rank is presumed lost."""
        return HEARTBEAT_LEASE * self._rt.heartbeat_s

    def silent_s(self, rank: int) -> float:
        """Seconds since ``rank``'s heartbeat last moved (as of the last :meth:`poll`)."""
        return time.monotonic() - self._seen[rank][1]

    def silence(self, rank: int) -> str:
        """What a lost ``rank`` looks like, for a :meth:`PSRuntime.server_lost` state."""
        return (f"stopped heartbeating (dead, frozen or cut off): its heartbeat has not moved for "
                f"{self.silent_s(rank):.1f}s, past the lease of {self.lease_s:g}s")

    def poll(self) -> set[int]:
        """Read every tracked heartbeat once; return the ranks presumed lost.

        Raises :class:`ServerLostError` once the job is aborted (a server was found lost by
        any rank): every wait loop polls one, so none outlives the abort by more than its poll.
        """
        self._rt.check_abort()
        now = time.monotonic()
        lost = set()
        for rank, (last, since) in self._seen.items():
            beat = self._rt.store.add(heartbeat_key(rank), 0)  # add 0: reads without blocking on a missing key
            if beat != last:
                self._seen[rank] = (beat, now)
            elif now - since > self.lease_s:
                lost.add(rank)
        return lost


@dataclasses.dataclass
class PSRuntime:
    """Everything a PS server or client needs: rank, layout, groups, control-plane store."""

    rank: int
    layout: Layout
    ps_group: dist.ProcessGroup | None  # None in a restarted worker (its peers are in _links)
    worker_group: dist.ProcessGroup | None
    store: TCPStore  # main-thread client (TCPStore clients are not shared across threads)
    store_host: str
    store_port: int
    timeout_s: float
    heartbeat_s: float
    incarnation: int = 0  # 0: launched with the job; k: this worker's k-th restart (join_runtime)
    _heartbeat: _Heartbeat | None = None
    _closed: bool = False
    _links: dict = dataclasses.field(default_factory=dict)  # peer -> Link replacing (ps_group, peer)
    link_model: LinkModel | None = None  # a modelled slow link to/from the servers (link.py); None: as fast as gloo
    _doorbells: DelayedDoorbells | None = None
    _unrung: dict = dataclasses.field(default_factory=dict)  # peer -> bytes sent since its last doorbell
    store_process: "StoreHost | None" = None  # on the first server: the control-plane store's own process
    _abort: AbortRecord | None = None  # the job's abort record once seen

    def __post_init__(self) -> None:
        if self.link_model is not None and self.link_model.enabled and self._doorbells is None:
            self._doorbells = DelayedDoorbells(self.link_model, self.store_host, self.store_port, self.timeout_s)

    @property
    def is_server(self) -> bool:
        """True on parameter-server ranks."""
        return self.layout.role(self.rank) == "server"

    def check_abort(self) -> None:
        """Raise :class:`ServerLostError` with the job's reason if any rank found a server lost (one store read)."""
        if self._abort is None:
            if not self.store.check([abort_key()]):
                return
            self._abort = AbortRecord.decode(self.store.get(abort_key()))
        record = self._abort
        raise ServerLostError(f"rank {self.rank}: the job stops because rank {record.by} found a parameter server "
                              f"lost: {record.reason}", server=record.server,
                              index=self.layout.server_index(record.server), by=record.by)

    @property
    def aborted(self) -> bool:
        """Whether the job is aborted (a server was found lost); reads the store until it is."""
        try:
            self.check_abort()
        except ServerLostError:
            return True
        return False

    def server_lost(self, server: int, state: str, waiting_for: str, since: float,
                    cause: BaseException | None = None, publish: bool = True) -> ServerLostError:
        """The error for a lost ``server`` (published as the job's abort reason unless ``publish`` is False).

        ``state``: what was seen (:meth:`Liveness.silence`, :func:`late`); ``waiting_for``: what this rank
        waited for; ``since``: ``time.time()`` when it started waiting. ``cause``: the gloo error, if any.

        Example::

            raise rt.server_lost(3, "is dead (its connection broke)", "the reply to pull #7", t0, cause=exc)
        """
        index = self.layout.server_index(server)
        waited = max(time.time() - since, 0.0)
        stamp = time.strftime("%H:%M:%S", time.localtime(since)) + f".{int(since % 1 * 1000):03d}"
        detail = f" ({str(cause).strip().splitlines()[0][:160]})" if cause is not None and str(cause).strip() else ""
        reason = (f"parameter server rank {server} (server index {index}) {state}{detail}, while rank {self.rank} "
                  f"waited for {waiting_for} since {stamp} ({waited:.1f}s); {NO_REPLACEMENT}")
        if publish:
            try:
                self.store.compare_set(abort_key(), "", AbortRecord(self.rank, server, reason).encode())
            except Exception as exc:  # the store host is gone too: this rank's own error still says why
                logger.warning("rank %d could not publish the job's abort: %s", self.rank, exc)
        logger.error("%s", reason)
        return ServerLostError(f"rank {self.rank}: {reason}", server=server, index=index, by=self.rank)

    def link(self, peer: int) -> Link:
        """How to reach ``peer``: the launch's ``ps_group``, or the pair group of a restarted worker."""
        if peer in self._links:
            base = self._links[peer]
        elif self.ps_group is None:
            raise PSConnectionError(f"rank {self.rank} (incarnation {self.incarnation}) has no link to rank {peer}")
        else:
            base = Link(self.ps_group, peer)
        if self._doorbells is None:
            return base
        return dataclasses.replace(base, meter=lambda nbytes: self._count(peer, nbytes))

    def ring(self, dst: int) -> None:
        """Tell ``dst`` that a message from this rank is on its way (after its isends are posted).

        With a :class:`~.link.LinkModel` the doorbell rings later, when the bytes sent to ``dst``
        since its last doorbell would have crossed the modelled link; this call returns at once.
        """
        key = inbox_key(dst, self.link(dst).incarnation)
        message = DoorbellMessage(self.rank, self.incarnation).encode()
        if self._doorbells is None:
            self.store.queue_push(key, message)
        else:
            self._doorbells.ring(dst, key, message, self._unrung.pop(dst, 0))

    def _count(self, peer: int, nbytes: int) -> None:
        self._unrung[peer] = self._unrung.get(peer, 0) + nbytes

    def wait_doorbell(self, timeout_s: float) -> DoorbellMessage | None:
        """The next doorbell, or None after ``timeout_s`` (a harmless store timeout).

        Doorbells of a dead incarnation of a worker (rung before it died) are skipped: their
        data went over a group the new incarnation does not use.
        """
        deadline = time.monotonic() + timeout_s
        try:
            while True:
                self.store.set_timeout(datetime.timedelta(seconds=max(deadline - time.monotonic(), 0.001)))
                try:
                    raw = self.store.queue_pop(inbox_key(self.rank, self.incarnation), block=True)
                except dist.DistStoreError:
                    return None
                bell = DoorbellMessage.decode(raw)
                if bell.join or bell.incarnation == self.link(bell.src).incarnation:
                    return bell
                logger.debug("rank %d: skipped a doorbell of rank %d's dead incarnation %d", self.rank, bell.src,
                             bell.incarnation)
        finally:
            self.store.set_timeout(datetime.timedelta(seconds=self.timeout_s))

    def accept_join(self, worker: int, incarnation: int) -> None:
        """Server side of a rejoin: build the pair group with ``worker``'s new incarnation (blocks, bounded).

        Raises RuntimeError when the new process does not build its side within ``timeout_s``.
        """
        if incarnation <= self.link(worker).incarnation:
            raise ValueError(f"rank {self.rank}: join of worker {worker} incarnation {incarnation}, which is not "
                             f"newer than {self.link(worker).incarnation}")
        group = _pair_group(self.store, self.store_host, worker, self.rank, incarnation, is_worker=False,
                            timeout=datetime.timedelta(seconds=self.timeout_s))
        self._links[worker] = Link(group, 0, incarnation)

    def close(self) -> None:
        """Stop the heartbeat and say goodbye (the store process stays up until every rank closed or is gone)."""
        if self._closed:
            return
        self._closed = True
        if self._doorbells is not None:  # the last doorbells (goodbyes) still reach their servers
            self._doorbells.close(timeout_s=self.timeout_s)
        if self._heartbeat is not None:
            self._heartbeat.stop(timeout_s=self.heartbeat_s + 1.0)
        try:
            self.store.set(closed_key(self.rank), FLAG)
        except Exception as exc:  # the store host is gone after a finished run: nothing left to tell
            logger.debug("rank %d could not mark itself closed: %s", self.rank, exc)


def _publish_control_plane(store: TCPStore, host: str, port: int, lay: Layout, control_file: str | None) -> None:
    store.set(layout_key(), LayoutRecord(lay.world_size, lay.num_servers).encode())
    if control_file:
        path = os.path.abspath(control_file)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            f.write(f"{StoreAddress(host, port).encode()}\n")
        os.replace(tmp, path)  # a restart script never reads half an address


def _connect(control_plane: str | os.PathLike, timeout_s: float) -> tuple[TCPStore, str, int, Layout]:
    """A client of the running job's control plane (``HOST:PORT`` or its control file), and the job's layout."""
    text = str(control_plane)
    if os.path.exists(text):
        text = Path(text).read_text().strip()
    try:
        address = StoreAddress.decode(text)
    except ValueError:
        raise ValueError(f"control plane {str(control_plane)!r} is neither HOST:PORT nor a file holding it "
                         "(gba.control_file of the running job)") from None
    host, port = address.host, address.port
    try:
        store = TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=timeout_s))
        record = LayoutRecord.decode(store.get(layout_key()))
    except (RuntimeError, dist.DistStoreError) as exc:
        raise PSConnectionError(f"no running gba job answers at {host}:{port}: {exc}") from exc
    return store, host, port, layout(record.world_size, record.num_servers)


def read_layout(control_plane: str | os.PathLike, timeout_s: float = 10.0) -> Layout:
    """The :class:`Layout` of the running job at ``control_plane`` (``HOST:PORT`` or its control file).

    Example::

        read_layout("runs/x/control_plane").workers       # (0, 1, 2, 3)
    """
    return _connect(control_plane, timeout_s)[3]


def join_runtime(config: GBAConfig, worker: int, control_plane: str | os.PathLike,
                 link: LinkModel | None = None) -> PSRuntime:
    """Connect a restarted worker process to a running job as ``worker`` (no torch.distributed needed).

    ``control_plane`` is ``HOST:PORT`` or the job's ``gba.control_file``. Checks, each a
    clear error: the address answers, ``worker`` is a worker of the job, the job has
    ``config.num_servers`` servers, the job is in a gba
    phase it will not leave (:func:`joinable_key`; sync mode keeps DeepSpeed's static group)
    and the old process of ``worker`` is gone (its heartbeat has not moved for the lease).
    Then it rings a ``join`` doorbell at every server and builds a pair group with each.

    Example::

        rt = join_runtime(GBAConfig(mode="gba", timeout_s=30), worker=1, control_plane="runs/x/control_plane")
        client = PSClient(rt, dense_numel=n, embedding_specs=specs)
    """
    store, host, port, lay = _connect(control_plane, config.timeout_s)
    timeout = datetime.timedelta(seconds=config.timeout_s)
    if worker not in lay.workers:
        raise ValueError(f"rank {worker} is not a worker of the running job (workers {list(lay.workers)}, "
                         f"servers {list(lay.servers)}): only a worker can rejoin")
    if lay.num_servers != config.num_servers:
        raise ValueError(f"gba.num_servers={config.num_servers}, but the running job at {host}:{port} has "
                         f"{lay.num_servers}: rejoin with the job's config")
    deadline = time.monotonic() + config.timeout_s
    while not store.check([joinable_key()]):
        if time.monotonic() > deadline:
            raise PSConnectionError(f"the job at {host}:{port} does not accept a restarted worker: it is not in a gba "
                                    f"phase it keeps (sync mode runs DeepSpeed's fixed group) after "
                                    f"{config.timeout_s:.0f}s")
        time.sleep(0.05)
    beat, since = store.add(heartbeat_key(worker), 0), time.monotonic()
    lease = HEARTBEAT_LEASE * config.heartbeat_s
    while time.monotonic() - since <= lease:  # the old process must be gone, or two would speak for one worker
        time.sleep(min(config.heartbeat_s, 0.05))
        if store.add(heartbeat_key(worker), 0) != beat:
            raise ValueError(f"worker {worker} of the job at {host}:{port} is alive (its heartbeat moves): "
                             "only a worker whose process died can be replaced")
    incarnation = store.add(incarnation_key(worker), 1)
    heartbeat = _Heartbeat(host, port, worker, config.heartbeat_s, config.timeout_s)
    store.set(host_key(worker), socket.gethostname())
    links = {}
    try:
        for s in lay.servers:
            store.queue_push(inbox_key(s), DoorbellMessage(worker, incarnation, join=True).encode())
        for s in lay.servers:  # in server order; each server builds its side when it pops the join
            links[s] = Link(_pair_group(store, host, worker, s, incarnation, is_worker=True, timeout=timeout), 1)
    except RuntimeError as exc:
        heartbeat.stop(config.heartbeat_s + 1.0)
        raise PSConnectionError(f"worker {worker} could not connect to the servers of the job at {host}:{port} "
                                f"within {config.timeout_s:.0f}s (has the job ended?): {exc}") from exc
    logger.info("worker %d rejoined the job at %s:%d as incarnation %d", worker, host, port, incarnation)
    return PSRuntime(rank=worker, layout=lay, ps_group=None, worker_group=None, store=store, store_host=host,
                     store_port=port, timeout_s=config.timeout_s, heartbeat_s=config.heartbeat_s,
                     incarnation=incarnation, _heartbeat=heartbeat, _links=links, link_model=link)


def _wait_address(default_store: dist.Store, key: str, rank: int, first_server: int, timeout_s: float) -> bytes:
    """The control plane's address the first server publishes on the launch's store, within a deadline.

    The first server may still be building its model, then starts the store process (at most
    ``max(timeout_s, 30)`` s, ``store_host.start_store_host``): the wait ends after both, or at once
    with the first server's error when it failed.
    """
    limit = max(timeout_s, 30.0) + timeout_s
    deadline = time.monotonic() + limit
    while not default_store.check([key]):
        if default_store.check([f"{key}/error"]):
            error = default_store.get(f"{key}/error").decode(errors="replace")
            raise PSConnectionError(f"rank {rank}: the first parameter server (rank {first_server}) could not start "
                                    f"the job's control plane: {error}")
        if time.monotonic() > deadline:
            raise PSConnectionError(f"rank {rank}: the first parameter server (rank {first_server}) did not publish "
                                    f"the job's control plane within {limit:g}s (max(gba.timeout_s, 30) for its store "
                                    "process + gba.timeout_s): is it alive, and did it reach gba_engine.initialize?")
        time.sleep(0.02)
    return default_store.get(key)


def init_runtime(config: GBAConfig, control_host: str = "127.0.0.1", link: LinkModel | None = None) -> PSRuntime:
    """Create the PS groups and control plane; every rank of the launch must call it, in the same order.

    ``control_host`` is the launch's master address (the launcher's ``MASTER_ADDR``): the
    first server hosts the control plane on its address that peers reaching it can reach.
    ``link``: a modelled slow link for this rank's parameter-server messages (``ps/link.py``);
    pass the same one on every rank, so that requests and replies both pay it.

    Raises ValueError for a bad ``num_servers`` (on every rank, before any collective).

    Example::

        rt = init_runtime(GBAConfig(num_servers=2, timeout_s=30))
        rt.layout.servers       # the last two ranks
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("init_runtime needs torch.distributed initialised (deepspeed.init_distributed) first")
    rank, world = dist.get_rank(), dist.get_world_size()
    lay = layout(world, config.num_servers)
    timeout = datetime.timedelta(seconds=config.timeout_s)
    ps_group = dist.new_group(ranks=list(range(world)), backend="gloo", timeout=timeout)
    worker_group = dist.new_group(ranks=list(lay.workers), timeout=timeout)
    if rank not in lay.workers:
        worker_group = None
    default_store = dist.distributed_c10d._get_default_store()
    addr_key = store_address_key(next(_GENERATION))
    process = None
    if rank == lay.servers[0]:
        from .store_host import StoreHostError, start_store_host  # imported here: the module is also a __main__

        try:
            host = _reachable_host(control_host)
            try:
                process = start_store_host(host, world, config.timeout_s, config.heartbeat_s)
            except StoreHostError as exc:
                raise PSConnectionError(f"rank {rank} (first server): {exc}") from exc
            port = process.port
            store = TCPStore(host, port, is_master=False, timeout=timeout)
            _publish_control_plane(store, host, port, lay, config.control_file)
        except Exception as exc:  # the other ranks wait for the address: tell them why none comes
            default_store.set(f"{addr_key}/error", f"{type(exc).__name__}: {exc}")
            raise
        default_store.set(addr_key, StoreAddress(host, port).encode())
    else:
        address = StoreAddress.decode(_wait_address(default_store, addr_key, rank, lay.servers[0], config.timeout_s))
        host, port = address.host, address.port
        store = TCPStore(host, port, is_master=False, timeout=timeout)
    heartbeat = _Heartbeat(host, port, rank, config.heartbeat_s, config.timeout_s)
    store.set(host_key(rank), socket.gethostname())  # the messages that name a lost rank name its host too
    logger.info("rank %d is a PS %s; control plane at %s:%d", rank, lay.role(rank), host, port)
    return PSRuntime(rank=rank, layout=lay, ps_group=ps_group, worker_group=worker_group, store=store,
                     store_host=host, store_port=port, timeout_s=config.timeout_s,
                     heartbeat_s=config.heartbeat_s, _heartbeat=heartbeat, link_model=link, store_process=process)
