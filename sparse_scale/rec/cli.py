"""``sparse-train-rec``: Train a wide-and-deep CTR model with DeepSpeed on a synthetic stream, Criteo TSV or parquet.

The edge of the rec job: it parses the flags, reads the environment (wandb's mode, the
launcher's variables through ``sparse_scale.distenv``), calls :func:`sparse_scale.rec.run` and
prints the summary table on rank 0. Runs unchanged under the deepspeed launcher, mpirun, srun
or as one plain process::

    deepspeed --num_gpus 2 launch/train_rec.py --config ds_configs/demo_cpu.json
    mpirun -n 2 python -m sparse_scale.rec --config ds_configs/demo_cpu.json
    sparse-train-rec --config ds_configs/demo_cpu.json --steps 50
"""
from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys
import warnings
from pathlib import Path
from typing import Any, Callable, Sequence

from sparse_scale.divergence import DEFAULT_EXPLOSION_FACTOR, DEFAULT_MAX_SKIPPED_STEPS
from sparse_scale.shutdown import shutdown_distributed
from sparse_scale.rec.config import RecJobConfig, RecJobError
from sparse_scale.rec.faults import Crash, Straggler, parse_crash, parse_straggler
from sparse_scale.reporting import finish_wandb, print_table, setup_wandb_env


def _argument(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """An argparse ``type=`` that shows the parser's own message (argparse hides a ValueError's)."""
    def convert(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    convert.__name__ = parse.__name__
    return convert


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The flags of ``sparse-train-rec`` (default: ``sys.argv[1:]``)."""
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0].split(": ", 1)[-1])
    p.add_argument("--config", required=True, help="DeepSpeed JSON/hjson with optional picasso/gba blocks")
    p.add_argument("--steps", type=int, default=1500, help="optimizer steps to train (in total, across resumes)")
    p.add_argument("--epochs", type=int, default=1, metavar="N",
                   help="passes over --train-files (file data only), each after the first with its file order and "
                        "windows of batches shuffled by --seed, evaluated at each epoch's end; --steps stays an "
                        "upper bound")
    p.add_argument("--out", default="runs/train_rec", help="folder for checkpoints, wandb and summary.json")
    p.add_argument("--data", choices=["synthetic", "criteo", "parquet"], default="synthetic")
    p.add_argument("--train-files", nargs="*", default=[], help="Criteo TSV or parquet files (--data criteo|parquet)")
    p.add_argument("--eval-files", nargs="*", default=[], help="held-out files (--data criteo|parquet)")
    p.add_argument("--max-bad-fraction", type=float, default=0.01, help="bad rows tolerated before failing")
    p.add_argument("--schema", default=None, metavar="FILE.json|criteo",
                   help="the files' columns (label, categorical, dense; header, delimiter, multi-hot separators): a "
                        "JSON data schema (picasso_ops.data.schema.DataSchema, docs/rec_job.md) or a preset name; "
                        "default: the Criteo layout. --data criteo reads TSV/CSV text with it")
    p.add_argument("--fields", type=int, default=None, help="categorical fields (synthetic; default 26)")
    p.add_argument("--vocab", type=int, default=2000, help="rows per field (synthetic) or hash buckets (files)")
    p.add_argument("--zipf", type=float, default=None, help="Zipf exponent of the synthetic ids (default 1.1)")
    p.add_argument("--max-hot", type=int, default=None, help="max ids per field and sample (synthetic; default 3)")
    p.add_argument("--num-dense", type=int, default=None, help="dense features (synthetic; default 13, files have 13)")
    p.add_argument("--embedding-dim", type=int, default=16)
    p.add_argument("--model", choices=["wide_deep", "dlrm", "deepfm", "dcn_v2"], default="wide_deep",
                   help="wide_deep: wide ids + FM + MLP (mean pooling); dlrm: bottom MLP, dot interactions, top MLP "
                        "(sum pooling); deepfm: first-order weights + FM over the categorical and dense fields + an "
                        "MLP sharing their vectors; dcn_v2: full-rank cross layers, then an MLP (stacked); each over "
                        "per-field tables, or packed ones with a picasso block")
    p.add_argument("--dropout", type=float, default=0.0, metavar="P",
                   help="dropout after each hidden ReLU of the model's MLP tower (deep MLP, DLRM's top MLP, an MoE "
                        "tower's hidden layers), in training only (0: none)")
    p.add_argument("--eval-samples", type=int, default=None, help="held-out samples (synthetic; default 200000)")
    p.add_argument("--eval-every", type=int, default=0, help="evaluate every N steps (0: only at the end)")
    p.add_argument("--save-every", type=int, default=0, help="checkpoint every N steps (0: only at the end)")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in OUT/checkpoints "
                   "(verified against its manifest; a broken one falls back to the newest intact one)")
    p.add_argument("--max-skipped-steps", type=int, default=DEFAULT_MAX_SKIPPED_STEPS, metavar="N",
                   help="stop with an error when DeepSpeed's overflow check skips more than N optimizer steps in a "
                        "row (a non-finite loss or gradient norm stops the job at once)")
    p.add_argument("--loss-explosion-factor", type=float, default=DEFAULT_EXPLOSION_FACTOR, metavar="F",
                   help="stop with an error when the median loss of the last 5 steps exceeds F x the larger of the "
                        "first step's loss and a constant predictor's (the entropy of the label rate seen so far): "
                        "a loss that explodes while staying finite (0: off)")
    p.add_argument("--early-stop-metric", choices=["auc", "logloss"], default=None,
                   help="judge each evaluation during training (each epoch's end with --epochs, every N steps with "
                        "--eval-every) on this held-out metric: the best one's checkpoint is kept in OUT/best and "
                        "reported, and --patience evaluations without improvement stop the run")
    p.add_argument("--patience", type=int, default=None, metavar="N",
                   help="with --early-stop-metric: stop after N evaluations in a row without improvement "
                        "(default 2; 0: never stop, only keep the best)")
    p.add_argument("--min-delta", type=float, default=None, metavar="D",
                   help="with --early-stop-metric: an improvement must beat the best by more than D (default 0)")
    p.add_argument("--overwrite", action="store_true",
                   help="start a new run in an OUT that already holds checkpoints (without it, and without "
                        "--resume, that is an error: a rerun would silently start over and move 'latest' back)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--threads", type=int, default=0, help="torch threads per rank (0: cores / local ranks)")
    p.add_argument("--straggler", action="append", default=[], type=_argument(parse_straggler),
                   metavar="RANK:FACTOR[:START-END]",
                   help="slow RANK by FACTOR (sleeping (FACTOR-1) x its forward+backward time, the median of its "
                        "first 3 micro-steps, before each backward), optionally only for optimizer steps "
                        "START <= step < END (with a gba block: job-wide steps); repeatable (demos, benchmarks)")
    p.add_argument("--server-tables", action="store_true",
                   help="with a gba block: the embedding tables live on the parameter servers (rows by id, updated "
                        "once per global batch in sync mode too) instead of in the workers' dense parameters")
    p.add_argument("--rejoin-as", type=int, default=None, metavar="WORKER",
                   help="with a gba block: replace worker WORKER of the running job (same --config and --out) whose "
                        "process died; needs no launcher, finds the servers through gba.control_file "
                        "(default OUT/gba_control_plane) and takes the job's next batch numbers")
    p.add_argument("--crash", type=_argument(parse_crash), default=None, metavar="RANK:STEP",
                   help="RANK exits at once (code 17, no goodbye) after its optimizer step STEP: fault-tolerance "
                        "demos and tests (in gba mode the others go on; --rejoin-as replaces it)")
    p.add_argument("--ps-link-latency-ms", type=float, default=0.0, metavar="MS",
                   help="with a gba block: model a slower link to the parameter servers, delivering every message "
                        "MS ms one-way later (gba_engine/ps/link.py; 0: off)")
    p.add_argument("--ps-link-mbit", type=float, default=0.0, metavar="MBIT",
                   help="with a gba block: model the link to the parameter servers at MBIT Mbit/s per direction "
                        "(0: unlimited)")
    p.add_argument("--local_rank", type=int, default=-1, help=argparse.SUPPRESS)  # set by the deepspeed launcher
    return p.parse_args(argv)


# Flags that shape the synthetic stream only: with file data they are refused, not silently ignored.
SYNTHETIC_ONLY_FLAGS = {"fields": "--fields", "zipf": "--zipf", "max_hot": "--max-hot", "num_dense": "--num-dense",
                        "eval_samples": "--eval-samples"}


def _synthetic_flags(args: argparse.Namespace) -> dict[str, Any]:
    """The synthetic-only flags as RecJobConfig fields: given ones, else the defaults; refused with file data."""
    given = {name: getattr(args, name) for name in SYNTHETIC_ONLY_FLAGS if getattr(args, name) is not None}
    if given and args.data != "synthetic":
        from sparse_scale.rec.job import FILE_DENSE, FILE_FIELDS

        flags = ", ".join(SYNTHETIC_ONLY_FLAGS[name] for name in given)
        raise RecJobError(f"{flags}: shape the synthetic stream only, and --data {args.data} reads the files "
                          f"(their categorical and dense columns: --schema's, by default Criteo's {FILE_FIELDS} and "
                          f"{FILE_DENSE}; held-out rows from "
                          f"--eval-files); drop {'it' if len(given) == 1 else 'them'}")
    return given


def _hygiene_flags(args: argparse.Namespace) -> dict[str, Any]:
    """Early stopping and the explosion guard as RecJobConfig fields; --patience / --min-delta need a metric."""
    given = [flag for flag, name in (("--patience", "patience"), ("--min-delta", "min_delta"))
             if getattr(args, name, None) is not None]
    metric = getattr(args, "early_stop_metric", None)
    if given and metric is None:
        raise RecJobError(f"{', '.join(given)}: {'sets' if len(given) == 1 else 'set'} early stopping, which "
                          "--early-stop-metric auc|logloss turns on")
    out: dict[str, Any] = {"early_stop_metric": metric,
                           "loss_explosion_factor": getattr(args, "loss_explosion_factor", DEFAULT_EXPLOSION_FACTOR)}
    if getattr(args, "patience", None) is not None:
        out["patience"] = args.patience
    if getattr(args, "min_delta", None) is not None:
        out["min_delta"] = args.min_delta
    return out


def job_config(args: argparse.Namespace) -> RecJobConfig:
    """The :class:`RecJobConfig` the parsed flags describe (reads and validates ``--config``)."""
    stragglers: list[Straggler] = list(args.straggler)
    crash: Crash | None = args.crash
    config = RecJobConfig(
        config=args.config, steps=args.steps, out=args.out, data=args.data, train_files=tuple(args.train_files),
        eval_files=tuple(args.eval_files), max_bad_fraction=args.max_bad_fraction, **_synthetic_flags(args),
        vocab=args.vocab, embedding_dim=args.embedding_dim, model=args.model, dropout=args.dropout,
        eval_every=args.eval_every, save_every=args.save_every, max_skipped_steps=args.max_skipped_steps,
        resume=args.resume, seed=args.seed,
        threads=args.threads, stragglers=tuple(stragglers), server_tables=args.server_tables,
        rejoin_as=args.rejoin_as, crash=crash, ps_link_latency_ms=args.ps_link_latency_ms,
        ps_link_mbit=args.ps_link_mbit, epochs=args.epochs, **_hygiene_flags(args),
        schema=args.schema)
    config.synthetic_config()  # a value the synthetic stream refuses names its flag here, not in pydantic's words
    return config


def check_out_folder(out: str | os.PathLike, resume: bool, overwrite: bool) -> None:
    """Refuse an OUT that is no writable folder, or an earlier run's folder without --resume / --overwrite.

    Run before step 1, so that a bad ``--out`` does not surface only when the first save is written::

        check_out_folder("runs/x", resume=False, overwrite=False)   # RecJobError if runs/x/checkpoints has a run
    """
    path = Path(out)
    if path.exists() and not path.is_dir():
        raise RecJobError(f"--out {path}: exists and is not a folder")
    existing = next((p for p in path.parents if p.exists()), Path(".")) if not path.exists() else path
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        raise RecJobError(f"--out {path}: cannot write there ({existing} is not a writable folder)")
    ckpt = path / "checkpoints"
    if not resume and not overwrite and ckpt.is_dir() and any(ckpt.iterdir()):
        raise RecJobError(f"--out {path}: already holds a run ({ckpt}); pass --resume to continue it or "
                          "--overwrite to start over in it")


def check_files(config: RecJobConfig) -> None:
    """Refuse missing, empty, gzip-compressed or unreadable --train-files / --eval-files before step 1."""
    from picasso_ops.data.quality import DataError
    from picasso_ops.data.rows import check_readable

    if config.data == "synthetic":
        return
    kind = "Criteo TSV" if config.data == "criteo" else "parquet"
    for flag, files in (("--train-files", config.train_files), ("--eval-files", config.eval_files)):
        try:
            check_readable(list(files), kind)
        except (OSError, DataError, ValueError) as exc:
            raise RecJobError(f"{flag}: {exc}") from None


def check_stragglers(config: RecJobConfig, world_size: int) -> None:
    """Refuse a --straggler or --crash rank that is not in this launch of ``world_size`` ranks."""
    ranks = [("--straggler", s.rank) for s in config.stragglers]
    ranks += [("--crash", config.crash.rank)] if config.crash is not None else []
    for flag, rank in ranks:
        if not 0 <= rank < world_size:
            raise RecJobError(f"{flag}: rank {rank} is out of range: this job has ranks 0..{world_size - 1}")


def _show_notices() -> None:
    """The job's one-line notes for people ("resumed from ...") go to stdout as plain lines."""
    notice = logging.getLogger("sparse_scale.rec.notice")
    if not any(getattr(h, "_sparse_rec_notice", False) for h in notice.handlers):
        handler = logging.StreamHandler(sys.stdout)
        handler.setFormatter(logging.Formatter("%(message)s"))
        handler._sparse_rec_notice = True  # type: ignore[attr-defined]  # added once per process
        notice.addHandler(handler)
    notice.setLevel(logging.INFO)
    notice.propagate = False


def train(args: argparse.Namespace, model_factory: Callable[..., Any] | None = None) -> dict[str, Any]:
    """Run the job the flags describe on this rank; returns its summary.json mapping (servers: ``{"server": True}``).

    Example::

        train(parse_args(["--config", "ds_configs/demo_cpu.json", "--steps", "20"]))["auc"]
    """
    from sparse_scale.rec import runner
    from sparse_scale.rec.combinations import check_combinations
    from sparse_scale.rec.summary import summary_rows

    _show_notices()
    config = job_config(args)
    check_combinations(config)  # before the launcher's rendezvous or a restarted worker's wait for the servers
    if config.rejoin_as is None:  # a replacement worker joins the running job's folder on purpose
        check_out_folder(config.out, config.resume, getattr(args, "overwrite", False))
        if getattr(args, "overwrite", False) and not config.resume:  # an earlier run's kept best is not this run's
            shutil.rmtree(Path(config.out) / "best", ignore_errors=True)  # every rank, before any rendezvous
    check_files(config)
    wandb_mode = setup_wandb_env(Path(config.out))
    ctx = runner.job_context(config)
    check_stragglers(config, ctx.world_size)
    summary = runner.run(config, ctx=ctx, wandb_mode=wandb_mode, model_factory=model_factory)
    result = summary.to_dict()
    if not summary.is_server and ctx.rank == 0:
        print_table(summary_rows(result))
    if not summary.is_server:
        finish_wandb(ctx.rank)
    return result


def main(argv: Sequence[str] | None = None) -> None:
    """The console script: parse, train, and turn a job error into a one-line exit message."""
    # DeepSpeed's ZeRO still calls the deprecated all_gather_into_tensor; not actionable for users.
    warnings.filterwarnings("ignore", message=".*all_gather_into_tensor.*", category=FutureWarning)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    args = parse_args(argv)
    from picasso_ops.ops import OpsConfig, configure

    configure(OpsConfig.from_env(os.environ))  # the edge: PICASSO_OPS_* are read here, once, for this process
    try:
        train(args)
    except RecJobError as exc:
        raise SystemExit(str(exc)) from None
    shutdown_distributed()


if __name__ == "__main__":
    main()
