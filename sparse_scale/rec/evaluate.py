"""Exact AUC and log loss of a recommender job over its whole held-out set.

Example::

    metrics = evaluate(engine, job)     # {"auc": ..., "log_loss": ..., "eval_samples": ..., ["bayes_auc", ...]}
"""
from __future__ import annotations

import logging
from typing import Any, Iterable

import torch
import torch.distributed as dist

from picasso_ops.block import flush_caches, monitor_events
from picasso_ops.data.batch import CTRBatch
from picasso_ops.data.metrics import auc, log_loss
from sparse_scale.rec import data
from sparse_scale.rec.engines import RecEngine
from sparse_scale.rec.job import RecJob

logger = logging.getLogger(__name__)
Scores = tuple[torch.Tensor, torch.Tensor, "torch.Tensor | None"]  # scores, labels, teacher probabilities


def gather_cat(t: torch.Tensor, group: Any = None) -> torch.Tensor:
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


def score(engine: RecEngine, stream: Iterable[CTRBatch]) -> Scores:
    """The model's click probabilities, the labels and (synthetic data) the teacher's probabilities of ``stream``."""
    scores, labels, teacher = [], [], []
    with torch.no_grad():
        for batch in stream:
            scores.append(torch.sigmoid(engine(batch.dense, batch.values, batch.lengths)).float())
            labels.append(batch.labels)
            if batch.teacher_prob is not None:
                teacher.append(batch.teacher_prob)
    return torch.cat(scores), torch.cat(labels), torch.cat(teacher) if teacher else None


def metrics(s: torch.Tensor, y: torch.Tensor, t: torch.Tensor | None) -> dict[str, float]:
    """AUC, log loss and sample count; with teacher probabilities also the best reachable ones."""
    out = {"auc": auc(s, y), "log_loss": log_loss(s, y), "eval_samples": float(s.numel())}
    if t is not None:
        out["bayes_auc"] = auc(t, y)
        out["bayes_log_loss"] = log_loss(t, y)
    return out


def _evaluate_live(engine: RecEngine, job: RecJob) -> dict[str, float]:
    """gba mode: every live worker scores its shard, the first live one also the shards of dead workers."""
    live = sorted(engine.gather_live("eval/ready", job.rank))
    shards = [job.rank] + ([w for w in range(job.workers) if w not in live] if job.rank == live[0] else [])
    if len(shards) > 1:
        logger.warning("evaluation: workers %s are gone; worker %d scores their shards too", shards[1:], job.rank)
    mine = {w: score(engine, data.eval_stream(job, shard=w)) for w in shards}
    parts: dict[int, Scores] = {}
    for got in engine.gather_live("eval/scores", mine).values():
        parts.update(got)
    order = sorted(parts)  # shard order: the same concatenation as the collective path
    teacher = None if parts[order[0]][2] is None else torch.cat([parts[w][2] for w in order])
    return metrics(torch.cat([parts[w][0] for w in order]), torch.cat([parts[w][1] for w in order]), teacher)


def evaluate(engine: RecEngine, job: RecJob) -> dict[str, float]:
    """Exact AUC and log loss over the whole held-out set, gathered from every worker."""
    flush_caches(engine.module)  # picasso cache: the stores hold every trained row before scoring
    engine.write_events(monitor_events(engine.module, engine.samples_seen))  # cache hit rate so far (if any)
    engine.eval()
    try:
        if engine.gathers_live:
            return _evaluate_live(engine, job)
        s, y, t = score(engine, data.eval_stream(job))
    finally:
        engine.train()
    group = engine.worker_group  # gba: the parameter servers take no part
    return metrics(gather_cat(s, group), gather_cat(y, group), None if t is None else gather_cat(t, group))
