"""A/B of the sparse-dist pipeline (``picasso.pipeline``) in the rec job: the rivals' "ours packed" run, off and on.

The run is ``benchmarks/system.py``'s "ours packed" (DLRM, F fields x vocab rows x dim 16, batch 256 per
rank, 2 gloo ranks, row-wise Adagrad on the tables, AdamW on the dense part, ``--threads 1``), with
``picasso.pipeline`` "off" and on ("all" for data-parallel tables: their row unions; "row_wise" for
row-wise tables: their ids and rows), variants alternated ``--reps`` times so that machine noise hits
both alike; per sharding (``--shardings``: the rivals' data_parallel, and row_wise where the pipeline
moves the most). Prints one line per run and a table of medians and ranges (markdown).

Usage::

    .venv/bin/python benchmarks/pipeline.py                                   # F=26 x 100,000, 600 steps, 3 reps
    .venv/bin/python benchmarks/pipeline.py --steps 300 --reps 2 --shardings data_parallel row_wise
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import tempfile
from pathlib import Path
from typing import Any

from sparse_scale.multiproc import run_distributed


class _Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def config(fields: int, dim: int, sharding: str, pipeline: str) -> dict[str, Any]:
    """``benchmarks/system.py``'s ``ds_config(shape, picasso=True)`` plus ``sharding`` and ``pipeline``."""
    return {
        "train_micro_batch_size_per_gpu": 256, "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.001, "weight_decay": 0.0, "torch_adam": True}},
        "zero_optimization": {"stage": 0}, "gradient_clipping": 0.0, "steps_per_print": 1_000_000,
        "wandb": {"enabled": False},
        "picasso": {"packing": True, "embedding_dim": dim, "sharding": sharding, "pipeline": pipeline,
                    "optimizer": {"type": "rowwise_adagrad", "lr": 0.05, "lr_schedule": "constant"}},
    }


def argv_of(cfg: Path, out: Path, fields: int, vocab: int, dim: int, steps: int, eval_samples: int) -> list[str]:
    """``benchmarks/system.py``'s ``train_rec_argv`` for the rivals (seed 1234, ``--threads 1``)."""
    return ["--config", str(cfg), "--out", str(out), "--model", "dlrm", "--fields", str(fields), "--vocab", str(vocab),
            "--embedding-dim", str(dim), "--steps", str(steps), "--eval-samples", str(eval_samples),
            "--seed", "1234", "--threads", "1"]


def rank_run(rank: int, world_size: int, argv: list[str]) -> dict[str, Any]:
    """The rec job on this rank; its summary and the pipeline's log line (rank 0)."""
    os.environ.setdefault("WANDB_MODE", "disabled")
    logging.getLogger("sparse_scale.rec.notice").setLevel(logging.WARNING)
    capture = _Capture()
    loop_log = logging.getLogger("sparse_scale.rec.loop")
    loop_log.setLevel(logging.INFO)
    loop_log.addHandler(capture)
    from sparse_scale.rec import cli

    summary = dict(cli.train(cli.parse_args(argv)))
    return {"samples_per_s": summary["samples_per_s"], "auc": summary["auc"],
            "pipeline_log": [m for m in capture.messages if "pipeline" in m]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--fields", type=int, default=26)
    p.add_argument("--vocab", type=int, default=100_000)
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--eval-samples", type=int, default=131_072)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--shardings", nargs="+", default=["data_parallel"], choices=["data_parallel", "row_wise"])
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING)
    rows: dict[tuple[str, bool], list[dict[str, Any]]] = {}
    for rep in range(args.reps):
        for sharding in args.shardings:
            for pipeline in ((False, True) if rep % 2 == 0 else (True, False)):  # alternate the order too
                with tempfile.TemporaryDirectory() as tmp:
                    cfg = Path(tmp) / "cfg.json"
                    mode = ("all" if sharding == "data_parallel" else "row_wise") if pipeline else "off"
                    cfg.write_text(json.dumps(config(args.fields, args.dim, sharding, mode)))
                    argv = argv_of(cfg, Path(tmp) / "out", args.fields, args.vocab, args.dim, args.steps,
                                   args.eval_samples)
                    r = run_distributed(rank_run, 2, args=(argv,), timeout_s=1800, init_process_group=False)[0]
                rows.setdefault((sharding, pipeline), []).append(r)
                print(json.dumps({"rep": rep, "sharding": sharding, "pipeline": pipeline, **r}), flush=True)
    print("\n| sharding | pipeline | runs | samples/s median | range | AUC median |")
    print("|---|---|---|---|---|---|")
    for (sharding, pipeline), runs in rows.items():
        rates = [r["samples_per_s"] for r in runs]
        print(f"| {sharding} | {'on' if pipeline else 'off'} | {len(runs)} | {statistics.median(rates):,.0f} | "
              f"{min(rates):,.0f}-{max(rates):,.0f} | {statistics.median(r['auc'] for r in runs):.4f} |")
    for sharding in args.shardings:
        off, on = rows.get((sharding, False)), rows.get((sharding, True))
        if off and on:
            ratios = [b["samples_per_s"] / a["samples_per_s"] for a, b in zip(off, on)]
            print(f"\n{sharding}: on/off per rep {[round(x, 3) for x in ratios]}, median "
                  f"{statistics.median(ratios):.3f}")


if __name__ == "__main__":
    main()
