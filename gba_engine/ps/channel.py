"""How a rank reaches one peer of the parameter-server protocol: a gloo group and the peer's rank in it.

A launched rank reaches every peer over the launch's ``ps_group``; a restarted worker (and the
servers, towards it) over a private two-rank gloo group built by :func:`pair_group` under its own
prefix of the control-plane store. :class:`PeerChannel` is either, with the byte meter of a
modelled slow link (``link.py``) and a receive deadline.

Example::

    channel = PeerChannel(group, peer=1)
    channel.send(torch.ones(4)).wait()
"""
from __future__ import annotations

import dataclasses
import datetime
import socket
import time
from typing import Callable

import torch.distributed as dist
from torch.distributed import TCPStore

from ..protocol import pair_prefix
from .errors import PSConnectionError

__all__ = ["PeerChannel", "pair_group", "reachable_host"]


def reachable_host(master_addr: str) -> str:
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
class PeerChannel:
    """The gloo group that carries this rank's messages to/from one peer, and the peer's rank in it.

    Not the modelled slow link of :mod:`.link` (:class:`~.link.LinkModel`): a channel is what a
    message travels over; a link model only delays its doorbell.

    Example::

        channel = rt.channel(peer=2)
        channel.send(tensor).wait()          # on rank 0; rank 2 calls channel.recv(tensor)
    """

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


def pair_group(store: TCPStore, host: str, worker: int, server: int, incarnation: int, is_worker: bool,
                timeout: datetime.timedelta) -> dist.ProcessGroup:
    """A two-rank gloo group (worker = rank 0, server = rank 1), rendezvous under its own store prefix."""
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = timeout
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=reachable_host(host))]
    prefix = dist.PrefixStore(pair_prefix(worker, server, incarnation), store)
    return dist.ProcessGroupGloo(prefix, 0 if is_worker else 1, 2, opts)
