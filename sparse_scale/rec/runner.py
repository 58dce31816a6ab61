"""``run``: one recommender training job on this rank, from its config to its summary.

Example::

    from sparse_scale.rec import RecJobConfig, run
    summary = run(RecJobConfig(config="ds_configs/demo_cpu.json", steps=20, vocab=200, out="runs/nb"))
    summary.to_dict()["auc"]
"""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Callable

import torch

from picasso_ops.block import picasso_summary
from sparse_scale.distenv import DistContext, init_distributed
from sparse_scale.rec import checkpoint, data, engines, model, moe_tower
from sparse_scale.rec import evaluate as evaluation
from sparse_scale.rec.checkpoint import Progress
from sparse_scale.rec.combinations import check_combinations
from sparse_scale.rec.config import RecJobConfig, RecJobError
from sparse_scale.rec.faults import FaultInjector
from sparse_scale.rec.job import RecJob
from sparse_scale.rec.loop import best_dir, train_loop
from sparse_scale.rec.summary import RecSummary, ServerSummary
from sparse_scale.reporting import wandb_dir
from sparse_scale.threads import set_default_threads

logger = logging.getLogger(__name__)
ModelFactory = Callable[[RecJob], torch.nn.Module]


def job_context(config: RecJobConfig) -> DistContext:
    """Where this process sits: a restarted worker's place from the job's control plane, else the launcher's."""
    if config.rejoin_as is not None:
        return engines.rejoin_context(config)
    return init_distributed()


def run(config: RecJobConfig, ctx: DistContext | None = None, wandb_mode: str | None = None,
        model_factory: ModelFactory | None = None) -> RecSummary | ServerSummary:
    """Train, evaluate and checkpoint the job on this rank; rank 0 also writes ``OUT/summary.json``.

    ``ctx``: this process's place (default :func:`job_context`, which starts torch.distributed).
    ``wandb_mode``: what the caller set wandb up as (reported in the summary; see
    ``sparse_scale.reporting.setup_wandb_env``); the caller also finishes the wandb run.
    ``model_factory``: builds the model from the job (default :func:`sparse_scale.rec.model.build_model`).
    A parameter-server rank serves the job and returns a :class:`ServerSummary`. Raises
    :class:`~sparse_scale.rec.config.RecJobError` (a :class:`CombinationError` for refused combinations).
    """
    check_combinations(config)
    ctx = ctx if ctx is not None else job_context(config)
    set_default_threads(ctx.local_world_size or ctx.world_size, requested=config.threads)
    torch.manual_seed(config.seed)
    job = RecJob.build(config, ctx.rank, ctx.world_size)
    data.check_epochs(job)  # --epochs against --steps, before any engine (or parameter server) starts
    net = (model_factory or model.build_model)(job)
    built = engines.build_engine(job, net, ctx)
    if isinstance(built, engines.ServedJob):
        return ServerSummary(built.stats)
    engine = built
    out, ckpt_dir = Path(config.out), Path(config.out) / "checkpoints"
    progress, data_states = Progress(), None
    if config.resume:
        progress, data_states = checkpoint.resume(engine, ckpt_dir, job.rank)
    stream = data.train_stream(job, engine, progress, data_states)
    crash = None if config.rejoin_as is not None else config.crash  # a replacement does not crash again
    loop = train_loop(job, engine, stream, progress, FaultInjector(job.rank, config.stragglers, crash), ckpt_dir)
    if loop.exhausted and loop.progress.step == 0:  # never evaluate or checkpoint an untrained model as a result
        engine.close()
        raise RecJobError(f"--train-files {' '.join(config.train_files)}: the training data ended before step 1 "
                          f"(no whole batch of {job.micro_batch * job.grad_accum} good rows for this rank)")

    tracker, history = loop.early_stop, loop.eval_history
    stopped = tracker is not None and tracker.stopped_at is not None
    x = stream.monitor_x(loop.progress)
    if stopped and history and history[-1]["step"] == loop.progress.step:  # stopped right after scoring this model
        metrics = {k: v for k, v in history[-1].items() if k not in ("step", "epoch")}
    else:
        metrics = evaluation.evaluate(engine, job)
        events = [(f"eval/{k}", v, x) for k, v in metrics.items()]
        end = {"step": loop.progress.step, **metrics}
        if config.epochs > 1 and loop.finished_epochs == config.epochs:  # the end evaluation scores the last epoch
            end = {"step": loop.progress.step, "epoch": config.epochs - 1, **metrics}
            history = [*history, end]
            events.append(("eval/epoch", float(config.epochs - 1), x))
        engine.write_events(events)
        if tracker is not None and tracker.observe(end, final=True).improved:  # the last model may be the best
            tracker.saved(checkpoint.save_best(engine, best_dir(job), loop.progress, stream, job.rank))
            if job.rank == 0:
                tracker.write(best_dir(job))
    last_ckpt = loop.last_checkpoint
    if last_ckpt is None or Path(last_ckpt).name != stream.tag(loop.progress):
        last_ckpt = checkpoint.save(engine, ckpt_dir, loop.progress, stream, job.rank)
    samples, rate = loop.progress.samples, loop.local_samples / max(loop.train_time_s, 1e-9)
    if stream.is_claimed:  # workers trained different shares: the job's samples over the slowest worker's time
        samples, slowest = engine.totals(loop.local_samples, loop.train_time_s)
        rate = samples / max(slowest, 1e-9)
    summary = RecSummary(
        model=config.model, world_size=ctx.world_size, launcher=ctx.launcher, steps=loop.progress.step,
        samples=samples, samples_per_s=rate, train_time_s=loop.train_time_s, local_samples=loop.local_samples,
        metrics=metrics, checkpoint=last_ckpt, wandb_mode=wandb_mode, wandb_dir=wandb_dir(job.rank),
        eval_history=history, best=tracker.summary() if tracker is not None else None,
        picasso=picasso_summary(engine.module) if job.picasso is not None else None,
        gba=engine.block_summary(),
        moe=moe_tower.expert_load_summary(engine, moe_tower.moe_block(job)))  # a collective over the workers
    engine.close()
    if job.rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        (out / "summary.json").write_text(json.dumps(summary.to_dict(), indent=2))
    return summary
