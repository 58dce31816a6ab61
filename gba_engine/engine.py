"""``gba_engine.initialize``: a DeepSpeed engine that trains sync, gba, or switches between them by itself.

Modes (the ``"gba"`` block of the DeepSpeed config):

* ``sync``: DeepSpeed all-reduce over the worker group; the servers only update the rows of
  server tables (``tables.py``), once per global batch, and stay idle without them;
* ``gba``: every global batch goes through the parameter servers with token control:
  a worker pulls the dense vector and a token, computes its local gradient and pushes it;
  the servers apply the mean of M = number of workers gradients (same global batch,
  same optimizer and learning rate as sync);
* ``auto``: starts in sync; a :class:`~gba_engine.straggler.StragglerDetector` on the
  workers' local step times moves the job to gba when a worker straggles and back when it
  recovers. Each switch hands over parameters and optimizer state (``switch.py``).

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

import atexit
import json
import logging
import math
import os
import pickle
import time
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping

import torch
import torch.distributed as dist
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from sparse_scale.config import parse_config, read_config_file

from .checkpoint import load_shard, load_tables, save_shard
from .claims import BatchClaims
from .config import GBAConfig
from .observe import Observer
from .ps import OptimizerSpec, ParameterServer, PSClient, PSRuntime, init_runtime, layout
from .ps.runtime import Liveness, join_runtime, joinable_key, version_key
from .ps.schedule import ServerLRSchedule
from .ps.sharding import DenseSharding, EmbeddingSpec
from .straggler import StragglerDetector
from .tables import server_tables
from .switch import (TrainState, moment_names, recv_state, send_state, state_from_deepspeed, state_from_server,
                     state_into_deepspeed, state_into_server, wait_sent)

logger = logging.getLogger(__name__)

_POLL_S = 0.02


def _cmd_key(seq: int) -> str:
    return f"gba/cmd/{seq}"


def _ack_key(seq: int, server: int) -> str:
    return f"gba/ack/{seq}/{server}"


def _done_key(rank: int) -> str:
    return f"gba/done/{rank}"


def _exhausted_key(phase: int) -> str:
    return f"gba/exhausted/{phase}"


def _out_key(phase: int, rank: int) -> str:
    return f"gba/out/{phase}/{rank}"


def _end_key(phase: int) -> str:
    # set once per gba phase by compare_set: "leave|TARGET|REASON" (auto mode returns to sync) or "finished"
    # (the data ran out); whichever comes first wins, so a worker that has stopped is never asked to switch
    return f"gba/end/{phase}"


class _WorkerMPU:
    """The minimal ``mpu`` DeepSpeed needs so that its data-parallel group is the workers only."""

    def __init__(self, group: dist.ProcessGroup, own: dist.ProcessGroup) -> None:
        self.group = group
        self.own = own  # a group of this rank alone: DeepSpeed's model-parallel reductions must not reach the servers

    def get_data_parallel_group(self):
        return self.group

    def get_data_parallel_rank(self) -> int:
        return dist.get_rank(group=self.group)

    def get_data_parallel_world_size(self) -> int:
        return dist.get_world_size(group=self.group)

    def get_model_parallel_rank(self) -> int:
        return 0

    def get_model_parallel_world_size(self) -> int:
        return 1

    def get_model_parallel_group(self):
        return self.own


def _load(config: str | os.PathLike | Mapping[str, Any]) -> tuple[dict, GBAConfig, str]:
    if isinstance(config, Mapping):
        job, source = parse_config(dict(config)), "<dict>"
    else:
        source = str(config)
        job = parse_config(read_config_file(config), source=source)
    return dict(job.ds), job.blocks.get("gba") or GBAConfig(), source


def _check(ds: dict, gba: GBAConfig, world: int | None, source: str) -> OptimizerSpec:
    """Every config mistake as one clear ValueError, raised on every rank before any collective.

    ``world=None`` (a restarted worker, before it knows the launch) skips the layout check.
    """
    try:
        if world is not None:
            layout(world, gba.num_servers)
    except ValueError as exc:
        raise ValueError(f"{source}: {exc}") from None
    if "optimizer" not in ds:
        raise ValueError(f"{source}: gba needs an \"optimizer\" block: the servers run the same optimizer as DeepSpeed")
    try:
        spec = OptimizerSpec.from_deepspeed(ds["optimizer"])
    except ValueError as exc:
        raise ValueError(f"{source}: optimizer: {exc}") from None
    if gba.mode != "sync" and "scheduler" in ds:
        try:
            _schedule(ds, spec)
        except ValueError as exc:
            raise ValueError(f"{source}: scheduler: {exc}") from None
    stage = int((ds.get("zero_optimization") or {}).get("stage", 0))
    if gba.mode != "sync" and stage > 1:
        raise ValueError(f"{source}: gba.mode={gba.mode!r} supports zero_optimization.stage 0 or 1, got {stage} "
                         "(stage 2 reduces gradients inside backward, which gba mode must keep local)")
    if gba.mode != "sync" and (ds.get("fp16", {}).get("enabled") or ds.get("bf16", {}).get("enabled")):
        raise ValueError(f"{source}: gba.mode={gba.mode!r} needs fp32 training (the servers hold fp32 state)")
    clip = ds.get("gradient_clipping", 0.0)
    if isinstance(clip, bool) or not isinstance(clip, (int, float)) or clip < 0:
        raise ValueError(f"{source}: gradient_clipping must be a number >= 0 (0: off), got {clip!r}")
    return spec


def _clip_norm(ds: dict) -> float:
    """The max norm DeepSpeed clips the global-batch gradient to (its own default when the key is absent)."""
    from deepspeed.runtime.constants import GRADIENT_CLIPPING_DEFAULT

    return float(ds.get("gradient_clipping", GRADIENT_CLIPPING_DEFAULT))


def _schedule(ds: dict, spec: OptimizerSpec) -> ServerLRSchedule | None:
    """The servers' copy of the config's learning-rate schedule (None without a scheduler block)."""
    if "scheduler" not in ds:
        return None
    return ServerLRSchedule(ds["scheduler"], base_lr=float(spec.kwargs.get("lr", 1e-3)))


def initialize(model: torch.nn.Module, config: str | os.PathLike | Mapping[str, Any],
               model_parameters: Iterable[torch.nn.Parameter] | None = None, **deepspeed_kwargs: Any) -> "GBAEngine":
    """Build the engine on every rank (workers: DeepSpeed + PS client; servers: serve the whole job, then return).

    ``config`` is a DeepSpeed JSON/hjson path or dict with a ``"gba"`` block; the model
    must be built identically on every rank (same seed), servers included.

    Example::

        engine = initialize(model=net, config="ds_configs/gba_cpu.json")
        if not engine.is_server:
            loss = F.mse_loss(engine(x), y); engine.backward(loss); engine.step(); engine.close()
    """
    ds, gba, source = _load(config)
    if not dist.is_initialized():
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo" if not torch.cuda.is_available() else "nccl")
    spec = _check(ds, gba, dist.get_world_size(), source)
    tables, collections = server_tables(model)
    rt = init_runtime(gba)
    singles = [dist.new_group(ranks=[r], backend="gloo") for r in range(dist.get_world_size())]  # every rank creates all
    flat0 = parameters_to_vector([p.detach().float() for p in model.parameters()]).clone()
    micro = int(ds.get("train_micro_batch_size_per_gpu", 1))
    gas = int(ds.get("gradient_accumulation_steps", 1))
    if rt.is_server:
        loop = _ServerLoop(rt, gba, spec, flat0, _schedule(ds, spec), tables, _clip_norm(ds))
        stats = loop.run()
        rt.close()
        return GBAEngine(rt=rt, gba=gba, spec=spec, ds_engine=None, module=model, micro=micro, gas=gas,
                         server_stats=stats)
    import deepspeed

    ds_engine, _, _, _ = deepspeed.initialize(model=model, config=ds, mpu=_WorkerMPU(rt.worker_group, singles[rt.rank]),
                                              model_parameters=model_parameters if model_parameters is not None
                                              else model.parameters(), **deepspeed_kwargs)
    engine = GBAEngine(rt=rt, gba=gba, spec=spec, ds_engine=ds_engine, module=model, micro=micro, gas=gas,
                       tables=tables)
    for c in collections:
        c.bind(engine)
    return engine


def rejoin(model: torch.nn.Module, config: str | os.PathLike | Mapping[str, Any], worker: int,
           control_plane: str | os.PathLike | None = None) -> "GBAEngine":
    """Replace worker ``worker`` of a running job whose process died; returns its engine, in gba mode.

    Needs no torch.distributed: the new process reaches the servers through the control
    plane at ``control_plane`` (``HOST:PORT`` or a file holding it; default: the config's
    ``gba.control_file``, which the first server writes at launch) and a private gloo pair
    with each server. The job must be in a gba phase it keeps: mode ``gba``, or ``auto``
    after a lost worker pinned it to gba (DeepSpeed's all-reduce group is fixed at launch, so
    a restarted process cannot take part in sync training). The old process must be dead
    (its heartbeat stopped for 5 x ``heartbeat_s``). Every failed check is a clear error.

    The engine has no DeepSpeed engine and no ``worker_group`` (collectives over the
    launch's workers cannot include it); :meth:`GBAEngine.claim_batches` continues the job's
    batch numbers (its ``start`` is ignored).

    Example::

        engine = gba_engine.rejoin(model=net, config="ds_configs/gba_cpu.json", worker=1)
        for index in engine.claim_batches(total=steps * engine.num_workers):
            engine.backward(loss_fn(engine(x[index]), y[index])); engine.step()
        engine.close()
    """
    ds, gba, source = _load(config)
    if gba.mode == "sync":
        raise ValueError(f"{source}: gba.mode='sync' has no parameter-server phase a restarted worker can join "
                         "(DeepSpeed's all-reduce group is fixed at launch); use mode gba or auto")
    control = control_plane if control_plane is not None else gba.control_file
    if control is None:
        raise ValueError(f"{source}: rejoin needs the job's control plane: set gba.control_file or pass "
                         "control_plane='HOST:PORT'")
    spec = _check(ds, gba, None, source)  # config mistakes before anything is asked of the servers
    tables, collections = server_tables(model)
    try:
        rt = join_runtime(gba, worker, control)
    except ValueError as exc:
        raise ValueError(f"{source}: {exc}") from None
    phase = int(rt.store.get(joinable_key()))
    engine = GBAEngine(rt=rt, gba=gba, spec=spec, ds_engine=None, module=model,
                       micro=int(ds.get("train_micro_batch_size_per_gpu", 1)),
                       gas=int(ds.get("gradient_accumulation_steps", 1)), tables=tables, joined_phase=phase)
    for c in collections:
        c.bind(engine)
    return engine


class _ServerLoop:
    """Runs on a server rank: executes the first worker's commands (put/get state, serve, save, load)."""

    def __init__(self, rt: PSRuntime, gba: GBAConfig, spec: OptimizerSpec, flat0: torch.Tensor,
                 schedule: ServerLRSchedule | None, tables: list[EmbeddingSpec], clip_norm: float) -> None:
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
        self.totals: dict = {"received": 0, "counted": 0, "dropped": 0, "decayed": 0, "staleness": {},
                             "lost_workers": [], "rejoined": [], "version": 0, "pushes": {}}
        self.last_save = 0
        self.phase = 0  # gba phases served so far (the engine numbers them the same way)
        self.dense_phase = True

    def _publish(self, live: dict | None = None) -> None:
        out = json.loads(json.dumps(self.totals))
        if live:
            for k in ("received", "counted", "dropped", "decayed"):
                out[k] += live[k]
            for tau, n in live["staleness"].items():
                out["staleness"][str(tau)] = out["staleness"].get(str(tau), 0) + n
        out["version"] = self.state.version if live is None else live["version"]
        out["clipped"] = self.ps.clipped
        if live is not None:
            out["rejoined"] = out["rejoined"] + self.ps.rejoined
            out["lost_workers"] = sorted(set(out["lost_workers"]) | set(self.ps.lost_workers))
        self.rt.store.set(f"gba/stats/{self.index}", json.dumps(out))

    def tick(self, ps: ParameterServer) -> None:
        """During a gba phase: answer a pending save request, publish live stats."""
        if self.rt.store.check(["gba/save_req"]):
            req_id, min_version, path = self.rt.store.get("gba/save_req").decode().split("|", 2)
            # sync phase: wait until the rows hold the update of the workers' last global batch
            if int(req_id) > self.last_save and ps.version >= int(min_version):
                self.last_save = int(req_id)
                save_shard(state_from_server(ps), path, self.index, self.rt.layout.num_servers,
                           tables=ps.export_tables())
                self.rt.store.set(f"gba/save_done/{req_id}/{self.index}", "1")
        if not self.dense_phase:  # a tables-only (sync) phase: no end-of-data protocol, its pushes are not gba's
            self.state.version = self.totals["version"] = ps.version
            self._publish()
            return
        if not ps.data_ended and self.rt.store.check([_exhausted_key(self.phase)]):
            ps.end_of_data()  # no worker may wait for pushes that will never come
        self._publish({**ps.control.stats.as_dict(), "version": ps.version})

    def _wait_command(self, seq: int) -> dict | None:
        live = Liveness(self.rt, self.rt.layout.workers)
        while True:
            if self.rt.store.check([_cmd_key(seq)]):
                return json.loads(self.rt.store.get(_cmd_key(seq)))
            lost = live.poll()
            if all(w in lost or self.rt.store.check([_done_key(w)]) for w in self.rt.layout.workers):
                return None  # every worker finished or is gone: the job is over
            time.sleep(_POLL_S)

    def run(self) -> dict:
        """Serve commands until the job ends; returns the accumulated stats."""
        seq = 0
        while True:
            cmd = self._wait_command(seq)
            if cmd is None:
                break
            op, reply = cmd["op"], {}
            if op == "put_state":
                self.state = recv_state(cmd["src"], self.rt.ps_group, moment_names(self.spec))
            elif op == "get_state":
                works = send_state(self.state, cmd["src"], self.rt.ps_group)
                self.rt.store.set(_ack_key(seq, self.index), "{}")  # the doorbell: our sends are posted
                wait_sent(works)
                seq += 1
                continue
            elif op == "serve":
                reply = self._serve(int(cmd["m"]), dense=bool(cmd.get("dense", True)))
            elif op == "save":
                save_shard(self.state, cmd["path"], self.index, self.rt.layout.num_servers,
                           tables=self.ps.export_tables())
            elif op == "load":
                self.state = load_shard(cmd["path"], self.index, self.rt.layout.num_servers)
                if self.tables:
                    self.ps.import_tables(load_tables(cmd["path"], self.index, self.rt.layout.num_servers))
                    state_into_server(self.ps, self.state)  # the token clock of the rows: the checkpoint's version
            else:
                raise RuntimeError(f"server {self.index}: unknown command {cmd!r}")
            self._publish()
            self.rt.store.set(_ack_key(seq, self.index), json.dumps(reply))
            seq += 1
        self.totals["clipped"] = self.ps.clipped
        self._publish()
        return self.totals

    def _serve(self, m: int, dense: bool) -> dict:
        """One phase: gba (dense + tables through the servers) or, with ``dense=False``, sync's tables-only serving."""
        ps = self.ps
        self.dense_phase = dense
        ps.begin_phase(m, dense=dense)
        if dense:
            self.phase += 1
            if self.tables and self.state.version != ps.version:
                logger.warning("server %d: dense state at version %d, tables at %d", self.index, self.state.version,
                               ps.version)
            state_into_server(ps, self.state)
        stats = ps.serve(until_version=None)
        if not dense:
            self.state.version = ps.version  # the rows' updates are the job's global batches
            self.totals["version"] = ps.version
            self.totals["lost_workers"] = sorted(set(self.totals["lost_workers"]) | set(stats.lost_workers))
            return {"version": ps.version, "lost_workers": stats.lost_workers}
        self.state = state_from_server(ps)
        t = self.totals
        for k in ("received", "counted", "dropped", "decayed"):
            t[k] += stats.tokens[k]
        for tau, n in stats.tokens["staleness"].items():
            t["staleness"][str(tau)] = t["staleness"].get(str(tau), 0) + n
        t["lost_workers"] = sorted(set(t["lost_workers"]) | set(stats.lost_workers))
        t["rejoined"] = t["rejoined"] + stats.rejoined
        for w, n in stats.pushes.items():
            t["pushes"][str(w)] = t["pushes"].get(str(w), 0) + n
        t["version"] = ps.version
        return {"version": ps.version, "lost_workers": stats.lost_workers}


class GBAEngine:
    """DeepSpeedEngine's training surface over sync / gba / auto modes (build it with :func:`initialize`).

    Example::

        out = engine(x); engine.backward(loss_fn(out, y)); engine.step()
        engine.mode, engine.version, engine.summary()
    """

    def __init__(self, rt: PSRuntime, gba: GBAConfig, spec: OptimizerSpec, ds_engine, module: torch.nn.Module,
                 micro: int, gas: int, server_stats: dict | None = None,
                 tables: list[EmbeddingSpec] | None = None, joined_phase: int | None = None) -> None:
        self.rt, self.gba, self.spec, self.ds_engine, self.module = rt, gba, spec, ds_engine, module
        self.tables = list(tables or [])  # ServerEmbeddingBagCollection tables: rows on the servers in every mode
        self._pulled_rows: list[tuple[str, torch.Tensor, torch.Tensor]] = []  # (table, unique ids, leaf) this step
        self.micro_batch, self.gas = micro, gas
        self.server_stats = server_stats
        self.is_server = rt.is_server
        self.workers = rt.layout.workers
        self.num_workers = len(self.workers)
        self.mode = "gba" if gba.mode == "gba" else "sync"
        self.version = 0  # global updates applied to the model
        self.global_steps = 0  # local optimizer steps of this worker
        self.truth = "workers"  # where the current parameters live: "workers" (DeepSpeed) or "servers"
        self.monitor = ds_engine.monitor if ds_engine is not None else None
        self.observer = Observer(rt.rank, self.monitor, self.mode, micro * gas * self.num_workers)
        self.client: PSClient | None = None
        self.detector = StragglerDetector.from_config(gba.switch, self.num_workers, mode=self.mode)
        self._cmd_seq = 0
        self._save_id = 0
        self._phase = 0
        self._phase_pushes = 0
        self._phase_v0 = 0
        self._token = None
        self._micro = 0
        self._local_s = 0.0
        self._mark = time.perf_counter()
        self._times_seen: dict[int, int] = {}
        self._pinned = False
        self._claims: BatchClaims | None = None
        self._closed = self.is_server
        self._worker_live = Liveness(rt, self.workers) if not self.is_server else None
        self._first_live = Liveness(rt, self.workers[:1]) if not self.is_server else None  # auto: the coordinator
        self.rejoined = joined_phase is not None  # a restarted process (rejoin): gba only, no DeepSpeed engine
        if self.rejoined:
            self._join_phase(joined_phase)
        if not self.is_server:
            atexit.register(self.close)
            if self.mode == "sync":
                self._begin_table_phase()

    def _join_phase(self, phase: int) -> None:
        """A restarted worker enters the job's running gba phase, which it never leaves."""
        store = self.rt.store
        self.mode, self.truth, self._phase, self._pinned = "gba", "servers", phase, True
        self.observer.mode = "gba"
        versions = [int(store.get(version_key(s))) if store.check([version_key(s)]) else 0
                    for s in self.rt.layout.servers]
        self._phase_v0 = self.version = min(versions)  # max_lead counts this worker's pulls from here
        self._cmd_seq = 0
        while store.check([_cmd_key(self._cmd_seq)]):  # a restarted first worker continues the command sequence
            self._cmd_seq += 1
        self.client = PSClient(self.rt, sum(p.numel() for p in self.module.parameters()), self.tables)
        self.detector = StragglerDetector.from_config(self.gba.switch, self.num_workers, mode="gba")

    # ------------------------------------------------------------------ DeepSpeedEngine surface
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward(*args, **kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The module's forward; in gba mode the first micro-batch of a step pulls fresh parameters first."""
        self._worker_only("forward")
        if self.mode == "gba" and self.client is None:
            self._enter_gba()
        if self.mode == "gba" and not self.module.training:
            return self.module(*args, **kwargs)  # evaluation: parameters pulled by eval(), no token taken
        if self.mode == "gba":
            if self._token is None:
                t0 = time.perf_counter()
                self._pull()
                self._local_s -= time.perf_counter() - t0  # waiting for the servers is not this worker's slowness
            return self.module(*args, **kwargs)
        return self.ds_engine(*args, **kwargs)

    def backward(self, loss: torch.Tensor) -> None:
        """Local backward (gba) or DeepSpeed's backward with its all-reduce (sync)."""
        self._worker_only("backward")
        self._local_s += time.perf_counter() - self._mark  # data + forward + user work: local, no waiting on peers
        if self.mode == "gba":
            (loss / self.gas).backward()
        else:
            self.ds_engine.backward(loss)

    def step(self) -> None:
        """Optimizer step at the accumulation boundary: DeepSpeed's (sync) or a push to the servers (gba)."""
        self._worker_only("step")
        if self.mode == "gba":
            self._micro += 1
            boundary = self._micro == self.gas
            if boundary:
                self._push()
        else:
            boundary = self.ds_engine.is_gradient_accumulation_boundary()
            self.ds_engine.step()
            if boundary:
                self._push_rows()
                self.version += 1
        if boundary:
            self._after_update()
        self._mark = time.perf_counter()

    def train(self, mode: bool = True) -> "GBAEngine":
        """Training mode of the module (like DeepSpeedEngine.train)."""
        self.module.train(mode)
        return self

    def eval(self) -> "GBAEngine":
        """Evaluation mode; in gba mode the module first gets the servers' latest parameters."""
        self.module.eval()
        if self.mode == "gba" and self.client is not None and self._token is None:
            got = self.client.pull(dense=True)
            with torch.no_grad():
                vector_to_parameters(got.dense, self.module.parameters())
        return self

    @property
    def worker_group(self) -> dist.ProcessGroup | None:
        """The workers' process group (DeepSpeed's data-parallel group); None on server ranks.

        Example::

            dist.all_reduce(t, group=engine.worker_group)     # a collective the servers take no part in
        """
        return self.rt.worker_group

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
        self._claims = BatchClaims(self.rt.store, self.num_workers, self.workers.index(self.rt.rank), total)
        if self.rejoined:
            self._claims.join_gba(self._phase)
        elif self.mode == "gba":
            if self.client is None:
                self._enter_gba()  # numbers a gba phase on every worker, so enter it before the first claim
            self._claims.enter_gba(self._phase, start)
        else:
            self._claims.enter_sync(start)
        while (index := self._next_claim()) is not None:
            yield index

    @property
    def batches_taken(self) -> int:
        """Batches handed out job-wide by :meth:`claim_batches` so far (0 before it starts)."""
        return 0 if self._claims is None else self._claims.taken

    def _next_claim(self) -> int | None:
        index = self._claims.next()
        if index is not None or self._claims.mode == "sync":
            return index
        # gba phase out of batches: nobody may wait for pushes of a worker that stopped
        store, phase = self.rt.store, self._phase
        store.set(_exhausted_key(phase), "1")
        if self.gba.mode == "auto":
            end = store.compare_set(_end_key(phase), "", "finished").decode()
            if end.startswith("leave|"):  # the first worker asked for sync before the data ran out: join it
                self._leave_gba(reason=end.split("|", 2)[2])
                return self._next_claim()
        store.set(_out_key(phase, self.rt.rank), "1")
        live = self._worker_live  # one tracker per engine: a worker found lost once costs no new lease
        waiting = set(self.workers)
        while waiting:  # a dead worker is dropped by its missing heartbeat, so this cannot hang
            waiting = {w for w in waiting - live.poll() if not store.check([_out_key(phase, w)])}
            if waiting:
                time.sleep(_POLL_S)
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
        store = self.rt.store
        key = lambda w: f"gba/gather/{name}/{w}"  # noqa: E731
        store.set(key(self.rt.rank), pickle.dumps(obj))
        live = self._worker_live  # one tracker per engine: a worker found lost once costs no new lease
        deadline = time.monotonic() + (self.rt.timeout_s if timeout_s is None else timeout_s)
        waiting = set(self.workers)
        while True:
            waiting = {w for w in waiting if not store.check([key(w)])}
            if waiting <= live.poll():
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank {self.rt.rank}: live workers {sorted(waiting)} did not reach gather "
                                   f"{name!r} within {timeout_s or self.rt.timeout_s:.0f}s")
            time.sleep(_POLL_S)
        return {w: pickle.loads(store.get(key(w))) for w in self.workers if store.check([key(w)])}

    def is_gradient_accumulation_boundary(self) -> bool:
        """Whether the next :meth:`step` ends an accumulation window (DeepSpeedEngine's contract)."""
        if self.mode == "gba":
            return self._micro + 1 == self.gas
        return self.ds_engine.is_gradient_accumulation_boundary()

    # ------------------------------------------------------------------ gba mode
    def _pull(self) -> None:
        lead = self.gba.max_lead
        min_version = None if lead is None else max(0, self._phase_v0 + self._phase_pushes - lead)
        got = self.client.pull(dense=True, min_version=min_version)
        with torch.no_grad():
            vector_to_parameters(got.dense, self.module.parameters())
        self._token = got.token
        self.version = min(got.token)

    def _push(self) -> None:
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.module.parameters()]
        ids, rows = self._row_grads()
        self.client.push(parameters_to_vector(grads), ids, rows, self._token, num_samples=self.micro_batch * self.gas)
        for p in self.module.parameters():
            p.grad = None
        self._token, self._micro = None, 0
        self._phase_pushes += 1

    # ------------------------------------------------------------------ tables on the servers (every mode)
    def fetch_rows(self, ids: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Rows of unique ``ids`` per server table (what a bound ``ServerEmbeddingBagCollection`` asks for).

        Sync: waits for the update of this worker's previous global batch (``min_version``),
        so every worker reads the rows sync training would. gba: the servers' current rows.
        The wait is not counted as this worker's step time (it waits on its peers).
        """
        self._worker_only("fetch_rows")
        if self.client is None:
            if self.mode == "gba":
                self._enter_gba()
            else:
                raise RuntimeError("server tables need the parameter servers' client: none is open (after close()?)")
        t0 = time.perf_counter()
        got = self.client.pull(dict(ids), dense=False, min_version=self.version if self.mode == "sync" else None)
        self._local_s -= time.perf_counter() - t0
        if self.mode == "sync" and self._token is None and self.module.training:
            self._token = got.token
        return got.rows

    def record_rows(self, table: str, ids: torch.Tensor, rows: torch.Tensor) -> None:
        """Keep a pulled leaf; its gradient goes to the servers at the step boundary."""
        self._pulled_rows.append((table, ids, rows))

    def table_rows(self, table: str, ids: torch.Tensor) -> torch.Tensor:
        """The servers' rows of ``table`` for ``ids`` (evaluation, export, tests): ``ids.shape + (dim,)``.

        Sync: the rows after this worker's last global batch; gba: the servers' current rows.

        Example::

            engine.table_rows("user", torch.arange(10))       # [10, dim]
        """
        self._worker_only("table_rows")
        if self.client is None:
            raise RuntimeError("no parameter-server client is open: call table_rows during training, before close()")
        min_version = self.version if self.mode == "sync" else None  # sync: after this worker's last global batch
        return self.client.pull({table: ids}, dense=False, min_version=min_version).rows[table]

    def _row_grads(self) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        ids: dict[str, list] = {}
        grads: dict[str, list] = {}
        for table, unique, leaf in self._pulled_rows:
            if leaf.grad is not None:
                ids.setdefault(table, []).append(unique)
                grads.setdefault(table, []).append(leaf.grad)
        self._pulled_rows = []
        return ({t: torch.cat(v) for t, v in ids.items()}, {t: torch.cat(v) for t, v in grads.items()})

    def _push_rows(self) -> None:
        """Sync mode: this worker's row gradients of the global batch (the servers apply all N at once)."""
        if not self.tables:
            return
        if self._token is None:  # no lookup this step: the servers still count this worker's share of the batch
            self._token = self.client.pull({}, dense=False, min_version=self.version).token
        ids, rows = self._row_grads()
        self.client.push(None, ids, rows, self._token, num_samples=self.micro_batch * self.gas)
        self._token = None

    def _begin_table_phase(self) -> None:
        """Sync mode with server tables: the servers serve the rows (no dense part), one update per global batch."""
        if not self.tables:
            return
        if self.rt.rank == self.workers[0]:
            self._command("serve", m=self.num_workers, dense=False)  # acknowledged when the phase ends
        self.client = PSClient(self.rt, sum(p.numel() for p in self.module.parameters()), self.tables,
                               tables_only=True)

    def _end_table_phase(self) -> None:
        if self.client is not None:
            self.client.close()  # the servers' phase ends once every worker said goodbye
            self.client = None

    def _enter_gba(self, reason: str = "mode gba", slow: frozenset = frozenset()) -> None:
        t0 = time.perf_counter()
        nbytes = 0
        self._end_table_phase()
        first = self.rt.rank == self.workers[0]
        if self.truth == "workers":
            st = state_from_deepspeed(self.ds_engine, self.spec, self.version)  # collective under ZeRO
            nbytes = st.nbytes
            if first:
                bounds = DenseSharding(st.params.numel(), self.rt.layout.num_servers).bounds
                sends = [send_state(st.shard(a, b), s, self.rt.ps_group) for s, (a, b) in zip(self.rt.layout.servers, bounds)]
                self._wait_acks(self._command("put_state", src=self.rt.rank))
                for works in sends:
                    wait_sent(works)
            self.truth = "servers"
        if first:
            self._command("serve", m=self.gba.grads_per_update or self.num_workers)  # acknowledged when the phase ends
        self._phase += 1
        if first and self.gba.mode == "gba":  # the job never leaves this phase: a restarted worker may join it
            self.rt.store.set(joinable_key(), str(self._phase))
        self._phase_v0, self._phase_pushes, self._token, self._micro = self.version, 0, None, 0
        if self._claims is not None:
            self._claims.enter_gba(self._phase, self._claims.taken)  # sync lockstep: the same base everywhere
        self.client = PSClient(self.rt, sum(p.numel() for p in self.module.parameters()), self.tables)
        # the workers that made us switch stay slow until a full window of their own times says otherwise
        self.detector = StragglerDetector.from_config(self.gba.switch, self.num_workers, mode="gba", slow=slow)
        self._switched(self.observer.mode, "gba", t0, nbytes, reason)

    def _leave_gba(self, reason: str) -> None:
        t0 = time.perf_counter()
        self.client.close()
        self.client = None
        first = self.rt.rank == self.workers[0]
        if first:
            seq = self._command("get_state", src=self.rt.rank)
            self._wait_acks(seq)
            st = TrainState.join([recv_state(s, self.rt.ps_group, moment_names(self.spec))
                                  for s in self.rt.layout.servers])
            meta = torch.tensor([st.params.numel(), st.step, st.version], dtype=torch.int64)
            flat = torch.cat([st.params] + [st.moments[k] for k in sorted(st.moments)])
        else:
            meta = torch.zeros(3, dtype=torch.int64)
        dist.broadcast(meta, src=self.workers[0], group=self.rt.worker_group)
        n, step, version = meta.tolist()
        names = sorted(moment_names(self.spec))
        if not first:
            flat = torch.empty(n * (1 + len(names)))
        dist.broadcast(flat, src=self.workers[0], group=self.rt.worker_group)
        parts = flat.split(n)
        st = TrainState(parts[0], {k: parts[1 + i] for i, k in enumerate(names)}, step, version)
        state_into_deepspeed(self.ds_engine, st, self.spec)
        self._position_scheduler(version)
        for p in self.module.parameters():
            p.grad = None
        if self._claims is not None:  # the sync phase starts after every number anybody took in gba
            free = torch.tensor([self._claims.next_free], dtype=torch.int64)
            dist.all_reduce(free, op=dist.ReduceOp.MAX, group=self.rt.worker_group)
            self._claims.enter_sync(int(free))
        self.version, self.truth, self.mode = version, "workers", "sync"
        self._begin_table_phase()
        self.detector = StragglerDetector.from_config(self.gba.switch, self.num_workers, mode="sync")
        self._switched("gba", "sync", t0, st.nbytes, reason)

    def _position_scheduler(self, version: int) -> None:
        # DeepSpeed's next optimizer step is update `version`: its scheduler must sit at iteration version - 1,
        # and its step/sample clocks (checkpoint tags, the monitor's x-axis) must count the servers' updates too
        sched = self.ds_engine.lr_scheduler
        if sched is not None and version > 0:
            sched.step(version - 1)
        self.ds_engine.global_steps = version
        self.ds_engine.global_samples = version * self.ds_engine.train_batch_size()

    def _switched(self, src: str, dst: str, t0: float, nbytes: int, reason: str) -> None:
        self.mode = dst
        if src != dst:
            self.observer.on_switch(self.global_steps, src, dst, time.perf_counter() - t0, nbytes, reason)
        else:
            self.observer.mode = dst

    # ------------------------------------------------------------------ auto mode
    def _after_update(self) -> None:
        local = self._local_s
        self._local_s = 0.0
        self.global_steps += 1
        self.observer.on_step(self.micro_batch * self.gas, local, self.version)
        store = self.rt.store
        store.set(f"gba/rate/{self.rt.rank}", repr(self.observer.samples_per_s))
        if self.gba.mode != "auto":
            return
        if self.mode == "sync":
            times = torch.zeros(self.num_workers, dtype=torch.float64)
            mine = torch.tensor([local], dtype=torch.float64)
            gathered = [torch.zeros(1, dtype=torch.float64) for _ in range(self.num_workers)]
            dist.all_gather(gathered, mine, group=self.rt.worker_group)  # same rows on every worker: same decision
            times = [float(t) for t in gathered]
            d = self.detector.observe(times)
            if d.switched and d.mode == "gba":
                self._enter_gba(reason=f"slow workers {sorted(d.slow)}, ratios {[round(r, 2) for r in d.ratios]}",
                                slow=d.slow)
            return
        store.set(f"gba/t/{self.rt.rank}", f"{self.global_steps}:{local!r}")
        end_key = _end_key(self._phase)
        if self.rt.rank == self.workers[0] and not self._pinned and not store.check([end_key]):
            times = []
            for w in self.workers:
                raw = store.get(f"gba/t/{w}").decode() if store.check([f"gba/t/{w}"]) else "0:nan"
                count, _, t = raw.partition(":")
                fresh = int(count) != self._times_seen.get(w)
                self._times_seen[w] = int(count)
                times.append(float(t) if fresh else math.nan)
            lost = self._worker_live.poll()
            if lost:
                self._pinned = True  # DeepSpeed's all-reduce cannot run without them: stay in gba
                store.set(joinable_key(), str(self._phase))  # ... where a restarted worker may join
                logger.warning("gba: workers %s are gone; auto mode stays in gba", sorted(lost))
            else:
                d = self.detector.observe(times)
                if d.switched and d.mode == "sync":  # loses to a "finished" some worker set first
                    store.compare_set(end_key, "", f"leave|{self._leave_target()}|recovered, ratios "
                                               f"{[round(r, 2) for r in d.ratios]}")
        elif self.rt.rank != self.workers[0] and not self._pinned and self._first_live.poll():
            # the first worker alone asks for sync: without it the job stays in gba, where a restarted one may join
            self._pinned = True
            store.set(joinable_key(), str(self._phase))
            logger.warning("gba: the first worker %d is gone; auto mode stays in gba", self.workers[0])
        if store.check([end_key]):
            kind, _, rest = store.get(end_key).decode().partition("|")
            target, _, reason = rest.partition("|")
            if kind == "leave" and self._phase_pushes >= int(target):
                self._leave_gba(reason=reason)

    def _leave_target(self) -> int:
        """Pushes of this phase after which every worker leaves gba (decided by the first worker).

        Under ``max_lead = k`` another worker can be at most k + 1 pushes ahead of this one
        and every worker can reach the target without waiting on a worker that left, so all
        leave after the same number of steps (lockstep: the switch is exact). Fully async
        workers leave at their next step boundary (nobody ever waits in a pull).
        """
        lead = self.gba.max_lead
        return 0 if lead is None else self._phase_pushes + lead + 1

    # ------------------------------------------------------------------ commands to the servers (first worker)
    def _command(self, op: str, **kw: Any) -> int:
        seq = self._cmd_seq
        self.rt.store.set(_cmd_key(seq), json.dumps({"op": op, **kw}))
        self._cmd_seq += 1
        return seq

    def _wait_acks(self, seq: int, timeout_s: float | None = None) -> list[dict]:
        deadline = time.monotonic() + (timeout_s or self.rt.timeout_s)
        keys = [_ack_key(seq, s) for s in range(self.rt.layout.num_servers)]
        while not self.rt.store.check(keys):
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank {self.rt.rank}: servers did not acknowledge command {seq} within "
                                   f"{timeout_s or self.rt.timeout_s:.0f}s")
            time.sleep(_POLL_S)
        return [json.loads(self.rt.store.get(k)) for k in keys]

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, save_dir: str | os.PathLike, tag: str | None = None,
                        client_state: dict | None = None) -> str:
        """Save where the truth lives: the workers' full state (sync) or the server shards (gba); returns the folder.

        Server tables are saved by the servers in every mode (rows, their optimizer state, the
        version). In sync mode every worker must call it (ZeRO state is gathered over the
        workers); in gba mode only the first worker waits for the servers, the others return at once.
        """
        self._worker_only("save_checkpoint")
        tag = tag or f"global_step{self.global_steps}"
        folder = Path(save_dir) / tag
        first = self.rt.rank == self.workers[0]
        if self.truth == "workers":
            # not DeepSpeed's save_checkpoint: it ends in a barrier over all ranks, which the servers never enter
            st = state_from_deepspeed(self.ds_engine, self.spec, self.version)  # collective over the workers
            if first:
                folder.mkdir(parents=True, exist_ok=True)
                torch.save({"params": st.params, "moments": st.moments, "step": st.step, "version": st.version},
                           folder / "gba_worker_state.pt")
        if first and (self.truth == "servers" or self.tables):
            self._save_id += 1
            # sync: the servers save once the rows hold the last global batch (every worker has pushed it)
            min_version = self.version if self.mode == "sync" else 0
            self.rt.store.set("gba/save_req", f"{self._save_id}|{min_version}|{folder}")
            keys = [f"gba/save_done/{self._save_id}/{s}" for s in range(self.rt.layout.num_servers)]
            deadline = time.monotonic() + self.rt.timeout_s
            while not self.rt.store.check(keys):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"parameter servers did not save {folder} within {self.rt.timeout_s:.0f}s")
                time.sleep(_POLL_S)
        if first:
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "gba_meta.json").write_text(json.dumps({"truth": self.truth, "mode": self.mode,
                                                              "version": self.version,
                                                              "num_servers": self.rt.layout.num_servers,
                                                              "tables": [t.name for t in self.tables]}))
            torch.save(client_state or {}, folder / "client_state.pt")
            (Path(save_dir) / "latest").write_text(tag)
        return str(folder)

    def load_checkpoint(self, load_dir: str | os.PathLike, tag: str | None = None) -> tuple[str | None, dict]:
        """Restore a checkpoint written by :meth:`save_checkpoint`; call it before training or in sync mode."""
        self._worker_only("load_checkpoint")
        if self.rejoined:
            raise RuntimeError("a rejoined worker trains on the running job's state; it cannot load a checkpoint")
        if self.mode == "gba" and self.client is not None:
            raise RuntimeError("load_checkpoint must be called before training starts or in sync mode, not in gba")
        latest = Path(load_dir) / "latest"
        if tag is None:
            if not latest.exists():
                return None, {}
            tag = latest.read_text().strip()
        folder = Path(load_dir) / tag
        meta = json.loads((folder / "gba_meta.json").read_text())
        if bool(meta.get("tables")) != bool(self.tables):
            raise ValueError(f"{folder}: checkpoint {'has' if meta.get('tables') else 'has no'} server tables, this "
                             f"model {'has' if self.tables else 'has none'}")
        self._end_table_phase()  # the servers read commands only between phases
        if meta["truth"] == "workers":
            raw = torch.load(folder / "gba_worker_state.pt", weights_only=True)
            st = TrainState(raw["params"], dict(raw["moments"]), int(raw["step"]), int(raw["version"]))
            state_into_deepspeed(self.ds_engine, st, self.spec)
            self._position_scheduler(st.version)
            self.version, self.truth = st.version, "workers"
            if self.tables:
                self._load_on_servers(folder)
                if self.mode == "sync":
                    self._begin_table_phase()
            return str(folder), torch.load(folder / "client_state.pt", weights_only=False)
        self._load_on_servers(folder)
        self.version, self.truth = int(meta["version"]), "servers"
        if self.mode == "sync":  # bring the restored state into DeepSpeed
            self.mode = "gba"
            self._enter_gba("restore")
            self._leave_gba("restore")
        return str(folder), torch.load(folder / "client_state.pt", weights_only=False)

    def _load_on_servers(self, folder: Path) -> None:
        if self.rt.rank == self.workers[0]:
            self._wait_acks(self._command("load", path=str(folder)))
        dist.barrier(group=self.rt.worker_group)  # nobody pulls before the servers hold the restored state

    # ------------------------------------------------------------------ end of job
    def summary(self) -> dict:
        """Mode, switches and their cost, staleness histogram, decayed/dropped, per-worker samples/s."""
        store = self.rt.store
        servers = [json.loads(store.get(f"gba/stats/{s}")) for s in range(self.rt.layout.num_servers)
                   if store.check([f"gba/stats/{s}"])]
        rates = {w: float(store.get(f"gba/rate/{w}")) for w in self.workers if store.check([f"gba/rate/{w}"])}
        return self.observer.summary(servers, rates)

    def close(self) -> None:
        """Leave the job: goodbye to the servers; the servers stop once every worker closed (or died)."""
        if self._closed:
            return
        self._closed = True
        try:
            if self.client is not None:
                self.client.close()
                self.client = None
            self.rt.store.set(_done_key(self.rt.rank), "1")
        except Exception as exc:  # the servers may already be gone after a failure: nothing left to tell
            logger.info("rank %d: close could not reach the servers: %s", self.rt.rank, exc)
        self.rt.close()

    def _worker_only(self, what: str) -> None:
        if self.is_server:
            raise RuntimeError(f"{what}() on parameter-server rank {self.rt.rank}: servers have already served the "
                               "job inside initialize(); skip the training loop when engine.is_server")
        if self._closed:
            raise RuntimeError(f"{what}() after close()")
