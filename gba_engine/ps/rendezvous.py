"""Start-up of the parameter-server runtime: every rank of a launch, a restarted worker, the running job's layout.

:func:`init_runtime` (every rank, right after ``torch.distributed`` / ``deepspeed.init_distributed``)
builds the groups and the control plane: the first server starts the TCPStore in a process of its
own (``store_host.py``) and publishes its address through the launch's store. :func:`join_runtime`
connects a restarted worker to a running job over that control plane (``HOST:PORT`` or the job's
``gba.control_file``), and :func:`read_layout` reads the running job's layout. Each returns or
reads what :mod:`.runtime` describes.

Example::

    dist.init_process_group("gloo")
    rt = init_runtime(GBAConfig(num_servers=1))
    rt.layout.servers                       # the last rank
"""
from __future__ import annotations

import datetime
import itertools
import logging
import os
import socket
import time
from pathlib import Path

import torch.distributed as dist
from torch.distributed import TCPStore

from ..config import HEARTBEAT_LEASE, GBAConfig
from ..protocol import (DoorbellMessage, LayoutRecord, StoreAddress, heartbeat_key, host_key, inbox_key,
                        incarnation_key, joinable_key, layout_key, store_address_key)
from .channel import PeerChannel, pair_group, reachable_host
from .errors import PSConnectionError
from .roles import Layout, layout
from .link import LinkModel
from .liveness import Heartbeat
from .runtime import PSRuntime

__all__ = ["init_runtime", "join_runtime", "read_layout"]

logger = logging.getLogger(__name__)

_GENERATION = itertools.count()  # every rank creates runtimes in the same order: a shared key suffix


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
    heartbeat = Heartbeat(host, port, worker, config.heartbeat_s, config.timeout_s)
    store.set(host_key(worker), socket.gethostname())
    links = {}
    try:
        for s in lay.servers:
            store.queue_push(inbox_key(s), DoorbellMessage(worker, incarnation, join=True).encode())
        for s in lay.servers:  # in server order; each server builds its side when it pops the join
            links[s] = PeerChannel(pair_group(store, host, worker, s, incarnation, is_worker=True, timeout=timeout), 1)
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
            host = reachable_host(control_host)
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
    heartbeat = Heartbeat(host, port, rank, config.heartbeat_s, config.timeout_s)
    store.set(host_key(rank), socket.gethostname())  # the messages that name a lost rank name its host too
    logger.info("rank %d is a PS %s; control plane at %s:%d", rank, lay.role(rank), host, port)
    return PSRuntime(rank=rank, layout=lay, ps_group=ps_group, worker_group=worker_group, store=store,
                     store_host=host, store_port=port, timeout_s=config.timeout_s,
                     heartbeat_s=config.heartbeat_s, _heartbeat=heartbeat, link_model=link, store_process=process)
