"""What one recommender job is: the CLI's flags as a frozen dataclass, plus the loaded config file.

Example::

    from sparse_scale.rec import RecJobConfig, run
    job = RecJobConfig(config="ds_configs/demo_cpu.json", steps=50, vocab=200, out="runs/nb")
    summary = run(job)          # RecSummary; summary.to_dict() is OUT/summary.json
"""
from __future__ import annotations

import dataclasses
import math
from typing import Literal

from sparse_scale.base.divergence import DEFAULT_MAX_SKIPPED_STEPS
from sparse_scale.config import JobConfig, load_config
from sparse_scale.rec.faults import Crash, Straggler

DataKind = Literal["synthetic", "criteo", "parquet"]
ModelKind = Literal["wide_deep", "dlrm"]
DATA_KINDS: tuple[str, ...] = ("synthetic", "criteo", "parquet")
MODEL_KINDS: tuple[str, ...] = ("wide_deep", "dlrm")


class RecJobError(ValueError):
    """A job that cannot run as asked; the message says why (the CLI prints it and exits)."""


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
    fields: int = 26  # synthetic only
    vocab: int = 2000  # rows per field (synthetic) or hash buckets (files)
    zipf: float = 1.1
    max_hot: int = 3
    num_dense: int = 13
    embedding_dim: int = 16
    model: ModelKind = "wide_deep"
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
    loaded: JobConfig | None = dataclasses.field(default=None, compare=False, repr=False)

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
        if not 0.0 <= self.max_bad_fraction <= 1.0:  # also false for NaN
            raise RecJobError(f"--max-bad-fraction {self.max_bad_fraction}: must be in [0, 1]")
        # tuples, so that the frozen config is hashable and cannot be changed through a list it was given
        object.__setattr__(self, "train_files", tuple(self.train_files))
        object.__setattr__(self, "eval_files", tuple(self.eval_files))
        object.__setattr__(self, "stragglers", tuple(self.stragglers))
        if self.loaded is None:
            object.__setattr__(self, "loaded", load_config(self.config))
