"""Data prefetch benchmark (issue 4 item 6): train_rec samples/s with ``picasso.interleave.prefetch_batches`` 0 vs N.

Each run is ``launch/train_rec.py`` in a fresh process (1 rank, ``--threads 1``,
synthetic data) on a copy of ``ds_configs/demo_cpu.json`` with wandb off, the
micro-batch size ``--batch`` and a picasso block (packed tables, row-wise
Adagrad) whose ``interleave.prefetch_batches`` is 0 ("off": the loop makes each
batch itself) or ``--depth`` ("on": a thread makes the next batches during the
step). Off and on alternate, ``--reps`` runs each, so load drifts hit both
alike; one untimed 2-step run first (the first packed lookup loads or
builds the C++ ops inside train_rec's first step). Reported: train_rec's own samples/s (training loop only, batch
generation included in "off"), median and each run; beside it the time to
generate one batch alone in this process (1 torch thread), i.e. the most that
prefetching can hide per step, and ``/proc/loadavg`` before and after.

Run::

    .venv/bin/python benchmarks/prefetch.py                 # ~5 minutes on 2 busy cores, writes RESULTS.md
    .venv/bin/python benchmarks/prefetch.py --quick         # small, writes nothing
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

logger = logging.getLogger("benchmarks.prefetch")
SECTION = "## Data prefetch in train_rec (issue 4 item 6)"
INTERLEAVE_SECTION = "## Interleaving (issue 4 item 6)"
RESULTS = Path(__file__).resolve().parent / "RESULTS.md"
BLOCK = {"packing": True, "embedding_dim": 16, "optimizer": {"type": "rowwise_adagrad", "lr": 0.05}}


def loadavg() -> str:
    """The first three fields of /proc/loadavg (1, 5, 15 minutes)."""
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())


def write_config(path: Path, depth: int, batch: int) -> Path:
    cfg = json.loads((ROOT / "ds_configs" / "demo_cpu.json").read_text())
    cfg.update(wandb={"enabled": False}, train_micro_batch_size_per_gpu=batch,
               picasso={**BLOCK, "interleave": {"prefetch_batches": depth}})
    path.write_text(json.dumps(cfg, indent=2))
    return path


def run_once(name: str, depth: int, args: argparse.Namespace, workdir: Path, steps: int | None = None
             ) -> dict[str, Any]:
    """One train_rec process; its summary's samples/s and the process wall time."""
    config = write_config(workdir / f"{name}.json", depth, args.batch)
    out = workdir / name
    cmd = [sys.executable, str(ROOT / "launch" / "train_rec.py"), "--config", str(config), "--out", str(out),
           "--fields", str(args.fields), "--vocab", str(args.vocab), "--steps", str(steps or args.steps),
           "--eval-samples", str(args.eval_samples), "--threads", "1", "--seed", "1234"]
    env = {**os.environ, "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1"}
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=args.timeout_s)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{name} failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}")
    summary = json.loads((out / "summary.json").read_text())
    return {"samples_per_s": summary["samples_per_s"], "auc": summary["auc"], "steps": summary["steps"],
            "train_time_s": summary["train_time_s"], "wall_s": wall}


def generation_ms(args: argparse.Namespace, batches: int = 8) -> float:
    """Median ms to make one training batch of this config on this thread (1 torch thread)."""
    import torch

    from picasso_ops.data import SyntheticConfig, SyntheticCTRStream

    torch.set_num_threads(1)
    # train_rec's synthetic settings for these arguments (its --zipf, --max-hot, --num-dense defaults)
    cfg = SyntheticConfig(num_fields=args.fields, vocab_sizes=args.vocab, zipf_exponent=1.1, max_ids_per_field=3,
                          num_dense=13, seed=1234)
    it = iter(SyntheticCTRStream(cfg, args.batch))
    next(it)
    times = []
    for _ in range(batches):
        t0 = time.perf_counter()
        next(it)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def loop_breakdown(args: argparse.Namespace, reps: int, steps: int = 15) -> dict[str, list[tuple[float, float]]]:
    """Per variant and repetition, ms per step spent waiting for the batch and computing, in this process.

    The same packed wide-and-deep as train_rec's picasso block (torch AdamW for the dense layers instead of
    DeepSpeed's) on the same stream, 1 torch thread; off and on alternate. It shows where the time goes:
    prefetching moves the batch's generation off the loop's critical path, and the compute that runs
    meanwhile slows down by whatever the producer thread takes from it.
    """
    import torch
    import torch.nn.functional as F

    from picasso_ops.data import SyntheticConfig, SyntheticCTRStream
    from picasso_ops.data.prefetch import Prefetcher
    from picasso_ops.distributed import sparse_step
    from picasso_ops.models import SparseArgs, WideAndDeepArgs, packed_wide_and_deep

    torch.set_num_threads(1)
    torch.manual_seed(0)
    cfg = SyntheticConfig(num_fields=args.fields, vocab_sizes=args.vocab, zipf_exponent=1.1, max_ids_per_field=3,
                          num_dense=13, seed=1234)
    model = packed_wide_and_deep(WideAndDeepArgs(vocab_sizes=[args.vocab] * args.fields, num_dense=13,
                                                 embedding_dim=16),
                                 SparseArgs(optimizer="rowwise_adagrad", optimizer_params={"lr": 0.05}))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def run(depth: int) -> tuple[float, float]:
        stream = SyntheticCTRStream(cfg, args.batch)
        batches = Prefetcher(stream, depth, name="bench-prefetch") if depth else iter(stream)
        wait = compute = 0.0
        for _ in range(steps):
            t0 = time.perf_counter()
            b = next(batches)
            t1 = time.perf_counter()
            loss = F.binary_cross_entropy_with_logits(model(b.dense, b.values, b.lengths), b.labels)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sparse_step(model)
            wait, compute = wait + t1 - t0, compute + time.perf_counter() - t1
        if depth:
            batches.close()
        return 1e3 * wait / steps, 1e3 * compute / steps

    run(0)  # warm-up: first touch of tables and optimizer state
    out: dict[str, list[tuple[float, float]]] = {"off": [], "on": []}
    for rep in range(reps):
        for name, depth in (("off", 0), ("on", args.depth)):
            out[name].append(run(depth))
            logger.info("loop rep %d %-3s wait %.0f ms + compute %.0f ms per step", rep, name, *out[name][-1])
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--fields", type=int, default=200)
    p.add_argument("--vocab", type=int, default=10_000, help="rows per field")
    p.add_argument("--batch", type=int, default=1024, help="micro-batch size")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--eval-samples", type=int, default=4096)
    p.add_argument("--depth", type=int, default=2, help="prefetch_batches of the 'on' runs")
    p.add_argument("--reps", type=int, default=3, help="runs of each variant, alternating")
    p.add_argument("--timeout-s", type=float, default=600)
    p.add_argument("--quick", action="store_true", help="F=26, batch 256, 10 steps, 1 rep; writes nothing")
    p.add_argument("--no-write", action="store_true", help="do not update RESULTS.md")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    if args.quick:
        args.fields, args.vocab, args.batch, args.steps, args.reps, args.eval_samples = 26, 1000, 256, 10, 1, 1024
    load_before = loadavg()
    gen_ms = generation_ms(args)
    runs: dict[str, list[dict[str, Any]]] = {"off": [], "on": []}
    started = time.strftime("%Y-%m-%d %H:%M")
    with tempfile.TemporaryDirectory(prefix="prefetch_bench_") as tmp:
        # untimed: the first packed lookup loads (or JIT-builds) the C++ ops inside train_rec's first step
        warm = run_once("warmup", args.depth, args, Path(tmp), steps=2)
        logger.info("warm-up run: process %.0f s", warm["wall_s"])
        for rep in range(args.reps):
            for name, depth in (("off", 0), ("on", args.depth)):
                r = run_once(f"{name}{rep}", depth, args, Path(tmp))
                runs[name].append(r)
                logger.info("rep %d %-3s %8.0f samples/s  (AUC %.4f, %d steps, process %.0f s, load %s)", rep, name,
                            r["samples_per_s"], r["auc"], r["steps"], r["wall_s"], loadavg())
    loop = loop_breakdown(args, args.reps)
    load_after = loadavg()
    med = {k: statistics.median(r["samples_per_s"] for r in v) for k, v in runs.items()}
    step_ms = {k: 1e3 * args.batch / m for k, m in med.items()}
    rows = [f"| {k} | {'0' if k == 'off' else args.depth} | {med[k]:,.0f} | "
            + ", ".join(f"{r['samples_per_s']:,.0f}" for r in v) + f" | {step_ms[k]:.0f} | "
            + ", ".join(f"{r['auc']:.4f}" for r in v) + " |" for k, v in runs.items()]
    lw = {k: statistics.median(w for w, _ in v) for k, v in loop.items()}
    lc = {k: statistics.median(c for _, c in v) for k, v in loop.items()}
    ratio = med["on"] / med["off"]
    same_auc = len({r["auc"] for v in runs.values() for r in v}) == 1
    argv = [f"--{k.replace('_', '-')} {getattr(args, k)}" for k in ("fields", "vocab", "batch", "steps", "depth", "reps")]
    cmd = ".venv/bin/python benchmarks/prefetch.py" + (" --quick" if args.quick else " " + " ".join(argv))
    text = "\n".join([
        SECTION,
        "",
        f"`{cmd}` ({started}, {os.cpu_count()} cores shared with other jobs; /proc/loadavg {load_before} before, "
        f"{load_after} after). Each run: `launch/train_rec.py` in a fresh process, 1 rank, `--threads 1`, "
        f"synthetic data F={args.fields}, {args.vocab:,} rows per field, micro-batch {args.batch}, {args.steps} steps, "
        f"picasso block with packed row-wise Adagrad tables and `interleave.prefetch_batches` 0 (off) or "
        f"{args.depth} (on); off and on alternate, {args.reps} run(s) each. samples/s is train_rec's (training loop, "
        f"batch generation included). Generating one batch alone on one thread takes {gen_ms:.0f} ms here.",
        "",
        "| prefetch | prefetch_batches | samples/s (median) | samples/s (each run) | ms per step (median) | AUC (each run) |",
        "|---|---|---|---|---|---|",
        *rows,
        "",
        f"on/off: **{ratio:.2f}x** samples/s; per step {step_ms['off'] - step_ms['on']:.0f} ms saved "
        f"of the {gen_ms:.0f} ms a batch takes to make alone. " + (
            "The AUC is the same in every run (same batches in the same order)." if same_auc else
            "**The AUCs differ between runs** (they should not: same batches in the same order)."),
        "",
        f"Where the time goes (`loop_breakdown`: the same model and stream in the benchmark's process, torch AdamW "
        f"instead of DeepSpeed, 15 steps per run, {args.reps} run(s) each, alternating; /proc/loadavg {load_after} "
        "at the end): ms per step waiting for the next batch + computing the step, median over runs.",
        "",
        "| prefetch | wait for the batch (ms) | compute (ms) | step (ms) | runs (wait + compute) |",
        "|---|---|---|---|---|",
        *[f"| {k} | {statistics.median(w for w, _ in v):.0f} | {statistics.median(c for _, c in v):.0f} | "
          f"{statistics.median(w + c for w, c in v):.0f} | " + ", ".join(f"{w:.0f} + {c:.0f}" for w, c in v) + " |"
          for k, v in loop.items()],
        "",
        "Reading: " + (
            f"prefetching pays here ({ratio:.2f}x). " if ratio > 1.05 else
            f"prefetching is slower here ({ratio:.2f}x). " if ratio < 0.95 else
            f"no measurable gain here ({ratio:.2f}x). ") +
        f"In the loop, the wait for the batch goes from {lw['off']:.0f} to {lw['on']:.0f} ms per step with "
        f"prefetching, and the compute from {lc['off']:.0f} to {lc['on']:.0f} ms: the producer thread takes the "
        "batch off the critical path, and whatever CPU it needs comes out of the step's when no core is idle "
        f"(1-minute load {load_before.split()[0]} on {os.cpu_count()} cores before the runs). Prefetching can only "
        "pay where a core is free while the step runs (a GPU host, or a CPU host with cores to spare), and by at "
        "most the batch's generation time.",
        "",
    ])
    logger.info("\n%s", text)
    if args.quick or args.no_write:
        return
    old = RESULTS.read_text() if RESULTS.exists() else "# Benchmark results\n"
    pattern = re.compile(re.escape(SECTION) + r".*?(?=\n## |\Z)", re.S)
    if pattern.search(old):
        new = pattern.sub(lambda _: text.rstrip() + "\n", old)
    else:  # first time: right after the interleaving section, whose loop this one completes
        after = re.search(re.escape(INTERLEAVE_SECTION) + r".*?(?=\n## |\Z)", old, re.S)
        at = after.end() if after else len(old)
        new = old[:at].rstrip() + "\n\n" + text.rstrip() + "\n" + ("\n" + old[at:].lstrip("\n") if old[at:] else "")
    RESULTS.write_text(new)
    logger.info("wrote %s", RESULTS)


if __name__ == "__main__":
    main()
