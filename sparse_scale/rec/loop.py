"""The training loop of a recommender job: steps over the stream, periodic eval and saves, fault hooks.

Example::

    result = train_loop(job, engine, stream, Progress(), FaultInjector(0, [], None), Path("runs/x/checkpoints"))
    result.progress.step, result.local_samples, result.last_checkpoint
"""
from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path

import torch

from sparse_scale.rec import checkpoint
from sparse_scale.rec import evaluate as evaluation
from sparse_scale.rec.checkpoint import Progress
from sparse_scale.rec.data import TrainStream
from sparse_scale.rec.engines import RecEngine
from sparse_scale.rec.faults import FaultInjector
from sparse_scale.rec.job import RecJob
from sparse_scale.rec.moe_tower import load_events, plus_aux_loss, towers_of

logger = logging.getLogger(__name__)
notice = logging.getLogger("sparse_scale.rec.notice")
LOG_EVERY = 50  # optimizer steps between loss / throughput points on the bar and the monitor


@dataclasses.dataclass(frozen=True)
class LoopResult:
    """What the loop did in this run."""

    progress: Progress
    train_time_s: float  # the training steps' wall time (no eval, no saves)
    local_samples: int  # this rank's samples of this run (with claimed batches, this worker's own)
    eval_history: list[dict[str, float]]
    last_checkpoint: str | None
    exhausted: bool  # the data (or, claimed, the job's batches) ran out


def train_loop(job: RecJob, engine: RecEngine, stream: TrainStream, progress: Progress, faults: FaultInjector,
               ckpt_dir: Path) -> LoopResult:
    """Train from ``progress`` until ``job.config.steps`` (per-rank streams) or until the stream ends.

    Closes ``stream`` (stops reading ahead) before it returns; its ``state()`` stays valid for a save.
    """
    from tqdm import tqdm

    cfg = job.config
    loss_fn = torch.nn.BCEWithLogitsLoss()
    bar = tqdm(total=cfg.steps, initial=progress.step, desc="train", unit="step", disable=job.rank != 0,
               dynamic_ncols=True, mininterval=1.0)
    batches = iter(stream)
    towers = towers_of(engine.module)  # MoE towers: their aux loss joins the loss, their load the monitor
    train_time, samples_this_run, history, last_ckpt = 0.0, 0, [], None
    loss_sum, loss_count = 0.0, 0  # since the last LOG_EVERY point (plain floats: no tensor per micro-step)
    exhausted = False
    while (stream.is_claimed or progress.step < cfg.steps) and not exhausted:
        t0, step_samples, micro_done = time.perf_counter(), 0, 0
        mark = stream.mark() if cfg.save_every else None  # only periodic saves need where the step started
        for _ in range(job.grad_accum):
            batch = next(batches, None)
            samples = stream.step_samples(batch, engine.worker_group)
            if samples == 0:
                exhausted = True  # a partial accumulation window is dropped, like drop_last
                break
            tc = time.perf_counter()
            loss = plus_aux_loss(loss_fn(engine(batch.dense, batch.values, batch.lengths), batch.labels), towers)
            forward_s = time.perf_counter() - tc
            faults.before_backward(stream.job_step(progress))
            tb = time.perf_counter()
            engine.backward(loss)
            faults.after_backward(forward_s + time.perf_counter() - tb)
            engine.step()
            micro_done += 1
            step_samples += samples  # claimed: this worker's samples (the job's are summed at the end)
            loss_sum, loss_count = loss_sum + loss.item(), loss_count + 1
        if exhausted:
            progress = dataclasses.replace(progress, micro_batches=progress.micro_batches + micro_done)
            break
        progress = progress.after_step(micro_done, step_samples)
        faults.after_step(progress.step)
        samples_this_run += step_samples
        train_time += time.perf_counter() - t0
        bar.update(1)
        if progress.step % LOG_EVERY == 0:
            x = stream.monitor_x(progress)  # the monitor's x only where an event is written
            mean_loss, loss_sum, loss_count = loss_sum / max(loss_count, 1), 0.0, 0
            bar.set_postfix(loss=f"{mean_loss:.4f}")
            engine.write_events([("train/loss", mean_loss, x),
                                 ("train/samples_per_s", progress.samples / max(train_time, 1e-9), x),
                                 *load_events(towers, x)])
        if cfg.eval_every and progress.step % cfg.eval_every == 0 and progress.step < cfg.steps:
            metrics, x = evaluation.evaluate(engine, job), stream.monitor_x(progress)
            history.append({"step": progress.step, **metrics})
            engine.write_events([(f"eval/{k}", v, x) for k, v in metrics.items()])
        if cfg.save_every and stream.save_due(cfg.save_every, progress, mark):
            last_ckpt = checkpoint.save(engine, ckpt_dir, progress, stream)
    bar.close()
    stream.close()  # stop reading ahead before evaluating
    if exhausted and job.rank == 0 and not stream.is_claimed:
        notice.info("training data ran out after %d steps (%s samples)", progress.step, f"{progress.samples:,}")
    return LoopResult(progress, train_time, samples_this_run, history, last_ckpt, exhausted)
