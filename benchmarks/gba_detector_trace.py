"""Record the step times auto mode's detector sees, on real processes, with CPU-bound competitors.

Runs a sync-phase GBA job (2 workers + 1 server, gloo on 127.0.0.1) of a compute-bound MLP while
``--hogs`` processes spin on the CPU, and writes every worker's own step time per step (the engine's
whole-step clock, ``gba_engine/step_clock.py``: wall minus waits on peers) to a JSON file that
``benchmarks/gba_sim.py --detector --trace FILE`` replays through the detector's settings.

    .venv/bin/python benchmarks/gba_detector_trace.py --steps 600 --hogs 2 --out runs/detector_trace.json
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import time
from pathlib import Path
from typing import List, Optional


def spin(stop_at: float) -> None:
    """A CPU-bound competitor: busy arithmetic until ``stop_at`` (time.time())."""
    x = 0
    while time.time() < stop_at:
        for i in range(100_000):
            x += i * i


def start_hogs(n: int, seconds: float) -> list:
    """``n`` spinning processes for at most ``seconds`` (each stops by itself)."""
    procs = [mp.get_context("spawn").Process(target=spin, args=(time.time() + seconds,), daemon=True)
             for _ in range(n)]
    for p in procs:
        p.start()
    return procs


def _record(rank: int, world_size: int, steps: int, width: int, batch: int) -> Optional[List[float]]:
    import torch
    import torch.nn.functional as F
    from torch import nn

    import gba_engine

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 1))
    cfg = {"train_micro_batch_size_per_gpu": batch, "gradient_accumulation_steps": 1,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
           "zero_optimization": {"stage": 0}, "steps_per_print": 10 ** 6, "gradient_clipping": 0.0,
           "gba": {"mode": "sync", "num_servers": 1, "timeout_s": 60, "heartbeat_s": 1.0}}
    engine = gba_engine.initialize(model=model, config=cfg)
    if engine.is_server:
        return None
    times, seen = [], 0.0
    g = torch.Generator().manual_seed(rank)
    for _ in range(steps):
        x = torch.randn(batch, 64, generator=g)
        loss = F.mse_loss(engine(x), x[:, :1])
        engine.backward(loss)
        engine.step()
        times.append(engine.observer.seconds - seen)  # this step's own time (the detector's input)
        seen = engine.observer.seconds
    engine.close()
    return times


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--hogs", type=int, default=2, help="CPU-bound processes competing for the cores")
    p.add_argument("--width", type=int, default=384, help="hidden width of the MLP (its compute per step)")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--out", default="runs/detector_trace.json")
    p.add_argument("--timeout-s", type=float, default=600.0)
    args = p.parse_args(argv)
    from sparse_scale.multiproc import run_distributed

    hogs = start_hogs(args.hogs, args.timeout_s)
    t0 = time.perf_counter()
    try:
        res = run_distributed(_record, world_size=3, args=(args.steps, args.width, args.batch),
                              timeout_s=args.timeout_s)
    finally:
        for h in hogs:
            h.terminate()
    rows = [list(r) for r in zip(res[0], res[1])]
    load = os.getloadavg()[0]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"hogs": args.hogs, "load1": load, "steps": args.steps, "rows": rows}))
    med = sorted(t for r in rows for t in r)[len(rows)]
    print(f"{len(rows)} steps of 2 workers with {args.hogs} CPU hogs (load {load:.1f}), median step {med * 1e3:.1f} ms, "
          f"{time.perf_counter() - t0:.0f} s -> {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
