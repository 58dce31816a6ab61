"""One rank's view of a recommender job: its place, the shapes and settings derived from the config.

Example::

    job = RecJob.build(RecJobConfig(config="ds_configs/demo_cpu.json"), rank=0, world_size=2)
    job.micro_batch, job.workers, job.model_args.vocab_sizes[:2]      # 256, 2, [2000, 2000]
"""
from __future__ import annotations

import dataclasses
from typing import Any

from picasso_ops.data.synthetic import SyntheticConfig
from picasso_ops.models import DCNv2Args, DeepFMArgs, DLRMArgs, WideAndDeepArgs, model_args
from sparse_scale.rec.config import RecJobConfig

FILE_FIELDS, FILE_DENSE = 26, 13  # Criteo's layout: 13 integer and 26 categorical columns


def with_schedule_length(ds: dict[str, Any], steps: int) -> dict[str, Any]:
    """A copy of the DeepSpeed dict whose scheduler ``total_num_steps: "auto"`` is ``steps``.

    Example::

        with_schedule_length({"scheduler": {"params": {"total_num_steps": "auto"}}}, 10)["scheduler"]
        # {"params": {"total_num_steps": 10}}
    """
    params = ds.get("scheduler", {}).get("params", {})
    if params.get("total_num_steps") != "auto":
        return dict(ds)
    return {**ds, "scheduler": {**ds["scheduler"], "params": {**params, "total_num_steps": steps}}}


@dataclasses.dataclass(frozen=True)
class RecJob:
    """Everything one rank needs to build, train and evaluate; made by :meth:`build`.

    ``workers`` is the number of ranks the data is split over: all of them, less the
    parameter servers (the last ``gba.num_servers`` ranks) with a gba block.
    """

    config: RecJobConfig
    rank: int
    workers: int
    ds: dict[str, Any]  # DeepSpeed's dict, scheduler length resolved
    micro_batch: int
    grad_accum: int
    synthetic: SyntheticConfig | None  # None: file data
    model_args: WideAndDeepArgs | DLRMArgs | DeepFMArgs | DCNv2Args  # the shape of --model

    @classmethod
    def build(cls, config: RecJobConfig, rank: int, world_size: int) -> "RecJob":
        """This rank's job in a launch of ``world_size`` processes."""
        gba = config.loaded.blocks.get("gba")
        workers = max(1, world_size - gba.num_servers) if gba is not None else world_size
        ds = with_schedule_length(config.loaded.ds, config.steps)
        synthetic = None
        if config.data == "synthetic":
            synthetic = SyntheticConfig(num_fields=config.fields, vocab_sizes=config.vocab,
                                        zipf_exponent=config.zipf, max_ids_per_field=config.max_hot,
                                        num_dense=config.num_dense, seed=config.seed)
            vocab_sizes, num_dense = synthetic.field_vocab_sizes(), config.num_dense
        else:
            schema = config.data_schema()  # the files' columns: --schema, else Criteo's FILE_FIELDS and FILE_DENSE
            vocab_sizes, num_dense = [config.vocab] * schema.num_categorical, schema.num_dense
        return cls(config=config, rank=rank, workers=workers, ds=ds,
                   micro_batch=int(ds.get("train_micro_batch_size_per_gpu", 256)),
                   grad_accum=int(ds.get("gradient_accumulation_steps", 1)), synthetic=synthetic,
                   model_args=model_args(config.model, vocab_sizes=vocab_sizes, num_dense=num_dense,
                                         embedding_dim=config.embedding_dim, dropout=config.dropout))

    @property
    def picasso(self) -> Any:
        """The validated ``picasso`` block, or None."""
        return self.config.loaded.blocks.get("picasso")

    @property
    def gba(self) -> Any:
        """The validated ``gba`` block, or None."""
        return self.config.loaded.blocks.get("gba")

    @property
    def claims_batches(self) -> bool:
        """Whether batches are handed out by number through the GBA engine (every job with a gba block)."""
        return self.gba is not None

    @property
    def prefetch_depth(self) -> int:
        """Training batches read ahead on a thread (``picasso.interleave.prefetch_batches``; 0 without the block)."""
        return self.picasso.interleave.prefetch_batches if self.picasso is not None else 0

    @property
    def global_batch(self) -> int:
        """Samples in one optimizer step of the whole job."""
        return self.micro_batch * self.grad_accum * self.workers
