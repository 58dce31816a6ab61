"""The ``picasso`` block of a DeepSpeed config: packing, caching and interleaving switches.

    >>> PicassoConfig.model_validate({"packing": True, "cache": {"rows": 200000}})
    >>> PicassoConfig.model_validate({"interleave": {"micro_batches": 2, "prefetch_batches": 2}})
"""
from __future__ import annotations

from typing import Literal

from pydantic import Field, PositiveFloat, PositiveInt

from sparse_scale.base.blocks import StrictBlock



class SparseOptimizerConfig(StrictBlock):
    """The optimizer fused into the embedding backward (dense layers use DeepSpeed's).

    ``lr_schedule``: ``"deepspeed"`` (default) runs the tables at ``lr`` x DeepSpeed's lr of that step / its
    schedule's peak (the config's ``scheduler`` warm-up and decay, peaking at ``lr``; no scheduler: ``lr``);
    ``"constant"``: always ``lr``. Default "deepspeed": DeepSpeed users expect the config's scheduler to govern
    the whole model. See ``picasso_ops.distributed.step.deepspeed_lr_factor``.

    Example::

        >>> SparseOptimizerConfig(type="adam", lr=0.001, lr_schedule="constant").lr_schedule
        'constant'
    """

    type: Literal["sgd", "rowwise_adagrad", "adam"] = "rowwise_adagrad"
    lr: PositiveFloat = 0.05
    lr_schedule: Literal["deepspeed", "constant"] = "deepspeed"
    eps: PositiveFloat = 1e-8
    beta1: float = Field(0.9, ge=0.0, lt=1.0)
    beta2: float = Field(0.999, ge=0.0, lt=1.0)


class CacheConfig(StrictBlock):
    """A fixed-capacity fast tier of hot rows in front of a slower store."""

    rows: PositiveInt
    policy: Literal["lfu", "lru"] = "lfu"
    store: Literal["memory", "mmap", "ps"] = "memory"
    prefetch: bool = True


class InterleaveConfig(StrictBlock):
    """Split each batch into micro-batches whose stages overlap; read the next batches while one trains.

    ``micro_batches`` K: the batch's K micro-batches run their lookups, dense compute and embedding
    backwards interleaved on threads (1: off). ``prefetch_batches`` N: a background thread reads the
    training data up to N batches ahead of the step (``picasso_ops.data.prefetch``; 0, the default: off,
    the loop reads each batch itself). Training sees the same batches in the same order either way, so
    the weights are the same bit for bit, and checkpoints record the position of the batches consumed.
    Off by default because the producer thread needs a core the step leaves idle: on the shared 2-core
    machine train_rec ran at 0.86x with 2 (benchmarks/RESULTS.md, "Data prefetch in train_rec"); turn it
    on where a core is free during the step (GPU hosts, CPU hosts with cores to spare).
    """

    micro_batches: PositiveInt = 1
    prefetch_batches: int = Field(0, ge=0, le=64)


class PicassoConfig(StrictBlock):
    """Validated ``"picasso"`` block; absent block = plain per-field embeddings."""

    packing: bool = True
    sharding: Literal["data_parallel", "row_wise"] = "data_parallel"  # how tables span ranks
    embedding_dim: PositiveInt = 16
    optimizer: SparseOptimizerConfig = SparseOptimizerConfig()
    cache: CacheConfig | None = None
    interleave: InterleaveConfig = InterleaveConfig()
