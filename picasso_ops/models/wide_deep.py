"""A wide-and-deep CTR model with an FM pairwise term, over one ``nn.EmbeddingBag`` per field.

    >>> model = WideAndDeep(WideAndDeepArgs(vocab_sizes=[1000] * 26, num_dense=13))
    >>> logits = model(batch.dense, batch.values, batch.lengths)   # [B]

The per-field embeddings are the plain baseline (what torchrec's unsharded
EmbeddingBagCollection does); picasso_ops' packed collection replaces them:

    >>> model = packed_wide_and_deep(WideAndDeepArgs(vocab_sizes=[1000] * 26, num_dense=13),
    ...                              SparseArgs(optimizer="rowwise_adagrad", sharding="data_parallel"))
    >>> loss_fn(model(batch.dense, batch.values, batch.lengths), batch.labels).backward()
    >>> sparse_step(model)   # picasso_ops.distributed: the tables' one optimizer step (every rank)

The packed variant's tables take their step in ``sparse_step`` (see
``picasso_ops.distributed.step`` for the contract with DeepSpeed's engine);
the dense layers are ordinary parameters for DeepSpeed's optimizer.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Optional, Sequence

import torch
from torch import nn

from picasso_ops.contracts import FieldEmbeddingLookup, StageableModel
# FieldEmbeddings, PackedFieldEmbeddings, SparseArgs: from .field_embeddings, importable from here as before
from picasso_ops.models.field_embeddings import FieldEmbeddings, PackedFieldEmbeddings, SparseArgs
from picasso_ops.models.layers import TowerFactory, fm_interaction, mlp_tower
from picasso_ops.models.stages import EmbedScoreStages

__all__ = ["FieldEmbeddings", "PackedFieldEmbeddings", "SparseArgs", "TowerFactory", "WideAndDeep", "WideAndDeepArgs",
           "mlp_tower", "packed_wide_and_deep"]  # TowerFactory, mlp_tower: from .layers, named here as before


@dataclasses.dataclass(frozen=True)
class WideAndDeepArgs:
    vocab_sizes: list[int]
    num_dense: int
    embedding_dim: int = 16
    hidden: tuple[int, ...] = (256, 128)
    pooling: str = "mean"  # of a multi-hot field's rows
    fm: bool = True  # the factorisation-machine pairwise term over field embeddings
    dropout: float = 0.0  # after each hidden ReLU of the deep MLP (training only)


class WideAndDeep(nn.Module, StageableModel):
    """logit = wide (per-id weights + linear dense) + FM pairwise term + MLP(embeddings, dense).

    ``embeddings`` (``[B, F, embedding_dim]``) and ``wide`` (``[B, F, 1]``) are any
    :class:`~picasso_ops.contracts.FieldEmbeddingLookup` (default :class:`FieldEmbeddings`).
    ``deep_tower`` (a :data:`TowerFactory`) builds the deep MLP from its input width
    ``F * embedding_dim + num_dense``, e.g. one with MoE layers; by default it is
    ``args.hidden``'s ReLU MLP (``mlp.0.weight``, ...), the same module with or without the argument.

    Example::

        >>> WideAndDeep(WideAndDeepArgs([5, 5], 2))(torch.zeros(3, 2), torch.arange(6) % 5, torch.ones(2, 3, dtype=torch.long)).shape
        torch.Size([3])
        >>> WideAndDeep(WideAndDeepArgs([5, 5], 2), deep_tower=lambda width: nn.Linear(width, 1)).mlp
        Linear(in_features=34, out_features=1, bias=True)
    """

    def __init__(self, args: WideAndDeepArgs, embeddings: FieldEmbeddingLookup | None = None,
                 wide: FieldEmbeddingLookup | None = None, deep_tower: TowerFactory | None = None):
        super().__init__()
        self.args = args
        num_fields = len(args.vocab_sizes)
        self.embeddings = embeddings or FieldEmbeddings(args.vocab_sizes, args.embedding_dim, args.pooling, 0.01)
        self.wide = wide or FieldEmbeddings(args.vocab_sizes, 1, args.pooling, 0.0)
        self.wide_dense = nn.Linear(args.num_dense, 1)
        width = num_fields * args.embedding_dim + args.num_dense
        # built where the default MLP is, so the RNG draws of everything before it are the same either way
        self.mlp = deep_tower(width) if deep_tower is not None else mlp_tower(width, args.hidden,
                                                                               dropout=args.dropout)

    def forward(self, dense: torch.Tensor, values: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        return self.score(dense, self.embed(values, lengths))

    def embed(self, values: torch.Tensor, lengths: torch.Tensor) -> list[torch.Tensor]:
        """``[deep [B, F, D], wide [B, F, 1]]`` embeddings of the field-major batch."""
        return [self.embeddings(values, lengths), self.wide(values, lengths)]

    def score(self, dense: torch.Tensor, embedded: Sequence[torch.Tensor]) -> torch.Tensor:
        """Logits ``[B]`` from the dense features and :meth:`embed`'s output: the model's math, once."""
        emb, wide = embedded
        logit = wide.sum(dim=(1, 2)) + self.wide_dense(dense).squeeze(-1)
        if self.args.fm:
            logit = logit + fm_interaction(emb)
        deep_in = torch.cat([emb.flatten(1), dense], dim=1)
        return logit + self.mlp(deep_in).squeeze(-1)

    def pipeline_stages(self) -> EmbedScoreStages:
        """This model cut between :meth:`embed` and :meth:`score`, for ``picasso_ops.interleave``."""
        return EmbedScoreStages(self)


def packed_wide_and_deep(args: WideAndDeepArgs, sparse: SparseArgs,
                         field_embeddings: Optional[Callable[..., FieldEmbeddingLookup]] = None,
                         deep_tower: TowerFactory | None = None) -> WideAndDeep:
    """:class:`WideAndDeep` whose deep and wide embeddings are packed collections.

    Deep tables start like the plain model's (normal, std 0.01) and wide ones at
    zero; both collections use ``sparse``'s optimizer and sharding.
    ``field_embeddings(vocab_sizes, dim, pooling, sparse, init_std, prefix)``
    builds each of the two (default :class:`PackedFieldEmbeddings`; the picasso
    block passes one that builds straight into a hot-row cache's store).
    ``deep_tower``: the deep MLP's factory, as in :class:`WideAndDeep`.

    Example::

        >>> model = packed_wide_and_deep(WideAndDeepArgs(vocab_sizes=[50] * 4, num_dense=3), SparseArgs())
        >>> sum(p.numel() for p in model.parameters()) > 0  # only the dense layers are parameters
        True
    """
    make = field_embeddings or PackedFieldEmbeddings
    embeddings = make(args.vocab_sizes, args.embedding_dim, args.pooling, sparse, 0.01, "emb")
    wide = make(args.vocab_sizes, 1, args.pooling, sparse, 0.0, "wide")
    return WideAndDeep(args, embeddings=embeddings, wide=wide, deep_tower=deep_tower)
