"""The CTR model of a recommender job, built from its flags and plugin blocks.

Example::

    model = build_model(RecJob.build(RecJobConfig(config="ds_configs/demo_cpu.json"), rank=0, world_size=1))
"""
from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

import torch

from picasso_ops.block import (PicassoBlockError, apply_picasso_block, cached_field_embeddings,
                               scheduled_sparse_lr)
from picasso_ops.models import (SparseArgs, build_model as build_named_model, packed_dcn_v2, packed_deepfm,
                                 packed_dlrm, packed_wide_and_deep, tower_argument)
from sparse_scale.rec.config import RecJobError
from sparse_scale.rec.job import RecJob
from sparse_scale.rec.moe_tower import tower_factory

__all__ = ["build_model", "scheduled_sparse_lr", "sparse_args", "tower_kwargs"]

logger = logging.getLogger(__name__)


def sparse_args(block: Any) -> SparseArgs:
    """The packed tables' settings from a validated ``picasso`` block (``SparseArgs.from_block``)."""
    return SparseArgs.from_block(block)


def tower_kwargs(job: RecJob) -> dict[str, Any]:
    """The model constructor's MLP argument for the job's ``moe_proto`` block (``{}`` without one).

    Example::

        WideAndDeep(job.model_args, **tower_kwargs(job))     # deep_tower=... with a moe_proto block
    """
    factory = tower_factory(job)
    if factory is None:
        return {}
    return {tower_argument(job.config.model): factory}


def _server_table_model(job: RecJob) -> torch.nn.Module:
    from gba_engine.tables import ServerFieldEmbeddings

    a, seed = job.model_args, job.config.seed

    def tables(dim: int, init_std: float, prefix: str) -> torch.nn.Module:
        return ServerFieldEmbeddings(a.vocab_sizes, dim, a.pooling, init_std, prefix, seed=seed)

    # the deep tables first, then (wide_deep, deepfm) the first-order ones, as before this helper
    return build_named_model(job.config.model, a, tables, tower_factory(job), prefix="deep")


def _packed_model(job: RecJob, block: Any) -> torch.nn.Module:
    args = dataclasses.replace(job.model_args, embedding_dim=block.embedding_dim)
    sparse = sparse_args(block)
    if job.rank == 0:
        logger.info("picasso model (%s): packing=%s dim=%d sparse optimizer %s %s (lr schedule: %s), %s tables",
                    job.config.model, block.packing, block.embedding_dim, sparse.optimizer,
                    dict(sparse.optimizer_params), block.optimizer.lr_schedule, block.table_placement)
    try:
        # mmap cache stores live beside the checkpoints; one file per rank (every rank holds every row)
        workdir = Path(job.config.out)
        if job.config.model == "dlrm" and block.table_placement == "auto":  # tables placed by the sharding planner
            from picasso_ops.models import DLRM

            emb = _planned_tables(job, block)(args.vocab_sizes, args.embedding_dim, args.pooling, sparse, 0.01, "emb")
            model = DLRM(args, embeddings=emb, **tower_kwargs(job))
        elif job.config.model == "dlrm":  # with a cache, apply_picasso_block moves the packed tables into the store
            model = packed_dlrm(args, sparse, **tower_kwargs(job))
        else:
            factory = None
            if block.cache is not None and block.table_placement == "data_parallel":  # tables straight into the store
                factory = cached_field_embeddings(block, workdir=workdir, rank=job.rank)
            elif block.table_placement == "auto":
                factory = _planned_tables(job, block)
            build = {"wide_deep": packed_wide_and_deep, "deepfm": packed_deepfm,
                     "dcn_v2": packed_dcn_v2}[job.config.model]
            model = build(args, sparse, field_embeddings=factory, **tower_kwargs(job))
        return apply_picasso_block(model, block, workdir=workdir, rank=job.rank)
    except PicassoBlockError as exc:
        raise RecJobError(f"{job.config.config}: {exc}") from None


def _planned_tables(job: RecJob, block: Any) -> Any:
    """The packed tables' factory for ``picasso.sharding: "auto"`` (``sparse_scale.planned_tables``).

    The planner sees the job's micro-batch and ranks; on synthetic data also its ids per field and
    their Zipf skew (the expected distinct ids of a rank's batch, per table), on files one id per field.
    """
    from picasso_ops.distributed.planner import expected_unique_ids
    from sparse_scale.planned_tables import planned_field_embeddings

    unique: dict[str, float] = {}
    syn = job.synthetic
    if syn is not None:
        top = syn.max_ids_per_field
        tops = top if isinstance(top, list) else [top] * syn.num_fields
        for f, (rows, hi) in enumerate(zip(syn.field_vocab_sizes(), tops)):
            draws = job.micro_batch * (syn.min_ids_per_field + hi) / 2
            unique[f"emb{f}"] = unique[f"wide{f}"] = expected_unique_ids(rows, draws, zipf_exponent=syn.zipf_exponent)
    # the job's loop runs the sparse-dist pipeline where the block lets it (sparse_scale.rec.loop.sparse_pipeline)
    pipelined = (block.pipeline != "off" and block.interleave.micro_batches == 1 and block.cache is None
                 and job.gba is None)
    return planned_field_embeddings(block, world_size=job.workers, batch_size=job.micro_batch, rank=job.rank,
                                    ids_per_field=1.0, unique_ids=unique, prefixes=("emb", "wide"), pipelined=pipelined)


def build_model(job: RecJob) -> torch.nn.Module:
    """The CTR model for this job.

    Without a ``picasso`` block: ``--model``'s model (wide-and-deep, DLRM, DeepFM or DCN-v2; see
    ``picasso_ops.models``) over one ``nn.EmbeddingBag`` per field. With it: the same model over
    packed tables (packing, embedding_dim and the fused sparse optimizer from the block), whose update runs in
    ``engine_step`` at the accumulation boundary (see picasso_ops.distributed.step),
    served through a hot-row cache with a ``cache`` block and run as interleaved
    micro-batches with ``interleave.micro_batches > 1`` (see picasso_ops.block).
    With ``server_tables`` (gba block): the same model, its tables on the parameter servers.
    With a ``moe_proto`` block: the MLP is an MoE tower (:func:`tower_kwargs`, sparse_scale.rec.moe_tower).
    With gba and picasso blocks: the packed model, its tables on the parameter servers
    (``sparse_scale.rec.server_model``; ``server_tables`` is implied).
    """
    if job.gba is not None and job.picasso is not None:
        from sparse_scale.rec.server_model import server_packed_model

        return server_packed_model(job, job.picasso, **tower_kwargs(job))
    if job.config.server_tables:  # the combinations allow it with a gba block only
        return _server_table_model(job)
    if job.picasso is None:  # a moe_proto block: the MLP is an MoE tower (sparse_scale.rec.moe_tower)
        return build_named_model(job.config.model, job.model_args, tower=tower_factory(job))
    return _packed_model(job, job.picasso)
