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

The concerns live in their own modules: the layout of a launch, who serves and who works (:mod:`.roles`), the channel to
one peer (:mod:`.channel`), heartbeats and liveness (:mod:`.liveness`), start-up and rejoin
(:mod:`.rendezvous`), the errors (:mod:`.errors`); this module holds :class:`PSRuntime`, what a
server or client holds once started, and keeps the old names importable from here
(``Link``, now :class:`~.channel.PeerChannel`, with a deprecation warning).

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
import logging
import time
import warnings
from typing import TYPE_CHECKING, Any

import torch.distributed as dist
from torch.distributed import TCPStore

from ..protocol import FLAG, AbortRecord, DoorbellMessage, abort_key, closed_key, inbox_key
from .channel import PeerChannel, pair_group
from .errors import NO_REPLACEMENT, PSConnectionError, ServerLostError, late
from .roles import Layout, layout
from .link import DelayedDoorbells, LinkModel
from .liveness import Heartbeat, Liveness

if TYPE_CHECKING:
    from .store_host import StoreHost

# and, from .rendezvous on first use: init_runtime, join_runtime, read_layout
__all__ = ["Layout", "Liveness", "NO_REPLACEMENT", "PSConnectionError", "PSRuntime", "PeerChannel", "ServerLostError",
           "late", "layout"]

logger = logging.getLogger(__name__)


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
    _heartbeat: Heartbeat | None = None
    _closed: bool = False
    _links: dict = dataclasses.field(default_factory=dict)  # peer -> PeerChannel replacing (ps_group, peer)
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

    def channel(self, peer: int) -> PeerChannel:
        """How to reach ``peer``: the launch's ``ps_group``, or the pair group of a restarted worker."""
        if peer in self._links:
            base = self._links[peer]
        elif self.ps_group is None:
            raise PSConnectionError(f"rank {self.rank} (incarnation {self.incarnation}) has no channel to rank {peer}")
        else:
            base = PeerChannel(self.ps_group, peer)
        if self._doorbells is None:
            return base
        return dataclasses.replace(base, meter=lambda nbytes: self._count(peer, nbytes))

    def link(self, peer: int) -> PeerChannel:
        """Deprecated name of :meth:`channel` (a "link" is the modelled slow link of ``link.py``)."""
        warnings.warn("PSRuntime.link(peer) is renamed PSRuntime.channel(peer); link() goes in the next release",
                      DeprecationWarning, stacklevel=2)
        return self.channel(peer)

    def ring(self, dst: int) -> None:
        """Tell ``dst`` that a message from this rank is on its way (after its isends are posted).

        With a :class:`~.link.LinkModel` the doorbell rings later, when the bytes sent to ``dst``
        since its last doorbell would have crossed the modelled link; this call returns at once.
        """
        key = inbox_key(dst, self.channel(dst).incarnation)
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
                if bell.join or bell.incarnation == self.channel(bell.src).incarnation:
                    return bell
                logger.debug("rank %d: skipped a doorbell of rank %d's dead incarnation %d", self.rank, bell.src,
                             bell.incarnation)
        finally:
            self.store.set_timeout(datetime.timedelta(seconds=self.timeout_s))

    def accept_join(self, worker: int, incarnation: int) -> None:
        """Server side of a rejoin: build the pair group with ``worker``'s new incarnation (blocks, bounded).

        Raises RuntimeError when the new process does not build its side within ``timeout_s``.
        """
        if incarnation <= self.channel(worker).incarnation:
            raise ValueError(f"rank {self.rank}: join of worker {worker} incarnation {incarnation}, which is not "
                             f"newer than {self.channel(worker).incarnation}")
        group = pair_group(self.store, self.store_host, worker, self.rank, incarnation, is_worker=False,
                           timeout=datetime.timedelta(seconds=self.timeout_s))
        self._links[worker] = PeerChannel(group, 0, incarnation)

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


_STARTUP = ("init_runtime", "join_runtime", "read_layout")


def __getattr__(name: str) -> Any:
    """The start-up functions (in :mod:`.rendezvous`, which imports this module) and the old name ``Link``."""
    if name in _STARTUP:
        from . import rendezvous

        return getattr(rendezvous, name)
    if name == "Link":
        warnings.warn("gba_engine.ps.runtime.Link is renamed gba_engine.ps.channel.PeerChannel (a 'link' is the "
                      "modelled slow link of gba_engine.ps.link); the old name goes in the next release",
                      DeprecationWarning, stacklevel=2)
        return PeerChannel
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
