"""The training engine of a recommender job behind one small interface, for each mode.

:func:`build_engine` returns a :class:`RecEngine` (DeepSpeed's engine, or a GBA worker's) or,
on a parameter-server rank, a :class:`ServedJob`: the servers serve the whole job inside
``gba_engine.initialize``, so there is nothing left to train. The loop, evaluation and
checkpoints talk to the interface and never ask which engine they have.

Example::

    built = build_engine(job, model, ctx)
    if isinstance(built, ServedJob):
        return built.stats
    loss = loss_fn(built(dense, values, lengths), labels); built.backward(loss); built.step()
"""
from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any, Iterator, Protocol, Sequence

import torch
import torch.distributed as dist

from sparse_scale.distenv import DistContext
from sparse_scale.rec.config import RecJobConfig, RecJobError
from sparse_scale.rec.job import RecJob

logger = logging.getLogger(__name__)

LIVE_GATHER_TIMEOUT_S = 600.0  # a live worker still scoring its shards is waited for this long
MonitorEvent = tuple[str, float, int]


class RecEngine(Protocol):
    """What a recommender job asks of its engine, whatever the mode."""

    module: torch.nn.Module
    worker_group: Any  # the process group of the ranks that train (None: every rank, or no collectives)

    def __call__(self, dense: torch.Tensor, values: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor: ...

    def backward(self, loss: torch.Tensor) -> None: ...

    def step(self) -> None:
        """The optimizer step (DeepSpeed's at the accumulation boundary, plus packed tables')."""

    def train(self) -> None: ...

    def eval(self) -> None: ...

    @property
    def mode(self) -> str:
        """``"sync"`` or ``"gba"`` (GBA engines), ``"deepspeed"`` otherwise."""

    @property
    def version(self) -> int:
        """Global updates applied to the model."""

    @property
    def batches_taken(self) -> int:
        """Job-wide batch numbers handed out so far (GBA engines)."""

    @property
    def samples_seen(self) -> int:
        """The x-axis of the engine's own monitor events."""

    @property
    def gathers_live(self) -> bool:
        """Whether end-of-job gathers go over the control plane (gba mode: a dead worker out, a rejoined one in)."""

    def claim_batches(self, total: int, start: int = 0) -> Iterator[int]: ...

    def gather_live(self, name: str, obj: Any) -> dict[int, Any]: ...

    def write_events(self, events: Sequence[MonitorEvent]) -> None:
        """Events to DeepSpeed's monitor (wandb, ...); nothing without a monitor."""

    def totals(self, samples: int, seconds: float) -> tuple[int, float]:
        """Samples summed over the workers and the longest training time among them."""

    def save_checkpoint(self, save_dir: str, tag: str, client_state: dict[str, Any]) -> None: ...

    def load_checkpoint(self, load_dir: str) -> tuple[str | None, dict[str, Any]]: ...

    def block_summary(self) -> dict[str, Any] | None:
        """The engine's own summary for summary.json (GBA: mode, switches, staleness), None for DeepSpeed's."""

    def close(self) -> None: ...


@dataclasses.dataclass(frozen=True)
class ServedJob:
    """A parameter-server rank's result: it served the whole job inside ``gba_engine.initialize``."""

    stats: dict[str, Any]


def _all_reduce_totals(samples: int, seconds: float, group: Any) -> tuple[int, float]:
    t = torch.tensor([float(samples)], dtype=torch.float64)
    slowest = torch.tensor([seconds], dtype=torch.float64)
    if dist.is_initialized():
        dist.all_reduce(t, group=group)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
    return int(t.item()), float(slowest.item())


class DeepSpeedRecEngine:
    """The engine of ``sparse_scale.initialize`` without a gba block: data parallel over all ranks.

    Its ``step``, ``save_checkpoint`` and ``load_checkpoint`` serve packed tables and MoE towers
    (``sparse_scale.engine.SparseEngine``); this class only adds the job's interface.
    """

    worker_group = None

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.module = engine.module

    def __call__(self, dense: torch.Tensor, values: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        return self.engine(dense, values, lengths)

    def backward(self, loss: torch.Tensor) -> None:
        self.engine.backward(loss)

    def step(self) -> None:
        self.engine.step()  # DeepSpeed's step, the tables' step and the expert biases at the boundary

    def train(self) -> None:
        self.engine.train()

    def eval(self) -> None:
        self.engine.eval()

    mode = "deepspeed"

    @property
    def version(self) -> int:
        return int(self.engine.global_steps)

    @property
    def batches_taken(self) -> int:
        raise RecJobError("batches are handed out by number only with a gba block")

    @property
    def samples_seen(self) -> int:
        return int(self.engine.global_samples)

    gathers_live = False

    def claim_batches(self, total: int, start: int = 0) -> Iterator[int]:
        raise RecJobError("batches are handed out by number only with a gba block")

    def gather_live(self, name: str, obj: Any) -> dict[int, Any]:
        raise RecJobError("live gathers need a gba block")

    def write_events(self, events: Sequence[MonitorEvent]) -> None:
        if events:
            self.engine.monitor.write_events(list(events))

    def totals(self, samples: int, seconds: float) -> tuple[int, float]:
        return _all_reduce_totals(samples, seconds, None)

    def save_checkpoint(self, save_dir: str, tag: str, client_state: dict[str, Any]) -> None:
        self.engine.save_checkpoint(save_dir, tag=tag, client_state=client_state)  # row-wise shards included

    def load_checkpoint(self, load_dir: str) -> tuple[str | None, dict[str, Any]]:
        try:
            return self.engine.load_checkpoint(load_dir)  # row-wise shards from every rank's file
        except ValueError as err:  # the module state does not fit the model
            raise RecJobError(f"--resume: {err}") from err

    def block_summary(self) -> None:
        return None

    def close(self) -> None:
        return None


class GBARecEngine:
    """A GBA worker's engine (launched, or a restarted worker's from ``gba_engine.rejoin``)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.module = engine.module
        self.worker_group = engine.worker_group  # None for a restarted worker: no collectives can include it

    def __call__(self, dense: torch.Tensor, values: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        return self.engine(dense, values, lengths)

    def backward(self, loss: torch.Tensor) -> None:
        self.engine.backward(loss)

    def step(self) -> None:
        self.engine.step()  # server tables (per-field or packed) take their update from the push

    def prefetch(self, values: torch.Tensor, lengths: torch.Tensor) -> None:
        """Start pulling the server rows the next batch (field-major ``values``/``lengths``) looks up; returns at once.

        Only with a row cache whose ``prefetch`` is on; call it after this batch's forward.
        """
        if self.engine.row_cache is None or not self.engine.row_cache.prefetch_enabled:
            return
        ids = next_lookup_ids(self.module, values, lengths)
        if ids:
            self.engine.prefetch_rows(ids)

    def train(self) -> None:
        self.engine.train()

    def eval(self) -> None:
        self.engine.eval()

    @property
    def mode(self) -> str:
        return self.engine.mode

    @property
    def version(self) -> int:
        return self.engine.version

    @property
    def batches_taken(self) -> int:
        return self.engine.batches_taken

    samples_seen = 0  # the engine keeps no sample count of its own; only picasso cache events use it

    @property
    def gathers_live(self) -> bool:
        return self.engine.mode == "gba"

    def claim_batches(self, total: int, start: int = 0) -> Iterator[int]:
        return self.engine.claim_batches(total, start=start)

    def gather_live(self, name: str, obj: Any) -> dict[int, Any]:
        return self.engine.gather_live(name, obj, timeout_s=LIVE_GATHER_TIMEOUT_S)

    def write_events(self, events: Sequence[MonitorEvent]) -> None:
        # a restarted worker (--rejoin-as) has no DeepSpeed engine, hence no monitor
        if events and self.engine.monitor is not None:
            self.engine.monitor.write_events(list(events))

    def totals(self, samples: int, seconds: float) -> tuple[int, float]:
        if self.gathers_live:
            got = self.gather_live("totals", (samples, seconds)).values()
            return sum(n for n, _ in got), max(t for _, t in got)
        return _all_reduce_totals(samples, seconds, self.worker_group)

    def save_checkpoint(self, save_dir: str, tag: str, client_state: dict[str, Any]) -> None:
        self.engine.save_checkpoint(save_dir, tag=tag, client_state=client_state)

    def load_checkpoint(self, load_dir: str) -> tuple[str | None, dict[str, Any]]:
        return self.engine.load_checkpoint(load_dir)

    def block_summary(self) -> dict[str, Any]:
        return self.engine.summary()  # mode, switches and their cost, staleness, per-worker samples/s

    def close(self) -> None:
        self.engine.close()  # the parameter servers stop once every worker closed


def next_lookup_ids(model: torch.nn.Module, values: torch.Tensor, lengths: torch.Tensor) -> dict[str, torch.Tensor]:
    """Unique ids per server table that ``model``'s lookups of a field-major batch read.

    Per-field server tables (``ServerFieldEmbeddings``) split ``values`` by field; packed ones
    (``ServerPackedFieldEmbeddings``) say their groups' ids through ``table_ids``.
    """
    from gba_engine.packed_tables import ServerPackedFieldEmbeddings
    from gba_engine.tables import ServerFieldEmbeddings

    out: dict[str, torch.Tensor] = {}
    for module in model.modules():
        if isinstance(module, ServerFieldEmbeddings):
            per_field = values.split(lengths.sum(dim=1).tolist())
            out.update({name: torch.unique(ids) for name, ids in zip(module.names, per_field)})
        elif isinstance(module, ServerPackedFieldEmbeddings):
            out.update({name: torch.unique(ids) for name, ids in module.table_ids(values, lengths).items()})
    return out


def control_file(gba: Any, out: str) -> str:
    """Where the servers' address is written for a restarted worker: beside the checkpoints unless the block says."""
    return gba.control_file or str(Path(out) / "gba_control_plane")


def rejoin_context(config: RecJobConfig) -> DistContext:
    """Where a restarted worker (``rejoin_as``) sits: its rank in the running job, read from the job's control plane."""
    from gba_engine import read_layout

    gba = config.loaded.blocks.get("gba")
    if gba is None:
        raise RecJobError(f"{config.config}: --rejoin-as needs a gba block (a restarted worker joins its servers)")
    control = control_file(gba, config.out)
    lay = read_layout(control, timeout_s=gba.timeout_s)
    if config.rejoin_as not in lay.workers:
        raise RecJobError(f"--rejoin-as {config.rejoin_as}: the job at {control} has workers {list(lay.workers)}")
    return DistContext(rank=config.rejoin_as, world_size=lay.world_size, local_rank=0, launcher="rejoin",
                       local_world_size=1)


def row_cache_config(job: RecJob) -> Any:
    """The picasso block's ``cache`` when it fronts the parameter servers (``store: "ps"``), else None."""
    block = job.picasso
    cache = block.cache if block is not None else None
    return cache if cache is not None and cache.store == "ps" else None


def _stream_reads_ahead(loaded: Any) -> Any:
    """``loaded`` without ``picasso.interleave.prefetch_batches`` for ``initialize``: the job's stream reads ahead
    itself (``initialize`` would wrap a loader it is not given and warn that none was)."""
    from sparse_scale.entry import with_block

    block = loaded.blocks.get("picasso")
    if block is None or block.interleave.prefetch_batches == 0:
        return loaded
    interleave = block.interleave.model_copy(update={"prefetch_batches": 0})
    return with_block(loaded, "picasso", block.model_copy(update={"interleave": interleave}))


def build_engine(job: RecJob, model: torch.nn.Module, ctx: DistContext) -> RecEngine | ServedJob:
    """The engine for the job's mode from ``sparse_scale.initialize`` (a gba block: a worker's, or a served job).

    ``ctx.master_addr`` is where the launcher put the rendezvous: the GBA control plane is reached there.
    """
    import sparse_scale
    from sparse_scale.entry import with_block

    loaded = _stream_reads_ahead(dataclasses.replace(job.config.loaded, ds=job.ds))  # scheduler length: --steps
    if job.gba is None:
        engine, *_ = sparse_scale.initialize(model=model, config=loaded, threads=job.config.threads)
        return DeepSpeedRecEngine(engine)
    import gba_engine

    from gba_engine.ps.link import LinkModel

    link = LinkModel(latency_ms=job.config.ps_link_latency_ms, mbit=job.config.ps_link_mbit)
    if job.config.rejoin_as is not None:
        block = {**job.gba.model_dump(), "control_file": control_file(job.gba, job.config.out)}
        return GBARecEngine(gba_engine.rejoin(model=model, config={**job.ds, "gba": block}, worker=job.config.rejoin_as,
                                              row_cache=row_cache_config(job), link=link))
    gba = job.gba.model_copy(update={"control_file": control_file(job.gba, job.config.out)})
    engine, *_ = sparse_scale.initialize(model=model, config=with_block(loaded, "gba", gba), threads=job.config.threads,
                                         gba_link=link)
    if engine.is_server:
        return ServedJob(engine.server_stats)
    return GBARecEngine(engine)
