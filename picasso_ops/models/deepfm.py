"""DeepFM (Guo et al., 2017): first-order weights + FM pairwise term + a deep MLP, all over shared field embeddings.

    >>> model = DeepFM(DeepFMArgs(vocab_sizes=[1000] * 26, num_dense=13))                 # per-field tables
    >>> model = packed_deepfm(DeepFMArgs(vocab_sizes=[1000] * 26, num_dense=13), SparseArgs())
    >>> logits = model(batch.dense, batch.values, batch.lengths)                          # [B]

As in the paper, every feature is a field with one ``D``-vector: a categorical field's vector
is its pooled embedding row, a dense feature ``j`` has one learned vector ``v_j`` scaled by its
value (``x_j v_j``). The FM part is ``w_0 + sum of first-order weights + sum_{i<j} <e_i, e_j>``
over all ``F + num_dense`` fields; the deep MLP reads the same ``F + num_dense`` vectors
flattened. How this differs from :class:`~picasso_ops.models.WideAndDeep` (which has an FM term
too): there the dense features enter the MLP raw and a linear term, and take no part in the
pairwise interactions.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import torch
from torch import nn

from picasso_ops.contracts import FieldEmbeddingLookup, StageableModel
from picasso_ops.models.layers import TowerFactory, check_dropout, fm_interaction, mlp_tower
from picasso_ops.models.stages import EmbedScoreStages
from picasso_ops.models.field_embeddings import FieldEmbeddings, PackedFieldEmbeddings, SparseArgs

__all__ = ["DeepFM", "DeepFMArgs", "DenseFields", "packed_deepfm"]


@dataclasses.dataclass(frozen=True)
class DeepFMArgs:
    """Shape of a DeepFM model.

    Attributes:
        vocab_sizes: rows per categorical field.
        num_dense: dense features (each one more field of the FM and the MLP; 0: none).
        embedding_dim: ``D``, every field's vector width.
        hidden: the deep MLP's hidden widths (a last layer to one logit is added).
        pooling: of a multi-hot field's rows (``"mean"`` or ``"sum"``).
        dropout: after each hidden ReLU of the deep MLP, in training only.

    Example::

        >>> DeepFMArgs(vocab_sizes=[10, 20], num_dense=3).hidden
        (256, 128)
    """

    vocab_sizes: list[int]
    num_dense: int
    embedding_dim: int = 16
    hidden: tuple[int, ...] = (256, 128)
    pooling: str = "mean"
    dropout: float = 0.0

    def __post_init__(self) -> None:
        check_dropout(self.dropout, "DeepFMArgs.dropout")


class DenseFields(nn.Module):
    """Dense features as FM fields: ``x [B, N] -> x_j v_j [B, N, D]`` and the first-order ``w_0 + sum_j w_j x_j``.

    ``vectors`` start N(0, ``init_std``) like the categorical embeddings; ``linear`` (the
    first-order weights and the global bias ``w_0``) is a ``Linear(N, 1)``.

    Example::

        >>> fields, first = DenseFields(3, 4)(torch.ones(2, 3))
        >>> fields.shape, first.shape
        (torch.Size([2, 3, 4]), torch.Size([2]))
    """

    def __init__(self, num_dense: int, dim: int, init_std: float = 0.01) -> None:
        super().__init__()
        self.vectors = nn.Parameter(torch.randn(num_dense, dim) * init_std)
        self.linear = nn.Linear(num_dense, 1)

    def forward(self, dense: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if dense.dim() != 2 or dense.shape[1] != self.vectors.shape[0]:
            raise ValueError(f"DeepFM: dense features must be [B, {self.vectors.shape[0]}], "
                             f"got shape {tuple(dense.shape)}")
        return dense.unsqueeze(-1) * self.vectors, self.linear(dense).squeeze(-1)


class DeepFM(nn.Module, StageableModel):
    """logit = FM(first order + pairwise over the field vectors) + MLP(the same field vectors, flattened).

    Args:
        args: the shape.
        embeddings: the categorical fields' vectors, a
            :class:`~picasso_ops.contracts.FieldEmbeddingLookup` mapping ``(values, lengths [F, B])``
            to ``[B, F, D]``; default one ``nn.EmbeddingBag`` per field, N(0, 0.01).
        wide: the first-order per-id weights, a lookup to ``[B, F, 1]``; default per-field bags at zero.
        deep_tower: a :data:`~picasso_ops.models.layers.TowerFactory` building the deep MLP from its
            input width ``(F + num_dense) * D`` (e.g. one with MoE layers); default ``args.hidden``'s
            ReLU MLP with ``args.dropout`` (``mlp.0.weight``, ...).

    ``forward(dense, values, lengths)`` is ``score(dense, embed(values, lengths))``, the cut that
    ``picasso_ops.interleave`` uses (:meth:`pipeline_stages`).

    Example::

        >>> m = DeepFM(DeepFMArgs(vocab_sizes=[5, 5], num_dense=2, embedding_dim=4))
        >>> m(torch.zeros(3, 2), torch.tensor([0, 1, 2, 3, 4, 0]), torch.ones(2, 3, dtype=torch.long)).shape
        torch.Size([3])
    """

    def __init__(self, args: DeepFMArgs, embeddings: Optional[FieldEmbeddingLookup] = None,
                 wide: Optional[FieldEmbeddingLookup] = None, deep_tower: Optional[TowerFactory] = None) -> None:
        super().__init__()
        if not args.vocab_sizes:
            raise ValueError("DeepFMArgs.vocab_sizes: needs at least one categorical field")
        self.args = args
        self.embeddings = embeddings or FieldEmbeddings(args.vocab_sizes, args.embedding_dim, args.pooling, 0.01)
        self.wide = wide or FieldEmbeddings(args.vocab_sizes, 1, args.pooling, 0.0)
        self.dense_fields = DenseFields(args.num_dense, args.embedding_dim)
        width = (len(args.vocab_sizes) + args.num_dense) * args.embedding_dim
        self.mlp = deep_tower(width) if deep_tower is not None else mlp_tower(width, args.hidden,
                                                                               dropout=args.dropout)

    def embed(self, values: torch.Tensor, lengths: torch.Tensor) -> list[torch.Tensor]:
        """``[field vectors [B, F, D], first-order weights [B, F, 1]]`` of the categorical fields."""
        return [self.embeddings(values, lengths), self.wide(values, lengths)]

    def score(self, dense: torch.Tensor, embedded: list[torch.Tensor]) -> torch.Tensor:
        """Logits ``[B]`` from the dense features and :meth:`embed`'s outputs."""
        emb, wide = embedded
        dense_vectors, dense_first = self.dense_fields(dense)
        fields = torch.cat([emb, dense_vectors], dim=1)  # [B, F + N, D]
        first_order = wide.sum(dim=(1, 2)) + dense_first
        return first_order + fm_interaction(fields) + self.mlp(fields.flatten(1)).squeeze(-1)

    def forward(self, dense: torch.Tensor, values: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        return self.score(dense, self.embed(values, lengths))

    def pipeline_stages(self) -> EmbedScoreStages:
        """This model cut between :meth:`embed` and :meth:`score`, for ``picasso_ops.interleave``."""
        return EmbedScoreStages(self)


def packed_deepfm(args: DeepFMArgs, sparse: SparseArgs,
                  field_embeddings: Optional[Callable[..., FieldEmbeddingLookup]] = None,
                  deep_tower: Optional[TowerFactory] = None) -> DeepFM:
    """:class:`DeepFM` whose field vectors and first-order weights are packed collections.

    Vectors start N(0, 0.01) (tables ``emb{f}``), first-order weights at zero (``wide{f}``), both with
    ``sparse``'s optimizer and sharding. ``field_embeddings(vocab_sizes, dim, pooling, sparse, init_std,
    prefix)`` builds each of the two (default
    :class:`~picasso_ops.models.wide_deep.PackedFieldEmbeddings`; ``picasso_ops.block.cached_field_embeddings``
    builds them into a hot-row cache's store). ``deep_tower``: as in :class:`DeepFM`.

    Example::

        >>> model = packed_deepfm(DeepFMArgs(vocab_sizes=[50] * 4, num_dense=3), SparseArgs())
        >>> sorted(n for n, _ in model.named_children())
        ['dense_fields', 'embeddings', 'mlp', 'wide']
    """
    make = field_embeddings or PackedFieldEmbeddings
    embeddings = make(args.vocab_sizes, args.embedding_dim, args.pooling, sparse, 0.01, "emb")
    wide = make(args.vocab_sizes, 1, args.pooling, sparse, 0.0, "wide")
    return DeepFM(args, embeddings=embeddings, wide=wide, deep_tower=deep_tower)
