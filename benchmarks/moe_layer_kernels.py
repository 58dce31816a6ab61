"""Paired A/B of the MoE layer's non-expert C++ kernels (issue 14 item 3): on against the torch paths they replaced.

The kernels: the top-1 choice and the capacity slots (``moe_proto/csrc/route_slots.cpp``), the
router's input gradient and the dispatch's in one pass (``router_grad.cpp``, with the router's view of
``x`` that lets one node receive both gradients, and the ``DispatchGradHandoff`` that leaves the
dispatch's gather to that pass) and the combine's two gradients in one pass
(``combine_grad.cpp``). "Torch paths" turns exactly those off (the routing functions' and the
combine's torch expressions, ``x`` dispatched itself); the expert FFN stays in C++ in both arms.

Why a separate script: ``benchmarks/moe_layer.py`` compares layers across runs, and its ratios move
by several percent between runs on a shared machine (the ideal alone moved 47-52k tok/s in an
hour), more than these kernels change. Here both arms run in one process on the same layers and
inputs, alternating every repetition (which arm goes first alternates too), with every other
variant of ``moe_layer.py`` (the ideal, experts only) in between as in that benchmark; the table
gives each arm's median thread CPU time of our layer's forward + backward.

Run::

    .venv/bin/python benchmarks/moe_layer_kernels.py --reps 14
    .venv/bin/python benchmarks/moe_layer_kernels.py --modes top-1,top-2 --reps 22
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import statistics
import sys
import time
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from moe_proto import dispatch, router, routing


def _load_layer_bench():
    # benchmarks/ is a folder of scripts: load moe_layer.py by path for its variants and sizes.
    if "moe_layer_bench" in sys.modules:
        return sys.modules["moe_layer_bench"]
    path = Path(__file__).resolve().parent / "moe_layer.py"
    spec = importlib.util.spec_from_file_location("moe_layer_bench", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve the module's annotations through sys.modules
    spec.loader.exec_module(module)
    return module


@contextlib.contextmanager
def torch_paths() -> Iterator[None]:
    """Inside: the layer's non-expert C++ kernels are off (their callers see no library), ``x`` is dispatched itself."""
    route = router.Router.route

    def route_without_alias(self, x, used_token=None, sequence_length=None):
        return router.RouterOutput(route(self, x, used_token, sequence_length).record, x, None)

    saved = (router.cpu_ops_for, dispatch.cpu_ops_for, routing.load_cpu_ops)
    router.Router.route = route_without_alias
    router.cpu_ops_for = dispatch.cpu_ops_for = lambda *tensors: None
    routing.load_cpu_ops = lambda: None
    try:
        yield
    finally:
        router.Router.route = route
        router.cpu_ops_for, dispatch.cpu_ops_for, routing.load_cpu_ops = saved


def run(cfg, modes: Sequence[str], reps: int, warmup: int = 2) -> List[Tuple[str, float, float]]:
    """``(mode, torch paths s, C++ kernels s)`` per mode: medians of our layer's step over ``reps`` pairs."""
    bench = _load_layer_bench()
    torch.set_num_threads(cfg.threads)
    steps: Dict[str, object] = {}
    for mode in bench.MODES:
        if mode.name in modes:
            variants, _ = bench.build_variants(cfg, mode, with_deepspeed=False)
            steps.update({f"{mode.name}|{name}": step for name, step in variants.items()})
    times: Dict[Tuple[str, bool], List[float]] = {}
    for rep in range(warmup + reps):
        for kernels in ((True, False) if rep % 2 else (False, True)):
            with (contextlib.nullcontext() if kernels else torch_paths()):
                for name, step in steps.items():
                    start = time.thread_time()
                    step()
                    if rep >= warmup and name.endswith("|ours"):
                        times.setdefault((name[:-len("|ours")], kernels), []).append(time.thread_time() - start)
    return [(mode, statistics.median(times[(mode, False)]), statistics.median(times[(mode, True)]))
            for mode in modes]


def main(argv: Optional[Sequence[str]] = None) -> None:
    bench = _load_layer_bench()
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=14, help="pairs of steps per variant")
    parser.add_argument("--modes", default=",".join(m.name for m in bench.MODES))
    args = parser.parse_args(argv)
    if args.reps < 1:
        parser.error(f"--reps must be >= 1, got {args.reps}")
    modes = [m.strip() for m in args.modes.split(",")]
    unknown = sorted(set(modes) - {m.name for m in bench.MODES})
    if unknown:
        parser.error(f"unknown modes {unknown}; known: {[m.name for m in bench.MODES]}")
    cfg = bench.BenchConfig()
    rows = run(cfg, modes, args.reps)
    print(f"S={cfg.tokens} d={cfg.hidden} ffn={cfg.ffn} E={cfg.experts} cf={cfg.capacity_factor} threads={cfg.threads} "
          f"reps={args.reps} pairs (one process, median thread CPU time of our layer's forward+backward)")
    print("| mode | torch paths ms | C++ kernels ms | saved ms | saved |")
    print("|---|---:|---:|---:|---:|")
    for mode, off, on in rows:
        print(f"| {mode} | {off * 1e3:.2f} | {on * 1e3:.2f} | {(off - on) * 1e3:.2f} | {(off - on) / off:.1%} |")


if __name__ == "__main__":
    main()
