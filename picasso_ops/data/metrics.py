"""CTR metrics: exact AUC (mid-rank ties), log loss, and the best values a planted teacher reaches.

    auc(torch.tensor([0.1, 0.9, 0.5]), torch.tensor([0., 1., 1.]))    # 1.0
    log_loss(torch.tensor([0.5, 0.5]), torch.tensor([0., 1.]))        # 0.6931...
    bayes_optimal_auc(eval_batches)   # AUC of the synthetic teacher's click probability
"""
from __future__ import annotations

import logging
from typing import Iterable

import torch

from .batch import CTRBatch

logger = logging.getLogger(__name__)

__all__ = ["auc", "log_loss", "bayes_optimal_auc", "bayes_optimal_log_loss"]


def _flat_pair(scores: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    s = torch.as_tensor(scores).detach().reshape(-1).to("cpu", torch.float64)
    y = torch.as_tensor(labels).detach().reshape(-1).to("cpu", torch.float64)
    if s.numel() != y.numel():
        raise ValueError(f"scores has {s.numel()} entries but labels has {y.numel()}")
    if s.numel() == 0:
        raise ValueError("scores and labels are empty")
    if torch.isnan(s).any():
        raise ValueError("scores contain NaN")
    if not ((y == 0) | (y == 1)).all():
        raise ValueError("labels must be 0 or 1")
    return s, y


def auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """Exact ROC AUC, ties counted as one half (Mann-Whitney U with mid-ranks).

    ``auc(model_probs, batch.labels)``; raises ValueError when only one class is present.
    """
    s, y = _flat_pair(scores, labels)
    num_pos = float(y.sum())
    num_neg = float(y.numel()) - num_pos
    if num_pos == 0 or num_neg == 0:
        raise ValueError(f"AUC needs both classes, got {int(num_pos)} positives and {int(num_neg)} negatives")
    sorted_s, order = torch.sort(s, stable=True)
    _, inverse, counts = torch.unique_consecutive(sorted_s, return_inverse=True, return_counts=True)
    # 1-based mid-rank of each tie group: (first rank + last rank) / 2
    ends = torch.cumsum(counts, 0).to(torch.float64)
    mid_rank = ends - (counts.to(torch.float64) - 1.0) / 2.0
    rank_sum_pos = float((mid_rank[inverse] * y[order]).sum())
    return (rank_sum_pos - num_pos * (num_pos + 1.0) / 2.0) / (num_pos * num_neg)


def log_loss(probs: torch.Tensor, labels: torch.Tensor, eps: float = 1e-7) -> float:
    """Mean binary cross-entropy of probabilities, clamped to ``[eps, 1-eps]``.

    ``log_loss(torch.sigmoid(logits), batch.labels)``.
    """
    p, y = _flat_pair(probs, labels)
    if ((p < 0) | (p > 1)).any():
        raise ValueError("probabilities must lie in [0, 1]")
    p = p.clamp(eps, 1.0 - eps)
    return float(-(y * torch.log(p) + (1.0 - y) * torch.log1p(-p)).mean())


def _teacher_pairs(batches: Iterable[CTRBatch]) -> tuple[torch.Tensor, torch.Tensor]:
    probs, labels = [], []
    for i, b in enumerate(batches):
        if b.teacher_prob is None:
            raise ValueError(f"batch {i} has no teacher_prob: only synthetic batches carry the planted teacher")
        probs.append(b.teacher_prob)
        labels.append(b.labels)
    if not probs:
        raise ValueError("no batches given")
    return torch.cat(probs), torch.cat(labels)


def bayes_optimal_auc(batches: Iterable[CTRBatch]) -> float:
    """AUC of the planted click probability against the sampled labels: the best reachable AUC.

    ``bayes_optimal_auc(SyntheticCTRStream(cfg, 4096, split="eval", num_batches=8))``.
    """
    probs, labels = _teacher_pairs(batches)
    return auc(probs, labels)


def bayes_optimal_log_loss(batches: Iterable[CTRBatch]) -> float:
    """Log loss of the planted click probability: the best reachable log loss in expectation.

    ``bayes_optimal_log_loss(eval_batches)``.
    """
    probs, labels = _teacher_pairs(batches)
    return log_loss(probs, labels)
