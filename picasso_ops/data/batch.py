"""`CTRBatch`: one batch of a CTR data set in torchrec's KeyedJaggedTensor layout.

Categorical ids are stored field-major: ``values`` holds field 0 sample 0, field 0
sample 1, ..., field 0 sample B-1, then field 1 sample 0, ... and ``lengths[f, b]``
is the number of ids of field ``f`` in sample ``b`` (0 = missing, 1 = single-hot,
more = multi-hot)::

    batch = CTRBatch(dense=torch.zeros(2, 13), values=torch.tensor([5, 7, 9]),
                     lengths=torch.tensor([[1, 1], [0, 1]]), labels=torch.tensor([0., 1.]))
    ids, offsets = batch.field_values(0)   # tensor([5, 7]), tensor([0, 1, 2])
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import cached_property
from typing import Sequence

import torch

logger = logging.getLogger(__name__)

__all__ = ["CTRBatch", "segment_gather_index"]


def segment_gather_index(src_starts: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Indices that copy segments ``[src_starts[i], src_starts[i] + counts[i])`` back to back.

    ``values[segment_gather_index(torch.tensor([4, 0]), torch.tensor([2, 3]))]`` gathers
    ``values[4:6]`` then ``values[0:3]``; built with tensor ops, no loop per segment.
    """
    counts = counts.to(torch.int64)
    total = int(counts.sum())
    if total == 0:
        return torch.zeros(0, dtype=torch.int64, device=counts.device)
    dst_starts = torch.cumsum(counts, 0) - counts
    # each output position = its segment's source start + its rank inside the segment
    shift = torch.repeat_interleave(src_starts.to(torch.int64) - dst_starts, counts, output_size=total)
    return shift + torch.arange(total, dtype=torch.int64, device=counts.device)


@dataclass(frozen=True, eq=False)  # tensors/arrays have no single-bool ==
class CTRBatch:
    """A batch of CTR samples: dense features, jagged categorical ids, labels.

    Fields:
        dense: float32 ``[B, num_dense]``.
        values: int64 ``[nnz]``, all categorical ids, field-major (see module doc).
        lengths: int64 ``[F, B]``, ids per field and sample; ``lengths.sum() == nnz``.
        labels: float32 ``[B]``, 0. or 1.
        teacher_prob: float32 ``[B]`` or None; the planted click probability (synthetic data only).

    Example::

        b = CTRBatch(torch.zeros(1, 0), torch.tensor([3]), torch.tensor([[1]]), torch.tensor([1.]))
        b.batch_size, b.num_fields   # (1, 1)
    """

    dense: torch.Tensor
    values: torch.Tensor
    lengths: torch.Tensor
    labels: torch.Tensor
    teacher_prob: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.lengths.dim() != 2:
            raise ValueError(f"lengths must be [F, B], got shape {tuple(self.lengths.shape)}")
        num_fields, batch_size = self.lengths.shape
        if self.labels.shape != (batch_size,):
            raise ValueError(f"labels must be [B={batch_size}], got shape {tuple(self.labels.shape)}")
        if self.dense.dim() != 2 or self.dense.shape[0] != batch_size:
            raise ValueError(f"dense must be [B={batch_size}, num_dense], got shape {tuple(self.dense.shape)}")
        if self.values.dim() != 1:
            raise ValueError(f"values must be 1-D, got shape {tuple(self.values.shape)}")
        if self.teacher_prob is not None and self.teacher_prob.shape != (batch_size,):
            raise ValueError(f"teacher_prob must be [B={batch_size}], got {tuple(self.teacher_prob.shape)}")
        if self.values.dtype != torch.int64 or self.lengths.dtype != torch.int64:
            raise ValueError(f"values and lengths must be int64, got {self.values.dtype} and {self.lengths.dtype}")
        # the nnz check reads lengths back, which would force a sync on an accelerator; numpy's
        # single-threaded sum avoids waking torch's thread pool for a tiny reduction
        if self.lengths.device.type == "cpu":
            nnz = int(self.lengths.detach().numpy().sum())
            if nnz != self.values.numel():
                raise ValueError(f"lengths sum to {nnz} but values has {self.values.numel()} ids")

    @property
    def batch_size(self) -> int:
        """Number of samples B: ``CTRBatch(...).batch_size``."""
        return int(self.lengths.shape[1])

    @property
    def num_fields(self) -> int:
        """Number of categorical fields F: ``batch.num_fields``."""
        return int(self.lengths.shape[0])

    @property
    def num_dense(self) -> int:
        """Number of dense features: ``batch.num_dense``."""
        return int(self.dense.shape[1])

    @cached_property
    def _offsets(self) -> torch.Tensor:
        zeros = torch.zeros(self.num_fields, 1, dtype=torch.int64, device=self.lengths.device)
        return torch.cat([zeros, torch.cumsum(self.lengths, dim=1)], dim=1)

    @cached_property
    def _field_starts(self) -> torch.Tensor:
        zero = torch.zeros(1, dtype=torch.int64, device=self.lengths.device)
        return torch.cat([zero, torch.cumsum(self.lengths.sum(dim=1), dim=0)])

    def offsets(self) -> torch.Tensor:
        """Per-field cumulative lengths, int64 ``[F, B+1]``; row f starts at 0.

        ``batch.offsets()[f]`` is what ``nn.EmbeddingBag(..., include_last_offset=True)``
        takes with ``batch.field_values(f)[0]``. Cached; do not modify the result.
        """
        return self._offsets

    def field_starts(self) -> torch.Tensor:
        """Start of each field's segment in ``values``, int64 ``[F+1]``: ``values[s[f]:s[f+1]]``."""
        return self._field_starts

    def flat_offsets(self) -> torch.Tensor:
        """KeyedJaggedTensor offsets over the field-major lengths, int64 ``[F*B+1]``.

        ``KeyedJaggedTensor(keys, batch.values, offsets=batch.flat_offsets())``.
        """
        zero = torch.zeros(1, dtype=torch.int64, device=self.lengths.device)
        return torch.cat([zero, torch.cumsum(self.lengths.reshape(-1), dim=0)])

    def field_values(self, field: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(ids, offsets)`` of one field, both views: ids ``[nnz_f]``, offsets ``[B+1]`` from 0.

        ``ids, offs = batch.field_values(3); emb_bag(ids, offs)`` with ``include_last_offset=True``.
        """
        if not 0 <= field < self.num_fields:
            raise IndexError(f"field {field} out of range for a batch with {self.num_fields} fields")
        start = int(self._field_starts[field])
        end = int(self._field_starts[field + 1])
        return self.values.narrow(0, start, end - start), self._offsets[field]

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "CTRBatch":
        """A copy of the batch on ``device``: ``batch.to("cuda", non_blocking=True)``."""

        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device, non_blocking=non_blocking)

        return CTRBatch(move(self.dense), move(self.values), move(self.lengths), move(self.labels),
                        move(self.teacher_prob))

    def narrow(self, start: int, length: int) -> "CTRBatch":
        """Samples ``[start, start + length)`` as a new batch: ``batch.narrow(0, 128)``."""
        if start < 0 or length < 0 or start + length > self.batch_size:
            raise IndexError(f"samples [{start}, {start + length}) out of range for batch size {self.batch_size}")
        offs = self._offsets
        src_starts = self._field_starts[:-1] + offs[:, start]
        counts = offs[:, start + length] - offs[:, start]
        values = self.values[segment_gather_index(src_starts, counts)]
        prob = None if self.teacher_prob is None else self.teacher_prob[start:start + length]
        return CTRBatch(self.dense[start:start + length], values, self.lengths[:, start:start + length].contiguous(),
                        self.labels[start:start + length], prob)

    def split(self, num_parts: int) -> list["CTRBatch"]:
        """Split into ``num_parts`` micro-batches of near-equal size, in order: ``batch.split(2)``."""
        if num_parts < 1 or num_parts > self.batch_size:
            raise ValueError(f"cannot split a batch of {self.batch_size} samples into {num_parts} parts")
        base, extra = divmod(self.batch_size, num_parts)
        sizes = [base + (1 if i < extra else 0) for i in range(num_parts)]
        starts = [sum(sizes[:i]) for i in range(num_parts)]
        return [self.narrow(s, n) for s, n in zip(starts, sizes)]

    @staticmethod
    def concat(batches: Sequence["CTRBatch"]) -> "CTRBatch":
        """Concatenate batches along the sample axis: ``CTRBatch.concat([a, b])``.

        All batches need the same number of fields and dense features; teacher_prob is
        kept only when every batch has it.
        """
        if not batches:
            raise ValueError("concat needs at least one batch")
        num_fields, num_dense = batches[0].num_fields, batches[0].num_dense
        for i, b in enumerate(batches):
            if b.num_fields != num_fields or b.num_dense != num_dense:
                raise ValueError(f"batch {i} has {b.num_fields} fields / {b.num_dense} dense features, "
                                 f"batch 0 has {num_fields} / {num_dense}")
        if len(batches) == 1:
            return batches[0]
        # counts[k, f] = ids of field f in batch k; output segments are ordered (f, k)
        counts = torch.stack([b.lengths.sum(dim=1) for b in batches])
        nnz = torch.tensor([b.values.numel() for b in batches], dtype=torch.int64, device=counts.device)
        batch_base = torch.cumsum(nnz, 0) - nnz
        field_starts = torch.stack([b.field_starts()[:-1] for b in batches])
        src_starts = (batch_base[:, None] + field_starts).t().reshape(-1)
        values = torch.cat([b.values for b in batches])[segment_gather_index(src_starts, counts.t().reshape(-1))]
        probs = [b.teacher_prob for b in batches]
        prob = torch.cat(probs) if all(p is not None for p in probs) else None  # type: ignore[arg-type]
        return CTRBatch(
            dense=torch.cat([b.dense for b in batches]),
            values=values,
            lengths=torch.cat([b.lengths for b in batches], dim=1),
            labels=torch.cat([b.labels for b in batches]),
            teacher_prob=prob,
        )
