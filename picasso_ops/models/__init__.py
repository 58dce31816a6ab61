"""Reference recommendation models: wide-and-deep (with an FM interaction), DLRM-style, DeepFM, DCN-v2; plain or packed.

    >>> from picasso_ops.models import WideAndDeepArgs, SparseArgs, packed_wide_and_deep
    >>> model = packed_wide_and_deep(WideAndDeepArgs(vocab_sizes=[100] * 8, num_dense=4), SparseArgs())
    >>> from picasso_ops.models import DeepFMArgs, packed_deepfm
    >>> model = packed_deepfm(DeepFMArgs(vocab_sizes=[100] * 8, num_dense=4, dropout=0.1), SparseArgs())

``build_model(name, args, ...)`` builds any of them by name (``"wide_deep"``, ``"dlrm"``, ``"deepfm"``,
``"dcn_v2"``).
"""
from picasso_ops.models.dcn import CrossNetwork, DCNv2, DCNv2Args, packed_dcn_v2
from picasso_ops.models.deepfm import DeepFM, DeepFMArgs, DenseFields, packed_deepfm
from picasso_ops.models.dlrm import DLRM, DLRMArgs, packed_dlrm
from picasso_ops.models.kinds import MODEL_NAMES, build_model, has_first_order, model_args, tower_argument
from picasso_ops.models.layers import TowerFactory, fm_interaction, mlp_tower
from picasso_ops.models.field_embeddings import FieldEmbeddings, PackedFieldEmbeddings, SparseArgs
from picasso_ops.models.stages import DLRMStages, EmbedScoreStages, WideAndDeepStages
from picasso_ops.models.wide_deep import WideAndDeep, WideAndDeepArgs, packed_wide_and_deep

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
    "DeepFM",
    "DeepFMArgs",
    "DenseFields",
    "packed_deepfm",
    "DCNv2",
    "DCNv2Args",
    "CrossNetwork",
    "packed_dcn_v2",
    "MODEL_NAMES",
    "build_model",
    "has_first_order",
    "model_args",
    "tower_argument",
    "TowerFactory",
    "fm_interaction",
    "mlp_tower",
    "WideAndDeepStages",
    "DLRMStages",
    "EmbedScoreStages",
]
