"""The layer's input gradient: the dispatch's gather and the router's term in one C++ pass, against two passes.

x's gradient is ``gather-sum of the buffer gradient (per token, over its kept routes) + grad_logits @ w``.
"two passes" is what the layer ran before ``moe_proto.dispatch.DispatchGradHandoff``: ``embedding_bag`` writes
the gather-sum to a new ``[S, d]`` tensor and ``add_router_input_grad`` reads it back to add the router's
term. "one pass" is ``add_router_input_grad`` with ``route_row``/``route_offsets``, gathering the buffer rows
itself. Both arms alternate (which goes first alternates too), one thread; before every call a 64 MB buffer
is written so that the operands come from memory, as in the layer's backward after the experts' (cold). The
table gives each arm's median wall time and checks that the two outputs agree.

Run::

    .venv/bin/python benchmarks/moe_router_grad.py                 # S=4096, d=256, E=16, top-1 and top-2 routes
    .venv/bin/python benchmarks/moe_router_grad.py --reps 60 --routes 1
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from moe_proto.ops import load_cpu_ops

EVICT_BYTES = 64 << 20  # larger than this machine's L2 and our share of its L3 (the point is cold operands)


def make_inputs(tokens: int, hidden: int, experts: int, routes: int, seed: int = 0) -> Dict[str, torch.Tensor]:
    """A dispatch as the layer has it: every token's ``routes`` rows at random places of the buffer."""
    gen = torch.Generator().manual_seed(seed)
    rows = tokens * routes
    return {
        "buffer_grad": torch.randn(rows, hidden, generator=gen),
        "grad_logits": torch.randn(tokens, experts, generator=gen),
        "w": torch.randn(experts, hidden, generator=gen),
        "route_row": torch.randperm(rows, generator=gen),
        "route_offsets": torch.arange(tokens) * routes,
    }


def arms(ops: object, inp: Dict[str, torch.Tensor]) -> Dict[str, Callable[[], torch.Tensor]]:
    tokens, hidden = inp["grad_logits"].shape[0], inp["w"].shape[1]
    out_two, out_one = torch.empty(tokens, hidden), torch.empty(tokens, hidden)

    def two_passes() -> torch.Tensor:
        gathered = F.embedding_bag(inp["route_row"], inp["buffer_grad"], inp["route_offsets"], mode="sum")
        ops.add_router_input_grad(gathered, inp["grad_logits"], inp["w"], out_two)
        return out_two

    def one_pass() -> torch.Tensor:
        ops.add_router_input_grad(inp["buffer_grad"], inp["grad_logits"], inp["w"], out_one, inp["route_row"],
                                  inp["route_offsets"])
        return out_one

    return {"two passes": two_passes, "one pass": one_pass}


def run(tokens: int, hidden: int, experts: int, routes: int, reps: int,
        evict_bytes: int = EVICT_BYTES) -> Tuple[float, float, float]:
    """``(two passes s, one pass s, max |difference|)``: medians over ``reps`` alternating pairs."""
    ops = load_cpu_ops()
    if ops is None:
        raise RuntimeError("moe_proto's C++ ops did not build here (see the warning above): nothing to time")
    inp = make_inputs(tokens, hidden, experts, routes)
    steps = arms(ops, inp)
    evict = torch.empty(evict_bytes // 4)
    times: Dict[str, List[float]] = {name: [] for name in steps}
    for rep in range(reps):
        for name in (list(steps) if rep % 2 else list(steps)[::-1]):
            evict.fill_(rep)
            start = time.perf_counter()
            steps[name]()
            times[name].append(time.perf_counter() - start)
    difference = float((steps["two passes"]() - steps["one pass"]()).abs().max())
    return statistics.median(times["two passes"]), statistics.median(times["one pass"]), difference


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--routes", default="1,2", help="kept routes per token, comma-separated")
    parser.add_argument("--reps", type=int, default=30, help="alternating pairs")
    args = parser.parse_args(argv)
    routes = [int(r) for r in args.routes.split(",")]
    for name, value in (("--tokens", args.tokens), ("--hidden", args.hidden), ("--experts", args.experts),
                        ("--reps", args.reps), ("--routes", min(routes))):
        if value < 1:
            parser.error(f"{name} must be >= 1, got {value}")
    torch.set_num_threads(1)
    print(f"S={args.tokens} d={args.hidden} E={args.experts} reps={args.reps} pairs, one thread, "
          f"{EVICT_BYTES >> 20} MB written before every call; torch {torch.__version__}")
    print("| routes per token | two passes ms | one pass ms | one / two | max abs difference |")
    print("|---:|---:|---:|---:|---:|")
    for k in routes:
        two, one, diff = run(args.tokens, args.hidden, args.experts, k, args.reps)
        print(f"| {k} | {two * 1e3:.3f} | {one * 1e3:.3f} | {one / two:.2f} | {diff:.1e} |")


if __name__ == "__main__":
    main()
