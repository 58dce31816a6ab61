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
import statistics
import tempfile
from pathlib import Path
from typing import Any

import system  # benchmarks/system.py, beside this script: the rivals' config, flags and rank runner


def config(shape: system.Shape, sharding: str, pipeline: str) -> dict[str, Any]:
    """``system.py``'s "ours packed" config plus ``sharding`` and ``pipeline``."""
    cfg = system.ds_config(shape, picasso=True)
    cfg["picasso"] |= {"sharding": sharding, "pipeline": pipeline}
    return cfg


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
    shape = system.Shape(fields=args.fields, vocab=args.vocab, dim=args.dim, steps=args.steps,
                         eval_samples=args.eval_samples)
    rows: dict[tuple[str, bool], list[dict[str, Any]]] = {}
    for rep in range(args.reps):
        for sharding in args.shardings:
            for pipeline in ((False, True) if rep % 2 == 0 else (True, False)):  # alternate the order too
                mode = ("all" if sharding == "data_parallel" else "row_wise") if pipeline else "off"
                with tempfile.TemporaryDirectory() as tmp:
                    r = system.run_train_rec(Path(tmp), f"{sharding} {mode}", config(shape, sharding, mode), shape,
                                             shape.steps, straggler=False)
                r = {"samples_per_s": r["samples_per_s"], "auc": r["auc"]}
                rows.setdefault((sharding, pipeline), []).append(r)
                print(json.dumps({"rep": rep, "sharding": sharding, "pipeline": mode, **r}), flush=True)
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
