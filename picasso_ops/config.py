"""The ``picasso`` block of a DeepSpeed config: packing, caching and interleaving switches.

    >>> PicassoConfig.model_validate({"packing": True, "cache": {"rows": 200000}})
    >>> PicassoConfig.model_validate({"interleave": {"micro_batches": 2, "prefetch_batches": 2}})
    >>> PicassoConfig.model_validate({"bounds_check": "warn"})
"""
from __future__ import annotations

from typing import Literal

from pydantic import Field, PositiveFloat, PositiveInt, model_validator

from sparse_core.blocks import StrictBlock


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

    type: Literal["sgd", "rowwise_adagrad", "adam"] = Field(
        "rowwise_adagrad",
        description='The tables\' optimizer, run on the touched rows inside the fused backward: "sgd", '
                    '"rowwise_adagrad" (one accumulator per row: the mean squared gradient over the row) or lazy '
                    '"adam" (moments of touched rows only, bias correction by the global step).')
    lr: PositiveFloat = Field(
        0.05, description='The tables\' learning rate: constant with lr_schedule "constant", the peak that '
                          'DeepSpeed\'s schedule scales at each step with "deepspeed".')
    lr_schedule: Literal["deepspeed", "constant"] = Field(
        "deepspeed",
        description='"deepspeed": the tables run at lr x DeepSpeed\'s lr of that step / its schedule\'s peak '
                    '(lr throughout without a scheduler); "constant": always lr.')
    eps: PositiveFloat = Field(
        1e-8, description="Term added to the square root in the update's denominator by rowwise_adagrad and adam "
                          "(sgd ignores it).")
    beta1: float = Field(0.9, ge=0.0, lt=1.0,
                         description="Decay rate of lazy adam's first-moment estimate per step (only adam reads it).")
    beta2: float = Field(0.999, ge=0.0, lt=1.0,
                         description="Decay rate of lazy adam's second-moment (squared gradient) estimate per step "
                                     "(only adam reads it).")
    weight_decay: float = Field(
        0.0, ge=0.0, allow_inf_nan=False,
        description="Decoupled weight decay of the embedding rows a step touches (AdamW's form, lazy like the "
                    "moments): each touched row is first scaled by 1 - lr x weight_decay, then updated (for sgd the "
                    "same as an L2 penalty of weight_decay / 2 x w**2); untouched rows do not decay. 0 (default): "
                    "off. lr x weight_decay must stay below 1. The fused C++/Triton kernels take no decay: with it "
                    "the packs update through the torch path (same formulas).")


class CacheConfig(StrictBlock):
    """A fixed-capacity fast tier of hot rows in front of a slower store."""

    rows: PositiveInt = Field(
        description="Capacity of the cache in rows per packed table (wide-and-deep: the deep embeddings and the wide "
                    "weights each), optimizer state included; at most the table's rows, and at least one "
                    "(micro-)batch's distinct rows on a rank.")
    policy: Literal["lfu", "lru"] = Field(
        "lfu", description='Eviction policy among the rows the batch does not use: "lfu" evicts the least used '
                           '(counts aged so once-hot rows fade), "lru" the least recently used.')
    store: Literal["memory", "mmap", "ps"] = Field(
        "memory", description='Where the rows behind the cache live: "memory" host tensors, "mmap" a file per rank '
                              'and table under OUT/picasso_cache/, "ps" gba_engine\'s parameter servers (with a gba '
                              'block: a read cache of server rows on each worker, docs/gba.md).')
    prefetch: bool = Field(
        True, description="Read the next micro-batch's missing rows from the store while the current one computes; "
                          "it has an effect only with interleave.micro_batches > 1 (with store 'ps' the "
                          "rec job does not read ahead: GBA hands out batches one step at a time; library users call "
                          "GBAEngine.prefetch_rows).")


class InterleaveConfig(StrictBlock):
    """Split each batch into micro-batches whose stages overlap; read the next batches while one trains.

    ``micro_batches`` K: the batch's K micro-batches run their lookups, dense compute and embedding
    backwards interleaved on threads (1: off). ``prefetch_batches`` N: a background thread reads the
    training data up to N batches ahead of the step (``picasso_ops.data.prefetch``; 0, the default: off,
    the loop reads each batch itself). Training sees the same batches in the same order either way, so
    the weights are the same bit for bit, and checkpoints record the position of the batches consumed.
    Off by default because the producer thread needs a core the step leaves idle, which a 2-core host
    does not have (benchmarks/RESULTS.md, "Data prefetch in train_rec"); turn it on where a core is free
    during the step (GPU hosts, CPU hosts with cores to spare).
    """

    micro_batches: PositiveInt = Field(
        1, description="Micro-batches K each batch is split into, whose lookups, dense compute and embedding "
                       "backwards overlap on threads (1: off; results equal K = 1 up to float rounding).")
    prefetch_batches: int = Field(
        0, ge=0, le=64,
        description="Training batches a background thread reads ahead of the step (0: off); the same batches "
                    "arrive in the same order, so the weights are the same bit for bit.")


class PicassoConfig(StrictBlock):
    """Validated ``"picasso"`` block; absent block = plain per-field embeddings."""

    packing: bool = Field(
        True, description="Pack tables that can share a kernel (same dtype, optimizer settings, pooling kind and "
                          "dim) into one buffer with one fused lookup and one fused backward + update per pack; "
                          "false: one pack per table (same results, more kernel calls).")
    sharding: Literal["data_parallel", "row_wise", "auto"] = Field(
        "auto", description='How tables span ranks: "data_parallel" replicates every table on every rank, '
                            '"row_wise" spreads each table\'s rows over the ranks (no cache then), "auto" (default) '
                            'lets the planner choose per table from its size and the batch\'s expected unique ids '
                            '(picasso_ops.distributed.planner; the plan is logged at start; small and hot tables '
                            'stay data-parallel); with a cache or bounds_check "warn"/"clamp", "auto" keeps every '
                            'table data-parallel.')
    table_sharding: dict[str, Literal["data_parallel", "row_wise"]] = Field(
        {}, description='With sharding "auto": placements that win over the planner\'s, keyed by table name (e.g. '
                        '"emb3") or field index ("3": every table of field 3), each "data_parallel" or "row_wise".')
    embedding_dim: PositiveInt = Field(
        16, description="Width of each field's deep embedding vector, in values per row (wide-and-deep's wide "
                        "weights stay at width 1).")
    optimizer: SparseOptimizerConfig = Field(
        SparseOptimizerConfig(),
        description="The optimizer fused into the embedding backward (dense layers use DeepSpeed's).")
    cache: CacheConfig | None = Field(
        None, description="A hot-row cache in front of a slower store for data-parallel tables; null: no cache.")
    interleave: InterleaveConfig = Field(
        InterleaveConfig(), description="Micro-batch interleaving inside a step and read-ahead of training batches "
                                        "(both off by default).")
    pipeline: Literal["row_wise", "all", "off"] = Field(
        "row_wise", description='Sparse-dist pipeline of the rec job and of engine.pipeline(batches) in an own '
                                'script: a background thread reads the next training batch and, on a gloo group of its own, prepares its lookups while this batch\'s '
                                'forward and backward run. "row_wise" (default): the row-wise tables\' ids are '
                                'deduplicated and sent to their owners, and the rows fetched once this batch\'s '
                                'step is done (a model without row-wise tables runs unpipelined); "all": also the '
                                'data-parallel tables\' row union over the ranks, so their step skips the dedup '
                                '(measured slower: that union costs more than it saves); "off". Results equal the '
                                'unpipelined step bit for bit. Per-rank streams, interleave.micro_batches 1 and no '
                                'cache only.')
    bounds_check: Literal["fatal", "warn", "clamp"] = Field(
        "fatal", description='What a lookup does with an embedding id < 0 or >= its table\'s rows (FBGEMM\'s '
                             'BoundsCheckMode): "fatal" stops with an error naming the field, table, id and range; '
                             '"warn" looks the id up as row 0 (FBGEMM\'s WARNING) and "clamp" as the nearest valid '
                             'row, both logged once per table and counted in the summary (data-parallel tables '
                             'without a cache or gba block only).')

    @property
    def planned(self) -> bool:
        """Whether the sharding planner places the tables: ``"auto"`` without a cache or a non-fatal bounds check."""
        return self.sharding == "auto" and self.cache is None and self.bounds_check == "fatal"

    @property
    def table_placement(self) -> Literal["data_parallel", "row_wise", "auto"]:
        """``sharding`` as it applies: ``"auto"`` only where :attr:`planned`, else its data-parallel fallback.

        Example::

            >>> PicassoConfig().table_placement, PicassoConfig(cache={"rows": 10}).table_placement
            ('auto', 'data_parallel')
        """
        if self.sharding == "auto" and not self.planned:
            return "data_parallel"
        return self.sharding

    @model_validator(mode="after")
    def _table_sharding_needs_auto(self) -> "PicassoConfig":
        """table_sharding needs sharding "auto"; its keys are table names or field indices (no ".", no spaces)."""
        if self.table_sharding and self.sharding != "auto":
            keys = sorted(self.table_sharding)
            raise ValueError(f'table_sharding {keys} applies with sharding "auto" only; sharding is '
                             f'"{self.sharding}" (set "sharding": "auto" or drop table_sharding)')
        if self.table_sharding and not self.planned:
            keys = sorted(self.table_sharding)
            why = "a cache" if self.cache is not None else f'bounds_check "{self.bounds_check}"'
            raise ValueError(f"table_sharding {keys}: with {why} every table stays data-parallel (drop table_sharding, "
                             "or the cache / use bounds_check \"fatal\")")
        bad = [k for k in self.table_sharding if not k or "." in k or k != k.strip()]
        if bad:
            raise ValueError(f"table_sharding keys must be table names or field indices, got {bad}")
        return self
