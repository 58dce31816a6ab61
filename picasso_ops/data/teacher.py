"""The planted teacher of the synthetic CTR stream: a known click model to measure against.

logit = alpha * (c_lin * linear + c_int * interaction + c_dense * dense) + bias, where
  linear       = sum over fields of the mean per-id weight w(f, id),
  interaction  = sum over field pairs f < g of <e_f, e_g>, e_f = mean id embedding (rank r),
                 computed as (|sum_f e_f|^2 - sum_f |e_f|^2) / 2 (the FM identity),
  dense        = dense features . w_dense.
The per-id weights and embeddings are rows of one random table of at most ``TABLE_ROWS``
rows, read at a per-field offset, so memory does not grow with the vocabulary. When all
(field, id) pairs fit, each owns a row; beyond that, pairs share rows at random offsets
(an id's weights are still fixed, which is all a teacher needs). ``calibrated`` sets
the c's so each part has the requested share of the spread, then picks alpha and bias
so that the expected AUC of Bernoulli(sigmoid(logit)) labels and the click rate hit
their targets::

    teacher = PlantedTeacher.random(vocab_sizes=[1000] * 26, num_dense=13, rank=4, seed=0)
    parts = teacher.components(dense, values, lengths)          # [B, 3], from a jagged batch
    teacher = teacher.calibrated(parts, weights=(1., 1., .5), target_auc=0.8, target_ctr=0.2)
    prob = torch.sigmoid(teacher.logit(dense, values, lengths))
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, replace
from functools import cached_property
from typing import Sequence

import torch

logger = logging.getLogger(__name__)

__all__ = ["PlantedTeacher", "expected_auc", "TABLE_ROWS"]

TABLE_ROWS = 1 << 18  # rows of the shared weight table (cache-sized); a (field, id) owns a row when all fit


def expected_auc(scores: torch.Tensor, probs: torch.Tensor) -> float:
    """Expected AUC of ``scores`` when each label is an independent Bernoulli(probs).

    Ratio of expectations over ordered pairs i != j: sum p_i (1 - p_j) [s_i > s_j] over
    sum p_i (1 - p_j). ``expected_auc(logit, torch.sigmoid(logit))`` is the teacher's own.
    """
    return _expected_auc_sorted(probs[torch.argsort(scores)].to(torch.float64))


def _expected_auc_sorted(p: torch.Tensor) -> float:
    neg = 1.0 - p
    neg_below = torch.cumsum(neg, 0) - neg
    numerator = float((p * neg_below).sum())
    denominator = float(p.sum() * neg.sum() - (p * neg).sum())
    return numerator / denominator if denominator > 0 else 0.5


def _bias_for_rate(z: torch.Tensor, rate: float) -> float:
    lo, hi = -40.0, 40.0
    for _ in range(50):  # bisection: mean sigmoid is increasing in the bias
        mid = 0.5 * (lo + hi)
        if float(torch.sigmoid(z + mid).mean()) < rate:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


@dataclass(frozen=True, eq=False)  # tensors/arrays have no single-bool ==
class PlantedTeacher:
    """Teacher parameters; build with ``PlantedTeacher.random(...)`` then ``.calibrated(...)``."""

    table: torch.Tensor          # float32 [rows, 1 + rank]: column 0 = id weight, rest = embedding
    field_offsets: torch.Tensor  # int64 [F]: row of id 0 of each field
    dense_weight: torch.Tensor   # float32 [num_dense]
    coef: torch.Tensor           # float32 [3]: linear, interaction, dense multipliers (alpha folded in)
    bias: float

    @staticmethod
    def random(vocab_sizes: Sequence[int], num_dense: int, rank: int, seed: int) -> "PlantedTeacher":
        """An uncalibrated teacher (coef 1, bias 0): ``PlantedTeacher.random([100] * 26, 13, 4, 0)``."""
        g = torch.Generator().manual_seed(seed)
        total = sum(vocab_sizes)
        rows = min(TABLE_ROWS, 1 << max(0, (total - 1).bit_length()))  # a power of two: rows are masked, not divided
        table = torch.randn(rows, 1 + rank, generator=g)
        if total <= TABLE_ROWS:
            # every (field, id) owns a row: offsets are the exclusive cumulative vocab sizes
            offsets = torch.cumsum(torch.tensor([0] + list(vocab_sizes[:-1]), dtype=torch.int64), 0)
        else:
            offsets = torch.randint(0, rows, (len(vocab_sizes),), generator=g, dtype=torch.int64)
        dense_weight = torch.randn(num_dense, generator=g) / math.sqrt(max(num_dense, 1))
        return PlantedTeacher(table, offsets, dense_weight, torch.ones(3), 0.0)

    @cached_property
    def _padded_table(self) -> torch.Tensor:
        return torch.cat([self.table, self.table.new_zeros(1, self.table.shape[1])])

    @property
    def rank(self) -> int:
        """Rank of the pairwise interaction embeddings: ``teacher.rank``."""
        return int(self.table.shape[1]) - 1

    def components(self, dense: torch.Tensor, values: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """Unscaled (linear, interaction, dense) parts per sample of a jagged batch, ``[B, 3]``.

        ``teacher.components(batch.dense, batch.values, batch.lengths)``.
        """
        num_fields, batch_size = lengths.shape
        flat_len = lengths.reshape(-1)
        segments = torch.repeat_interleave(torch.arange(num_fields * batch_size), flat_len,
                                           output_size=values.numel())
        field = segments // batch_size
        rows = (self.field_offsets.index_select(0, field) + values) & (self.table.shape[0] - 1)
        pooled = torch.zeros(num_fields * batch_size, self.table.shape[1])
        pooled.index_add_(0, segments, self.table.index_select(0, rows))
        pooled = pooled / flat_len.clamp(min=1).unsqueeze(1).to(pooled.dtype)
        return self._combine(pooled.view(num_fields, batch_size, -1), dense)

    def components_grid(self, dense: torch.Tensor, ids: torch.Tensor, lengths: torch.Tensor,
                        present: torch.Tensor | None = None) -> torch.Tensor:
        """Same as ``components`` for ids laid out ``[F, B, L]``, of which the first ``lengths[f, b]`` count.

        The generator's fast path: broadcasting per-field offsets and a masked sum
        replace the per-id field lookup and scatter of the jagged form. ``present``
        (optional) is the ``[F, B, L]`` mask ``slot < lengths``, when the caller has it.
        """
        num_fields, batch_size, max_len = ids.shape
        rows = (ids + self.field_offsets.view(-1, 1, 1)) & (self.table.shape[0] - 1)
        if max_len == 1:
            gathered = self.table.index_select(0, rows.reshape(-1)).view(num_fields, batch_size, -1)
            pooled = gathered * (lengths > 0).unsqueeze(-1)
        else:
            # absent slots read an all-zero row, so the pooled sum needs no mask multiply
            zero_row = torch.full_like(rows, self.table.shape[0])
            if present is None:
                present = torch.arange(max_len).view(1, 1, -1) < lengths.unsqueeze(-1)
            rows = torch.where(present, rows, zero_row)
            gathered = self._padded_table.index_select(0, rows.reshape(-1)).view(num_fields, batch_size, max_len, -1)
            pooled = gathered[:, :, 0].clone()
            for slot in range(1, max_len):  # slot-wise adds: several times faster than .sum(2) here
                pooled += gathered[:, :, slot]
            pooled /= lengths.clamp(min=1).unsqueeze(-1)  # mean pooling keeps multi-hot fields in scale
        return self._combine(pooled, dense)

    def _combine(self, pooled: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
        linear = pooled[:, :, 0].sum(0)
        emb = pooled[:, :, 1:]
        interaction = 0.5 * (emb.sum(0).square().sum(-1) - emb.square().sum((0, 2)))
        dense_part = dense @ self.dense_weight if dense.shape[1] else torch.zeros(pooled.shape[1])
        return torch.stack([linear, interaction, dense_part], dim=1)

    def logit_from_components(self, parts: torch.Tensor) -> torch.Tensor:
        """``parts @ coef + bias``: ``teacher.logit_from_components(teacher.components(...))``."""
        return parts @ self.coef + self.bias

    def logit(self, dense: torch.Tensor, values: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """Teacher logit per sample ``[B]``: ``teacher.logit(batch.dense, batch.values, batch.lengths)``."""
        return self.logit_from_components(self.components(dense, values, lengths))

    def calibrated(self, parts: torch.Tensor, weights: tuple[float, float, float],
                   target_auc: float, target_ctr: float) -> "PlantedTeacher":
        """A copy whose coef/bias give ``target_auc`` and ``target_ctr`` on the sample ``parts``.

        ``weights`` are the relative standard deviations of the linear, interaction and
        dense parts. ``teacher.calibrated(parts, (1., 1., .5), 0.8, 0.2)``.
        """
        parts64 = parts.to(torch.float64)
        std = parts64.std(0)
        w = torch.tensor(weights, dtype=torch.float64)
        unit = torch.where((std > 0) & (w > 0), w / std.clamp(min=1e-12), torch.zeros_like(std))
        if not bool((unit > 0).any()):
            raise ValueError("every teacher part has zero weight or zero variance; nothing carries signal")
        raw = parts64 @ unit
        raw_mean, raw_std = float(raw.mean()), float(raw.std().clamp(min=1e-12))
        # unit scale makes the alpha search range generic; sorted once since alpha keeps the order
        z = torch.sort((raw - raw_mean) / raw_std).values

        def auc_at(alpha: float) -> tuple[float, float]:
            bias = _bias_for_rate(alpha * z, target_ctr)
            return _expected_auc_sorted(torch.sigmoid(alpha * z + bias)), bias

        lo, hi = math.log(1e-3), math.log(1e3)
        best_auc, _ = auc_at(math.exp(hi))
        if best_auc < target_auc:
            logger.warning("teacher cannot reach AUC %.3f (max %.3f on the calibration sample); using the max",
                           target_auc, best_auc)
            lo = hi
        for _ in range(40):  # bisection on log alpha: expected AUC grows with the logit scale
            mid = 0.5 * (lo + hi)
            if auc_at(math.exp(mid))[0] < target_auc:
                lo = mid
            else:
                hi = mid
        alpha = math.exp(0.5 * (lo + hi))
        reached, z_bias = auc_at(alpha)
        # alpha * (raw - mean) / std + z_bias == parts @ coef + bias
        coef = unit * (alpha / raw_std)
        bias = z_bias - alpha * raw_mean / raw_std
        logger.debug("teacher calibrated: alpha=%.4f bias=%.4f expected AUC=%.4f", alpha, bias, reached)
        return replace(self, coef=coef.to(torch.float32), bias=float(bias))
