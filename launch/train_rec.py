"""Train a wide-and-deep CTR model with DeepSpeed on a synthetic stream, Criteo TSV or parquet.

Runs unchanged under the deepspeed launcher, mpirun, srun or as one plain process:

    deepspeed --num_gpus 2 launch/train_rec.py --config ds_configs/demo_cpu.json
    mpirun -n 2 python launch/train_rec.py --config ds_configs/demo_cpu.json
    python launch/train_rec.py --config ds_configs/demo_cpu.json --steps 50

Rank 0 prints a progress bar and a final summary table and writes OUT/summary.json.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import os
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Iterator

# Entry scripts live beside their launch helpers; library code never imports from here.
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from sparse_scale.distenv import DistContext, init_distributed  # noqa: E402
from sparse_scale.reporting import finish_wandb, print_table, setup_wandb_env, wandb_dir  # noqa: E402
from picasso_ops.data.batch import CTRBatch  # noqa: E402
from picasso_ops.data.prefetch import Prefetcher  # noqa: E402
from picasso_ops.data.row_range import RowRangeReader  # noqa: E402
from picasso_ops.data.synthetic import SyntheticConfig, SyntheticCTRGenerator, SyntheticCTRStream  # noqa: E402
from picasso_ops.data.metrics import auc, log_loss  # noqa: E402
from picasso_ops.distributed import engine_step  # noqa: E402
from picasso_ops.embedding.sparse_optim import OPTIMIZERS  # noqa: E402
from picasso_ops.models import (DLRM, DLRMArgs, SparseArgs, WideAndDeep, WideAndDeepArgs, packed_dlrm,  # noqa: E402
                                packed_wide_and_deep)
from picasso_ops.block import (PicassoBlockError, apply_picasso_block, cached_field_embeddings,  # noqa: E402
                                flush_caches, monitor_events, picasso_summary)
from sparse_scale.config import load_config  # noqa: E402

logger = logging.getLogger("train_rec")
CALIBRATION_STEPS = 3  # undelayed micro-steps whose median forward+backward a --straggler factor scales


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True, help="DeepSpeed JSON/hjson with optional picasso/gba blocks")
    p.add_argument("--steps", type=int, default=1500, help="optimizer steps to train (in total, across resumes)")
    p.add_argument("--out", default="runs/train_rec", help="folder for checkpoints, wandb and summary.json")
    p.add_argument("--data", choices=["synthetic", "criteo", "parquet"], default="synthetic")
    p.add_argument("--train-files", nargs="*", default=[], help="Criteo TSV or parquet files (--data criteo|parquet)")
    p.add_argument("--eval-files", nargs="*", default=[], help="held-out files (--data criteo|parquet)")
    p.add_argument("--max-bad-fraction", type=float, default=0.01, help="bad rows tolerated before failing")
    p.add_argument("--fields", type=int, default=26, help="categorical fields (synthetic)")
    p.add_argument("--vocab", type=int, default=2000, help="rows per field (synthetic) or hash buckets (files)")
    p.add_argument("--zipf", type=float, default=1.1, help="Zipf exponent of the synthetic ids")
    p.add_argument("--max-hot", type=int, default=3, help="max ids per field and sample (synthetic)")
    p.add_argument("--num-dense", type=int, default=13)
    p.add_argument("--embedding-dim", type=int, default=16)
    p.add_argument("--model", choices=["wide_deep", "dlrm"], default="wide_deep",
                   help="wide-and-deep (wide ids + FM + MLP, mean pooling) or DLRM (bottom MLP, dot interactions, "
                        "top MLP, sum pooling); either over per-field tables, or packed ones with a picasso block")
    p.add_argument("--eval-samples", type=int, default=200_000, help="held-out samples (synthetic)")
    p.add_argument("--eval-every", type=int, default=0, help="evaluate every N steps (0: only at the end)")
    p.add_argument("--save-every", type=int, default=0, help="checkpoint every N steps (0: only at the end)")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in OUT/checkpoints")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--threads", type=int, default=0, help="torch threads per rank (0: cores / local ranks)")
    p.add_argument("--straggler", action="append", default=[], type=parse_straggler, metavar="RANK:FACTOR[:START-END]",
                   help="slow RANK by FACTOR (sleeping (FACTOR-1) x its forward+backward time, the median of its "
                        "first 3 micro-steps, before each backward), optionally only for optimizer steps "
                        "START <= step < END (with a gba block: job-wide steps); repeatable (demos, benchmarks)")
    p.add_argument("--server-tables", action="store_true",
                   help="with a gba block: the embedding tables live on the parameter servers (rows by id, updated "
                        "once per global batch in sync mode too) instead of in the workers' dense parameters")
    p.add_argument("--rejoin-as", type=int, default=None, metavar="WORKER",
                   help="with a gba block: replace worker WORKER of the running job (same --config and --out) whose "
                        "process died; needs no launcher, finds the servers through gba.control_file "
                        "(default OUT/gba_control_plane) and takes the job's next batch numbers")
    p.add_argument("--crash", type=parse_crash, default=None, metavar="RANK:STEP",
                   help="RANK exits at once (code 17, no goodbye) after its optimizer step STEP: fault-tolerance "
                        "demos and tests (in gba mode the others go on; --rejoin-as replaces it)")
    p.add_argument("--local_rank", type=int, default=-1, help=argparse.SUPPRESS)  # set by the deepspeed launcher
    return p.parse_args(argv)


@dataclasses.dataclass(frozen=True)
class Straggler:
    """One ``--straggler RANK:FACTOR[:START-END]`` option."""

    rank: int
    factor: float
    start: int = 0
    end: int | None = None  # exclusive; None: until the end

    def delay_s(self, rank: int, step: int, compute_s: float) -> float:
        """Seconds to sleep on ``rank`` at optimizer step ``step`` for a step of ``compute_s`` compute."""
        if rank != self.rank or step < self.start or (self.end is not None and step >= self.end):
            return 0.0
        return (self.factor - 1.0) * compute_s


def parse_straggler(text: str) -> Straggler:
    """``"1:4"`` (rank 1, 4x slower throughout) or ``"1:4:20-60"`` (only for steps 20..59).

    Example::

        parse_straggler("1:4:20-60")      # Straggler(rank=1, factor=4.0, start=20, end=60)
    """
    parts = text.split(":")
    try:
        if len(parts) not in (2, 3):
            raise ValueError("expected RANK:FACTOR or RANK:FACTOR:START-END")
        rank, factor = int(parts[0]), float(parts[1])
        start, end = 0, None
        if len(parts) == 3:
            a, _, b = parts[2].partition("-")
            start, end = int(a), int(b)
            if end <= start:
                raise ValueError(f"empty step window {start}-{end}")
        if rank < 0 or factor < 1.0:
            raise ValueError("RANK must be >= 0 and FACTOR >= 1")
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"--straggler {text!r}: {exc}") from None
    return Straggler(rank, factor, start, end)


class ClaimedBatches:
    """Micro-batches of the batch numbers a GBAEngine hands this worker (fast workers take more).

    Batch number ``i`` is the job's global micro-batches ``i*gas .. i*gas+gas-1``: of the synthetic
    stream (with gas 1 a sync run reads exactly the per-rank streams' batches) or, for files, global
    rows ``[j*micro_batch, (j+1)*micro_batch)`` of micro-batch ``j`` (``RowRangeReader``). ``index``
    is the number being trained; ``state()`` the job-wide resume point.

    Example::

        for batch in ClaimedBatches(engine, SyntheticCTRGenerator.for_config(cfg), 256, gas=1, total=1000):
            ...
    """

    def __init__(self, engine: Any, source: Any, micro_batch: int, gas: int, total: int, start: int = 0) -> None:
        self.engine, self.micro_batch, self.gas, self.total, self.start = engine, micro_batch, gas, total, start
        self.source = source  # SyntheticCTRGenerator or RowRangeReader
        self.index = -1

    def _micro(self, j: int) -> CTRBatch:
        if isinstance(self.source, RowRangeReader):
            return self.source.rows(j * self.micro_batch, (j + 1) * self.micro_batch)
        return self.source.batch(self.micro_batch, j, "train")

    def __iter__(self) -> Iterator[CTRBatch]:
        for index in self.engine.claim_batches(self.total, start=self.start):
            self.index = index
            for j in range(self.gas):
                yield self._micro(index * self.gas + j)

    def state(self) -> dict[str, int]:
        """The resume point: every batch number below it was handed out."""
        return {"batches_taken": self.engine.batches_taken}


@dataclasses.dataclass
class Progress:
    step: int = 0  # optimizer steps done
    micro_batches: int = 0  # batches consumed by each rank (ranks run in lockstep)
    samples: int = 0  # global samples trained



def _gather_cat(t: torch.Tensor, group: Any = None) -> torch.Tensor:
    """Concatenate a 1-D tensor of any length from every rank of ``group`` (default: all), in rank order."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return t
    world = dist.get_world_size(group)
    n = torch.tensor([t.numel()])
    sizes = [torch.zeros_like(n) for _ in range(world)]
    dist.all_gather(sizes, n, group=group)
    width = int(max(s.item() for s in sizes))
    padded = torch.zeros(width, dtype=t.dtype)
    padded[: t.numel()] = t
    parts = [torch.zeros_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded, group=group)
    return torch.cat([p[: int(s.item())] for p, s in zip(parts, sizes)])


CRASH_EXIT_CODE = 17


def parse_crash(text: str) -> tuple[int, int]:
    """``"1:3"``: rank 1 exits after its optimizer step 3.

    Example::

        parse_crash("1:3")      # (1, 3)
    """
    try:
        rank, step = (int(x) for x in text.split(":"))
        if rank < 0 or step < 1:
            raise ValueError("RANK must be >= 0 and STEP >= 1")
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"--crash {text!r}: {exc} (expected RANK:STEP)") from None
    return rank, step


class RecJob:
    """Everything one rank needs to train and evaluate; built from the CLI arguments."""

    def __init__(self, args: argparse.Namespace, rank: int, world_size: int):
        self.args, self.rank, self.world_size = args, rank, world_size
        self.job = load_config(args.config)
        self.gba = self.job.blocks.get("gba")
        if self.gba is not None:
            if "picasso" in self.job.blocks:
                raise SystemExit(f"{args.config}: the gba and picasso blocks cannot be combined yet (the parameter "
                                 "servers hold the dense parameters; packed tables update on the workers)")
            if self.gba.mode != "sync" and args.eval_every:
                raise SystemExit(f"{args.config}: --eval-every with gba.mode={self.gba.mode!r}: workers run at their "
                                 "own pace in gba mode and evaluation is a collective over them; evaluate at the end "
                                 "(or score the --save-every checkpoints)")
            if args.rejoin_as is not None and args.resume:
                raise SystemExit("--rejoin-as continues the running job's state; it cannot --resume a checkpoint")
            if args.rejoin_as is not None and self.gba.mode == "sync":
                raise SystemExit(f"{args.config}: --rejoin-as needs gba.mode gba or auto: a sync job keeps DeepSpeed's "
                                 "fixed all-reduce group, which a restarted process cannot join")
            # the last num_servers ranks are parameter servers: data is split over the workers only
            self.world_size = max(1, world_size - self.gba.num_servers)
        elif args.rejoin_as is not None:
            raise SystemExit(f"{args.config}: --rejoin-as needs a gba block (a restarted worker joins its servers)")
        elif args.server_tables:
            raise SystemExit(f"{args.config}: --server-tables needs a gba block (the tables live on its parameter "
                             "servers)")
        self.ds = _with_schedule_length(self.job.ds, args.steps)
        self.micro_batch = int(self.ds.get("train_micro_batch_size_per_gpu", 256))
        self.grad_accum = int(self.ds.get("gradient_accumulation_steps", 1))
        self.data_cfg = None
        if args.data == "synthetic":
            self.data_cfg = SyntheticConfig(
                num_fields=args.fields, vocab_sizes=args.vocab, zipf_exponent=args.zipf,
                max_ids_per_field=args.max_hot, num_dense=args.num_dense, seed=args.seed,
            )
            self.vocab_sizes = self.data_cfg.field_vocab_sizes()
            self.num_dense = args.num_dense
        else:
            self.vocab_sizes = [args.vocab] * 26
            self.num_dense = 13
        shape = DLRMArgs if args.model == "dlrm" else WideAndDeepArgs
        self.model_args = shape(vocab_sizes=self.vocab_sizes, num_dense=self.num_dense, embedding_dim=args.embedding_dim)

    @property
    def claims_batches(self) -> bool:
        """Whether batches are handed out by number through the GBA engine (every job with a gba block)."""
        return self.gba is not None

    def train_stream(self, progress: "Progress", data_states: list[dict] | None, engine: Any = None):
        """This rank's training stream, positioned after what ``progress`` says was consumed.

        With ``picasso.interleave.prefetch_batches`` N > 0 the synthetic and file streams are read
        N batches ahead on a thread (a :class:`Prefetcher`, closed by the caller); its ``state()`` is
        the position of the batches *consumed*, which is what checkpoints record.
        """
        if self.claims_batches:
            # never prefetched: a claim is a job-wide batch number taken from the GBA engine's store, and
            # claiming ahead on a thread would take numbers this worker may never train (and a block
            # carrying prefetch_batches cannot be combined with gba yet anyway)
            start = int(data_states[0]["batches_taken"]) if data_states else 0
            total = self.args.steps * self.world_size
            if self.data_cfg is not None:
                source: Any = SyntheticCTRGenerator.for_config(self.data_cfg)
            else:  # batch k = file rows [k*gas*B, (k+1)*gas*B): each worker reads forward to its numbers
                source = RowRangeReader(lambda row: self._file_reader(self.args.train_files, row, sharded=False))
                in_files = source.num_rows // (self.micro_batch * self.grad_accum)  # whole batches only
                if in_files < total and self.rank == 0:
                    print(f"the training files hold {in_files:,} whole batches of {self.micro_batch * self.grad_accum} "
                          f"rows, fewer than --steps x workers = {total:,}: training on those")
                total = min(total, in_files)
            return ClaimedBatches(engine, source, self.micro_batch, self.grad_accum, total=total, start=start)
        if self.data_cfg is not None:
            stream = SyntheticCTRStream(self.data_cfg, self.micro_batch, rank=self.rank, world_size=self.world_size,
                                        split="train", start_batch=progress.micro_batches * self.world_size)
            return self._prefetched(stream)
        start_row = 0
        if data_states:
            if len(data_states) != self.world_size:
                raise SystemExit(f"--resume: the checkpoint was written by {len(data_states)} ranks reading files; "
                                 f"resume file streams with the same number of ranks, not {self.world_size}")
            start_row = int(data_states[self.rank]["next_row"])  # exact even when bad rows were skipped
        return self._prefetched(self._file_reader(self.args.train_files, start_row))

    def _prefetched(self, stream):
        """``stream``, read ``picasso.interleave.prefetch_batches`` batches ahead on a thread when that is > 0."""
        block = self.job.blocks.get("picasso")
        depth = block.interleave.prefetch_batches if block is not None else 0
        if depth == 0:
            return stream
        if self.rank == 0:
            logger.info("picasso interleave: training batches read %d ahead on a thread", depth)
        return Prefetcher(stream, depth, state=stream.state, name=f"train_rec-data-rank{self.rank}")

    def eval_stream(self, shard: int | None = None):
        """The held-out batches of ``shard`` (default: this rank's) of ``world_size`` shards."""
        shard = self.rank if shard is None else shard
        if self.data_cfg is not None:
            total = math.ceil(self.args.eval_samples / self.micro_batch)
            return SyntheticCTRStream(self.data_cfg, self.micro_batch, rank=shard, world_size=self.world_size,
                                      split="eval", num_batches=total)
        return self._file_reader(self.args.eval_files, 0, shard=shard)

    def _file_reader(self, files: list[str], start_row: int, sharded: bool = True, shard: int | None = None):
        if not files:
            raise SystemExit(f"--data {self.args.data} needs --train-files and --eval-files")
        from picasso_ops.data.criteo import CriteoTSVReader
        from picasso_ops.data.parquet import ParquetCTRReader

        cls = CriteoTSVReader if self.args.data == "criteo" else ParquetCTRReader
        rank, world = (self.rank if shard is None else shard, self.world_size) if sharded else (0, 1)
        return cls(files, self.micro_batch, vocab_sizes=self.args.vocab, rank=rank, world_size=world,
                   start_row=start_row, max_bad_fraction=self.args.max_bad_fraction)


def _with_schedule_length(ds: dict[str, Any], steps: int) -> dict[str, Any]:
    """A copy of the DeepSpeed dict whose scheduler ``total_num_steps: "auto"`` is ``--steps``."""
    params = ds.get("scheduler", {}).get("params", {})
    if params.get("total_num_steps") != "auto":
        return dict(ds)
    return {**ds, "scheduler": {**ds["scheduler"], "params": {**params, "total_num_steps": steps}}}


def _global_batch(batch: CTRBatch | None, finite: bool, micro_batch: int, group: Any = None) -> int:
    """Samples in this micro-step over all ranks, or 0 when any rank's stream has ended.

    File streams can end at different rows on different ranks (and the last batch may be
    short), so they pay one tiny all-reduce per micro-step; the synthetic stream never ends.
    """
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    if not finite:
        return micro_batch * world
    have_and_size = torch.tensor([0, 0] if batch is None else [1, batch.batch_size])
    if world > 1:
        dist.all_reduce(have_and_size, group=group)
    return int(have_and_size[1]) if int(have_and_size[0]) == world else 0


def _monitor_write(engine, events: list) -> None:
    # a restarted gba worker (--rejoin-as) has no DeepSpeed engine, hence no monitor
    if events and getattr(engine, "monitor", None) is not None:
        engine.monitor.write_events(events)


def _log_cache_stats(engine) -> None:
    """The picasso cache's hit rate and counters so far to the monitor (nothing without a cache)."""
    _monitor_write(engine, monitor_events(engine.module, int(getattr(engine, "global_samples", 0))))


def _gathers_live(engine) -> bool:
    """In gba mode the end-of-job gathers go over the control plane: a dead worker is left out, a rejoined one in."""
    return getattr(engine, "mode", None) == "gba" and hasattr(engine, "gather_live")


LIVE_GATHER_TIMEOUT_S = 600.0  # a live worker still scoring its shards is waited for this long


def _score(engine, stream) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    scores, labels, teacher = [], [], []
    with torch.no_grad():
        for batch in stream:
            scores.append(torch.sigmoid(engine(batch.dense, batch.values, batch.lengths)).float())
            labels.append(batch.labels)
            if batch.teacher_prob is not None:
                teacher.append(batch.teacher_prob)
    return torch.cat(scores), torch.cat(labels), torch.cat(teacher) if teacher else None


def _metrics(s: torch.Tensor, y: torch.Tensor, t: torch.Tensor | None) -> dict[str, float]:
    out = {"auc": auc(s, y), "log_loss": log_loss(s, y), "eval_samples": float(s.numel())}
    if t is not None:
        out["bayes_auc"] = auc(t, y)
        out["bayes_log_loss"] = log_loss(t, y)
    return out


def evaluate(engine, job: RecJob) -> dict[str, float]:
    """Exact AUC and log loss over the whole held-out set, gathered from every rank."""
    flush_caches(engine.module)  # picasso cache: the stores hold every trained row before scoring
    _log_cache_stats(engine)
    engine.eval()
    if _gathers_live(engine):
        out = _evaluate_live(engine, job)
        engine.train()
        return out
    s, y, t = _score(engine, job.eval_stream())
    engine.train()
    group = getattr(engine, "worker_group", None)  # gba: the parameter servers take no part
    return _metrics(_gather_cat(s, group), _gather_cat(y, group), None if t is None else _gather_cat(t, group))


def _evaluate_live(engine, job: RecJob) -> dict[str, float]:
    """gba mode: every live worker scores its shard, the first live one also the shards of dead workers."""
    live = sorted(engine.gather_live("eval/ready", job.rank, timeout_s=LIVE_GATHER_TIMEOUT_S))
    shards = [job.rank] + ([w for w in range(job.world_size) if w not in live] if job.rank == live[0] else [])
    if len(shards) > 1:
        logger.warning("evaluation: workers %s are gone; worker %d scores their shards too", shards[1:], job.rank)
    mine = {w: _score(engine, job.eval_stream(shard=w)) for w in shards}
    parts: dict[int, tuple] = {}
    for got in engine.gather_live("eval/scores", mine, timeout_s=LIVE_GATHER_TIMEOUT_S).values():
        parts.update(got)
    order = sorted(parts)  # shard order: the same concatenation as the collective path
    teacher = None if parts[order[0]][2] is None else torch.cat([parts[w][2] for w in order])
    return _metrics(torch.cat([parts[w][0] for w in order]), torch.cat([parts[w][1] for w in order]), teacher)


def _save_due(every: int, progress: Progress, stream, taken_before: int, mode_before: str | None, engine,
              job: RecJob) -> bool:
    """Whether this step ends a ``--save-every`` period; with claimed batches every worker must agree when sync."""
    if not isinstance(stream, ClaimedBatches):
        return progress.step % every == 0
    if mode_before == "gba" and engine.mode == "sync":
        return False  # just back from gba: the workers' counts before this step differ, the next period will save
    period = every * job.world_size
    return stream.state()["batches_taken"] // period > taken_before // period


def _monitor_x(engine, job: RecJob, progress: Progress, claimed: bool) -> int:
    """The monitor's x-axis: the job's samples (with claimed batches: updates x global batch, as DeepSpeed counts)."""
    if not claimed:
        return progress.samples
    return engine.version * job.micro_batch * job.grad_accum * job.world_size


def _job_totals(samples: int, seconds: float, group: Any, engine: Any = None) -> tuple[int, float]:
    """Samples summed over the workers and the longest training time among them."""
    if _gathers_live(engine):
        got = engine.gather_live("totals", (samples, seconds), timeout_s=LIVE_GATHER_TIMEOUT_S).values()
        return sum(n for n, _ in got), max(t for _, t in got)
    t = torch.tensor([float(samples)], dtype=torch.float64)
    slowest = torch.tensor([seconds], dtype=torch.float64)
    if dist.is_initialized():
        dist.all_reduce(t, group=group)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
    return int(t.item()), float(slowest.item())


def _tag(progress: Progress, stream) -> str:
    # claimed batches: the job-wide count, the same on every worker whenever a save is collective (sync)
    return f"batch{stream.state()['batches_taken']}" if isinstance(stream, ClaimedBatches) else f"step{progress.step}"


def _save(engine, ckpt_dir: Path, progress: Progress, stream) -> str:
    tag = _tag(progress, stream)
    group = getattr(engine, "worker_group", None)  # gba: the parameter servers take no part
    if isinstance(stream, ClaimedBatches):
        states = [stream.state()]  # one job-wide resume point; no collective (gba-mode saves are the first worker's)
    else:
        states = [None] * dist.get_world_size(group)
        dist.all_gather_object(states, stream.state(), group=group)  # DeepSpeed writes client_state from rank 0 only
    flush_caches(engine.module)  # picasso cache: dirty rows go to the stores the checkpoint is read from
    engine.save_checkpoint(str(ckpt_dir), tag=tag,
                           client_state={"progress": dataclasses.asdict(progress), "data_states": states})
    return str(ckpt_dir / tag)


def sparse_args(block: Any) -> SparseArgs:
    """The packed tables' settings from a validated ``picasso`` block.

    Only the hyperparameters the chosen optimizer takes are passed (``eps``
    means nothing to sgd). Tables are data-parallel unless the block carries
    ``sharding: "row_wise"``.
    """
    opt = block.optimizer
    params = {k: float(getattr(opt, k)) for k in OPTIMIZERS[opt.type].defaults}
    return SparseArgs(optimizer=opt.type, optimizer_params=params, packing=block.packing,
                      sharding=getattr(block, "sharding", "data_parallel"))


def scheduled_sparse_lr(block: Any) -> float | None:
    """The packed tables' peak lr for ``engine_step`` when they follow DeepSpeed's schedule, else ``None``.

    ``picasso.optimizer.lr_schedule`` ``"deepspeed"``: the tables' lr at each step
    is ``picasso.optimizer.lr`` x DeepSpeed's lr of that step / its schedule's
    peak; ``"constant"`` (or no picasso block): ``None``, the block's lr throughout.

    Example::

        >>> from picasso_ops.config import PicassoConfig
        >>> scheduled_sparse_lr(PicassoConfig.model_validate({"optimizer": {"type": "adam", "lr": 0.001}}))
        0.001
    """
    if block is None or block.optimizer.lr_schedule != "deepspeed":
        return None
    return float(block.optimizer.lr)


def build_model(job: RecJob) -> torch.nn.Module:
    """The CTR model for this job.

    Without a ``picasso`` block: wide-and-deep (``--model dlrm``: DLRM) over one
    ``nn.EmbeddingBag`` per field. With it: the same model over packed tables (packing, embedding_dim
    and the fused sparse optimizer from the block), whose update runs in
    ``engine_step`` at the accumulation boundary (see picasso_ops.distributed.step),
    served through a hot-row cache with a ``cache`` block and run as interleaved
    micro-batches with ``interleave.micro_batches > 1`` (see picasso_ops.block).
    With ``--server-tables`` (gba block): the same model, its tables on the parameter servers.
    """
    block = job.job.blocks.get("picasso")
    a, dlrm = job.model_args, job.args.model == "dlrm"
    if job.args.server_tables:  # RecJob allows it with a gba block only
        from gba_engine.tables import ServerFieldEmbeddings

        deep = ServerFieldEmbeddings(a.vocab_sizes, a.embedding_dim, a.pooling, 0.01, "deep", seed=job.args.seed)
        if dlrm:
            return DLRM(a, embeddings=deep)
        return WideAndDeep(a, embeddings=deep,
                           wide=ServerFieldEmbeddings(a.vocab_sizes, 1, a.pooling, 0.0, "wide", seed=job.args.seed))
    if block is None:
        return DLRM(a) if dlrm else WideAndDeep(a)
    args = dataclasses.replace(a, embedding_dim=block.embedding_dim)
    sparse = sparse_args(block)
    if job.rank == 0:
        logger.info("picasso model (%s): packing=%s dim=%d sparse optimizer %s %s (lr schedule: %s), %s tables",
                    job.args.model, block.packing, block.embedding_dim, sparse.optimizer,
                    dict(sparse.optimizer_params), block.optimizer.lr_schedule, sparse.sharding)
    try:
        # mmap cache stores live beside the checkpoints; one file per rank (every rank holds every row)
        workdir = Path(job.args.out)
        if dlrm:  # with a cache, apply_picasso_block moves the packed tables into the store
            model = packed_dlrm(args, sparse)
        else:
            factory = None
            if block.cache is not None and block.sharding == "data_parallel":  # tables straight into the store
                factory = cached_field_embeddings(block, workdir=workdir, rank=job.rank)
            model = packed_wide_and_deep(args, sparse, field_embeddings=factory)
        return apply_picasso_block(model, block, workdir=workdir, rank=job.rank)
    except PicassoBlockError as exc:
        raise SystemExit(f"{job.args.config}: {exc}") from None


def build_engine(job: RecJob, model: torch.nn.Module):
    """The training engine: DeepSpeed's, data parallel over all ranks; with a ``gba`` block a GBAEngine.

    A GBAEngine trains on the workers only; on parameter-server ranks ``initialize`` serves
    the whole job and returns an engine with ``is_server=True`` (the caller stops there).
    """
    if job.gba is not None:
        import gba_engine

        block = {**job.gba.model_dump(), "control_file": _control_file(job.gba, job.args.out)}
        if job.args.rejoin_as is not None:
            return gba_engine.rejoin(model=model, config={**job.ds, "gba": block}, worker=job.args.rejoin_as)
        return gba_engine.initialize(model=model, config={**job.ds, "gba": block})
    import deepspeed

    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=job.ds)
    return engine


def _control_file(gba: Any, out: str) -> str:
    """Where the servers' address is written for a restarted worker: beside the checkpoints unless the block says."""
    return gba.control_file or str(Path(out) / "gba_control_plane")


def _rejoin_context(args: argparse.Namespace) -> DistContext:
    """Where a restarted worker sits: its rank in the running job, read from the job's control plane."""
    from gba_engine import read_layout

    job = load_config(args.config)
    gba = job.blocks.get("gba")
    if gba is None:
        raise SystemExit(f"{args.config}: --rejoin-as needs a gba block (a restarted worker joins its servers)")
    control = _control_file(gba, args.out)
    lay = read_layout(control, timeout_s=gba.timeout_s)
    if args.rejoin_as not in lay.workers:
        raise SystemExit(f"--rejoin-as {args.rejoin_as}: the job at {control} has workers {list(lay.workers)}")
    return DistContext(rank=args.rejoin_as, world_size=lay.world_size, local_rank=0, launcher="rejoin",
                       local_world_size=1)


def train(args: argparse.Namespace) -> dict[str, Any]:
    out = Path(args.out)
    wandb_mode = setup_wandb_env(out)
    ctx = _rejoin_context(args) if args.rejoin_as is not None else init_distributed()
    rank, world = ctx.rank, ctx.world_size
    threads = args.threads or max(1, (os.cpu_count() or 1) // max(1, ctx.local_world_size or ctx.world_size))
    torch.set_num_threads(threads)
    torch.manual_seed(args.seed)
    from tqdm import tqdm

    job = RecJob(args, rank, world)
    model = build_model(job)
    engine = build_engine(job, model)
    if getattr(engine, "is_server", False):
        return {"server": True, "gba_server": engine.server_stats}  # served the whole job inside build_engine
    group = getattr(engine, "worker_group", None)
    stragglers = [s for s in args.straggler if s.rank == rank]
    ckpt_dir = out / "checkpoints"
    progress, data_states = Progress(), None
    if args.resume:
        path, client = engine.load_checkpoint(str(ckpt_dir))
        if path is None:
            raise SystemExit(f"--resume: no checkpoint found in {ckpt_dir}")
        progress, data_states = Progress(**client["progress"]), client.get("data_states")
        if rank == 0:
            print(f"resumed from {path} at step {progress.step} (batch {progress.micro_batches} of each rank)")

    # picasso tables' peak lr when they follow DeepSpeed's scheduler (engine_step scales it each step), else None
    sparse_lr = scheduled_sparse_lr(job.job.blocks.get("picasso"))
    loss_fn = torch.nn.BCEWithLogitsLoss()
    bar = tqdm(total=args.steps, initial=progress.step, desc="train", unit="step", disable=rank != 0,
               dynamic_ncols=True, mininterval=1.0)
    stream = job.train_stream(progress, data_states, engine)
    claimed = isinstance(stream, ClaimedBatches)  # gba block: the job's total is shared, fast workers take more
    batches, finite = iter(stream), job.data_cfg is None
    train_time, samples_this_run, history, last_ckpt = 0.0, 0, [], None
    running = torch.zeros(2)
    exhausted = False
    # forward+backward of this rank's first micro-steps, when nobody is slowed yet: the time a --straggler factor
    # scales, fixed for the run (a live step time would include all-reduce waits for another slow rank)
    calibration: list[float] = []
    while (claimed or progress.step < args.steps) and not exhausted:
        t0, step_samples = time.perf_counter(), 0
        # one store read per step, and only when periodic saves need to know where the step started
        taken_before, mode_before = (stream.state()["batches_taken"], engine.mode) if claimed and args.save_every \
            else (0, None)
        for _ in range(job.grad_accum):
            batch = next(batches, None)
            if claimed:  # no collective per micro-step: the engine says when the shared total is used up
                global_batch = 0 if batch is None else batch.batch_size  # files: bad rows are not samples
            else:
                global_batch = _global_batch(batch, finite, job.micro_batch, group)
            if global_batch == 0:
                exhausted = True  # a partial accumulation window is dropped, like drop_last
                break
            tc = time.perf_counter()
            loss = loss_fn(engine(batch.dense, batch.values, batch.lengths), batch.labels)
            fwd_s = time.perf_counter() - tc
            job_step = stream.index // job.world_size if claimed else progress.step  # windows are job-wide with gba
            if len(calibration) >= CALIBRATION_STEPS:
                base = statistics.median(calibration)
                delay = sum(s.delay_s(rank, job_step, base) for s in stragglers)
                if delay:
                    time.sleep(delay)  # before backward: the engine counts it as this worker's own compute
            tb = time.perf_counter()
            engine.backward(loss)
            if stragglers and len(calibration) < CALIBRATION_STEPS:
                calibration.append(fwd_s + time.perf_counter() - tb)
            if job.gba is not None:
                engine.step()  # no packed tables with gba (RecJob rejects the picasso block)
            else:
                engine_step(engine, sparse_lr=sparse_lr)  # engine.step() + the packed tables' step at the boundary
            progress.micro_batches += 1
            step_samples += global_batch  # claimed: this worker's samples (the job's are summed at the end)
            running += torch.tensor([loss.item(), 1.0])
        if exhausted:
            break
        progress.step += 1
        if args.crash is not None and args.crash == (rank, progress.step) and args.rejoin_as is None:
            os._exit(CRASH_EXIT_CODE)  # a crash: no goodbye to the servers, no cleanup
        progress.samples += step_samples
        x = _monitor_x(engine, job, progress, claimed)
        samples_this_run += step_samples
        train_time += time.perf_counter() - t0
        bar.update(1)
        if progress.step % 50 == 0:
            mean_loss = (running[0] / running[1]).item()
            running.zero_()
            bar.set_postfix(loss=f"{mean_loss:.4f}")
            _monitor_write(engine, [("train/loss", mean_loss, x),
                                         ("train/samples_per_s", progress.samples / max(train_time, 1e-9), x)])
        if args.eval_every and progress.step % args.eval_every == 0 and progress.step < args.steps:
            metrics = evaluate(engine, job)
            history.append({"step": progress.step, **metrics})
            _monitor_write(engine, [(f"eval/{k}", v, x) for k, v in metrics.items()])
        if args.save_every and _save_due(args.save_every, progress, stream, taken_before, mode_before, engine, job):
            last_ckpt = _save(engine, ckpt_dir, progress, stream)
    bar.close()
    if isinstance(stream, Prefetcher):
        # stop reading ahead before evaluating; state() keeps the consumed position for the last save.
        # (if the loop raised: a daemon thread, stopped when the prefetcher is collected or the process exits)
        stream.close()
    if exhausted and rank == 0 and not claimed:
        print(f"training data ran out after {progress.step} steps ({progress.samples:,} samples)")

    metrics = evaluate(engine, job)
    _monitor_write(engine, [(f"eval/{k}", v, _monitor_x(engine, job, progress, claimed)) for k, v in metrics.items()])
    if last_ckpt is None or Path(last_ckpt).name != _tag(progress, stream):
        last_ckpt = _save(engine, ckpt_dir, progress, stream)
    samples, rate = progress.samples, samples_this_run / max(train_time, 1e-9)
    if claimed:  # workers trained different shares: the job's samples over the slowest worker's time
        samples, slowest = _job_totals(samples_this_run, train_time, group, engine)
        rate = samples / max(slowest, 1e-9)
    summary = {
        "model": args.model,
        "world_size": world,
        "launcher": ctx.launcher,
        "steps": progress.step,
        "samples": samples,
        "samples_per_s": rate,
        "train_time_s": train_time,
        "local_samples": samples_this_run,
        **metrics,
        "checkpoint": last_ckpt,
        "wandb_mode": wandb_mode,
        "wandb_dir": wandb_dir(rank),
        "eval_history": history,
    }
    if "picasso" in job.job.blocks:
        summary["picasso"] = picasso_summary(engine.module)  # cache hit rate (training lookups), micro-batches
    if job.gba is not None:
        summary["gba"] = engine.summary()  # mode, switches and their cost, staleness, per-worker samples/s
        engine.close()  # the parameter servers stop once every worker closed
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        (out / "summary.json").write_text(json.dumps(summary, indent=2))
        _print_summary(summary)
    finish_wandb(rank)
    return summary




def _gba_rows(g: dict[str, Any] | None) -> list[tuple[str, str]]:
    """Summary-table rows of a GBA job: mode, switches and their cost, staleness, per-worker samples/s."""
    if not g:
        return []
    rows = [("gba mode (end) / steps per mode", f"{g['mode']} / {g['steps_per_mode']}"),
            ("gba switches", f"{len(g['switches'])} ({g['switch_seconds']:.3f} s, {g['switch_bytes'] / 1e6:.2f} MB)")]
    rows += [(f"  step {e['step']}", f"{e['src']} -> {e['dst']}: {e['reason']}") for e in g["switches"]]
    if g["staleness_histogram"]:
        rows.append(("gba staleness (tau: grads)", ", ".join(f"{t}: {n}" for t, n in g["staleness_histogram"].items())))
    if g["gradients"]:
        rows.append(("gba gradients", ", ".join(f"{k} {v}" for k, v in g["gradients"].items())))
    if g.get("clipped_updates"):
        rows.append(("gba updates clipped (servers)", f"{g['clipped_updates']}"))
    if g.get("lost_workers") or g.get("rejoined_workers"):
        rows.append(("gba workers lost / rejoined", f"{g.get('lost_workers', [])} / {g.get('rejoined_workers', [])}"))
    rows.append(("samples/s per worker", ", ".join(f"{float(v):,.0f}" for v in g["samples_per_s"].values())))
    return rows


def _print_summary(s: dict[str, Any]) -> None:
    rows = [
        ("ranks", f"{s['world_size']} ({s['launcher']})"),
        ("steps / samples", f"{s['steps']} / {s['samples']:,}"),
        ("samples/s (this run)", f"{s['samples_per_s']:,.0f}"),
        ("eval samples", f"{int(s['eval_samples']):,}"),
        ("AUC", f"{s['auc']:.4f}"),
    ]
    if "bayes_auc" in s:
        rows.append(("best reachable AUC", f"{s['bayes_auc']:.4f}  (planted teacher; gap {s['bayes_auc'] - s['auc']:.4f})"))
    rows.append(("log loss", f"{s['log_loss']:.4f}" + (f"  (teacher {s['bayes_log_loss']:.4f})" if "bayes_log_loss" in s else "")))
    if "cache_hit_rate" in s.get("picasso", {}):
        rows.append(("picasso cache hit rate", f"{s['picasso']['cache_hit_rate']:.4f}"))
    rows += _gba_rows(s.get("gba"))
    rows += [("checkpoint", s["checkpoint"]), ("wandb", f"{s['wandb_dir']} ({s['wandb_mode']})")]
    print_table(rows)


def main(argv: list[str] | None = None) -> None:
    # DeepSpeed's ZeRO still calls the deprecated all_gather_into_tensor; not actionable for users.
    warnings.filterwarnings("ignore", message=".*all_gather_into_tensor.*", category=FutureWarning)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    train(parse_args(argv))


if __name__ == "__main__":
    main()
