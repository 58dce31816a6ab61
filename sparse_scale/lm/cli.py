"""Train the byte-level MoE transformer LM with DeepSpeed on any folder of text files.

Runs unchanged under the deepspeed launcher, mpirun, srun or as one plain process:

    TRAIN_SCRIPT=launch/train_moe_lm.py bash launch/run_deepspeed.sh ds_configs/moe_lm_cpu.json --data DIR
    deepspeed --num_gpus 2 launch/train_moe_lm.py --config ds_configs/moe_lm_cpu.json --data DIR --steps 300
    python -m sparse_scale.lm --config ds_configs/moe_lm_cpu.json --data DIR --glob '*.py' --steps 50
    sparse-train-moe-lm --config ds_configs/moe_lm_cpu.json --data DIR --steps 50

The config needs a ``moe_model`` block (the shape); without a ``moe_proto`` block the model is
dense. Rank 0 prints a progress bar and a summary table (held-out loss, bits per byte,
tokens/s) and writes OUT/summary.json; checkpoints go to OUT/checkpoints (``--resume``).
The job itself is :func:`sparse_scale.lm.run`; this module only parses flags and prints.
"""
from __future__ import annotations

import argparse
import logging
import sys

from sparse_scale.atomic_checkpoint import CheckpointError
from sparse_scale.divergence import DEFAULT_MAX_SKIPPED_STEPS, DivergenceError
from sparse_scale.shutdown import shutdown_distributed
from sparse_scale.reporting import print_table

from .checkpoints import NoCheckpointError
from .job import LMJobConfig, run
from .summary import summary_rows

_LOG_FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"
_HANDLER = "sparse_scale.lm.cli"  # names our stdout handler, so that a second main() adds none


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line's flags (``argv`` None: ``sys.argv[1:]``)."""
    p = argparse.ArgumentParser(prog="sparse-train-moe-lm", description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True, help="DeepSpeed JSON/hjson with a moe_model and optional moe_proto block")
    p.add_argument("--data", required=True, help="folder of text files (searched recursively, see --glob)")
    p.add_argument("--glob", default="**/*", help="which files of --data to read (default: all, binary files skipped)")
    p.add_argument("--heldout-fraction", type=float, default=0.05, help="share of files held out for evaluation")
    p.add_argument("--eval-tokens", type=int, default=200_000, help="held-out tokens to evaluate (all ranks together)")
    p.add_argument("--steps", type=int, default=300, help="optimizer steps to train (in total, across resumes)")
    p.add_argument("--out", default="runs/train_moe_lm", help="folder for checkpoints, wandb and summary.json")
    p.add_argument("--save-every", type=int, default=0, help="checkpoint every N steps (0: only at the end)")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in OUT/checkpoints "
                   "(verified against its manifest; a broken one falls back to the newest intact one)")
    p.add_argument("--max-skipped-steps", type=int, default=DEFAULT_MAX_SKIPPED_STEPS, metavar="N",
                   help="stop with an error when DeepSpeed's overflow check skips more than N optimizer steps in a "
                        "row (a non-finite loss or gradient norm stops the job at once)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--threads", type=int, default=0, help="torch threads per rank (0: cores / local ranks)")
    p.add_argument("--local_rank", type=int, default=-1, help=argparse.SUPPRESS)  # set by the deepspeed launcher
    return p.parse_args(argv)


def job_from_args(args: argparse.Namespace) -> LMJobConfig:
    """The :class:`LMJobConfig` the flags describe.

    Example::

        job_from_args(parse_args(["--config", "cfg.json", "--data", "texts"])).steps     # 300
    """
    return LMJobConfig(config=args.config, data=args.data, glob=args.glob, heldout_fraction=args.heldout_fraction,
                       eval_tokens=args.eval_tokens, steps=args.steps, out=args.out, save_every=args.save_every,
                       resume=args.resume, seed=args.seed, threads=args.threads,
                       max_skipped_steps=args.max_skipped_steps)


def _show_job_messages() -> None:
    """The job's INFO messages (e.g. where it resumed from) go to stdout as plain lines, as the script printed them.

    Warnings and errors keep the log format on stderr.
    """
    job_logger = logging.getLogger("sparse_scale.lm")
    if any(h.get_name() == _HANDLER for h in job_logger.handlers):
        return
    messages = logging.StreamHandler(sys.stdout)
    messages.set_name(_HANDLER)
    messages.setFormatter(logging.Formatter("%(message)s"))
    messages.addFilter(lambda record: record.levelno < logging.WARNING)
    problems = logging.StreamHandler(sys.stderr)
    problems.setLevel(logging.WARNING)
    problems.setFormatter(logging.Formatter(_LOG_FORMAT))
    job_logger.addHandler(messages)
    job_logger.addHandler(problems)
    job_logger.setLevel(logging.INFO)
    job_logger.propagate = False  # the root handler would print the INFO lines a second time


def main(argv: list[str] | None = None) -> None:
    """Parse flags, run the job, print the summary table on rank 0 (the summary itself is OUT/summary.json).

    Example::

        main(["--config", "ds_configs/moe_lm_cpu.json", "--data", "texts", "--steps", "50"])
    """
    logging.basicConfig(level=logging.WARNING, format=_LOG_FORMAT)
    _show_job_messages()
    args = parse_args(argv)
    try:
        summary = run(job_from_args(args))
    except NoCheckpointError as err:
        raise SystemExit(f"--resume: {err}") from err
    except (DivergenceError, CheckpointError) as err:  # a clear one-line message and a non-zero exit
        raise SystemExit(str(err)) from err
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_rank() == 0:
        print_table(summary_rows(summary))
    shutdown_distributed(flush=True)  # every rank of a synchronous job gets here
