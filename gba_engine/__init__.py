"""gba_engine: GBA (Global Batch gradients Aggregation) over a parameter server, for DeepSpeed.

Names are imported lazily so that reading the ``"gba"`` config block (``gba_engine.config``)
does not pull in torch.distributed.

Example::

    from gba_engine import StalenessDecay, TokenControl, init_runtime, ParameterServer, PSClient
    decay = StalenessDecay("inverse", threshold=2)
"""
from __future__ import annotations

from sparse_core.lazy_exports import lazy_exports

_EXPORTS = {
    "GBAConfig": "config",
    "GBAEngine": "engine",
    "initialize": "entry",
    "rejoin": "entry",
    "check_gba_model": "model_check",
    "gba_refusals": "model_check",
    "GBAModelError": "model_check",
    "StuckCollectiveError": "collective_guard",
    "ServerEmbeddingBagCollection": "tables",
    "Observer": "observe",
    "StragglerDetector": "straggler",
    "TrainState": "switch",
    "StalenessDecay": "decay",
    "Admission": "tokens",
    "GlobalBatchBuffer": "tokens",
    "GlobalBatchGradient": "tokens",
    "TokenControl": "tokens",
    "TokenStats": "tokens",
    "grads_per_update": "tokens",
    "DenseSharding": "ps",
    "ServerTableSpec": "ps",
    "Layout": "ps",
    "OptimizerSpec": "ps",
    "PSClient": "ps",
    "PSConnectionError": "ps",
    "PSRuntime": "ps",
    "PSStalledError": "ps",
    "ServerLostError": "ps",
    "ParameterServer": "ps",
    "Pulled": "ps",
    "ServeStats": "ps",
    "init_runtime": "ps",
    "join_runtime": "ps",
    "read_layout": "ps",
    "layout": "ps",
}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_exports(__name__, _EXPORTS, globals())
