"""The reference models cut at their embeddings, for interleaving (``picasso_ops.contracts.StagedModel``).

``WideAndDeep.pipeline_stages()`` and ``DLRM.pipeline_stages()`` return these (DeepFM and DCN-v2, whose
``forward`` is ``score(dense, embed(values, lengths))``, return :class:`EmbedScoreStages`), so
``picasso_ops.interleave`` runs the models' micro-batches without importing them.
Whatever MLP a model holds (its default one or an injected tower, e.g. an MoE tower), the
dense stage calls it once per micro-batch, as ``forward`` calls it once per batch.

Example::

    >>> st = WideAndDeepStages(model)  # doctest: +SKIP
    >>> torch.allclose(st.dense(b, st.lookup(b)), model(b.dense, b.values, b.lengths))
    True
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, Sequence

import torch
from torch import Tensor

from picasso_ops.data.batch import CTRBatch
from picasso_ops.models.layers import fm_interaction

if TYPE_CHECKING:  # the models import this module to return their adapters
    from picasso_ops.models.dlrm import DLRM
    from picasso_ops.models.wide_deep import WideAndDeep

__all__ = ["DLRMStages", "EmbedScoreModel", "EmbedScoreStages", "WideAndDeepStages"]


class WideAndDeepStages:
    """:class:`~picasso_ops.models.WideAndDeep` cut at its two embedding modules (same math as its ``forward``).

    Example::

        >>> st = WideAndDeepStages(model)
        >>> torch.allclose(st.dense(b, st.lookup(b)), model(b.dense, b.values, b.lengths))
        True
    """

    def __init__(self, model: WideAndDeep) -> None:
        self.model = model

    def lookup(self, batch: CTRBatch) -> list[Tensor]:
        """``[deep [B, F, D], wide [B, F, 1]]`` embeddings of ``batch``."""
        m = self.model
        return [m.embeddings(batch.values, batch.lengths), m.wide(batch.values, batch.lengths)]

    def dense(self, batch: CTRBatch, embedded: Sequence[Tensor]) -> Tensor:
        """Logits ``[B]`` from the two embeddings, as ``WideAndDeep.forward`` computes them."""
        m, (emb, wide) = self.model, embedded
        logit = wide.sum(dim=(1, 2)) + m.wide_dense(batch.dense).squeeze(-1)
        if m.args.fm:
            logit = logit + fm_interaction(emb)
        deep_in = torch.cat([emb.flatten(1), batch.dense], dim=1)
        return logit + m.mlp(deep_in).squeeze(-1)


class DLRMStages:
    """:class:`~picasso_ops.models.DLRM` cut at its embeddings (same math as its ``forward``).

    Example::

        >>> st = DLRMStages(model); logits = st.dense(b, st.lookup(b))  # doctest: +SKIP
    """

    def __init__(self, model: DLRM) -> None:
        self.model = model

    def lookup(self, batch: CTRBatch) -> list[Tensor]:
        """``[embeddings [B, F, D]]`` of ``batch``."""
        return [self.model.embeddings(batch.values, batch.lengths)]

    def dense(self, batch: CTRBatch, embedded: Sequence[Tensor]) -> Tensor:
        """Logits ``[B]`` from the embeddings, as ``DLRM.forward`` computes them."""
        m = self.model
        return m.top(m.interaction(m.bottom(batch.dense), embedded[0])).squeeze(-1)


class EmbedScoreModel(Protocol):
    """A model whose ``forward(dense, values, lengths)`` is ``score(dense, embed(values, lengths))``."""

    def embed(self, values: Tensor, lengths: Tensor) -> list[Tensor]:
        """Every embedding output of the field-major batch (their autograd graphs lead to the tables)."""
        ...

    def score(self, dense: Tensor, embedded: Sequence[Tensor]) -> Tensor:
        """Logits ``[B]`` from the dense features and what :meth:`embed` returned."""
        ...


class EmbedScoreStages:
    """A model split into ``embed`` and ``score`` (DeepFM, DCN-v2), cut there: the same calls as its ``forward``.

    Example::

        >>> st = EmbedScoreStages(model); logits = st.dense(b, st.lookup(b))  # doctest: +SKIP
    """

    def __init__(self, model: EmbedScoreModel) -> None:
        self.model = model

    def lookup(self, batch: CTRBatch) -> list[Tensor]:
        """The model's ``embed`` of ``batch``."""
        return self.model.embed(batch.values, batch.lengths)

    def dense(self, batch: CTRBatch, embedded: Sequence[Tensor]) -> Tensor:
        """Logits ``[B]``: the model's ``score`` of the batch's dense features and ``embedded``."""
        return self.model.score(batch.dense, embedded)
