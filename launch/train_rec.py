"""Train a wide-and-deep or DLRM CTR model with DeepSpeed: the script form of ``sparse-train-rec``.

The job itself is the library ``sparse_scale.rec`` (``run(RecJobConfig(...))``); this file
exists because the deepspeed launcher takes a script path:

    deepspeed --num_gpus 2 launch/train_rec.py --config ds_configs/demo_cpu.json
    mpirun -n 2 python launch/train_rec.py --config ds_configs/demo_cpu.json
    python launch/train_rec.py --config ds_configs/demo_cpu.json --steps 50

Rank 0 prints a progress bar and a final summary table and writes OUT/summary.json.
"""
from __future__ import annotations

import argparse
from typing import Any

from sparse_scale.rec import cli
from sparse_scale.rec.cli import main, parse_args
from sparse_scale.rec.model import build_model, scheduled_sparse_lr

__all__ = ["build_model", "main", "parse_args", "scheduled_sparse_lr", "train"]


def train(args: argparse.Namespace) -> dict[str, Any]:
    """``sparse_scale.rec.cli.train`` with this module's ``build_model`` (callers may replace it to wrap the model)."""
    return cli.train(args, model_factory=build_model)


if __name__ == "__main__":
    main()
