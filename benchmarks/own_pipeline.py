"""An own training loop with ``engine.pipeline(batches)`` against the same loop without it.

What a user writes (examples/dlrm_kjt.py's shape): tables from ``sparse_scale.tables_from_block``
(row-wise, F fields x rows, dim 16, row-wise Adagrad), a DLRM-like dense part (bottom 13-64-16, dot
interactions, top 128-64-1, AdamW under DeepSpeed ZeRO 0), a generator of batches (1-3 Zipf(1.1) ids
per field and sample, 256 samples per rank) and ``loss; engine.backward; engine.step``. Two
variants differ only in ``picasso.pipeline`` (``"row_wise"`` vs ``"off"``, where ``engine.pipeline``
hands the batches back), a third has data-parallel tables; they run alternated inside each 2-rank launch (the order rotated per round), each
from the same initial weights and batches; samples/s over the timed steps, the slower rank.

Run::

    .venv/bin/python benchmarks/own_pipeline.py                     # 3 rounds, writes a RESULTS.md section
    .venv/bin/python benchmarks/own_pipeline.py --rounds 1 --steps 10 --no-write
"""
from __future__ import annotations

import os
import statistics
import time
from typing import Any, Iterator

from planner import BATCH, DIM, MAX_IDS, ZIPF, report, rounds_args, zipf_ids  # benchmarks/planner.py beside it: the same ids

DENSE = 13
VARIANTS = ("row_wise", "off", "data_parallel")  # picasso.pipeline on / off (row-wise tables); replicated tables
WARMUP = 5


def _batches(steps: int, rank: int, fields: int, rows: int) -> Iterator[tuple[Any, ...]]:
    """``(dense, values, lengths [F, B], labels)`` per step, drawn when the loop (or the pipeline) reads it."""
    import torch

    for step in range(steps):
        g = torch.Generator().manual_seed(1_000_003 * step + rank)
        lengths = torch.randint(1, MAX_IDS + 1, (fields, BATCH), generator=g)
        values = zipf_ids(int(lengths.sum()), rows, g)
        dense = torch.randn(BATCH, DENSE, generator=g)
        yield dense, values, lengths, (dense[:, 0] > 0).float()


def _model(tables: Any, fields: int) -> Any:
    import torch
    from torch import nn

    class OwnDLRM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tables = tables
            self.bottom = nn.Sequential(nn.Linear(DENSE, 64), nn.ReLU(), nn.Linear(64, DIM))
            pairs = (fields + 1) * fields // 2
            self.top = nn.Sequential(nn.Linear(DIM + pairs, 128), nn.ReLU(), nn.Linear(128, 64), nn.ReLU(),
                                     nn.Linear(64, 1))
            self.register_buffer("pairs", torch.triu_indices(fields + 1, fields + 1, offset=1), persistent=False)

        def forward(self, dense, values, lengths):
            x = self.bottom(dense)
            feats = torch.cat([x.unsqueeze(1), self.tables(values, lengths)], dim=1)
            dots = feats @ feats.transpose(1, 2)
            return self.top(torch.cat([x, dots[:, self.pairs[0], self.pairs[1]]], dim=1)).squeeze(-1)

    return OwnDLRM()


def _rank(rank: int, world: int, fields: int, rows: int, steps: int, round_: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    import sparse_scale

    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    for mode in VARIANTS[round_ % 3:] + VARIANTS[:round_ % 3]:
        config = {"train_micro_batch_size_per_gpu": BATCH, "steps_per_print": 10**6,
                  "optimizer": {"type": "AdamW", "params": {"lr": 0.001, "torch_adam": True}},
                  "zero_optimization": {"stage": 0},
                  "picasso": {"embedding_dim": DIM, "sharding": "data_parallel" if mode == "data_parallel" else "row_wise",
                              "pipeline": "off" if mode == "data_parallel" else mode,
                              "optimizer": {"type": "rowwise_adagrad", "lr": 0.05}}}
        torch.manual_seed(0)
        tables = sparse_scale.tables_from_block(config, [rows] * fields)
        engine, *_ = sparse_scale.initialize(model=_model(tables, fields), config=config, threads=1)
        loader = engine.pipeline(_batches(steps + WARMUP, rank, fields, rows), ids=lambda b: (b[1], b[2]))
        dist.barrier()
        losses = []
        for i, (dense, values, lengths, labels) in enumerate(loader):
            if i == WARMUP:
                dist.barrier()
                start = time.perf_counter()
            loss = F.binary_cross_entropy_with_logits(engine(dense, values, lengths), labels)
            engine.backward(loss)
            engine.step()
            losses.append(float(loss.detach()))
        dist.barrier()
        out[mode] = steps * BATCH * world / (time.perf_counter() - start)
        out[f"{mode}_loss"] = losses[-1]
        out[f"{mode}_read_ahead"] = loader.stats["rounds"] if hasattr(loader, "stats") else 0
        engine.close()
    return out


def main() -> None:
    args = rounds_args(__doc__.splitlines()[0], 200, ["26x100000"])
    from sparse_scale.multiproc import run_distributed

    load_before = os.getloadavg()
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    lines = []
    for fields, rows in args.shapes:
        per: dict[str, list[float]] = {v: [] for v in VARIANTS}
        same = True
        for r in range(args.rounds):
            got = run_distributed(_rank, 2, args=(fields, rows, args.steps, r), timeout_s=900)
            for v in VARIANTS:
                per[v].append(min(g[v] for g in got))  # the slower rank sets the pace
            same &= all(g["row_wise_loss"] == g["off_loss"] for g in got)
            ahead = got[0]["row_wise_read_ahead"]
        med = {v: statistics.median(per[v]) for v in VARIANTS}
        ratios = sorted(a / b for a, b in zip(per["row_wise"], per["off"]))
        dp = sorted(a / b for a, b in zip(per["off"], per["data_parallel"]))
        lines.append(f"| {fields} x {rows:,} | " + " | ".join(
            f"{med[v]:,.0f} ({min(per[v]):,.0f}-{max(per[v]):,.0f})" for v in VARIANTS)
            + f" | {statistics.median(ratios):.2f}x ({ratios[0]:.2f}-{ratios[-1]:.2f}) | "
            f"{statistics.median(dp):.2f}x ({dp[0]:.2f}-{dp[-1]:.2f}) | {ahead} | "
            f"{'equal' if same else 'DIFFER'} |")
        print(lines[-1], flush=True)
    report(f"engine.pipeline in an own loop: on against off ({started})", "own_pipeline.py", load_before,
           f"2 gloo ranks x 1 torch thread. Row-wise tables, dim {DIM}, batch {BATCH} per rank, 1-{MAX_IDS} "
           f"Zipf({ZIPF}) ids per field, the user's DLRM-like loop (module docstring); {args.rounds} rounds of "
           f"{args.steps} timed steps after {WARMUP}, variants alternated; samples/s median (range over rounds), the "
           "slower rank; ratio paired per round.",
           ["F x rows", "row-wise, engine.pipeline on", "row-wise, off", "data-parallel", "on / off, paired",
            "row-wise off / data-parallel, paired", "batches read ahead (on)", "last loss on = off"], lines,
           write=not args.no_write)

if __name__ == "__main__":
    main()
