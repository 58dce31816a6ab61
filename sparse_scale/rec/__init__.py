"""The recommender training job as a library: one typed entry point, :func:`run`.

Example::

    from sparse_scale.rec import RecJobConfig, run
    summary = run(RecJobConfig(config="ds_configs/demo_cpu.json", steps=20, vocab=200, out="runs/nb"))
    print(summary.to_dict()["auc"])

Modules, one idea each: ``config`` (RecJobConfig), ``combinations`` (which blocks and flags
may be combined), ``job`` (one rank's derived shapes), ``data`` (training and held-out
streams), ``model`` (build_model), ``engines`` (the engine behind one interface), ``evaluate``,
``checkpoint``, ``faults`` (--straggler, --crash), ``loop``, ``runner`` (run), ``summary``,
``cli`` (the ``sparse-train-rec`` console script). Names are imported lazily so that the
CLI's ``--help`` and the config types do not pull in torch.
"""
from __future__ import annotations

from sparse_core.lazy_exports import lazy_exports

_EXPORTS = {
    "RecJobConfig": "config",
    "RecJobError": "config",
    "CombinationError": "combinations",
    "check_combinations": "combinations",
    "RecJob": "job",
    "Straggler": "faults",
    "Crash": "faults",
    "FaultInjector": "faults",
    "RecSummary": "summary",
    "ServerSummary": "summary",
    "run": "runner",
}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_exports(__name__, _EXPORTS, globals())
