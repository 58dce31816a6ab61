"""MoE layer benchmark (issue 3 item 9): moe_proto.MoE against deepspeed.moe.layer.MoE and the ideal.

One process, one intra-op thread (``torch.set_num_threads(1)``), forward + backward of
one MoE layer over S tokens, in every routing mode:

* top-1, top-2 and expert prototyping P=2 (top-1 in each of 2 groups of E/2 experts),
  each with a capacity factor and dropless (DeepSpeed: ``drop_tokens=False``, whose
  capacity is the busiest expert's count; DeepSpeed has no prototyping);
* "ideal": only the expert FFN maths (``Linear -> GELU -> Linear`` with biases, the
  same module every expert is copied from) as one dense chain over S x K rows, K the
  routes per token - what a perfect MoE layer with no routing, no dispatch and no
  load imbalance would cost.

Timing: all variants of all modes run round-robin inside every repetition (so load
from other processes on this shared machine hits all of them alike) and the median
over repetitions is reported, for thread CPU time (``time.thread_time``: what this
thread computed, less sensitive to being descheduled) and wall time. Speeds are
tokens/s over S tokens; "x ideal" is ideal time / variant time.

Peak memory: the profiler's allocation events (``torch.profiler`` with
``profile_memory=True``; every CPU tensor allocation and free) over one
forward+backward, summed in time order; the peak is the most bytes live at once
beyond what existed before the step (parameters and the input are not counted;
activations, gradients and temporaries are).

Run::

    .venv/bin/python benchmarks/moe_layer.py            # full size, 12 repetitions
    .venv/bin/python benchmarks/moe_layer.py --reps 20 --markdown

Expert parallelism (ep=2 over gloo) is not timed here: the script prints
``ep=2: expert parallelism not available in this build`` when the layer rejects
ep_size > 1, and says ep=2 was not measured when it accepts it.
"""
from __future__ import annotations

import argparse
import itertools
import os
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

from moe_proto import MoE
from moe_proto.args import MoEArgs

EP2_UNAVAILABLE = "ep=2: expert parallelism not available in this build"
EP2_NOT_MEASURED = "ep=2: not measured (this benchmark has no expert-parallel run)"


@dataclass(frozen=True)
class BenchConfig:
    """Problem size and measurement settings (defaults: the issue's configuration)."""

    tokens: int = 4096
    hidden: int = 256
    ffn: int = 1024
    experts: int = 16
    capacity_factor: float = 1.25
    reps: int = 12
    warmup: int = 2
    threads: int = 1
    seed: int = 0


@dataclass(frozen=True)
class Mode:
    """A routing mode: ``k`` experts per prototype, ``prototypes`` groups, capacity or dropless."""

    name: str
    k: int
    prototypes: int
    dropless: bool

    @property
    def routes_per_token(self) -> int:
        return self.k * self.prototypes

    @property
    def deepspeed_supported(self) -> bool:
        # DeepSpeed's MoE has no expert prototyping.
        return self.prototypes == 1


MODES: Tuple[Mode, ...] = tuple(
    Mode(f"{base}{' dropless' if dropless else ''}", k, p, dropless)
    for base, k, p in (("top-1", 1, 1), ("top-2", 2, 1), ("P=2", 1, 2))
    for dropless in (False, True))


@dataclass
class Timing:
    """Per-repetition seconds of one variant."""

    thread: List[float] = field(default_factory=list)
    wall: List[float] = field(default_factory=list)

    @property
    def thread_median(self) -> float:
        return statistics.median(self.thread)

    @property
    def wall_median(self) -> float:
        return statistics.median(self.wall)


@dataclass(frozen=True)
class Row:
    """One line of the results table (times are medians in seconds; memory in bytes)."""

    mode: str
    tokens: int
    ours_s: float
    ds_s: Optional[float]
    ideal_s: float
    ours_wall_s: float
    ds_wall_s: Optional[float]
    ideal_wall_s: float
    ours_peak: int
    ds_peak: Optional[int]
    ideal_peak: int
    ours_drop_rate: float


Step = Callable[[], None]


def expert_module(cfg: BenchConfig) -> nn.Module:
    """The FFN every expert is a copy of (DeepSpeed deep-copies it; moe_proto stacks copies)."""
    return nn.Sequential(nn.Linear(cfg.hidden, cfg.ffn), nn.GELU(), nn.Linear(cfg.ffn, cfg.hidden))


def init_deepspeed_single_process() -> None:
    """A 1-process gloo group, as DeepSpeed's MoE needs initialised groups (also at ep_size=1)."""
    import deepspeed
    import torch.distributed as dist

    if dist.is_initialized():
        return
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    if "MASTER_PORT" not in os.environ:
        from sparse_scale.multiproc import free_port

        os.environ["MASTER_PORT"] = str(free_port())
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)


def _layer_step(layer: nn.Module, x: Tensor, grad: Tensor) -> Step:
    """Forward + backward through ``output`` and ``l_aux``, as a training step would."""

    def step() -> None:
        for p in layer.parameters():
            p.grad = None  # gradients are allocated inside the step, as in training with zero_grad(set_to_none)
        inp = x.detach().requires_grad_()
        out, l_aux, _ = layer(inp)
        torch.autograd.backward([out, l_aux], [grad, torch.ones_like(l_aux)])

    return step


def _ideal_step(mlp: nn.Module, rows: Tensor, grad: Tensor) -> Step:
    def step() -> None:
        for p in mlp.parameters():
            p.grad = None
        inp = rows.detach().requires_grad_()
        mlp(inp).backward(grad)

    return step


def build_variants(cfg: BenchConfig, mode: Mode, with_deepspeed: bool = True) -> Tuple[Dict[str, Step], float]:
    """The steps to time for one mode: ``ours``, ``ideal`` and (when supported) ``deepspeed``.

    Returns the steps and our layer's drop rate on the benchmark input. Both layers copy
    the same expert module and the same router weights, so they route alike (not
    identically: DeepSpeed drops by position and top-2 renormalises after drops).
    """
    gen = torch.Generator().manual_seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    mlp = expert_module(cfg)
    x = torch.randn(cfg.tokens, cfg.hidden, generator=gen)
    grad = torch.randn(cfg.tokens, cfg.hidden, generator=gen)
    common = dict(num_experts=cfg.experts, k=mode.k, capacity_factor=cfg.capacity_factor,
                  eval_capacity_factor=cfg.capacity_factor, use_rts=False, top2_2nd_expert_sampling=False)
    ours = MoE(cfg.hidden, mlp, num_prototypes=mode.prototypes, dropless=mode.dropless, **common)
    steps: Dict[str, Step] = {}
    if with_deepspeed and mode.deepspeed_supported:
        from deepspeed.moe.layer import MoE as DeepSpeedMoE

        ds = DeepSpeedMoE(cfg.hidden, mlp, drop_tokens=not mode.dropless, **common)
        ds.set_deepspeed_parallelism()
        with torch.no_grad():
            ours.gate.weight.copy_(ds.deepspeed_moe.gate.wg.weight)
        steps["deepspeed"] = _layer_step(ds, x, grad)
    steps["ours"] = _layer_step(ours, x, grad)
    rows = mode.routes_per_token * cfg.tokens
    steps["ideal"] = _ideal_step(mlp, torch.randn(rows, cfg.hidden, generator=gen),
                                 torch.randn(rows, cfg.hidden, generator=gen))
    with torch.no_grad():
        ours(x)
    drop_rate = float(ours.last_stats.drop_rate)
    return steps, drop_rate


def peak_bytes(steps: Dict[str, Step]) -> Dict[str, int]:
    """Per step: most bytes live at once during it beyond those live when it started.

    One profiler session for all steps (starting one costs seconds); each step runs
    inside a ``record_function`` range and its peak is read from the allocation events
    (``+bytes`` on allocation, ``-bytes`` on free) that fall inside that range.
    """
    from torch.profiler import ProfilerActivity, profile, record_function

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        for name, step in steps.items():
            with record_function(f"peak::{name}"):
                step()
    events = list(prof.profiler.kineto_results.events())
    ranges = {e.name()[len("peak::"):]: (e.start_ns(), e.end_ns()) for e in events if e.name().startswith("peak::")}
    memory = sorted(((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]"), key=lambda m: m[0])
    peaks = {}
    for name, (start, end) in ranges.items():
        live = peak = 0
        for stamp, nbytes in memory:
            if start <= stamp <= end:
                live += nbytes
                peak = max(peak, live)
        peaks[name] = peak
    return peaks


def time_round_robin(steps: Dict[str, Step], reps: int, warmup: int) -> Dict[str, Timing]:
    """Run every step once per repetition, in a rotating order, and record thread and wall time.

    Rotation keeps any one variant from always following the same neighbour (whose
    freed memory and cache state it would inherit).
    """
    names = list(steps)
    for _ in range(warmup):
        for name in names:
            steps[name]()
    timings = {name: Timing() for name in names}
    for rep in range(reps):
        shift = rep % len(names)
        for name in names[shift:] + names[:shift]:
            wall0, cpu0 = time.perf_counter(), time.thread_time()
            steps[name]()
            timings[name].thread.append(time.thread_time() - cpu0)
            timings[name].wall.append(time.perf_counter() - wall0)
    return timings


def run(cfg: BenchConfig, modes: Sequence[Mode] = MODES, with_deepspeed: bool = True) -> List[Row]:
    """Build every mode's variants, time them all interleaved, measure peak memory; one row per mode."""
    torch.set_num_threads(cfg.threads)
    if with_deepspeed:
        init_deepspeed_single_process()
    all_steps: Dict[str, Step] = {}
    drop_rates: Dict[str, float] = {}
    for mode in modes:
        steps, drop_rates[mode.name] = build_variants(cfg, mode, with_deepspeed)
        all_steps.update({f"{mode.name}|{name}": step for name, step in steps.items()})
    timings = time_round_robin(all_steps, cfg.reps, cfg.warmup)
    peaks = peak_bytes(all_steps)
    rows = []
    for mode in modes:
        ds_key = f"{mode.name}|deepspeed"
        has_ds = ds_key in timings
        ours, ideal = timings[f"{mode.name}|ours"], timings[f"{mode.name}|ideal"]
        rows.append(Row(
            mode=mode.name, tokens=cfg.tokens,
            ours_s=ours.thread_median, ds_s=timings[ds_key].thread_median if has_ds else None,
            ideal_s=ideal.thread_median, ours_wall_s=ours.wall_median,
            ds_wall_s=timings[ds_key].wall_median if has_ds else None, ideal_wall_s=ideal.wall_median,
            ours_peak=peaks[f"{mode.name}|ours"], ds_peak=peaks.get(ds_key),
            ideal_peak=peaks[f"{mode.name}|ideal"], ours_drop_rate=drop_rates[mode.name]))
    return rows


def format_table(rows: Sequence[Row]) -> str:
    """Markdown table: speeds from thread CPU time medians; the wall-time ratio alongside."""

    def tps(seconds: Optional[float], tokens: int) -> str:
        return "n/a" if seconds is None else f"{tokens / seconds:,.0f}"

    def ratio(a: Optional[float], b: Optional[float]) -> str:
        return "n/a" if a is None or b is None else f"{a / b:.2f}"

    def mb(n: Optional[int]) -> str:
        return "n/a" if n is None else f"{n / 2**20:.0f}"

    lines = [
        "| mode | ours tok/s | DeepSpeed tok/s | ideal tok/s | ours/ideal | DS/ideal | ours/DS "
        "| ours/ideal (wall) | DS/ideal (wall) | peak MB ours / DS / ideal | ours drop rate |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r.mode} | {tps(r.ours_s, r.tokens)} | {tps(r.ds_s, r.tokens)} | {tps(r.ideal_s, r.tokens)} "
            f"| {ratio(r.ideal_s, r.ours_s)} | {ratio(r.ideal_s, r.ds_s)} | {ratio(r.ds_s, r.ours_s)} "
            f"| {ratio(r.ideal_wall_s, r.ours_wall_s)} | {ratio(r.ideal_wall_s, r.ds_wall_s)} "
            f"| {mb(r.ours_peak)} / {mb(r.ds_peak)} / {mb(r.ideal_peak)} | {r.ours_drop_rate:.1%} |")
    return "\n".join(lines)


def ep_available() -> bool:
    """Whether this build's MoE accepts ep_size > 1 (it raises a ValueError saying so when not)."""
    try:
        MoEArgs(hidden_size=8, num_experts=2, ep_size=2)
    except ValueError as err:
        if "expert parallelism is not available" in str(err):
            return False
        raise
    return True


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=BenchConfig.reps)
    parser.add_argument("--warmup", type=int, default=BenchConfig.warmup)
    parser.add_argument("--tokens", type=int, default=BenchConfig.tokens)
    parser.add_argument("--no-deepspeed", action="store_true", help="time moe_proto and the ideal only")
    args = parser.parse_args(argv)
    cfg = BenchConfig(tokens=args.tokens, reps=args.reps, warmup=args.warmup)
    load_before = os.getloadavg()
    rows = run(cfg, with_deepspeed=not args.no_deepspeed)
    load_after = os.getloadavg()
    print(f"S={cfg.tokens} d={cfg.hidden} ffn={cfg.ffn} E={cfg.experts} cf={cfg.capacity_factor} "
          f"threads={cfg.threads} reps={cfg.reps} (median; thread CPU time) torch {torch.__version__}; "
          f"{os.cpu_count()} CPUs, 1-min load {load_before[0]:.1f} before, {load_after[0]:.1f} after")
    print(format_table(rows))
    if not ep_available():
        print(EP2_UNAVAILABLE)
    else:
        # The layer accepts ep_size > 1 but this benchmark has no expert-parallel timing yet: say so
        # rather than print numbers for it.
        print(EP2_NOT_MEASURED)


if __name__ == "__main__":
    main()
