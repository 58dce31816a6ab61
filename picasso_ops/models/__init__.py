"""Reference recommendation models: wide-and-deep (with an FM interaction) over per-field embeddings."""
from picasso_ops.models.wide_deep import FieldEmbeddings, WideAndDeep, WideAndDeepArgs

__all__ = ["FieldEmbeddings", "WideAndDeep", "WideAndDeepArgs"]
