"""Reference recommendation models: wide-and-deep (with an FM interaction) and DLRM-style, plain or packed.

    >>> from picasso_ops.models import WideAndDeepArgs, SparseArgs, packed_wide_and_deep
    >>> model = packed_wide_and_deep(WideAndDeepArgs(vocab_sizes=[100] * 8, num_dense=4), SparseArgs())
"""
from picasso_ops.models.dlrm import DLRM, DLRMArgs, packed_dlrm
from picasso_ops.models.stages import DLRMStages, WideAndDeepStages
from picasso_ops.models.wide_deep import (
    FieldEmbeddings,
    PackedFieldEmbeddings,
    SparseArgs,
    WideAndDeep,
    WideAndDeepArgs,
    packed_wide_and_deep,
)

__all__ = [
    "FieldEmbeddings",
    "WideAndDeep",
    "WideAndDeepArgs",
    "PackedFieldEmbeddings",
    "SparseArgs",
    "packed_wide_and_deep",
    "DLRM",
    "DLRMArgs",
    "packed_dlrm",
    "WideAndDeepStages",
    "DLRMStages",
]
