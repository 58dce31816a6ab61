"""Embedding table specification: one table, its pooling, its sparse optimizer and its features.

This is the spec of a picasso_ops table (packed, fused sparse optimizer,
features). A parameter-server table of gba_engine has its own spec type
(rows, dim, init; no pooling or optimizer: the servers own those).

Example::

    >>> from picasso_ops.embedding.spec import TableSpec
    >>> spec = TableSpec("user_id", num_embeddings=1000, embedding_dim=16, pooling="mean",
    ...                  optimizer="rowwise_adagrad", optimizer_params={"lr": 0.05})
    >>> spec.feature_names, spec.hyperparams["eps"]
    (('user_id',), 1e-08)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Mapping, Sequence, Union

import torch

from picasso_ops.embedding.sparse_optim import resolve_hyperparams

__all__ = ["TableSpec", "Pooling"]

Pooling = Literal["sum", "mean", "none"]
_POOLINGS = ("sum", "mean", "none")


@dataclass(frozen=True)
class TableSpec:
    """One embedding table.

    Args:
        name: table name, unique in a collection, no ``"."`` (it prefixes state_dict keys).
        num_embeddings: rows.
        embedding_dim: columns ``D``.
        pooling: ``"sum"`` or ``"mean"`` over each sample's ids, or ``"none"``
            (one embedding per id, a sequence feature).
        optimizer: ``"sgd"``, ``"rowwise_adagrad"`` or ``"adam"`` (see ``sparse_optim``).
        optimizer_params: hyperparameters; missing ones take the optimizer's
            defaults; stored as sorted ``(key, value)`` pairs so specs hash.
        feature_names: the input fields looked up in this table (several fields
            may share a table); defaults to ``(name,)``.
        dtype: weight dtype (optimizer state is always fp32).
    """

    name: str
    num_embeddings: int
    embedding_dim: int
    pooling: Pooling = "sum"
    optimizer: str = "sgd"
    optimizer_params: Union[Mapping[str, float], tuple[tuple[str, float], ...]] = ()
    feature_names: Sequence[str] = field(default=())
    dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name or "." in self.name:
            raise ValueError(f"table name must be a non-empty string without '.', got {self.name!r}")
        if int(self.num_embeddings) < 1:
            raise ValueError(f"table {self.name!r}: num_embeddings must be >= 1, got {self.num_embeddings}")
        if int(self.embedding_dim) < 1:
            raise ValueError(f"table {self.name!r}: embedding_dim must be >= 1, got {self.embedding_dim}")
        if self.pooling not in _POOLINGS:
            raise ValueError(f"table {self.name!r}: pooling must be one of {_POOLINGS}, got {self.pooling!r}")
        if not self.dtype.is_floating_point:
            raise ValueError(f"table {self.name!r}: dtype must be floating point, got {self.dtype}")
        params = dict(self.optimizer_params)
        try:
            resolved = resolve_hyperparams(self.optimizer, params)
        except ValueError as exc:
            raise ValueError(f"table {self.name!r}: {exc}") from None
        features = (self.name,) if not self.feature_names else tuple(self.feature_names)
        if isinstance(self.feature_names, str):
            raise ValueError(f"table {self.name!r}: feature_names must be a sequence of names, not a string")
        if len(set(features)) != len(features):
            raise ValueError(f"table {self.name!r}: duplicate feature names {features}")
        # frozen dataclass: normalise through object.__setattr__ once, at construction
        object.__setattr__(self, "num_embeddings", int(self.num_embeddings))
        object.__setattr__(self, "embedding_dim", int(self.embedding_dim))
        object.__setattr__(self, "optimizer_params", resolved)
        object.__setattr__(self, "feature_names", features)

    @property
    def hyperparams(self) -> dict[str, float]:
        """The resolved optimizer hyperparameters as a dict."""
        return dict(self.optimizer_params)
