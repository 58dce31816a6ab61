"""A DLRM-style CTR model: bottom MLP on dense features, pairwise dot interactions, top MLP.

    >>> model = DLRM(DLRMArgs(vocab_sizes=[1000] * 26, num_dense=13))                # per-field tables
    >>> model = packed_dlrm(DLRMArgs(vocab_sizes=[1000] * 26, num_dense=13), SparseArgs(sharding="row_wise"))
    >>> logits = model(batch.dense, batch.values, batch.lengths)                     # [B]

As in facebookresearch/dlrm (``--arch-interaction-op dot``): the bottom MLP
maps the dense features to one ``D``-vector, which joins the ``F`` pooled
embeddings; the ``(F + 1) F / 2`` dot products between distinct vectors
(strict lower triangle of ``T T^T``), concatenated with the bottom output,
feed the top MLP.
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import torch
from torch import nn

from picasso_ops.contracts import FieldEmbeddingLookup, StageableModel
from picasso_ops.models.stages import EmbedScoreStages
from picasso_ops.models.layers import TowerFactory, mlp_tower
from picasso_ops.models.field_embeddings import FieldEmbeddings, PackedFieldEmbeddings, SparseArgs

__all__ = ["DLRMArgs", "DLRM", "DotInteraction", "packed_dlrm"]


@dataclasses.dataclass(frozen=True)
class DLRMArgs:
    """Shape of a DLRM-style model.

    Example::

        >>> DLRMArgs(vocab_sizes=[10, 20], num_dense=3).top
        (128, 64)
    """

    vocab_sizes: list[int]
    num_dense: int
    embedding_dim: int = 16
    bottom: tuple[int, ...] = (64,)  # hidden widths; a last layer to embedding_dim is added
    top: tuple[int, ...] = (128, 64)  # hidden widths; a last layer to one logit is added
    pooling: str = "sum"
    dropout: float = 0.0  # after each hidden ReLU of the top MLP (training only)


class DotInteraction(nn.Module):
    """``[x, dot products of the distinct pairs of {x, e_1 .. e_F}]``: the interaction stage of :class:`DLRM`.

    Example::

        >>> DotInteraction(num_fields=2)(torch.ones(3, 4), torch.ones(3, 2, 4)).shape  # 4 + 3 pairs
        torch.Size([3, 7])
    """

    def __init__(self, num_fields: int) -> None:
        super().__init__()
        rows, cols = torch.tril_indices(num_fields + 1, num_fields + 1, offset=-1)
        self.register_buffer("pair_rows", rows, persistent=False)
        self.register_buffer("pair_cols", cols, persistent=False)

    @property
    def num_pairs(self) -> int:
        return self.pair_rows.numel()

    def forward(self, x: torch.Tensor, embedded: torch.Tensor) -> torch.Tensor:
        t = torch.cat([x.unsqueeze(1), embedded], dim=1)  # [B, F + 1, D]
        z = torch.bmm(t, t.transpose(1, 2))  # [B, F + 1, F + 1]
        pairs = z[:, self.pair_rows, self.pair_cols]  # distinct pairs only (no self-products)
        return torch.cat([x, pairs], dim=1)


class DLRM(nn.Module, StageableModel):
    """logit = top_mlp([bottom(dense), dot interactions of {bottom(dense), e_1 .. e_F}]).

    Args:
        args: the shape.
        embeddings: a :class:`~picasso_ops.contracts.FieldEmbeddingLookup` module mapping
            ``(values, lengths [F, B])`` to ``[B, F, D]``; default one ``nn.EmbeddingBag``
            per field (the plain baseline).
        top_mlp: a :data:`~picasso_ops.models.wide_deep.TowerFactory` building the top MLP
            from its input width ``D + (F + 1) F / 2`` (e.g. one with MoE layers); default
            ``args.top``'s ReLU MLP (``top.0.weight``, ...), the same module with or without the argument.

    Example::

        >>> m = DLRM(DLRMArgs(vocab_sizes=[5, 5], num_dense=2, embedding_dim=4))
        >>> m(torch.zeros(3, 2), torch.tensor([0, 1, 2, 3, 4, 0]), torch.ones(2, 3, dtype=torch.long)).shape
        torch.Size([3])
    """

    def __init__(self, args: DLRMArgs, embeddings: Optional[FieldEmbeddingLookup] = None,
                 top_mlp: Optional[TowerFactory] = None) -> None:
        super().__init__()
        self.args = args
        self.embeddings = embeddings or FieldEmbeddings(args.vocab_sizes, args.embedding_dim, args.pooling, 0.01)
        self.bottom = mlp_tower(args.num_dense, args.bottom, args.embedding_dim, last_relu=True)
        # a submodule, so the model's own state is all in children (InterleavedForward wraps such models)
        self.interaction = DotInteraction(len(args.vocab_sizes))
        width = args.embedding_dim + self.interaction.num_pairs
        self.top = top_mlp(width) if top_mlp is not None else mlp_tower(width, args.top, dropout=args.dropout)

    def forward(self, dense: torch.Tensor, values: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        return self.score(dense, self.embed(values, lengths))

    def embed(self, values: torch.Tensor, lengths: torch.Tensor) -> list[torch.Tensor]:
        """``[embeddings [B, F, D]]`` of the field-major batch."""
        return [self.embeddings(values, lengths)]

    def score(self, dense: torch.Tensor, embedded: Sequence[torch.Tensor]) -> torch.Tensor:
        """Logits ``[B]`` from the dense features and :meth:`embed`'s output: the model's math, once."""
        return self.top(self.interaction(self.bottom(dense), embedded[0])).squeeze(-1)

    def pipeline_stages(self) -> EmbedScoreStages:
        """This model cut between :meth:`embed` and :meth:`score`, for ``picasso_ops.interleave``."""
        return EmbedScoreStages(self)


def packed_dlrm(args: DLRMArgs, sparse: SparseArgs, top_mlp: Optional[TowerFactory] = None) -> DLRM:
    """:class:`DLRM` over a packed (data-parallel or row-sharded) collection, one table per field.

    ``top_mlp``: the top MLP's factory, as in :class:`DLRM`.

    Example::

        >>> packed_dlrm(DLRMArgs(vocab_sizes=[50] * 4, num_dense=3), SparseArgs(packing=False))  # doctest: +ELLIPSIS
        DLRM(...)
    """
    embeddings = PackedFieldEmbeddings(args.vocab_sizes, args.embedding_dim, args.pooling, sparse, 0.01, "emb")
    return DLRM(args, embeddings=embeddings, top_mlp=top_mlp)
