"""The training loop of a recommender job: steps over the stream, periodic and per-epoch eval, saves, fault hooks.

With ``--epochs`` N > 1 an epoch's end is evaluated after the step that holds its last batch (with
gradient accumulation a rank stream completes that step with the next epoch's first micro-batches,
claimed batches evaluate after the step whose claims pass the epoch's last number); the job's last
epoch is scored by the runner's end evaluation instead.

With ``--early-stop-metric`` each evaluation is judged (:mod:`sparse_scale.rec.early_stop`): a new
best is saved under ``OUT/best`` at once, and running out of ``--patience`` ends the loop right
after that evaluation (``LoopResult.early_stop`` tells the runner, which reports it; rc 0).

Example::

    result = train_loop(job, engine, stream, Progress(), FaultInjector(0, [], None), Path("runs/x/checkpoints"))
    result.progress.step, result.local_samples, result.last_checkpoint
"""
from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path
from typing import Any

import torch

from sparse_scale.atomic_checkpoint import latest_checkpoint
from sparse_scale.divergence import DivergenceError, DivergenceGuard, bce_entropy, deepspeed_engine_of
from sparse_scale.rec import checkpoint
from sparse_scale.rec import evaluate as evaluation
from sparse_scale.rec.checkpoint import Progress
from sparse_scale.rec.config import RecJobError
from sparse_scale.rec.data import TrainStream
from sparse_scale.rec.early_stop import EarlyStopping
from sparse_scale.rec.engines import RecEngine
from sparse_scale.rec.faults import FaultInjector
from sparse_scale.rec.job import RecJob
from sparse_scale.rec.moe_tower import load_events, plus_aux_loss, towers_of

logger = logging.getLogger(__name__)
notice = logging.getLogger("sparse_scale.rec.notice")
PIPELINE_TIMEOUT_S = 300.0  # a sparse-dist pipeline's waits and collectives (a rank's step, not an evaluation)
LOG_EVERY = 50  # optimizer steps between loss / throughput points on the bar and the monitor


@dataclasses.dataclass(frozen=True)
class LoopResult:
    """What the loop did in this run."""

    progress: Progress
    train_time_s: float  # the training steps' wall time (no eval, no saves)
    local_samples: int  # this rank's samples of this run (with claimed batches, this worker's own)
    eval_history: list[dict[str, float]]  # per-epoch entries carry "epoch"
    last_checkpoint: str | None
    exhausted: bool  # the data (or, claimed, the job's batches) ran out
    finished_epochs: int = 0  # epochs read to their end (file data)
    early_stop: EarlyStopping | None = None  # --early-stop-metric: the best evaluation and whether it stopped the run


class TrainingDivergedError(RecJobError):
    """The loss or gradients went non-finite, the loss exploded while finite, or DeepSpeed skipped too many steps in
    a row; the diverged state was not saved."""


def best_dir(job: RecJob) -> Path:
    """Where the best evaluation's checkpoint is kept: ``OUT/best``."""
    return Path(job.config.out) / "best"


def early_stopping(job: RecJob) -> EarlyStopping | None:
    """The job's keep-best / early-stopping tracker (None without ``--early-stop-metric``); on --resume it starts
    from the best kept so far (``OUT/best/best.json``)."""
    cfg = job.config
    if cfg.early_stop_metric is None:
        return None
    tracker = EarlyStopping(cfg.early_stop_metric, cfg.patience, cfg.min_delta)  # type: ignore[arg-type]
    if cfg.resume:
        tracker.restore(best_dir(job))
    return tracker


def sparse_pipeline(job: RecJob, engine: RecEngine, stream: TrainStream) -> Any:
    """The job's sparse-dist pipeline (``picasso.pipeline``), or ``None`` where it is off or does not apply.

    It applies to per-rank streams with packed row-wise tables (``"all"``: or data-parallel ones)
    under ``sparse_scale.initialize``'s DeepSpeed engine, with ``interleave.micro_batches`` 1 and no cache.
    """
    from picasso_ops.distributed.pipeline import SparseDistPipeline
    from picasso_ops.distributed.pipelined_loader import unpipelined_reason

    block = job.picasso
    if block is None or block.pipeline == "off":
        return None
    data_parallel = block.pipeline == "all"
    if stream.is_claimed or job.gba is not None:
        why: str | None = "batches are claimed by number (gba block)"
    else:
        why = unpipelined_reason(block.pipeline, engine.module, micro_batches=block.interleave.micro_batches,
                                 cache=block.cache is not None)
    if why is not None:
        if job.rank == 0:  # the default ("row_wise") on a model without row-wise tables: not worth a line
            log = logger.info if data_parallel else logger.debug
            log("picasso.pipeline %r does not apply here (%s): the steps run unpipelined", block.pipeline, why)
        return None
    if job.rank == 0:
        logger.info("picasso pipeline (%s): the next batch's ids are read and exchanged on a thread while one trains",
                    block.pipeline)
    return SparseDistPipeline(engine.module, peek=stream.peek, to_batch=lambda b: (b.values, b.lengths),  # type: ignore[attr-defined]
                              timeout_s=PIPELINE_TIMEOUT_S, data_parallel=data_parallel)


def train_loop(job: RecJob, engine: RecEngine, stream: TrainStream, progress: Progress, faults: FaultInjector,
               ckpt_dir: Path) -> LoopResult:
    """Train from ``progress`` until ``job.config.steps`` (per-rank streams), the stream's end or an early stop.

    Closes ``stream`` (stops reading ahead) before it returns; its ``state()`` stays valid for a save.
    Raises :class:`TrainingDivergedError` (after closing ``stream``) when training diverges; the diverged
    state is not saved, so the last good checkpoint stays ``latest`` (and the best one stays in OUT/best).
    """
    tracker = early_stopping(job)
    pipe = sparse_pipeline(job, engine, stream)
    try:
        return _train_loop(job, engine, stream, progress, faults, ckpt_dir, tracker, pipe)
    except DivergenceError as exc:
        _close_quietly(pipe, job.rank)
        stream.close()
        message = str(exc)
        if tracker is not None and tracker.best is not None and "checkpoint" in tracker.best:
            b = tracker.best
            message += (f"; the best evaluation's checkpoint {b['checkpoint']} ({tracker.metric} "
                        f"{b[tracker.key]:.4f} at step {b['step']}) is kept")
        raise TrainingDivergedError(message) from None
    finally:
        _close_quietly(pipe, job.rank)


def _close_quietly(pipe: Any, rank: int) -> None:
    """Close a pipeline after the loop failed (the loop's error is the one reported); a closed one: nothing."""
    if pipe is None or pipe.closed:
        return
    try:
        pipe.close()
    except Exception:  # noqa: BLE001
        logger.exception("rank %d: closing the sparse-dist pipeline after an error", rank)


def _train_loop(job: RecJob, engine: RecEngine, stream: TrainStream, progress: Progress, faults: FaultInjector,
                ckpt_dir: Path, tracker: EarlyStopping | None = None, pipe: Any = None) -> LoopResult:
    from tqdm import tqdm

    cfg = job.config
    loss_fn = torch.nn.BCEWithLogitsLoss()
    bar = tqdm(total=cfg.steps, initial=progress.step, desc="train", unit="step", disable=job.rank != 0,
               dynamic_ncols=True, mininterval=1.0)
    batches = iter(stream)

    def take() -> Any:
        return next(batches, None) if pipe is None else pipe.next_item(lambda: next(batches, None))

    towers = towers_of(engine.module)  # MoE towers: their aux loss joins the loss, their load the monitor
    train_time, samples_this_run, history, last_ckpt = 0.0, 0, [], None
    loss_sum, loss_count = 0.0, 0  # since the last LOG_EVERY point (plain floats: no tensor per micro-step)
    exhausted = False
    ds_engine = deepspeed_engine_of(engine)  # its skipped steps and gradient norm feed the divergence guard
    # its error names the checkpoint to resume from: the one on disk now, then each one this loop saves
    guard = DivergenceGuard(cfg.max_skipped_steps, engine.worker_group, lockstep=not stream.is_claimed,
                            last_checkpoint=latest_checkpoint(ckpt_dir), explosion_factor=cfg.loss_explosion_factor)
    positives, labelled = 0.0, 0  # this rank's labels so far: the constant predictor the explosion check compares with
    stop = False  # --patience ran out at the last evaluation

    def judge(entry: dict[str, float]) -> bool:
        """Keep the evaluation's checkpoint if it is the best; whether patience ran out."""
        if tracker is None:
            return False
        verdict = tracker.observe(entry)
        if verdict.improved:
            guard.check_params(engine.module, progress.step)  # never keep a diverged state as the best
            tracker.saved(checkpoint.save_best(engine, best_dir(job), progress, stream, job.rank))
            if job.rank == 0:
                tracker.write(best_dir(job))
        if verdict.stop and job.rank == 0:
            notice.info("%s", tracker.reason())
        return verdict.stop

    while (stream.is_claimed or progress.step < cfg.steps) and not exhausted and not stop:
        t0, step_samples, micro_done = time.perf_counter(), 0, 0
        # only periodic saves and epoch ends need where the step started
        mark = stream.mark() if cfg.save_every or cfg.epochs > 1 else None
        guard.start_step(ds_engine)
        for _ in range(job.grad_accum):
            batch = take()
            samples = stream.step_samples(batch, engine.worker_group)
            while samples == 0 and stream.next_epoch():  # an epoch ended on some rank: every rank takes the next
                if micro_done == 0:  # at a step boundary the model is the epoch's end: score it before going on
                    te = time.perf_counter()
                    for e in stream.epoch_ends(None):
                        history.append(_evaluate(engine, job, stream, progress, e))
                        stop = judge(history[-1]) or stop
                    t0 += time.perf_counter() - te  # evaluation is no training time
                    if stop:
                        break
                batch = take()
                samples = stream.step_samples(batch, engine.worker_group)
            if stop:  # at a step boundary (micro_done == 0): nothing of this step was trained
                break
            if samples == 0:
                exhausted = True  # a partial accumulation window is dropped, like drop_last
                break
            if pipe is not None:
                pipe.submit()  # the next batch is read and exchanged while this one trains
                pipe.arm()  # this batch's lookups, prepared during the last step
            tc = time.perf_counter()
            loss = plus_aux_loss(loss_fn(engine(batch.dense, batch.values, batch.lengths), batch.labels), towers)
            forward_s = time.perf_counter() - tc
            faults.before_backward(stream.job_step(progress))
            tb = time.perf_counter()
            engine.backward(loss)
            faults.after_backward(forward_s + time.perf_counter() - tb)
            engine.step()
            if pipe is not None:
                pipe.release()  # the tables are updated: the next batch's rows may be fetched
            micro_done += 1
            step_samples += samples  # claimed: this worker's samples (the job's are summed at the end)
            loss_value = loss.item()
            positives, labelled = positives + float(batch.labels.sum()), labelled + batch.labels.numel()
            guard.loss(loss_value, baseline=bce_entropy(positives / labelled))
            loss_sum, loss_count = loss_sum + loss_value, loss_count + 1
        if exhausted:
            progress = dataclasses.replace(progress, micro_batches=progress.micro_batches + micro_done)
            break
        if stop:
            break
        progress = progress.after_step(micro_done, step_samples)
        guard.end_step(progress.step, ds_engine)
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
        ended = stream.epoch_ends(mark)
        if ended or (cfg.eval_every and progress.step % cfg.eval_every == 0 and progress.step < cfg.steps):
            history.append(_evaluate(engine, job, stream, progress, ended[-1] if ended else None))
            stop = judge(history[-1])
        if cfg.save_every and stream.save_due(cfg.save_every, progress, mark):
            guard.check_params(engine.module, progress.step)
            last_ckpt = checkpoint.save(engine, ckpt_dir, progress, stream, job.rank)
            guard.checkpoint_saved(last_ckpt, progress.step)
    guard.check_params(engine.module, progress.step)  # the runner's final save follows: never of a diverged state
    bar.close()
    if pipe is not None:
        pipe.close()  # raises what its thread hit; a batch it read ahead is dropped (the stream's state is consumed)
        if job.rank == 0:
            logger.info("picasso pipeline: %(rounds)d batches read ahead (%(void)d at an end of the data), "
                        "%(unprepared)d trained unprepared", pipe.stats)
    stream.close()  # stop reading ahead before evaluating
    if exhausted and job.rank == 0 and not stream.is_claimed and not stop:
        if cfg.epochs > 1:
            notice.info("%d epochs of the training data done after %d steps (%s samples)", cfg.epochs,
                        progress.step, f"{progress.samples:,}")
        else:
            notice.info("training data ran out after %d steps (%s samples)", progress.step, f"{progress.samples:,}")
    finished = stream.finished_epochs()
    if cfg.epochs > 1 and finished < cfg.epochs and job.rank == 0 and not stop:
        notice.info("--steps %d ended the job in epoch %d of --epochs %d (0-based)", cfg.steps, finished, cfg.epochs)
    return LoopResult(progress, train_time, samples_this_run, history, last_ckpt, exhausted, finished, tracker)


def _evaluate(engine: RecEngine, job: RecJob, stream: TrainStream, progress: Progress,
              epoch: int | None) -> dict[str, float]:
    """Evaluate now (every rank together) and write ``eval/*`` events; ``epoch``: the epoch that just ended."""
    metrics, x = evaluation.evaluate(engine, job), stream.monitor_x(progress)
    events = [(f"eval/{k}", v, x) for k, v in metrics.items()]
    if epoch is None:
        engine.write_events(events)
        return {"step": progress.step, **metrics}
    engine.write_events([*events, ("eval/epoch", float(epoch), x)])
    if job.rank == 0:
        notice.info("epoch %d of %d ended at step %d: auc %.4f, log loss %.4f", epoch, job.config.epochs,
                    progress.step, metrics["auc"], metrics["log_loss"])
    return {"step": progress.step, "epoch": epoch, **metrics}
