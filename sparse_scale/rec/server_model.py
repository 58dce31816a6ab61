"""The rec model of a job with both a ``gba`` and a ``picasso`` block: packed tables on the parameter servers.

The picasso block gives the layout and the tables' optimizer (packing, embedding_dim, the
sparse optimizer with its lr and lr schedule); the gba block puts the rows and their
optimizer state on the parameter servers. Wide-and-deep and DeepFM get two collections (the deep
embeddings and the first-order per-id weights, as picasso's packed models have), DLRM and DCN-v2 one; each is a
``gba_engine.packed_tables.ServerPackedFieldEmbeddings``, so the lookups stay fused on the
workers while the servers aggregate the rows' gradients per id over the global batch and
run the block's optimizer on them, in sync, gba and auto modes alike.

Example::

    model = server_packed_model(job, job.picasso)     # job.gba and job.picasso both set
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Any

from torch import nn

from gba_engine.packed_tables import ServerPackedFieldEmbeddings
from picasso_ops.models import build_model, tower_argument
from sparse_scale.builders import table_optimizer
from sparse_scale.rec.job import RecJob

logger = logging.getLogger(__name__)


def server_packed_model(job: RecJob, block: Any, **tower: Any) -> nn.Module:
    """``--model``'s model (wide-and-deep, DLRM, DeepFM, DCN-v2) over packed tables whose rows live on the servers.

    Deep tables start N(0, 0.01) and wide ones at zero, like the per-field server tables.
    ``tower``: the model constructor's MLP argument (``deep_tower=`` / ``top_mlp=``: a moe_proto tower).
    """
    args = dataclasses.replace(job.model_args, embedding_dim=block.embedding_dim)
    opt, seed = table_optimizer(block), job.config.seed
    made: list[ServerPackedFieldEmbeddings] = []

    def tables(dim: int, init_std: float, prefix: str) -> ServerPackedFieldEmbeddings:
        made.append(ServerPackedFieldEmbeddings(args.vocab_sizes, dim, args.pooling, init_std, opt,
                                                packing=block.packing, prefix=prefix, seed=seed))
        return made[-1]

    # deep tables first, then (wide_deep, deepfm) the first-order ones
    model = build_model(job.config.model, args, tables, tower.get(tower_argument(job.config.model)), prefix="deep")
    deep = made[0]
    if job.rank == 0:
        logger.info("gba + picasso model (%s): %d fields packed into %d server tables per collection (packing=%s), "
                    "dim %d, the servers run sparse optimizer %s %s (lr schedule: %s)", job.config.model,
                    len(args.vocab_sizes), len(deep.names), block.packing, block.embedding_dim, opt.type,
                    dict(opt.params), opt.lr_schedule)
    return model
