"""Keep-best and early stopping of a recommender job: which evaluation is the best, and when to stop trying.

Each evaluation during training (every ``--eval-every`` steps, each epoch's end) is judged on one
metric, ``auc`` (higher is better) or ``logloss`` (lower is better). An evaluation better than the
best so far by more than ``min_delta`` is the new best (the loop saves its checkpoint under
``OUT/best``); ``patience`` evaluations in a row without one stop the run (0: never stop, only keep
the best). The first evaluation is always a best.

Example::

    tracker = EarlyStopping("logloss", patience=2)
    tracker.observe({"step": 10, "epoch": 0, "auc": 0.71, "log_loss": 0.52}).improved     # True
    tracker.observe({"step": 20, "epoch": 1, "auc": 0.72, "log_loss": 0.53}).stop         # False (1 of 2)
    tracker.observe({"step": 30, "epoch": 2, "auc": 0.72, "log_loss": 0.55}).stop         # True
    tracker.best["step"], tracker.reason()                                                 # 10, "..."
"""
from __future__ import annotations

import dataclasses
import json
import logging
import math
from pathlib import Path
from typing import Any, Literal

logger = logging.getLogger(__name__)
Metric = Literal["auc", "logloss"]
METRICS: tuple[str, ...] = ("auc", "logloss")
METRIC_KEY = {"auc": "auc", "logloss": "log_loss"}  # the flag's word -> the evaluation's key
BEST_FILE = "best.json"  # in OUT/best: the best evaluation so far and its checkpoint (read back on --resume)


@dataclasses.dataclass(frozen=True)
class Verdict:
    """What one evaluation means: a new best (save it), and whether patience ran out (stop)."""

    improved: bool
    stop: bool


class EarlyStopping:
    """Tracks the best evaluation on ``metric`` and counts evaluations without an improvement.

    ``patience``: evaluations in a row without an improvement larger than ``min_delta`` that stop
    the run (0: never stop). ``best`` (the best evaluation's entry plus ``checkpoint`` once saved)
    may be seeded from an earlier run's ``best.json`` with :meth:`restore`.
    """

    def __init__(self, metric: Metric, patience: int = 0, min_delta: float = 0.0) -> None:
        if metric not in METRICS:
            raise ValueError(f"--early-stop-metric {metric!r}: expected one of {', '.join(METRICS)}")
        if isinstance(patience, bool) or not isinstance(patience, int) or patience < 0:
            raise ValueError(f"--patience {patience!r}: must be an integer >= 0 (0: never stop, only keep the best)")
        if not (math.isfinite(min_delta) and min_delta >= 0):
            raise ValueError(f"--min-delta {min_delta}: must be a finite number >= 0")
        self.metric, self.key, self.patience, self.min_delta = metric, METRIC_KEY[metric], patience, min_delta
        self.best: dict[str, Any] | None = None
        self.since_best = 0  # evaluations since the best one
        self.stopped_at: dict[str, Any] | None = None  # the evaluation that ran out of patience

    def better(self, value: float, than: float) -> bool:
        """Whether ``value`` improves on ``than`` by more than ``min_delta`` (NaN never does)."""
        if not math.isfinite(value):
            return False
        return value > than + self.min_delta if self.metric == "auc" else value < than - self.min_delta

    def observe(self, entry: dict[str, Any], final: bool = False) -> Verdict:
        """Judge one evaluation (``{"step", ["epoch"], "auc", "log_loss", ...}``).

        ``final``: the job's end evaluation, which may be the best but never stops anything.
        """
        value = float(entry[self.key])
        if self.best is None or self.better(value, float(self.best[self.key])):
            if self.best is None and not math.isfinite(value):
                return self._no_improvement(entry, final)
            self.best, self.since_best = dict(entry), 0
            return Verdict(improved=True, stop=False)
        return self._no_improvement(entry, final)

    def _no_improvement(self, entry: dict[str, Any], final: bool) -> Verdict:
        self.since_best += 1
        stop = not final and self.patience > 0 and self.since_best >= self.patience
        if stop:
            self.stopped_at = dict(entry)
        return Verdict(improved=False, stop=stop)

    def saved(self, checkpoint: str) -> None:
        """The best evaluation's checkpoint was committed at ``checkpoint``."""
        assert self.best is not None, "saved() follows an improving observe()"
        self.best["checkpoint"] = checkpoint

    def reason(self) -> str:
        """Why the run stopped (empty when it did not)."""
        if self.stopped_at is None or self.best is None:
            return ""
        where = _where(self.best)
        delta = f" by more than {self.min_delta:g}" if self.min_delta else ""
        return (f"early stop at step {self.stopped_at['step']}: {self.metric} did not improve{delta} in "
                f"{self.patience} evaluation{'s' if self.patience != 1 else ''} since the best, "
                f"{self.best[self.key]:.4f} at {where}")

    def summary(self) -> dict[str, Any]:
        """summary.json's ``best`` mapping: the metric, the best evaluation and its checkpoint, and the stop."""
        out: dict[str, Any] = {"metric": self.metric, "patience": self.patience, "min_delta": self.min_delta,
                               **(self.best or {})}
        out["early_stopped"] = self.stopped_at is not None
        if self.stopped_at is not None:
            out["stopped_at_step"] = self.stopped_at["step"]
            out["reason"] = self.reason()
        return out

    def write(self, folder: Path) -> None:
        """Record the best evaluation in ``folder/best.json`` (rank 0, after its checkpoint was committed)."""
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / (BEST_FILE + ".tmp")
        tmp.write_text(json.dumps({"metric": self.metric, **(self.best or {})}, indent=1))
        tmp.replace(folder / BEST_FILE)

    def restore(self, folder: Path) -> None:
        """Seed the best from an earlier part of this run (``--resume``); a file for another metric is ignored."""
        path = folder / BEST_FILE
        if not path.is_file():
            return
        try:
            saved = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            logger.warning("%s: unreadable (%s); the best is tracked from this run's evaluations only", path, exc)
            return
        if saved.get("metric") != self.metric or self.key not in saved:
            logger.warning("%s was kept by %s, not %s; the best is tracked from this run's evaluations only",
                           path, saved.get("metric"), self.metric)
            return
        saved.pop("metric")
        self.best = saved


def _where(entry: dict[str, Any]) -> str:
    return f"step {entry['step']}" + (f" (epoch {entry['epoch']})" if "epoch" in entry else "")
