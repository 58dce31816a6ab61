"""Entry points: ``gba_engine.initialize`` (every rank of a launch) and ``gba_engine.rejoin`` (a restarted worker).

The engine they build (``engine.py``) trains sync, gba, or switches between them by itself.

Modes (the ``"gba"`` block of the DeepSpeed config):

* ``sync``: DeepSpeed all-reduce over the worker group; the servers only update the rows of
  server tables (``tables.py``), once per global batch, and stay idle without them;
* ``gba``: every global batch goes through the parameter servers with token control:
  a worker pulls the dense vector and a token, computes its local gradient and pushes it;
  the servers apply the mean of M = number of workers gradients (same global batch,
  same optimizer and learning rate as sync);
* ``auto``: starts in sync; a :class:`~gba_engine.straggler.StragglerDetector` on the
  workers' local step times moves the job to gba when a worker straggles and back when it
  recovers. Each switch hands over parameters and optimizer state (``switch.py``, ``phases/``).

Server ranks (the last ``num_servers``) never enter the user's loop: on them
:func:`initialize` runs the parameter-server loop until every worker has called
:meth:`GBAEngine.close` (or died) and returns an engine with ``is_server=True``. The user
loop is therefore::

    engine = gba_engine.initialize(model=model, config="ds_configs/gba_cpu.json")
    if engine.is_server:
        return                                # this rank served the whole job already
    for batch in data:
        loss = loss_fn(engine(batch.x), batch.y)
        engine.backward(loss)
        engine.step()
    engine.close()                            # also called at exit

A worker whose process died can be replaced while the job runs in a gba phase it keeps
(mode ``gba``, or ``auto`` once a lost worker pinned it to gba): start a new process with
:func:`rejoin` (same model and config, the worker's index); it takes batches from the
same ``claim_batches`` counter and pushes under the same token control.

The config's learning-rate scheduler runs on the servers too, as a function of the version
(``ps/schedule.py``: DeepSpeed's own classes), so sync, gba and auto follow one curve, and so
does ``gradient_clipping`` (DeepSpeed's default 1.0 when absent): the servers clip the
global-batch dense gradient by its norm over all shards, as DeepSpeed clips the all-reduced
one. Rows of server tables are not clipped in any mode (DeepSpeed's norm covers its own
parameters only).
"""
from __future__ import annotations

import os
from typing import Any, Iterable, Mapping

import torch
import torch.distributed as dist
from picasso_ops.config import CacheConfig
from torch.nn.utils import parameters_to_vector

from .collective_guard import CollectiveWatch, DefaultGroupDeadline
from .engine import GBAEngine
from .model_check import check_gba_model
from .protocol import decode_int, joinable_key
from .ps import init_runtime
from .ps.link import LinkModel
from .ps.rendezvous import join_runtime
from .server_loop import ServerLoop
from .startup import (WorkerMPU, batch_shape, check_config, clip_norm, load_config, server_schedule,
                      with_schedule_peaks)
from .tables import server_tables


def initialize(model: torch.nn.Module, config: str | os.PathLike | Mapping[str, Any],
               model_parameters: Iterable[torch.nn.Parameter] | None = None, *, control_host: str = "127.0.0.1",
               row_cache: CacheConfig | None = None, link: LinkModel | None = None,
               **deepspeed_kwargs: Any) -> "GBAEngine":
    """Build the engine on every rank (workers: DeepSpeed + PS client; servers: serve the whole job, then return).

    ``config`` is a DeepSpeed JSON/hjson path or dict with a ``"gba"`` block; the model
    must be built identically on every rank (same seed), servers included. ``control_host``
    is the launch's master address (the launcher's ``MASTER_ADDR``): the first server hosts
    the control plane on its address that reaches it. Binds the model's server-table
    collections to the engine. ``row_cache``: a picasso ``cache`` block with ``store="ps"``
    puts a read cache of server rows on each worker (``row_cache.py``; ``rows`` per table).
    ``link``: a modelled slow link to the servers (``ps/link.py``); give the same on every rank.

    Refused on every rank before anything waits on another (``GBAModelError``, ``model_check.py``): modules
    that run collectives in their step or train rows on the workers (picasso's data-parallel / row-sharded /
    cached / plain packed tables); use ``gba_engine.packed_tables.ServerPackedFieldEmbeddings``. During the
    job a collective over the default group fails after ``gba.timeout_s``, and one the servers never join
    is named to the servers, which stop with ``StuckCollectiveError`` (``collective_guard.py``).

    Example::

        engine = initialize(model=net, config="ds_configs/gba_cpu.json", control_host="127.0.0.1")
        if not engine.is_server:
            loss = F.mse_loss(engine(x), y); engine.backward(loss); engine.step(); engine.close()
    """
    ds, gba, source = load_config(config)
    # every rank sees the same model: each refuses alone, before anything waits on another rank
    check_gba_model(model, entry=f"gba_engine.initialize ({source})")
    if not dist.is_initialized():
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo" if not torch.cuda.is_available() else "nccl")
    spec = check_config(ds, gba, dist.get_world_size(), source)
    tables, collections = server_tables(model)
    tables = with_schedule_peaks(tables, ds, spec)  # tables with their own optimizer follow the config's schedule
    # the servers never join a collective during the job: one over the default group fails after timeout_s
    deadline = DefaultGroupDeadline(gba.timeout_s)
    watch = None
    try:
        rt = init_runtime(gba, control_host=control_host, link=link)
        singles = [dist.new_group(ranks=[r], backend="gloo") for r in range(dist.get_world_size())]  # every rank: all
        flat0 = parameters_to_vector([p.detach().float() for p in model.parameters()]).clone()
        micro, gas = batch_shape(ds)
        if rt.is_server:
            try:
                stats = ServerLoop(rt, gba, spec, flat0, server_schedule(ds, spec), tables, clip_norm(ds)).run()
            finally:
                deadline.restore()  # the job is over on this rank: collectives wait as long as before
            rt.close()
            return GBAEngine(rt=rt, gba=gba, spec=spec, ds_engine=None, module=model, micro=micro, gas=gas,
                             server_stats=stats)
        watch = CollectiveWatch(rt, model)  # names a collective the servers never join, to this rank and the servers
        import deepspeed

        ds_engine, _, _, _ = deepspeed.initialize(model=model, config=ds,
                                                  mpu=WorkerMPU(rt.worker_group, singles[rt.rank]),
                                                  model_parameters=model_parameters if model_parameters is not None
                                                  else model.parameters(), **deepspeed_kwargs)
        engine = GBAEngine(rt=rt, gba=gba, spec=spec, ds_engine=ds_engine, module=model, micro=micro, gas=gas,
                           tables=tables, row_cache=row_cache, on_close=(watch.stop, deadline.restore),
                           table_schedule=server_schedule(ds, spec))
    except BaseException:
        if watch is not None:
            watch.stop()
        deadline.restore()
        raise
    for c in collections:
        c.bind(engine)
    return engine


def rejoin(model: torch.nn.Module, config: str | os.PathLike | Mapping[str, Any], worker: int,
           control_plane: str | os.PathLike | None = None, *, row_cache: CacheConfig | None = None,
           link: LinkModel | None = None) -> "GBAEngine":
    """Replace worker ``worker`` of a running job whose process died; returns its engine, in gba mode.

    Needs no torch.distributed: the new process reaches the servers through the control
    plane at ``control_plane`` (``HOST:PORT`` or a file holding it; default: the config's
    ``gba.control_file``, which the first server writes at launch) and a private gloo pair
    with each server. The job must be in a gba phase it keeps: mode ``gba``, or ``auto``
    after a lost worker pinned it to gba (DeepSpeed's all-reduce group is fixed at launch, so
    a restarted process cannot take part in sync training). The old process must be dead
    (its heartbeat stopped for 5 x ``heartbeat_s``). Every failed check is a clear error; the model is
    checked as in :func:`initialize` (``GBAModelError``) before anything is asked of the job.

    The engine has no DeepSpeed engine and no ``worker_group`` (collectives over the
    launch's workers cannot include it); :meth:`GBAEngine.claim_batches` continues the job's
    batch numbers (its ``start`` is ignored).

    Example::

        engine = gba_engine.rejoin(model=net, config="ds_configs/gba_cpu.json", worker=1)
        for index in engine.claim_batches(total=steps * engine.num_workers):
            engine.backward(loss_fn(engine(x[index]), y[index])); engine.step()
        engine.close()
    """
    ds, gba, source = load_config(config)
    check_gba_model(model, entry=f"gba_engine.rejoin ({source})")
    if gba.mode == "sync":
        raise ValueError(f"{source}: gba.mode='sync' has no parameter-server phase a restarted worker can join "
                         "(DeepSpeed's all-reduce group is fixed at launch); use mode gba or auto")
    control = control_plane if control_plane is not None else gba.control_file
    if control is None:
        raise ValueError(f"{source}: rejoin needs the job's control plane: set gba.control_file or pass "
                         "control_plane='HOST:PORT'")
    spec = check_config(ds, gba, None, source)  # config mistakes before anything is asked of the servers
    tables, collections = server_tables(model)
    tables = with_schedule_peaks(tables, ds, spec)
    try:
        rt = join_runtime(gba, worker, control, link=link)
    except ValueError as exc:
        raise ValueError(f"{source}: {exc}") from None
    phase = decode_int(rt.store.get(joinable_key()))
    micro, gas = batch_shape(ds)
    engine = GBAEngine(rt=rt, gba=gba, spec=spec, ds_engine=None, module=model, micro=micro, gas=gas, tables=tables,
                       joined_phase=phase, row_cache=row_cache)
    for c in collections:
        c.bind(engine)
    return engine
