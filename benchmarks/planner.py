"""The sharding planner's choice against replicating every table and sharding every table row-wise.

The packed tables alone (no dense model) on 2 gloo ranks, 1 torch thread each: per step one
forward of a rank's batch, a backward of a fixed linear loss and the sparse step (the gradients'
exchange and the optimizer, row-wise Adagrad). Three shapes (F fields x rows, dim 16, batch 256 per
rank, 1-3 ids per field and sample, Zipf(1.1) ids as the synthetic stream draws them):
F=26 x 100,000, F=200 x 10,000, F=1,000 x 1,000. Variants ``data_parallel``, ``row_wise`` and
``auto`` (the planner's plan with its default constants and the Zipf estimate of unique ids) run
alternated inside each launch, the order rotated per round; ms/step is the median over rounds of
each round's mean over the timed steps (range shown).

Run::

    .venv/bin/python benchmarks/planner.py                      # 3 rounds, writes a RESULTS.md section
    .venv/bin/python benchmarks/planner.py --rounds 1 --steps 5 --no-write   # a quick look
"""
from __future__ import annotations

import argparse
import os
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"
SHAPES = [(26, 100_000), (200, 10_000), (1000, 1_000)]
DIM, BATCH, MAX_IDS, ZIPF = 16, 256, 3, 1.1
VARIANTS = ("data_parallel", "row_wise", "auto")


def zipf_ids(n: int, rows: int, generator: Any) -> Any:
    """``n`` Zipf(``ZIPF``) row ids in ``[0, rows)``: inverse transform of the continuous approximation, clipped."""
    import torch

    u = torch.rand(n, generator=generator, dtype=torch.float64)
    return (((1 - u) ** (-1.0 / (ZIPF - 1.0))).clamp(max=rows).long() - 1).clamp(0, rows - 1)


def _batch(step: int, rank: int, fields: int, rows: int) -> Any:
    import torch

    from picasso_ops.jagged import JaggedBatch

    g = torch.Generator().manual_seed(1_000_003 * step + rank)
    lengths = torch.randint(1, MAX_IDS + 1, (fields, BATCH), generator=g)
    ids = zipf_ids(int(lengths.sum()), rows, g)
    return JaggedBatch(tuple(f"f{i}" for i in range(fields)), ids, lengths, validate=False)


def _collection(variant: str, fields: int, rows: int, world: int) -> tuple[Any, Any]:
    from picasso_ops.distributed import DataParallelEmbeddingCollection, RowShardedEmbeddingCollection
    from picasso_ops.distributed.mixed import MixedEmbeddingCollection
    from picasso_ops.distributed.planner import expected_unique_ids, plan_tables
    from picasso_ops.embedding import TableSpec

    specs = [TableSpec(f"t{i}", rows, DIM, "sum", "rowwise_adagrad", {"lr": 0.05}, feature_names=(f"f{i}",))
             for i in range(fields)]
    if variant == "data_parallel":
        return DataParallelEmbeddingCollection(specs), None
    if variant == "row_wise":
        return RowShardedEmbeddingCollection(specs), None
    unique = expected_unique_ids(rows, BATCH * (1 + MAX_IDS) / 2, zipf_exponent=ZIPF)
    plan = plan_tables(specs, world_size=world, batch_size=BATCH, unique_ids={s.name: unique for s in specs})
    if plan.uniform is not None:  # as sparse_scale.planned_tables builds a uniform plan: the one class
        return _collection(plan.uniform, fields, rows, world)[0], plan
    return MixedEmbeddingCollection(specs, plan), plan


def _rank(rank: int, world: int, fields: int, rows: int, steps: int, round_: int) -> dict[str, Any]:
    import torch

    from picasso_ops.distributed import sparse_step

    torch.set_num_threads(1)
    order = VARIANTS[round_ % 3:] + VARIANTS[:round_ % 3]
    out: dict[str, Any] = {}
    batches = [_batch(s, rank, fields, rows) for s in range(steps + 2)]
    target = torch.randn(fields * DIM, generator=torch.Generator().manual_seed(5))
    for variant in order:
        torch.manual_seed(0)
        emb, plan = _collection(variant, fields, rows, world)
        if plan is not None:
            out["auto_plan"] = {p: len(plan.names(p)) for p in ("data_parallel", "row_wise")}
            out["auto_why"] = plan.tables[0].why
        torch.distributed.barrier()
        for i, b in enumerate(batches):
            if i == 2:  # two warm-up steps
                torch.distributed.barrier()
                start = time.perf_counter()
            (emb(b).values @ target).mean().backward()
            sparse_step(emb)
        torch.distributed.barrier()
        out[variant] = (time.perf_counter() - start) / steps * 1e3
        del emb
    return out


def rounds_args(description: str, steps: int, shapes: list[str]) -> argparse.Namespace:
    """The flags of a benchmark that alternates its variants over rounds at FIELDSxROWS shapes."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=steps)
    p.add_argument("--shapes", nargs="+", default=shapes, help="FIELDSxROWS, e.g. 26x100000")
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args()
    args.shapes = [tuple(int(x) for x in shape.split("x")) for shape in args.shapes]
    return args


def main() -> None:
    args = rounds_args(__doc__.splitlines()[0], 20, [f"{f}x{r}" for f, r in SHAPES])
    from sparse_scale.multiproc import run_distributed

    load_before = os.getloadavg()
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    rows_out = []
    for fields, rows in args.shapes:
        per: dict[str, list[float]] = {v: [] for v in VARIANTS}
        plan = why = None
        for r in range(args.rounds):
            got = run_distributed(_rank, 2, args=(fields, rows, args.steps, r), timeout_s=600)
            for v in VARIANTS:
                per[v].append(max(g[v] for g in got))  # the slower rank sets the step
            plan, why = got[0]["auto_plan"], got[0]["auto_why"]
        med = {v: statistics.median(per[v]) for v in VARIANTS}
        line = (f"| {fields} x {rows:,} | " + " | ".join(
            f"{med[v]:.2f} ({min(per[v]):.2f}-{max(per[v]):.2f})" for v in VARIANTS)
            + f" | {plan['data_parallel']} dp / {plan['row_wise']} rw: {why} | "
            f"{med['data_parallel'] / med['row_wise']:.2f}x |")
        print(line, flush=True)
        rows_out.append(line)
    report(f"Sharding planner: tables alone, data-parallel vs row-wise vs auto ({started})", "planner.py", load_before,
           "2 gloo ranks x 1 thread. Dim 16, batch 256 per rank, 1-3 "
           f"Zipf(1.1) ids per field, row-wise Adagrad; forward + backward + sparse step of the tables only; "
           f"{args.rounds} rounds of {args.steps} steps, variants alternated; ms/step median (range over rounds), the "
           "slower rank.",
           ["F x rows", "data_parallel", "row_wise", "auto", "auto's plan (why, first table)",
            "dp ms / rw ms (> 1: rw faster)"], rows_out, write=not args.no_write)


def report(heading: str, script: str, load_before: tuple[float, ...], setup: str, columns: list[str],
           rows: list[str], *, write: bool) -> None:
    """Print a RESULTS.md section (heading, the command, machine and load, ``setup``, the table) and append it."""
    command = f".venv/bin/python benchmarks/{script} " + shlex.join(sys.argv[1:])
    text = "\n".join([
        f"\n## {heading}\n",
        f"Command: `{command.strip()}`; {platform.processor() or platform.machine()}, {os.cpu_count()} cores; load "
        f"average {load_before[0]:.1f} before, {os.getloadavg()[0]:.1f} after. {setup}\n",
        "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns), *rows, ""])
    print(text)
    if write:
        with RESULTS.open("a") as f:
            f.write(text)

if __name__ == "__main__":
    main()
