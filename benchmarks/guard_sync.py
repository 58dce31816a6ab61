"""The divergence guard's agreement of the ranks: every optimizer step against every AGREE_EVERY steps.

The rec job on 2 gloo ranks at one of ``benchmarks/system.py``'s rivals shapes (default F=26 x 100,000
rows, 300 steps) and one of its variants of ours (default ``ours row_wise``), run with the guard's
all-reduce every step (``--every 1``, what the guard did before) and every
``sparse_scale.divergence.AGREE_EVERY`` steps, alternated (``--abba``: A B B A ...), ``--reps`` times each. The rank sets the
module's ``AGREE_EVERY`` before the job builds its guard (a benchmark switch; the library has none).
Prints the runs and the medians, and with ``--write`` adds a dated section to benchmarks/RESULTS.md.

    .venv/bin/python benchmarks/guard_sync.py --reps 3 --write
    .venv/bin/python benchmarks/guard_sync.py --reps 6 --abba --write
    .venv/bin/python benchmarks/guard_sync.py --reps 1 --shape 26x100:20:1024      # a smoke run, a minute
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

import system  # benchmarks/system.py, beside this script: the rivals' shapes, variants and one train_rec run

SECTION = "## The divergence guard's all-reduce: every step against every AGREE_EVERY steps"


def guarded_rank(rank: int, world_size: int, argv: list[str], agree_every: int) -> dict[str, Any]:
    """:func:`system.train_rec_rank` with the guard agreeing every ``agree_every`` optimizer steps."""
    import sparse_scale.divergence as divergence

    divergence.AGREE_EVERY = agree_every  # read when the loop builds its guard
    spent = {"end_step": 0.0, "calls": 0}
    real = divergence.DivergenceGuard.end_step

    def timed(self: Any, step: int, ds_engine: Any) -> None:  # the loop's wait in the guard, all_reduce included
        t = time.perf_counter()
        try:
            real(self, step, ds_engine)
        finally:
            spent["end_step"] += time.perf_counter() - t
            spent["calls"] += 1

    divergence.DivergenceGuard.end_step = timed  # this rank's process only
    summary = system.train_rec_rank(rank, world_size, argv)
    return summary | {"guard_ms_per_step": 1e3 * spent["end_step"] / max(spent["calls"], 1)}


def one_run(workdir: Path, slug: str, cfg: dict[str, Any], shape: system.Shape, agree_every: int) -> dict[str, Any]:
    """One 2-rank train_rec job; rank 0's samples/s and AUC."""
    import json

    from sparse_scale.multiproc import run_distributed

    config = workdir / f"{slug}.json"
    config.write_text(json.dumps(cfg, indent=1))
    argv = system.train_rec_argv(config, workdir / slug, shape, shape.steps, False)
    started = time.time() - 1.0
    try:
        ranks = run_distributed(guarded_rank, 2, args=(argv, agree_every), timeout_s=system.RUN_TIMEOUT_S,
                                init_process_group=False)
    finally:
        system.remove_leaked_shm(started)
    return {"samples_per_s": ranks[0]["samples_per_s"], "auc": ranks[0]["auc"],
            "guard_ms": max(r["guard_ms_per_step"] for r in ranks)}


def table(runs: Sequence[dict[str, Any]], everies: Sequence[int]) -> str:
    """Markdown: every run in order, then per setting the median and range, and the paired ratio to every step."""
    lines = ["| run | agree every | samples/s | AUC | ms per step in guard.end_step (slower rank) |", "|---|---|---|---|---|"]
    lines += [f"| {i + 1} | {r['every']} | {r['samples_per_s']:.0f} | {r['auc']:.4f} | "
              f"{r['guard_ms']:.3f} |" if "guard_ms" in r else
              f"| {i + 1} | {r['every']} | {r['samples_per_s']:.0f} | {r['auc']:.4f} | - |" for i, r in enumerate(runs)]
    lines += ["", "| agree every | runs | samples/s, median (range) | x every step, paired by repetition (range) |",
              "|---|---|---|---|"]
    base = [r["samples_per_s"] for r in runs if r["every"] == everies[0]]
    for every in everies:
        vals = [r["samples_per_s"] for r in runs if r["every"] == every]
        ratios = [v / b for v, b in zip(vals, base)]  # the same repetition: next to each other in time
        lines.append(f"| {every} | {len(vals)} | {statistics.median(vals):.0f} ({min(vals):.0f}-{max(vals):.0f}) | "
                     f"{statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f}) |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    from sparse_scale.divergence import AGREE_EVERY

    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--shape", default=system.RIVAL_SHAPES[0], metavar="FxROWS[:STEPS[:EVAL]]")
    p.add_argument("--variant", default="ours row_wise",
                   help="one of benchmarks/system.py's variants of ours (rivals and optional ones)")
    p.add_argument("--every", type=int, nargs="+", default=[1, AGREE_EVERY],
                   help="the settings compared, the first is the reference (default: 1 and AGREE_EVERY)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--abba", action="store_true",
                   help="reverse the order every other repetition (A B B A ...), so a load that rises or falls "
                        "during the runs does not favour the setting run second")
    p.add_argument("--write", action="store_true", help="add a dated section to benchmarks/RESULTS.md")
    args = p.parse_args(argv)
    ours = {v.name: v for v in (*system.RIVAL_VARIANTS, *system.OPTIONAL_VARIANTS) if v.torchrec is None}
    if args.variant not in ours:
        p.error(f"--variant {args.variant!r}: one of {', '.join(ours)}")
    if min(args.every) < 1 or args.reps < 1:
        p.error("--every and --reps: positive integers")
    shape = system.parse_shape(args.shape, system.Shape())
    cfg = system.variant_config(shape, ours[args.variant])
    command = shlex.join([".venv/bin/python", "benchmarks/guard_sync.py", *(sys.argv[1:] if argv is None else argv)])
    from sparse_scale.multiproc import start_ranks_from_forkserver

    start_ranks_from_forkserver(["torch", "torch.distributed", "numpy", "deepspeed", "picasso_ops",
                                 "sparse_scale.rec.cli"])
    started, load0, t0 = time.strftime("%Y-%m-%d %H:%M"), os.getloadavg(), time.perf_counter()
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="guard_sync_") as tmp:
        for rep in range(args.reps):
            order = args.every if rep % 2 == 0 or not args.abba else args.every[::-1]
            for every in order:  # alternated: A B A B ..., or with --abba A B B A ... (a drifting load hits both)
                got = one_run(Path(tmp), f"every{every}_{rep}", cfg, shape, every)
                runs.append({"every": every, "rep": rep, **got})
                print(f"rep {rep + 1}, agree every {every}: {got['samples_per_s']:.0f} samples/s, "
                      f"AUC {got['auc']:.4f}, {got['guard_ms']:.3f} ms/step in the guard; "
                      f"load {os.getloadavg()[0]:.2f}", flush=True)
    body = table(runs, args.every)
    print(body, flush=True)
    if args.write:
        from embedding import write_section  # benchmarks/embedding.py

        load1, minutes = os.getloadavg(), (time.perf_counter() - t0) / 60
        head = (f"`{command}` ({minutes:.0f} min; 1-min load {load0[0]:.2f} before, {load1[0]:.2f} after; "
                f"{os.cpu_count()} cores). {args.variant!r} ({dataclasses.asdict(ours[args.variant])['picasso']}) at "
                f"F={shape.fields} x {shape.vocab:,} rows, dim {shape.dim}, micro-batch {shape.micro_batch}/rank, "
                f"{shape.steps} steps, 2 gloo ranks; samples/s and AUC of rank 0's summary.")
        write_section(system.RESULTS, SECTION, f"{head}\n\n{body}", title=f"{started}, benchmarks/guard_sync.py")
        print(f"wrote {system.RESULTS}", flush=True)


if __name__ == "__main__":
    main()
