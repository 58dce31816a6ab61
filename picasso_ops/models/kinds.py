"""The reference CTR models by name: their shape classes and one way to build any of them over given tables.

A job that picks its model by a flag (``--model deepfm``) maps the name here instead of
branching per model, so a new model is one entry:

    >>> args = model_args("deepfm", vocab_sizes=[100] * 8, num_dense=4, embedding_dim=8)
    >>> model = build_model("deepfm", args)                                  # per-field nn.EmbeddingBag tables
    >>> model = build_model("deepfm", args, tables=lambda dim, init_std, prefix: my_tables(dim, init_std, prefix))

``tables(dim, init_std, prefix)`` makes one field-embedding module (``[B, F, dim]``; e.g. tables
on parameter servers); the models with first-order per-id weights (wide-and-deep, DeepFM) ask
for a second one, ``dim`` 1 at zero, prefix ``"wide"``, after the embeddings.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

from torch import nn

from picasso_ops.contracts import FieldEmbeddingLookup
from picasso_ops.models.dcn import DCNv2, DCNv2Args
from picasso_ops.models.deepfm import DeepFM, DeepFMArgs
from picasso_ops.models.dlrm import DLRM, DLRMArgs
from picasso_ops.models.layers import TowerFactory
from picasso_ops.models.wide_deep import WideAndDeep, WideAndDeepArgs

__all__ = ["MODEL_NAMES", "TableFactory", "build_model", "has_first_order", "model_args", "tower_argument"]

TableFactory = Callable[[int, float, str], FieldEmbeddingLookup]
"""``(dim, init_std, prefix) -> module``: one table per field, ``forward(values, lengths)`` giving ``[B, F, dim]``."""

_MODELS: dict[str, tuple[type, type]] = {
    "wide_deep": (WideAndDeep, WideAndDeepArgs),
    "dlrm": (DLRM, DLRMArgs),
    "deepfm": (DeepFM, DeepFMArgs),
    "dcn_v2": (DCNv2, DCNv2Args),
}
MODEL_NAMES: tuple[str, ...] = tuple(_MODELS)
_FIRST_ORDER = ("wide_deep", "deepfm")  # per-id first-order weights: a second table collection


def _known(name: str) -> tuple[type, type]:
    if name not in _MODELS:
        raise ValueError(f"model {name!r}: expected one of {', '.join(MODEL_NAMES)}")
    return _MODELS[name]


def model_args(name: str, **fields: Any) -> Any:
    """The shape dataclass of model ``name`` (``WideAndDeepArgs``, ``DLRMArgs``, ...) built from ``fields``.

    Example::

        >>> model_args("dcn_v2", vocab_sizes=[10], num_dense=2).cross_layers
        3
    """
    return _known(name)[1](**fields)


def has_first_order(name: str) -> bool:
    """Whether model ``name`` has per-id first-order weights (a ``wide`` table collection beside ``embeddings``).

    Example::

        >>> has_first_order("deepfm"), has_first_order("dcn_v2")
        (True, False)
    """
    _known(name)
    return name in _FIRST_ORDER


def tower_argument(name: str) -> str:
    """The constructor argument of model ``name`` that takes its MLP factory (``top_mlp`` or ``deep_tower``).

    Example::

        >>> tower_argument("dlrm"), tower_argument("deepfm")
        ('top_mlp', 'deep_tower')
    """
    _known(name)
    return "top_mlp" if name == "dlrm" else "deep_tower"


def build_model(name: str, args: Any, tables: Optional[TableFactory] = None, tower: Optional[TowerFactory] = None,
                *, prefix: str = "emb") -> nn.Module:
    """Model ``name`` of shape ``args``; its tables from ``tables`` (default: the model's own per-field bags).

    ``tables`` is called for the embeddings (``args.embedding_dim``, N(0, 0.01), ``prefix``), then,
    for a model with first-order weights, for those (dim 1, zero, ``"wide"``). ``tower``: the
    MLP factory (:func:`tower_argument` says which MLP it replaces).

    Example::

        >>> build_model("dlrm", model_args("dlrm", vocab_sizes=[5, 5], num_dense=2)).__class__.__name__
        'DLRM'
    """
    cls, shape = _known(name)
    if not isinstance(args, shape):
        raise TypeError(f"model {name!r} takes {shape.__name__}, got {type(args).__name__}")
    kwargs: dict[str, Any] = {tower_argument(name): tower} if tower is not None else {}
    if tables is not None:
        kwargs["embeddings"] = tables(args.embedding_dim, 0.01, prefix)
        if has_first_order(name):
            kwargs["wide"] = tables(1, 0.0, "wide")
    return cls(args, **kwargs)
