"""The MoE LM job's entry point: one typed config in, one :class:`LMSummary` out.

    from sparse_scale.lm import LMJobConfig, run
    summary = run(LMJobConfig(config="ds_configs/moe_lm_cpu.json", data="texts/", steps=300, out="runs/lm"))

Every rank calls :func:`run` (it starts ``deepspeed.comm`` through ``sparse_scale.distenv``
under any launcher). Rank 0 shows a progress bar and writes ``OUT/summary.json``; every
rank returns the same summary (``wandb_dir`` is rank 0's only). Checkpoints go to
``OUT/checkpoints`` (``resume=True`` continues from the latest one).
"""
from __future__ import annotations

import dataclasses
import logging
import math
import time
from pathlib import Path

import torch

from moe_proto.data import ByteCorpus
from moe_proto.models import MoETransformerLM
from sparse_scale.atomic_checkpoint import latest_checkpoint
from sparse_scale.divergence import DEFAULT_MAX_SKIPPED_STEPS, DivergenceError, DivergenceGuard
from sparse_scale.divergence import hint as divergence_hint
from sparse_scale.distenv import init_distributed
import sparse_scale
from sparse_scale.reporting import finish_wandb, setup_wandb_env, wandb_dir
from sparse_scale.threads import set_default_threads

from .checkpoints import Progress, load_job_checkpoint, save_job_checkpoint
from .metrics import evaluate, routing_events
from .model import model_args_from_config
from .summary import LMSummary

logger = logging.getLogger(__name__)

LOG_EVERY = 10  # steps between wandb/progress-bar loss updates


@dataclasses.dataclass(frozen=True)
class LMJobConfig:
    """One LM training job (the command line's flags, field for field).

    ``config`` is a DeepSpeed JSON/hjson with a ``moe_model`` block (the shape) and an
    optional ``moe_proto`` block (without it the model is dense); ``data`` a folder of text
    files searched recursively with ``glob``. ``steps`` counts optimizer steps in total,
    across resumes. ``threads`` 0: cores / local ranks.
    """

    config: str
    data: str
    glob: str = "**/*"
    heldout_fraction: float = 0.05
    eval_tokens: int = 200_000  # held-out tokens to evaluate, all ranks together
    steps: int = 300
    out: str = "runs/train_moe_lm"
    save_every: int = 0  # 0: checkpoint only at the end
    max_skipped_steps: int = DEFAULT_MAX_SKIPPED_STEPS  # overflow-skipped steps in a row before the job stops
    resume: bool = False
    seed: int = 1234
    threads: int = 0
    show_progress: bool = True  # rank 0's tqdm bar


def run(job: LMJobConfig) -> LMSummary:
    """Train, evaluate on the held-out files and checkpoint; every rank of the launch calls it.

    Raises :class:`~sparse_scale.lm.NoCheckpointError` for ``resume=True`` without a checkpoint,
    :class:`~sparse_scale.divergence.DivergenceError` when training diverges (nothing diverged is
    saved) and :class:`~sparse_scale.atomic_checkpoint.CheckpointError` for a full disk or no intact checkpoint.

    Example::

        s = run(LMJobConfig(config="cfg.json", data="texts", steps=4, out="runs/a", eval_tokens=3000))
        s.steps, s.eval_bits_per_byte                # (4, 7.9...)
    """
    out = Path(job.out)
    wandb_mode = setup_wandb_env(out)
    model_args, ds = model_args_from_config(job.config)
    ctx = init_distributed()
    rank, world = ctx.rank, ctx.world_size
    set_default_threads(ctx.local_world_size or ctx.world_size, requested=job.threads)
    torch.manual_seed(job.seed)  # same initial weights on every rank (DeepSpeed broadcasts them anyway)
    from tqdm import tqdm

    corpus = ByteCorpus.from_folder(job.data, job.glob, job.heldout_fraction)
    seq_len = model_args.max_seq_len
    micro_batch = int(ds.get("train_micro_batch_size_per_gpu", 8))
    grad_accum = int(ds.get("gradient_accumulation_steps", 1))
    model = MoETransformerLM(model_args)
    # the experts' param groups and clip, the expert biases at each applied step, the MoE checkpoints
    engine, _, _, _ = sparse_scale.initialize(model=model, config=job.config,
                                              threads=job.threads)

    ckpt_dir = out / "checkpoints"
    progress = Progress()
    if job.resume:
        path, progress = load_job_checkpoint(engine, ckpt_dir)
        if rank == 0:
            logger.info("resumed from %s at step %d", path, progress.step)
    step, micro_batches, tokens = progress.step, progress.micro_batches, progress.tokens
    batches = corpus.train_batches(seq_len, micro_batch, rank, world, job.seed, micro_batches)
    bar = tqdm(total=job.steps, initial=step, desc="train", unit="step",
               disable=rank != 0 or not job.show_progress, dynamic_ncols=True, mininterval=1.0)
    train_time, tokens_this_run, last_ckpt = 0.0, 0, None
    running = torch.zeros(3)  # ce loss sum, aux loss sum, count
    step_tokens = micro_batch * seq_len * world * grad_accum
    # checked on the loss: NaN/inf in the token embeddings or the hidden states entering the MoE layers reach it
    # its error names the checkpoint to resume from: the one on disk now, then each one this run saves
    guard = DivergenceGuard(job.max_skipped_steps, what="the LM loss", last_checkpoint=latest_checkpoint(ckpt_dir))
    while step < job.steps:
        t0 = time.perf_counter()
        guard.start_step(engine)
        for _ in range(grad_accum):
            inputs, targets = next(batches)
            try:
                result = engine(inputs, targets)
            except FloatingPointError as exc:  # an MoE layer refused NaN/inf hidden states: the run diverged
                raise DivergenceError(f"training diverged at step {step + 1}: {exc}; "
                                      f"{divergence_hint(guard.last_checkpoint)}") from exc
            engine.backward(result.loss)
            engine.step()
            micro_batches += 1
            ce_aux = [result.ce_loss.item(), result.aux_loss.item()]
            guard.loss(ce_aux[0] + ce_aux[1])
            running += torch.tensor([*ce_aux, 1.0])
        step += 1
        guard.end_step(step, engine)  # DivergenceError: stops before any save of the diverged state
        tokens += step_tokens
        tokens_this_run += step_tokens
        train_time += time.perf_counter() - t0
        bar.update(1)
        if step % LOG_EVERY == 0 or step == job.steps:
            ce, aux = (running[:2] / running[2]).tolist()
            running.zero_()
            bar.set_postfix(loss=f"{ce:.3f}", bpb=f"{ce / math.log(2):.3f}")
            events = [("train/loss", ce, tokens), ("train/aux_loss", aux, tokens),
                      ("train/tokens_per_s", tokens_this_run / max(train_time, 1e-9), tokens)]
            events += [(name, value, tokens) for name, value in routing_events(model)]
            engine.monitor.write_events(events)
        if job.save_every and step % job.save_every == 0:
            guard.check_params(model, step)
            last_ckpt = save_job_checkpoint(engine, ckpt_dir, Progress(step, micro_batches, tokens=tokens), rank)
            guard.checkpoint_saved(last_ckpt)
    bar.close()
    guard.check_params(model, step)  # the final save follows: never of a diverged state

    metrics = evaluate(engine, corpus, seq_len, micro_batch, rank, world, job.eval_tokens)
    engine.monitor.write_events([(f"eval/{k}", v, tokens) for k, v in metrics.items()])
    if last_ckpt is None or not last_ckpt.endswith(f"step{step}"):
        last_ckpt = save_job_checkpoint(engine, ckpt_dir, Progress(step, micro_batches, tokens=tokens), rank)
    summary = LMSummary(
        world_size=world,
        launcher=ctx.launcher,
        steps=step,
        tokens=tokens,
        tokens_per_s=tokens_this_run / max(train_time, 1e-9),
        train_time_s=train_time,
        params=sum(p.numel() for p in model.parameters()),
        num_experts=model_args.num_experts,
        num_prototypes=model_args.num_prototypes,
        top_k=model_args.top_k,
        train_files=len(corpus.train_files),
        heldout_files=len(corpus.heldout_files),
        eval_loss=metrics["eval_loss"],
        eval_bits_per_byte=metrics["eval_bits_per_byte"],
        eval_tokens=metrics["eval_tokens"],
        checkpoint=last_ckpt,
        wandb_mode=wandb_mode,
        wandb_dir=wandb_dir(rank),
    )
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        (out / "summary.json").write_text(summary.to_json())
    finish_wandb(rank)
    return summary
