"""Interleaving benchmark (issue 4 item 6): samples/s of a packed wide-and-deep, plain steps vs interleaved micro-batches.

Trains ``packed_wide_and_deep`` (F=200 fields, D=16, row-wise Adagrad tables,
torch SGD with momentum for the dense layers) on the synthetic CTR stream,
batch 4096:

* ``plain``: no interleaving: load the batch, forward, backward, dense step,
  sparse step, one after another on the main thread;
* ``plain, N threads``: the same with torch's intra-op threads set to the
  machine's N cores for its steps (the fair baseline when the interleaved
  stages may use every core);
* ``interleaved n``: :class:`InterleavedTrainer` with ``micro_batches = n``
  (n = 1, 2, 4): split / lookup / dense / sparse stage threads, the next
  batch loading on its own thread.

Methods run round-robin (one repetition of each, then the next repetition) so
machine load drifts hit them alike; each repetition is ``--steps`` timed
steps after ``--warmup`` untimed ones, on fresh batches of one stream per
method (same data for every method). Reported: median and IQR of samples/s
over repetitions. The Chrome trace of the last ``interleaved 4`` repetition
goes to ``benchmarks/interleave_trace.json`` (open in chrome://tracing or
https://ui.perfetto.dev).

Run::

    .venv/bin/python benchmarks/interleave.py            # ~4 minutes on 2 busy cores, writes RESULTS.md
    .venv/bin/python benchmarks/interleave.py --quick    # small, writes neither RESULTS.md nor the trace
"""
from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Iterator

import torch
import torch.nn.functional as F

from picasso_ops.data import SyntheticConfig, SyntheticCTRStream
from picasso_ops.distributed import sparse_step
from picasso_ops.interleave import InterleavedTrainer, Timeline
from picasso_ops.models import SparseArgs, WideAndDeep, WideAndDeepArgs, packed_wide_and_deep

logger = logging.getLogger("benchmarks.interleave")
SECTION = "## Interleaving (issue 4 item 6)"
HERE = Path(__file__).resolve().parent


def build(fields: int, vocab: int, dim: int) -> tuple[WideAndDeep, torch.optim.Optimizer]:
    """The model and its dense optimizer; same seed, so every method starts from the same weights."""
    torch.manual_seed(0)
    model = packed_wide_and_deep(
        WideAndDeepArgs(vocab_sizes=[vocab] * fields, num_dense=13, embedding_dim=dim),
        SparseArgs(optimizer="rowwise_adagrad", optimizer_params={"lr": 0.05}),
    )
    return model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)


def plain_runner(model: WideAndDeep, opt: torch.optim.Optimizer) -> Callable[[Iterator, int], None]:
    """``run(batches, steps)``: the non-interleaved loop."""

    def run(batches: Iterator, steps: int, threads: int | None = None) -> None:
        before = torch.get_num_threads()
        if threads is not None:
            torch.set_num_threads(threads)
        try:
            _steps(batches, steps)
        finally:
            torch.set_num_threads(before)

    def _steps(batches: Iterator, steps: int) -> None:
        for _ in range(steps):
            b = next(batches)
            loss = F.binary_cross_entropy_with_logits(model(b.dense, b.values, b.lengths), b.labels.float())
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sparse_step(model)

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fields", type=int, default=200)
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=10_000, help="rows per field table")
    parser.add_argument("--batch", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per repetition")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--reps", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (every method)")
    parser.add_argument("--quick", action="store_true", help="F=26, batch 512, 2 reps, no RESULTS.md")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    if args.quick:
        args.fields, args.batch, args.reps, args.vocab = 26, 512, 2, 2000
    torch.set_num_threads(args.threads)
    cfg = SyntheticConfig(num_fields=args.fields, vocab_sizes=args.vocab, num_dense=13, seed=11,
                          zipf_exponent=1.1, max_ids_per_field=3)
    cores = os.cpu_count() or 1
    all_cores = f"plain, {cores} threads"
    methods = ["plain", *([all_cores] if cores != args.threads else []), "interleaved 1", "interleaved 2",
               "interleaved 4"]
    runners: dict[str, Callable[[Iterator, int], None]] = {}
    streams: dict[str, Iterator] = {}
    trainers: list[InterleavedTrainer] = []
    timeline = Timeline()
    for name in methods:
        model, opt = build(args.fields, args.vocab, args.dim)
        streams[name] = iter(SyntheticCTRStream(cfg, args.batch))
        if name == "plain":
            runners[name] = plain_runner(model, opt)
            continue
        if name == all_cores:
            run = plain_runner(model, opt)
            runners[name] = lambda batches, steps, r=run: r(batches, steps, threads=cores)  # type: ignore[misc]
            continue
        n = int(name.split()[1])
        trainer = InterleavedTrainer(model, opt, micro_batches=n, timeout_s=600,
                                     timeline=timeline if n == 4 else None)
        trainers.append(trainer)
        runners[name] = lambda batches, steps, t=trainer: t.train(batches, steps)  # type: ignore[misc]
    rates: dict[str, list[float]] = {m: [] for m in methods}
    load_before = os.getloadavg()[0]
    overlap_s = wall_s = 0.0
    per_stage: dict[str, list[float]] = {}
    try:
        for name in methods:  # warm-up: allocator, first-touch of tables and optimizer state
            runners[name](streams[name], args.warmup)
        for rep in range(args.reps):
            for name in methods:
                if name == "interleaved 4":
                    timeline.clear()
                t0 = time.perf_counter()
                runners[name](streams[name], args.steps)
                dt = time.perf_counter() - t0
                rates[name].append(args.steps * args.batch / dt)
                logger.info("rep %d %-14s %8.0f samples/s", rep, name, rates[name][-1])
        overlap_s = timeline.overlap_seconds()
        spans = timeline.spans()
        wall_s = max(s.end_s for s in spans) - min(s.start_s for s in spans)
        per_stage.clear()
        for s in spans:
            per_stage.setdefault(s.stage, []).append(s.duration_s * 1e3)
        if not args.quick:
            timeline.write_chrome_trace(HERE / "interleave_trace.json")
    finally:
        for t in trainers:
            t.close()

    load_after = os.getloadavg()[0]
    medians = {name: statistics.median(rates[name]) for name in methods}
    base = medians["plain"]
    best_plain = max(medians[m] for m in methods if m.startswith("plain"))
    rows = []
    for name in methods:
        r = sorted(rates[name])
        q = statistics.quantiles(r, n=4) if len(r) >= 2 else [r[0], r[0], r[0]]
        rows.append(f"| {name} | {medians[name]:,.0f} | {q[0]:,.0f} - {q[2]:,.0f} | {medians[name] / base:.2f}x "
                    f"| {medians[name] / best_plain:.2f}x |")
    best = max((m for m in methods if m.startswith("interleaved")), key=medians.__getitem__)
    cmd = " ".join([".venv/bin/python benchmarks/interleave.py", *sys.argv[1:]])
    text = "\n".join([
        f"`{cmd}` ({cores} cores, torch {torch.__version__}, {args.threads} intra-op thread(s) per thread "
        f"unless the method says; 1-minute load average {load_before:.1f} before the timed reps, "
        f"{load_after:.1f} after).",
        f"Packed wide-and-deep, F={args.fields}, D={args.dim}, {args.vocab:,} rows per field, batch {args.batch}, "
        f"row-wise Adagrad tables, SGD-momentum dense; {args.reps} round-robin repetitions x {args.steps} steps "
        f"(after {args.warmup} warm-up step), median and IQR of samples/s.",
        "",
        "| method | samples/s (median) | IQR | vs plain | vs the faster plain |",
        "|---|---|---|---|---|",
        *rows,
        "",
        f"Timeline of the last `interleaved 4` repetition: `benchmarks/interleave_trace.json` "
        f"(chrome://tracing / Perfetto): {wall_s:.1f} s wall clock, of which {overlap_s:.1f} s had stages of two "
        f"or more micro-batches (or the next batch's load) running at once. Mean span per stage (ms): "
        + ", ".join(f"{k} {statistics.mean(v):.0f}" for k, v in per_stage.items()) + ".",
        "",
        f"Best interleaved ({best}) vs the faster plain loop: **{medians[best] / best_plain:.2f}x**.",
        "",
    ])
    logger.info("\n%s", text)
    if not args.quick:
        from embedding import write_section  # benchmarks/embedding.py: dated runs under one heading

        write_section(HERE / "RESULTS.md", SECTION, text,
                      title=f"{time.strftime('%Y-%m-%d %H:%M')}, benchmarks/interleave.py")
        logger.info("wrote %s", HERE / "RESULTS.md")


if __name__ == "__main__":
    main()
