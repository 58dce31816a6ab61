"""From a config's blocks to the modules they describe: tables for a list of fields, an MoE layer for a width.

Nobody maps block keys by hand: ``tables_from_block`` picks the class for ``picasso.sharding``, the
world size and a ``gba`` block, with the block's optimizer, cache and bounds check;
``moe_from_block`` gives the ``moe_proto`` block's layer (experts replicated on every worker with a
gba block, the ZeRO stage 3 class with a stage 3 config).

Example::

    import sparse_scale
    emb = sparse_scale.tables_from_block("ds_config.json", vocab_sizes=[1000] * 26)   # [B, 26, dim]
    moe = sparse_scale.moe_from_block("ds_config.json", hidden_size=256, ffn_hidden_size=1024)
    out, l_aux, _ = moe(h); loss = loss + moe.aux_loss_coef * l_aux
"""
from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch
from torch import nn

from sparse_core.config_file import ConfigError
from sparse_scale.config import JobConfig

logger = logging.getLogger(__name__)


def _job(config: str | os.PathLike | Mapping[str, Any] | JobConfig) -> JobConfig:
    from sparse_scale.entry import load_job

    return load_job(config)


def _started_distributed() -> tuple[int, int]:
    """``(rank, world size)``, starting torch.distributed for a launched job (tables broadcast their init)."""
    import torch.distributed as dist

    from sparse_scale.distenv import init_distributed, resolve_dist_env

    if not (dist.is_available() and dist.is_initialized()) and resolve_dist_env(os.environ).world_size > 1:
        init_distributed(backend="nccl" if torch.cuda.is_available() else "gloo")  # deepspeed, mpirun, srun alike
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def table_optimizer(block: Any) -> Any:
    """The parameter servers' optimizer for packed tables, from a validated ``picasso`` block.

    Example::

        >>> from picasso_ops.config import PicassoConfig
        >>> table_optimizer(PicassoConfig.model_validate({"optimizer": {"type": "sgd", "lr": 0.1}})).params
        (('lr', 0.1),)
    """
    from gba_engine.ps.optim import TableOptimizerSpec
    from picasso_ops.embedding.sparse_optim import OPTIMIZERS

    opt = block.optimizer
    params = {k: float(getattr(opt, k)) for k in OPTIMIZERS[opt.type].defaults}
    return TableOptimizerSpec.of(opt.type, lr_schedule=opt.lr_schedule, **params)


def tables_from_block(config: str | os.PathLike | Mapping[str, Any] | JobConfig, vocab_sizes: Sequence[int], *,
                      dim: int | None = None, pooling: str = "sum", init_std: float = 0.01, prefix: str = "emb",
                      seed: int = 0, workdir: str | os.PathLike | None = None, ids_per_field: float = 1.0,
                      unique_ids: Mapping[str, float] | None = None) -> nn.Module:
    """One table per field, as the config's ``picasso`` block (and ``gba`` block) says; ``forward`` gives ``[B, F, dim]``.

    ``forward(values, lengths)`` takes the field-major jagged batch (``lengths [F, B]``; a torchrec
    ``KeyedJaggedTensor`` ``kjt`` is ``kjt.values(), kjt.lengths().view(F, B)``). The class:

    * a ``gba`` block: ``gba_engine.packed_tables.ServerPackedFieldEmbeddings`` (rows and their
      optimizer on the parameter servers; a ``cache`` with ``store: "ps"`` becomes the engine's row cache);
    * else ``picasso.sharding`` ``"data_parallel"`` (every rank holds every row; with a ``cache``, a
      hot-row cache over the block's store, files under ``workdir``) or ``"row_wise"``;
    * ``"auto"``: each table placed by the sharding planner (``sparse_scale.planned_tables``; the plan,
      logged once on rank 0, comes from the tables' sizes, the world size, the config's
      ``train_micro_batch_size_per_gpu`` and ``ids_per_field`` or ``unique_ids``, table name -> expected
      distinct rows of one rank's batch; ``picasso.table_sharding`` overrides it per table).

    ``dim`` defaults to ``picasso.embedding_dim``; ``init_std`` 0 starts the rows at zero (a wide
    part). Starts torch.distributed under a launcher (data-parallel tables broadcast rank 0's rows).
    No ``picasso`` block: the block's defaults. Names must be unique per model (``prefix``).

    Example::

        emb = tables_from_block("ds_configs/rec_picasso_cpu.json", [1000] * 26)
        pooled = emb(values, lengths)        # [B, 26, 16]
    """
    from picasso_ops.config import PicassoConfig
    from sparse_scale.block_rules import check_blocks

    job = _job(config)
    check_blocks(job)
    block = job.blocks.get("picasso") or PicassoConfig()
    dim = int(dim or block.embedding_dim)
    sizes = [int(v) for v in vocab_sizes]
    if not sizes or min(sizes) < 1:
        raise ValueError(f"tables_from_block: vocab_sizes must be one positive row count per field, got {sizes}")
    rank, world_size = _started_distributed()
    if "gba" in job.blocks:
        from gba_engine.packed_tables import ServerPackedFieldEmbeddings

        return ServerPackedFieldEmbeddings(sizes, dim, pooling, init_std, table_optimizer(block), packing=block.packing,
                                           prefix=prefix, seed=seed)
    from picasso_ops.block import cached_field_embeddings, set_bounds_check
    from picasso_ops.models.field_embeddings import PackedFieldEmbeddings, SparseArgs

    sparse = SparseArgs.from_block(block)
    if block.cache is not None:
        if block.table_placement != "data_parallel":
            raise ValueError(f"{job.source}: picasso.cache serves data-parallel tables; sharding is {block.sharding!r}")
        make = cached_field_embeddings(block, workdir=Path(workdir) if workdir is not None else None, rank=rank)
        module: nn.Module = make(sizes, dim, pooling, sparse, init_std, prefix)
    elif block.table_placement == "auto" and (_has_batch_size(job) or "sharding" in block.model_fields_set):
        from sparse_scale.planned_tables import planned_field_embeddings

        make = planned_field_embeddings(block, world_size=world_size, batch_size=_micro_batch(job, world_size),
                                        rank=rank, ids_per_field=ids_per_field, unique_ids=unique_ids,
                                        prefixes=(prefix,))
        try:
            module = make(sizes, dim, pooling, sparse, init_std, prefix)
        except ValueError as exc:  # an override key that names no table
            raise ConfigError(f"{job.source}: {exc}") from None
    else:  # the default "auto" without a batch size to plan from: every table data-parallel (SparseArgs' own)
        module = PackedFieldEmbeddings(sizes, dim, pooling, sparse, init_std, prefix)
    set_bounds_check(module, block)
    return module


def _has_batch_size(job: JobConfig) -> bool:
    """Whether the config gives the batch size the planner needs (the default "auto" without one: data-parallel)."""
    return bool(job.ds.get("train_micro_batch_size_per_gpu") or job.ds.get("train_batch_size"))


def _micro_batch(job: JobConfig, world_size: int) -> int:
    """Samples per rank per step: ``train_micro_batch_size_per_gpu``, else ``train_batch_size / (world x gas)``."""
    ds = job.ds
    if ds.get("train_micro_batch_size_per_gpu"):
        return int(ds["train_micro_batch_size_per_gpu"])
    if ds.get("train_batch_size"):
        return max(1, int(ds["train_batch_size"]) // (world_size * int(ds.get("gradient_accumulation_steps") or 1)))
    raise ValueError(f'{job.source}: picasso.sharding "auto" plans from the batch size; the config sets neither '
                     "train_micro_batch_size_per_gpu nor train_batch_size")


def moe_from_block(config: str | os.PathLike | Mapping[str, Any] | JobConfig, hidden_size: int, *,
                   expert: nn.Module | None = None, ffn_hidden_size: int | None = None,
                   activation: str | None = None, **overrides: Any) -> nn.Module:
    """The ``moe_proto`` block's MoE layer over ``hidden_size``; ``layer.aux_loss_coef`` weighs its ``l_aux``.

    ``forward(x)`` returns ``(out, l_aux, exp_counts)`` like ``deepspeed.moe.layer.MoE``. With a
    ``gba`` block every worker holds every expert (``moe_proto.replicated.ReplicatedMoE``); with
    ``zero_optimization.stage`` 3 the layer is ``moe_proto.ZeRO3MoE``. ``overrides``: other
    ``moe_proto.MoE`` arguments (``activation``, ``use_residual``, ...).

    Example::

        moe = moe_from_block("ds_configs/moe_lm_cpu.json", hidden_size=64, ffn_hidden_size=128)
        out, l_aux, _ = moe(h); loss = ce + moe.aux_loss_coef * l_aux
    """
    from moe_proto.from_block import moe_layer

    from sparse_scale.block_rules import check_blocks

    job = _job(config)
    check_blocks(job)
    block = job.blocks.get("moe_proto")
    if block is None:
        raise ValueError(f"{job.source}: moe_from_block needs a moe_proto block (num_experts, ...)")
    stage = (job.ds.get("zero_optimization") or {}).get("stage", 0)
    return moe_layer(block, hidden_size, expert=expert, ffn_hidden_size=ffn_hidden_size, activation=activation,
                     zero_stage=3 if stage == 3 else None, replicated="gba" in job.blocks, **overrides)
