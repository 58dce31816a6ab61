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
import sys
import warnings
from pathlib import Path
from typing import Any, Callable, Sequence

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
    p.add_argument("--out", default="runs/train_rec", help="folder for checkpoints, wandb and summary.json")
    p.add_argument("--data", choices=["synthetic", "criteo", "parquet"], default="synthetic")
    p.add_argument("--train-files", nargs="*", default=[], help="Criteo TSV or parquet files (--data criteo|parquet)")
    p.add_argument("--eval-files", nargs="*", default=[], help="held-out files (--data criteo|parquet)")
    p.add_argument("--max-bad-fraction", type=float, default=0.01, help="bad rows tolerated before failing")
    p.add_argument("--fields", type=int, default=26, help="categorical fields (synthetic)")
    p.add_argument("--vocab", type=int, default=2000, help="rows per field (synthetic) or hash buckets (files)")
    p.add_argument("--zipf", type=float, default=1.1, help="Zipf exponent of the synthetic ids")
    p.add_argument("--max-hot", type=int, default=3, help="max ids per field and sample (synthetic)")
    p.add_argument("--num-dense", type=int, default=13)
    p.add_argument("--embedding-dim", type=int, default=16)
    p.add_argument("--model", choices=["wide_deep", "dlrm"], default="wide_deep",
                   help="wide-and-deep (wide ids + FM + MLP, mean pooling) or DLRM (bottom MLP, dot interactions, "
                        "top MLP, sum pooling); either over per-field tables, or packed ones with a picasso block")
    p.add_argument("--eval-samples", type=int, default=200_000, help="held-out samples (synthetic)")
    p.add_argument("--eval-every", type=int, default=0, help="evaluate every N steps (0: only at the end)")
    p.add_argument("--save-every", type=int, default=0, help="checkpoint every N steps (0: only at the end)")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in OUT/checkpoints")
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


def job_config(args: argparse.Namespace) -> RecJobConfig:
    """The :class:`RecJobConfig` the parsed flags describe (reads and validates ``--config``)."""
    stragglers: list[Straggler] = list(args.straggler)
    crash: Crash | None = args.crash
    return RecJobConfig(
        config=args.config, steps=args.steps, out=args.out, data=args.data, train_files=tuple(args.train_files),
        eval_files=tuple(args.eval_files), max_bad_fraction=args.max_bad_fraction, fields=args.fields,
        vocab=args.vocab, zipf=args.zipf, max_hot=args.max_hot, num_dense=args.num_dense,
        embedding_dim=args.embedding_dim, model=args.model, eval_samples=args.eval_samples,
        eval_every=args.eval_every, save_every=args.save_every, resume=args.resume, seed=args.seed,
        threads=args.threads, stragglers=tuple(stragglers), server_tables=args.server_tables,
        rejoin_as=args.rejoin_as, crash=crash, ps_link_latency_ms=args.ps_link_latency_ms,
        ps_link_mbit=args.ps_link_mbit)


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
    wandb_mode = setup_wandb_env(Path(config.out))
    ctx = runner.job_context(config)
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


if __name__ == "__main__":
    main()
