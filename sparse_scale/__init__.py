"""sparse-scale: a DeepSpeed plugin for large sparse models; the entry point of a user's own script.

Example::

    import sparse_scale
    emb = sparse_scale.tables_from_block("ds_config.json", vocab_sizes=[1000] * 26)
    engine, optimizer, _, scheduler = sparse_scale.initialize(model=MyModel(emb), config="ds_config.json")

Names are imported on first use, so ``import sparse_scale`` (and reading a config) stays cheap.
"""
from __future__ import annotations

from sparse_core.lazy_exports import lazy_exports

_EXPORTS = {
    "initialize": "entry",
    "check_model": "entry",
    "load_job": "entry",
    "SetupError": "entry",
    "SparseEngine": "engine",
    "tables_from_block": "builders",
    "moe_from_block": "builders",
    "ConfigError": "config",
    "load_config": "config",
    "init_distributed": "distenv",
    "shutdown_distributed": "shutdown",
}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_exports(__name__, _EXPORTS, globals())
