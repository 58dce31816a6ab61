"""What one recommender job is: the CLI's flags as a frozen dataclass, plus the loaded config file.

Example::

    from sparse_scale.rec import RecJobConfig, run
    job = RecJobConfig(config="ds_configs/demo_cpu.json", steps=50, vocab=200, out="runs/nb")
    summary = run(job)          # RecSummary; summary.to_dict() is OUT/summary.json
"""
from __future__ import annotations

import dataclasses
import math
import re
from typing import TYPE_CHECKING, Any, Literal

from sparse_scale.divergence import DEFAULT_EXPLOSION_FACTOR, DEFAULT_MAX_SKIPPED_STEPS
from sparse_scale.config import JobConfig, load_config
from sparse_scale.rec.faults import Crash, Straggler

if TYPE_CHECKING:
    from picasso_ops.data.schema import DataSchema
    from picasso_ops.data.synthetic import SyntheticConfig

DataKind = Literal["synthetic", "criteo", "parquet"]
ModelKind = Literal["wide_deep", "dlrm", "deepfm", "dcn_v2"]  # picasso_ops.models.MODEL_NAMES
DATA_KINDS: tuple[str, ...] = ("synthetic", "criteo", "parquet")
MODEL_KINDS: tuple[str, ...] = ("wide_deep", "dlrm", "deepfm", "dcn_v2")


class RecJobError(ValueError):
    """A job that cannot run as asked; the message says why (the CLI prints it and exits)."""


# The flags that set the synthetic stream: RecJobConfig field -> (flag, picasso_ops SyntheticConfig field).
SYNTHETIC_FLAGS: dict[str, tuple[str, str]] = {
    "fields": ("--fields", "num_fields"), "vocab": ("--vocab", "vocab_sizes"), "zipf": ("--zipf", "zipf_exponent"),
    "max_hot": ("--max-hot", "max_ids_per_field"), "num_dense": ("--num-dense", "num_dense"),
    "seed": ("--seed", "seed")}
_BOUND_WORDS = (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<"))


def _allowed_range(model: Any, field: str) -> str:
    """``"26 <= num_fields <= 1000"`` / ``"seed >= 0"``: the Field bounds of ``model.field`` ("" when none)."""
    info = model.model_fields.get(field)
    bounds = {key: getattr(item, key) for item in (info.metadata if info is not None else ())
              for key, _ in _BOUND_WORDS if getattr(item, key, None) is not None}
    words = dict(_BOUND_WORDS)
    low = next((k for k in ("ge", "gt") if k in bounds), None)
    high = next((k for k in ("le", "lt") if k in bounds), None)
    if low and high:
        return f"{bounds[low]} {words[low].replace('>', '<')} {field} {words[high]} {bounds[high]}"
    if low or high:
        key = low or high
        return f"{field} {words[key]} {bounds[key]}"
    return ""


def _synthetic_error(config: "RecJobConfig", err: Any, model: Any) -> str:
    """One pydantic error of the synthetic stream's settings, said in terms of the flag that set the value."""
    by_field = {name: (flag, attr) for attr, (flag, name) in SYNTHETIC_FLAGS.items()}
    loc = [x for x in err["loc"] if isinstance(x, str)]
    if loc:  # a Field bound: "Input should be greater than or equal to 26"
        field, ctx = loc[0], err.get("ctx") or {}
        text = next((f"must be {word} {ctx[key]}" for key, word in _BOUND_WORDS if key in ctx), err["msg"])
    else:  # a model validator: "Value error, vocab_sizes must lie in [1, 2147483648], got [0, ...]"
        match = re.match(r"(?:Value error, )?(\w+) (.*?)(?:, got .*)?$", err["msg"], re.S)
        field, text = (match.group(1), match.group(2)) if match else ("", err["msg"])
    if field not in by_field:
        flags = ", ".join(f"{flag} {getattr(config, attr)}" for attr, (flag, _) in SYNTHETIC_FLAGS.items())
        return f"the synthetic stream refuses {flags}: {err['msg']}"
    flag, attr = by_field[field]
    where = _allowed_range(model, field) or field
    return f"{flag} {getattr(config, attr)}: {text} (the synthetic stream's {where})"


def _load_schema(source: str, data: str) -> "DataSchema":
    """``--schema``'s data schema (a file or a preset name); refused with synthetic data, errors as RecJobError."""
    from picasso_ops.data.schema import DataSchema
    from sparse_core.config_file import ConfigError

    if data == "synthetic":
        raise RecJobError(f"--schema {source}: describes the columns of --train-files and --eval-files, and --data "
                          "synthetic reads none; pass --data criteo (TSV/CSV) or --data parquet")
    try:
        return DataSchema.load(source)
    except ConfigError as exc:
        raise RecJobError(f"--schema {exc}") from None


@dataclasses.dataclass(frozen=True)
class RecJobConfig:
    """Every option of a recommender training job (one field per ``sparse-train-rec`` flag).

    ``loaded`` is the validated DeepSpeed file at ``config`` (read on construction unless given).
    Which flags and plugin blocks may be combined is checked by
    :func:`sparse_scale.rec.combinations.check_combinations` when the job runs.

    Example::

        RecJobConfig(config="ds_configs/gba_cpu.json", steps=8, stragglers=(Straggler(1, 20.0),))
    """

    config: str
    steps: int = 1500  # optimizer steps to train, in total across resumes
    out: str = "runs/train_rec"  # checkpoints, wandb and summary.json
    data: DataKind = "synthetic"
    train_files: tuple[str, ...] = ()
    eval_files: tuple[str, ...] = ()
    max_bad_fraction: float = 0.01
    schema: str | None = None  # --schema: a data schema file or preset (file data; None: the Criteo layout)
    fields: int = 26  # synthetic only
    vocab: int = 2000  # rows per field (synthetic) or hash buckets (files)
    zipf: float = 1.1
    max_hot: int = 3
    num_dense: int = 13
    embedding_dim: int = 16
    model: ModelKind = "wide_deep"
    dropout: float = 0.0  # after each hidden ReLU of the model's MLP tower, in training only
    eval_samples: int = 200_000  # synthetic only
    eval_every: int = 0  # 0: only at the end
    save_every: int = 0  # 0: only at the end
    max_skipped_steps: int = DEFAULT_MAX_SKIPPED_STEPS  # overflow-skipped optimizer steps in a row before stopping
    resume: bool = False
    seed: int = 1234
    threads: int = 0  # torch threads per rank; 0: cores / local ranks
    stragglers: tuple[Straggler, ...] = ()
    server_tables: bool = False
    rejoin_as: int | None = None
    crash: Crash | None = None
    ps_link_latency_ms: float = 0.0  # modelled one-way latency to the parameter servers (gba_engine/ps/link.py)
    ps_link_mbit: float = 0.0  # modelled bandwidth to the parameter servers, Mbit/s (0: unlimited)
    epochs: int = 1  # passes over the training files (file data only); --steps stays an upper bound
    early_stop_metric: str | None = None  # "auc" | "logloss": keep the best evaluation (OUT/best), stop without gains
    patience: int = 2  # evaluations in a row without improvement that stop the run (0: never stop, keep the best)
    min_delta: float = 0.0  # an improvement must beat the best by more than this
    loss_explosion_factor: float = DEFAULT_EXPLOSION_FACTOR  # stop a finite loss explosion (0: off)
    loaded: JobConfig | None = dataclasses.field(default=None, compare=False, repr=False)
    loaded_schema: "DataSchema | None" = dataclasses.field(default=None, compare=False, repr=False)  # --schema's

    def __post_init__(self) -> None:
        if self.data not in DATA_KINDS:
            raise RecJobError(f"--data {self.data!r}: expected one of {', '.join(DATA_KINDS)}")
        if self.model not in MODEL_KINDS:
            raise RecJobError(f"--model {self.model!r}: expected one of {', '.join(MODEL_KINDS)}")
        for flag, value in (("--eval-every", self.eval_every), ("--save-every", self.save_every),
                            ("--threads", self.threads)):
            if value < 0:
                zero = "cores / local ranks" if flag == "--threads" else "only at the end"
                raise RecJobError(f"{flag} {value}: must be >= 0 (0: {zero})")
        for flag, value, low in (("--steps", self.steps, 1), ("--fields", self.fields, 1), ("--vocab", self.vocab, 1),
                                 ("--embedding-dim", self.embedding_dim, 1), ("--max-hot", self.max_hot, 1),
                                 ("--num-dense", self.num_dense, 0), ("--eval-samples", self.eval_samples, 1),
                                 ("--max-skipped-steps", self.max_skipped_steps, 1)):
            if value < low:  # a job that would train or score nothing is refused before step 1
                raise RecJobError(f"{flag} {value}: must be >= {low}")
        if isinstance(self.epochs, bool) or not isinstance(self.epochs, int) or self.epochs < 1:
            raise RecJobError(f"--epochs {self.epochs!r}: must be an integer >= 1")
        if self.epochs > 1 and self.data == "synthetic":  # the synthetic stream is endless: it has no epochs
            raise RecJobError(f"--epochs {self.epochs}: needs file data (--data criteo|parquet with --train-files); "
                              "the synthetic stream never ends, train it longer with --steps")
        if not (math.isfinite(self.zipf) and self.zipf >= 0):
            raise RecJobError(f"--zipf {self.zipf}: must be a finite exponent >= 0")
        for flag, value in (("--ps-link-latency-ms", self.ps_link_latency_ms), ("--ps-link-mbit", self.ps_link_mbit)):
            if not (math.isfinite(value) and value >= 0):
                raise RecJobError(f"{flag} {value}: must be a finite number >= 0")
        if isinstance(self.dropout, bool) or not isinstance(self.dropout, (int, float)) \
                or not 0.0 <= self.dropout < 1.0:  # also false for NaN
            raise RecJobError(f"--dropout {self.dropout!r}: must be a probability in [0, 1) (0: no dropout)")
        if not 0.0 <= self.max_bad_fraction <= 1.0:  # also false for NaN
            raise RecJobError(f"--max-bad-fraction {self.max_bad_fraction}: must be in [0, 1]")
        # tuples, so that the frozen config is hashable and cannot be changed through a list it was given
        object.__setattr__(self, "train_files", tuple(self.train_files))
        object.__setattr__(self, "eval_files", tuple(self.eval_files))
        object.__setattr__(self, "stragglers", tuple(self.stragglers))
        if self.loaded is None:
            object.__setattr__(self, "loaded", load_config(self.config))
        if self.schema is not None and self.loaded_schema is None:
            object.__setattr__(self, "loaded_schema", _load_schema(self.schema, self.data))
        self._check_hygiene()

    def _check_hygiene(self) -> None:
        """Refuse bad early-stopping and divergence settings (sparse_scale.rec.early_stop, base.divergence)."""
        from sparse_scale.rec.early_stop import METRICS

        if self.early_stop_metric is not None and self.early_stop_metric not in METRICS:
            raise RecJobError(f"--early-stop-metric {self.early_stop_metric!r}: expected one of {', '.join(METRICS)}")
        if isinstance(self.patience, bool) or not isinstance(self.patience, int) or self.patience < 0:
            raise RecJobError(f"--patience {self.patience!r}: must be an integer >= 0 (0: never stop, keep the best)")
        if not (isinstance(self.min_delta, (int, float)) and math.isfinite(self.min_delta) and self.min_delta >= 0):
            raise RecJobError(f"--min-delta {self.min_delta!r}: must be a finite number >= 0")
        factor = self.loss_explosion_factor
        if not (isinstance(factor, (int, float)) and math.isfinite(factor) and (factor == 0 or factor > 1)):
            raise RecJobError(f"--loss-explosion-factor {factor!r}: must be 0 (off) or a finite number > 1")
        if self.early_stop_metric is None:
            return
        if self.epochs == 1 and self.eval_every == 0:
            raise RecJobError(f"--early-stop-metric {self.early_stop_metric}: needs evaluations during training "
                              "(--epochs N > 1 evaluates each epoch's end, --eval-every N every N steps); with "
                              "neither the job evaluates once, at its end")
        if self.loaded is not None and "gba" in self.loaded.blocks:
            raise RecJobError(f"--early-stop-metric {self.early_stop_metric}: not with a gba block (its workers "
                              "evaluate at their own pace, so they cannot stop together); drop the flag or the block")

    def data_schema(self) -> "DataSchema":
        """The columns of the training and held-out files: ``--schema``, else the Criteo layout."""
        from picasso_ops.data.schema import DataSchema

        return self.loaded_schema if self.loaded_schema is not None else DataSchema.criteo()

    def synthetic_config(self) -> "SyntheticConfig | None":
        """The synthetic stream's settings from the flags (None with file data).

        A value the stream refuses is a :class:`RecJobError` naming the flag and the bound, e.g.
        ``--fields 5: must be >= 26 (the synthetic stream's 26 <= num_fields <= 1000)``.
        """
        if self.data != "synthetic":
            return None
        import pydantic

        from picasso_ops.data.synthetic import SyntheticConfig

        values = {name: getattr(self, attr) for attr, (_, name) in SYNTHETIC_FLAGS.items()}
        try:
            return SyntheticConfig(**values)
        except pydantic.ValidationError as exc:
            raise RecJobError("; ".join(_synthetic_error(self, e, SyntheticConfig) for e in exc.errors())) from None
