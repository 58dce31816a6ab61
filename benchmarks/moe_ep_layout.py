"""Paired A/B at expert parallelism: the received rows computed in peer blocks (now) against reordered expert-major.

``moe_proto.parallel.dispatch_to_experts`` returns the rows as they arrive, one block per peer, and
``GroupedExperts`` computes them there (``[W, L]`` counts) when the segments are long enough
(``GroupedExperts.min_block_rows``, default ffn // 2 rows on average; shorter ones it gathers
expert-major itself). Before, they were always reordered to
local-expert-major for the experts and back afterwards (two gathers forward, two backward). The
"reordered" arm puts those gathers back in front of the same experts
(``GroupedExperts``' own gather path, taken for every block layout), so the two arms differ in
exactly that.

Both arms run in the same ``ep`` gloo processes on the same layers and inputs, alternating every
repetition (which arm goes first alternates too), with a barrier before every step; a step's time
is the slower rank's, and the table gives medians. Same sizes as ``benchmarks/moe_layer.py``.

Run::

    .venv/bin/python benchmarks/moe_ep_layout.py --reps 14
    .venv/bin/python benchmarks/moe_ep_layout.py --modes "top-2 dropless" --reps 20
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import statistics
import time
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from moe_layer_kernels import _load_layer_bench  # a sibling script: benchmarks/ is this script's folder

from moe_proto import experts as experts_module


@contextlib.contextmanager
def reordered_blocks() -> Iterator[None]:
    """Inside: ``GroupedExperts`` gathers every block layout expert-major before its loop and back after (the old path)."""
    cls = experts_module.GroupedExperts
    in_place = cls._blocks_in_place
    cls._blocks_in_place = lambda self, counts: False
    try:
        yield
    finally:
        cls._blocks_in_place = in_place


def _worker(rank: int, world: int, cfg_fields: Dict[str, object], modes: Sequence[str], reps: int,
            warmup: int) -> Dict[Tuple[str, bool], List[Tuple[float, float]]]:
    """One rank: ``(wall s, thread CPU s)`` of our layer's step per (mode, reordered) and repetition."""
    import deepspeed
    import torch.distributed as dist

    bench = _load_layer_bench()
    cfg = bench.BenchConfig(**cfg_fields)  # sent as a dict: the ranks load moe_layer.py by path, not by name
    torch.set_num_threads(cfg.threads)
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    steps = {}
    for mode in bench.MODES:
        if mode.name in modes:
            variants, _ = bench.build_variants(cfg, mode, with_deepspeed=False, ep_size=world, rank=rank)
            steps[mode.name] = variants["ours"]
    times: Dict[Tuple[str, bool], List[Tuple[float, float]]] = {}
    for rep in range(warmup + reps):
        for reordered in ((True, False) if rep % 2 else (False, True)):
            with (reordered_blocks() if reordered else contextlib.nullcontext()):
                for name, step in steps.items():
                    dist.barrier()
                    wall0, cpu0 = time.perf_counter(), time.thread_time()
                    step()
                    if rep >= warmup:
                        times.setdefault((name, reordered), []).append(
                            (time.perf_counter() - wall0, time.thread_time() - cpu0))
    return times


def run(cfg, modes: Sequence[str], reps: int, ep: int = 2, warmup: int = 2,
        timeout_s: Optional[float] = None) -> List[Tuple[str, float, float, float, float]]:
    """``(mode, reordered wall, blocks wall, reordered CPU, blocks CPU)`` in seconds: medians of the slower rank."""
    from sparse_scale.multiproc import run_distributed

    if timeout_s is None:  # generous: a loaded 2-core machine runs these steps several times slower
        timeout_s = 120.0 + 10.0 * len(modes) * (reps + warmup)
    results = run_distributed(_worker, world_size=ep, args=(dataclasses.asdict(cfg), list(modes), reps, warmup),
                              timeout_s=timeout_s,
                              threads_per_rank=cfg.threads)
    rows = []
    for mode in modes:
        medians = []
        for which in (0, 1):  # wall, thread CPU
            for reordered in (True, False):
                per_rank = [[t[which] for t in r[(mode, reordered)]] for r in results]
                medians.append(statistics.median(max(step) for step in zip(*per_rank)))
        rows.append((mode, medians[0], medians[1], medians[2], medians[3]))
    return rows


def main(argv: Optional[Sequence[str]] = None) -> None:
    bench = _load_layer_bench()
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=14, help="pairs of steps per mode")
    parser.add_argument("--ep", type=int, default=2, help="expert-parallel ranks (gloo processes)")
    parser.add_argument("--modes", default="top-1,top-1 dropless,top-2,top-2 dropless")
    args = parser.parse_args(argv)
    if args.reps < 1 or args.ep < 2:
        parser.error(f"--reps must be >= 1 and --ep >= 2, got {args.reps} and {args.ep}")
    modes = [m.strip() for m in args.modes.split(",")]
    unknown = sorted(set(modes) - {m.name for m in bench.MODES})
    if unknown:
        parser.error(f"unknown modes {unknown}; known: {[m.name for m in bench.MODES]}")
    cfg = bench.BenchConfig()
    rows = run(cfg, modes, args.reps, ep=args.ep)
    print(f"S={cfg.tokens} per rank d={cfg.hidden} ffn={cfg.ffn} E={cfg.experts} cf={cfg.capacity_factor} "
          f"ep={args.ep} threads={cfg.threads} reps={args.reps} pairs (median of the slower rank, our layer's "
          "forward+backward)")
    print("| mode | reordered wall ms | blocks wall ms | saved | reordered CPU ms | blocks CPU ms |")
    print("|---|---:|---:|---:|---:|---:|")
    for mode, old_wall, new_wall, old_cpu, new_cpu in rows:
        print(f"| {mode} | {old_wall * 1e3:.1f} | {new_wall * 1e3:.1f} | {(old_wall - new_wall) / old_wall:.1%} "
              f"| {old_cpu * 1e3:.1f} | {new_cpu * 1e3:.1f} |")


if __name__ == "__main__":
    main()
