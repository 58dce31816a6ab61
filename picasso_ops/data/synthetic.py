"""A synthetic CTR stream with a planted teacher, so the best reachable AUC is known.

Ids are Zipf-distributed per field (``zipf.py``), fields can be multi-hot, dense
features are standard normal, and labels are Bernoulli(sigmoid(teacher logit))
(``teacher.py``). Batch k of a split is a pure function of (seed, split, k, batch
size): it does not depend on how many batches were drawn before, on the rank, or on
the world size. Rank r of W takes global batches start, start+W, ... offset by r, so
the union over ranks is exactly the single-rank stream::

    cfg = SyntheticConfig(num_fields=26, vocab_sizes=100_000, seed=1)
    train = SyntheticCTRStream(cfg, batch_size=4096, rank=0, world_size=2)
    batch = next(iter(train))
    eval_batches = list(SyntheticCTRStream(cfg, 4096, split="eval", num_batches=8))
    print(bayes_optimal_auc(eval_batches))   # about cfg.target_auc
"""
from __future__ import annotations

import functools
import logging
from typing import Iterator, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from .batch import CTRBatch
from .teacher import PlantedTeacher
from .zipf import MAX_VOCAB, ZipfSampler

logger = logging.getLogger(__name__)

__all__ = ["SyntheticConfig", "SyntheticCTRGenerator", "SyntheticCTRStream", "Split"]

Split = Literal["train", "eval"]
_SPLIT_CODES = {"train": 1, "eval": 2, "calibration": 3}
_MASK64 = (1 << 64) - 1
_CALIBRATION_IDS = 1 << 19  # ids in the calibration sample: a stable AUC estimate, cheap at 1000 fields


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def _mix_seed(*parts: int) -> int:
    x = 0
    for p in parts:
        x = _splitmix64(x ^ (p & _MASK64))
    return x & ((1 << 63) - 1)


class SyntheticConfig(BaseModel):
    """Settings of the synthetic CTR stream; unknown keys are errors.

    ``SyntheticConfig(num_fields=100, vocab_sizes=[10_000] * 100, max_ids_per_field=1)``
    gives 100 single-hot fields. Fields:
        num_fields: categorical fields F, 26..1000.
        vocab_sizes: one vocabulary size for all fields, or a list of F.
        zipf_exponent: s > 1 of the id distribution (rank k has mass ~ k^-s).
        min_ids_per_field / max_ids_per_field: ids per field and sample are uniform in
            [min, max]; max may be one int or a list of F. 1/1 is single-hot, min 0 allows missing.
        num_dense: dense features per sample (standard normal).
        seed: seeds the teacher, the id permutations and every batch.
        teacher_rank: rank of the teacher's pairwise field interactions.
        linear_weight / interaction_weight / dense_weight: relative standard deviations of
            the teacher's per-id, pairwise and dense parts.
        target_auc: Bayes-optimal AUC the teacher is scaled to (expected value).
        target_ctr: click rate the teacher's bias is set to.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    num_fields: int = Field(26, ge=26, le=1000)
    vocab_sizes: int | list[int] = 100_000
    zipf_exponent: float = Field(1.1, gt=1.0, le=4.0)
    min_ids_per_field: int = Field(1, ge=0)
    max_ids_per_field: int | list[int] = 3
    num_dense: int = Field(13, ge=0, le=10_000)
    seed: int = Field(0, ge=0)
    teacher_rank: int = Field(4, ge=1, le=64)
    linear_weight: float = Field(1.0, ge=0.0)
    interaction_weight: float = Field(1.0, ge=0.0)
    dense_weight: float = Field(0.5, ge=0.0)
    target_auc: float = Field(0.8, gt=0.5, lt=0.99)
    target_ctr: float = Field(0.2, ge=0.01, le=0.5)

    @model_validator(mode="after")
    def _check_lists(self) -> "SyntheticConfig":
        vocab = self.field_vocab_sizes()
        if len(vocab) != self.num_fields:
            raise ValueError(f"vocab_sizes has {len(vocab)} entries but num_fields is {self.num_fields}")
        bad = [v for v in vocab if not 1 <= v <= MAX_VOCAB]
        if bad:
            raise ValueError(f"vocab_sizes must lie in [1, {MAX_VOCAB}], got {bad[:5]}")
        max_ids = self.field_max_ids()
        if len(max_ids) != self.num_fields:
            raise ValueError(f"max_ids_per_field has {len(max_ids)} entries but num_fields is {self.num_fields}")
        low = [m for m in max_ids if m < max(self.min_ids_per_field, 1)]
        if low:
            raise ValueError(f"max_ids_per_field must be >= max(min_ids_per_field, 1) = "
                             f"{max(self.min_ids_per_field, 1)}, got {low[:5]}")
        if max(max_ids) > 1024:
            raise ValueError(f"max_ids_per_field must be <= 1024, got {max(max_ids)}")
        if self.linear_weight + self.interaction_weight + self.dense_weight <= 0:
            raise ValueError("at least one of linear_weight, interaction_weight, dense_weight must be > 0")
        if self.dense_weight > 0 and self.num_dense == 0 and self.linear_weight + self.interaction_weight == 0:
            raise ValueError("dense_weight is the only signal but num_dense is 0")
        return self

    def field_vocab_sizes(self) -> list[int]:
        """Vocabulary size of every field: ``cfg.field_vocab_sizes()[3]``."""
        v = self.vocab_sizes
        return [v] * self.num_fields if isinstance(v, int) else list(v)

    def field_max_ids(self) -> list[int]:
        """Most ids per sample of every field: ``cfg.field_max_ids()``."""
        m = self.max_ids_per_field
        return [m] * self.num_fields if isinstance(m, int) else list(m)


class SyntheticCTRGenerator:
    """Makes batch k of a split on demand: ``SyntheticCTRGenerator.for_config(cfg).batch(4096, k)``.

    Construction samples a calibration batch to scale the teacher (~0.2 s at 26 fields, ~2 s at 1000);
    ``for_config`` caches generators so train and eval streams share one teacher.
    """

    def __init__(self, config: SyntheticConfig) -> None:
        self.config = config
        vocab = config.field_vocab_sizes()
        self._zipf = ZipfSampler(vocab, config.zipf_exponent, _mix_seed(config.seed, 11))
        self._min_len = config.min_ids_per_field
        self._len_span = torch.tensor([m - self._min_len + 1 for m in config.field_max_ids()],
                                      dtype=torch.float32).unsqueeze(1)
        self._max_len = max(config.field_max_ids())
        self._fixed_len = all(m == self._min_len for m in config.field_max_ids())
        raw = PlantedTeacher.random(vocab, config.num_dense, config.teacher_rank, _mix_seed(config.seed, 12))
        mean_len = sum(0.5 * (self._min_len + m) for m in config.field_max_ids()) / config.num_fields
        cal_size = int(min(16384, max(2048, _CALIBRATION_IDS // max(1.0, config.num_fields * mean_len))))
        dense, ids, lengths, _ = self._draw(cal_size, 0, "calibration")
        parts = raw.components_grid(dense, ids, lengths)
        weights = (config.linear_weight, config.interaction_weight, config.dense_weight)
        self.teacher = raw.calibrated(parts, weights, config.target_auc, config.target_ctr)
        logger.debug("synthetic generator ready: %d fields, calibration sample of %d", config.num_fields, cal_size)

    @staticmethod
    def for_config(config: SyntheticConfig) -> "SyntheticCTRGenerator":
        """The cached generator of ``config``: ``SyntheticCTRGenerator.for_config(cfg)``."""
        return _cached_generator(config.model_dump_json())

    @property
    def zipf(self) -> ZipfSampler:
        """The id sampler (for tests and cache studies): ``gen.zipf.probability_of_rank(0, 0)``."""
        return self._zipf

    def _draw(self, batch_size: int, index: int, split: str
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Generator]:
        """Dense ``[B, D]``, ids ``[F, B, L]`` (first ``lengths`` of each row count), lengths ``[F, B]``."""
        cfg = self.config
        g = torch.Generator().manual_seed(_mix_seed(cfg.seed, _SPLIT_CODES[split], index))
        num_fields = cfg.num_fields
        if self._fixed_len:
            lengths = torch.full((num_fields, batch_size), self._min_len, dtype=torch.int64)
        else:
            u = torch.rand(num_fields, batch_size, generator=g)
            lengths = (u * self._len_span).to(torch.int64).clamp_(max=self._len_span.to(torch.int64) - 1)
            lengths += self._min_len
        # a dense [F, B, max] grid: per-field parameters broadcast instead of per-id gathers
        ids = self._zipf.sample(torch.rand(num_fields, batch_size, self._max_len, generator=g, dtype=torch.float64))
        dense = torch.randn(batch_size, cfg.num_dense, generator=g)
        return dense, ids, lengths, g

    def batch(self, batch_size: int, index: int, split: Split = "train") -> CTRBatch:
        """Global batch ``index`` of ``split``, identical on every call: ``gen.batch(4096, 7, "eval")``."""
        if split not in ("train", "eval"):
            raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
        if batch_size < 1 or index < 0:
            raise ValueError(f"need batch_size >= 1 and index >= 0, got {batch_size} and {index}")
        dense, ids, lengths, g = self._draw(batch_size, index, split)
        if self._fixed_len:
            present = None
            values = ids.reshape(-1)
        else:
            present = torch.arange(self._max_len).view(1, 1, -1) < lengths.unsqueeze(-1)
            values = torch.masked_select(ids, present)
        parts = self.teacher.components_grid(dense, ids, lengths, present)
        prob = torch.sigmoid(self.teacher.logit_from_components(parts))
        labels = (torch.rand(batch_size, generator=g) < prob).to(torch.float32)
        return CTRBatch(dense=dense, values=values, lengths=lengths, labels=labels, teacher_prob=prob)


@functools.lru_cache(maxsize=4)
def _cached_generator(config_json: str) -> SyntheticCTRGenerator:
    return SyntheticCTRGenerator(SyntheticConfig.model_validate_json(config_json))


class SyntheticCTRStream:
    """Iterates this rank's share of a synthetic split.

    Rank r yields global batches ``start_batch + r``, ``start_batch + r + W``, ...; a
    train stream is infinite unless ``num_batches`` (a global count, exclusive end
    index) is given, an eval stream needs it. Each ``iter()`` starts again at
    ``start_batch``; ``state()["next_batch"]`` after k batches is ``start_batch + k*W``,
    the ``start_batch`` to resume with (with any world size)::

        stream = SyntheticCTRStream(cfg, 512, rank=1, world_size=2, start_batch=ckpt["next_batch"])
    """

    def __init__(self, config: SyntheticConfig, batch_size: int, rank: int = 0, world_size: int = 1,
                 split: Split = "train", start_batch: int = 0, num_batches: int | None = None) -> None:
        if split not in ("train", "eval"):
            raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
        if batch_size < 1 or start_batch < 0:
            raise ValueError(f"need batch_size >= 1 and start_batch >= 0, got {batch_size} and {start_batch}")
        if split == "eval" and num_batches is None:
            raise ValueError("an eval stream must be finite: pass num_batches (global batches in the eval split)")
        if num_batches is not None and num_batches < 0:
            raise ValueError(f"num_batches must be >= 0, got {num_batches}")
        self.config = config
        self.batch_size = batch_size
        self.rank = rank
        self.world_size = world_size
        self.split: Split = split
        self.start_batch = start_batch
        self.num_batches = num_batches
        self.generator = SyntheticCTRGenerator.for_config(config)
        self._next_batch = start_batch

    def __len__(self) -> int:
        """Batches this rank yields per pass (finite streams only): ``len(eval_stream)``."""
        if self.num_batches is None:
            raise TypeError("an infinite train stream has no length; pass num_batches")
        first = self.start_batch + self.rank
        return max(0, -(-(self.num_batches - first) // self.world_size))

    def __iter__(self) -> Iterator[CTRBatch]:
        self._next_batch = self.start_batch
        step = 0
        while True:
            index = self.start_batch + self.rank + step * self.world_size
            if self.num_batches is not None and index >= self.num_batches:
                return
            batch = self.generator.batch(self.batch_size, index, self.split)
            step += 1
            self._next_batch = self.start_batch + step * self.world_size
            yield batch

    def state(self) -> dict[str, int | str]:
        """Resume point: ``SyntheticCTRStream(cfg, bs, r, W, start_batch=stream.state()["next_batch"])``."""
        return {"split": self.split, "seed": self.config.seed, "batch_size": self.batch_size,
                "next_batch": self._next_batch}
