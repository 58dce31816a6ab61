"""DCN-v2 (Wang et al., 2021), stacked: a cross network of full-rank layers, then a deep MLP, over field embeddings.

    >>> model = DCNv2(DCNv2Args(vocab_sizes=[1000] * 26, num_dense=13))                   # per-field tables
    >>> model = packed_dcn_v2(DCNv2Args(vocab_sizes=[1000] * 26, num_dense=13), SparseArgs())
    >>> logits = model(batch.dense, batch.values, batch.lengths)                          # [B]

``x_0 = [e_1, .., e_F, dense]`` (the pooled field embeddings flattened, then the raw dense
features); each cross layer ``l`` computes ``x_{l+1} = x_0 * (W_l x_l + b_l) + x_l`` with a full
``W_l`` (``width x width``; the paper's low-rank and mixture-of-experts variants are not built);
the deep MLP maps ``x_L`` to the logit. This is the paper's *stacked* structure (cross network,
then deep network) rather than the *parallel* one (both on ``x_0``, outputs concatenated): the
deep tower then only ever sees the cross output, so an injected tower (e.g. an MoE tower) takes
the same ``[B, width]`` rows it takes in the other models.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import torch
from torch import nn

from picasso_ops.contracts import FieldEmbeddingLookup, StageableModel
from picasso_ops.models.layers import TowerFactory, check_dropout, mlp_tower
from picasso_ops.models.stages import EmbedScoreStages
from picasso_ops.models.field_embeddings import FieldEmbeddings, PackedFieldEmbeddings, SparseArgs

__all__ = ["CrossNetwork", "DCNv2", "DCNv2Args", "packed_dcn_v2"]


@dataclasses.dataclass(frozen=True)
class DCNv2Args:
    """Shape of a DCN-v2 model.

    Attributes:
        vocab_sizes: rows per categorical field.
        num_dense: dense features, appended to the flattened embeddings in ``x_0``.
        embedding_dim: ``D`` of every field's embedding.
        cross_layers: ``L`` full-rank cross layers (``width x width`` weights each).
        hidden: the deep MLP's hidden widths (a last layer to one logit is added).
        pooling: of a multi-hot field's rows (``"mean"`` or ``"sum"``).
        dropout: after each hidden ReLU of the deep MLP, in training only.

    Example::

        >>> DCNv2Args(vocab_sizes=[10, 20], num_dense=3).cross_layers
        3
    """

    vocab_sizes: list[int]
    num_dense: int
    embedding_dim: int = 16
    cross_layers: int = 3
    hidden: tuple[int, ...] = (256, 128)
    pooling: str = "mean"
    dropout: float = 0.0

    def __post_init__(self) -> None:
        check_dropout(self.dropout, "DCNv2Args.dropout")
        if isinstance(self.cross_layers, bool) or not isinstance(self.cross_layers, int) or self.cross_layers < 0:
            raise ValueError(f"DCNv2Args.cross_layers {self.cross_layers!r}: must be an integer >= 0")


class CrossNetwork(nn.Module):
    """``L`` DCN-v2 cross layers: ``x_{l+1} = x_0 * (W_l x_l + b_l) + x_l``, ``[B, width] -> [B, width]``.

    ``W_l`` starts Glorot-uniform and ``b_l`` at zero (the paper's code). ``L = 0`` is the identity.

    Example::

        >>> net = CrossNetwork(4, layers=2)
        >>> net(torch.ones(3, 4)).shape
        torch.Size([3, 4])
    """

    def __init__(self, width: int, layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))
        for layer in self.layers:
            nn.init.xavier_uniform_(layer.weight)
            nn.init.zeros_(layer.bias)

    def forward(self, x0: torch.Tensor) -> torch.Tensor:
        x = x0
        for layer in self.layers:
            x = x0 * layer(x) + x
        return x


class DCNv2(nn.Module, StageableModel):
    """logit = MLP(cross network([embeddings flattened, dense])): DCN-v2's stacked structure.

    Args:
        args: the shape.
        embeddings: a :class:`~picasso_ops.contracts.FieldEmbeddingLookup` mapping
            ``(values, lengths [F, B])`` to ``[B, F, D]``; default one ``nn.EmbeddingBag`` per
            field, N(0, 0.01).
        deep_tower: a :data:`~picasso_ops.models.layers.TowerFactory` building the deep MLP from
            its input width ``F * D + num_dense`` (e.g. one with MoE layers); default
            ``args.hidden``'s ReLU MLP with ``args.dropout`` (``mlp.0.weight``, ...).

    ``forward(dense, values, lengths)`` is ``score(dense, embed(values, lengths))``, the cut that
    ``picasso_ops.interleave`` uses (:meth:`pipeline_stages`).

    Example::

        >>> m = DCNv2(DCNv2Args(vocab_sizes=[5, 5], num_dense=2, embedding_dim=4, cross_layers=2))
        >>> m(torch.zeros(3, 2), torch.tensor([0, 1, 2, 3, 4, 0]), torch.ones(2, 3, dtype=torch.long)).shape
        torch.Size([3])
    """

    def __init__(self, args: DCNv2Args, embeddings: Optional[FieldEmbeddingLookup] = None,
                 deep_tower: Optional[TowerFactory] = None) -> None:
        super().__init__()
        if not args.vocab_sizes:
            raise ValueError("DCNv2Args.vocab_sizes: needs at least one categorical field")
        self.args = args
        self.embeddings = embeddings or FieldEmbeddings(args.vocab_sizes, args.embedding_dim, args.pooling, 0.01)
        width = len(args.vocab_sizes) * args.embedding_dim + args.num_dense
        self.cross = CrossNetwork(width, args.cross_layers)
        self.mlp = deep_tower(width) if deep_tower is not None else mlp_tower(width, args.hidden,
                                                                               dropout=args.dropout)

    def embed(self, values: torch.Tensor, lengths: torch.Tensor) -> list[torch.Tensor]:
        """``[embeddings [B, F, D]]`` of the field-major batch."""
        return [self.embeddings(values, lengths)]

    def score(self, dense: torch.Tensor, embedded: list[torch.Tensor]) -> torch.Tensor:
        """Logits ``[B]`` from the dense features and :meth:`embed`'s output."""
        emb = embedded[0]
        if dense.dim() != 2 or dense.shape[1] != self.args.num_dense:
            raise ValueError(f"DCNv2: dense features must be [B, {self.args.num_dense}], got {tuple(dense.shape)}")
        x0 = torch.cat([emb.flatten(1), dense], dim=1)
        return self.mlp(self.cross(x0)).squeeze(-1)

    def forward(self, dense: torch.Tensor, values: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        return self.score(dense, self.embed(values, lengths))

    def pipeline_stages(self) -> EmbedScoreStages:
        """This model cut between :meth:`embed` and :meth:`score`, for ``picasso_ops.interleave``."""
        return EmbedScoreStages(self)


def packed_dcn_v2(args: DCNv2Args, sparse: SparseArgs,
                  field_embeddings: Optional[Callable[..., FieldEmbeddingLookup]] = None,
                  deep_tower: Optional[TowerFactory] = None) -> DCNv2:
    """:class:`DCNv2` over a packed (data-parallel or row-sharded) collection, one table per field (``emb{f}``).

    Tables start N(0, 0.01) like the plain model's. ``field_embeddings(vocab_sizes, dim, pooling, sparse,
    init_std, prefix)`` builds the collection (default
    :class:`~picasso_ops.models.wide_deep.PackedFieldEmbeddings`; ``picasso_ops.block.cached_field_embeddings``
    builds it into a hot-row cache's store). ``deep_tower``: as in :class:`DCNv2`.

    Example::

        >>> packed_dcn_v2(DCNv2Args(vocab_sizes=[50] * 4, num_dense=3), SparseArgs()).cross  # doctest: +ELLIPSIS
        CrossNetwork(...)
    """
    make = field_embeddings or PackedFieldEmbeddings
    embeddings = make(args.vocab_sizes, args.embedding_dim, args.pooling, sparse, 0.01, "emb")
    return DCNv2(args, embeddings=embeddings, deep_tower=deep_tower)
