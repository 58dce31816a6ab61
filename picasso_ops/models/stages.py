"""Models cut at their embeddings, for interleaving (``picasso_ops.contracts.StagedModel``).

Every reference model's ``forward`` is ``score(dense, embed(values, lengths))``, and its
``pipeline_stages()`` returns :class:`EmbedScoreStages` over those two methods, so the math lives once, in
the model, and ``picasso_ops.interleave`` runs the models' micro-batches without importing them.
Whatever MLP a model holds (its default one or an injected tower, e.g. an MoE tower), the dense stage
calls it once per micro-batch, as ``forward`` calls it once per batch.

Example::

    >>> st = EmbedScoreStages(model)  # doctest: +SKIP
    >>> torch.allclose(st.dense(b, st.lookup(b)), model(b.dense, b.values, b.lengths))
    True
"""
from __future__ import annotations

from typing import Protocol, Sequence

from torch import Tensor

from picasso_ops.data.batch import CTRBatch

__all__ = ["DLRMStages", "EmbedScoreModel", "EmbedScoreStages", "WideAndDeepStages"]


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


# the adapters' earlier names: every model is now cut the same way
WideAndDeepStages = EmbedScoreStages
DLRMStages = EmbedScoreStages
