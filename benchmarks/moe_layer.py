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
* "experts only" (a diagnostic, not an anchor): our layer's expert stage alone
  (``GroupedExperts``) over S x K rows split evenly over the E experts - no routing,
  dispatch or combine. Its gap to the ideal is the cost of E separate weight sets
  (E small GEMMs per projection, E times the weights read and their gradients written);
  the gap between it and "ours" is what routing, dispatch and combine cost.

Timing: all variants of all modes run round-robin inside every repetition (so load
from other processes on this shared machine hits all of them alike) and the median
over repetitions is reported, for thread CPU time (``time.thread_time``: what this
thread computed, less sensitive to being descheduled) and wall time. Speeds are
tokens/s over S tokens; "x ideal" is ideal time / variant time.

Page faults: each step's minor page faults (``getrusage``) are counted alongside its time, and
the table gives the medians for ours and the ideal. The ideal is plain torch: its activations
come from glibc's malloc, which maps fresh pages for some of them in some runs (the top-1
ideal page-faulted 0-8,200 times a step, 2026-12-04), so its time moves with the allocator's
state. ``--steady-malloc`` raises glibc's mmap and trim thresholds (``mallopt``) for the whole
process before anything runs: every variant then reuses its memory and the ideal stops
faulting - what the ideal costs without allocator overhead. Our layer takes its large buffers
from a pool (``moe_proto.buffer_pool``) and faults about 0 times a step either way.

Peak memory: the profiler's allocation events (``torch.profiler`` with
``profile_memory=True``; every CPU tensor allocation and free) over one
forward+backward, summed in time order; the peak is the most bytes live at once
beyond what existed before the step (parameters and the input are not counted;
activations, gradients and temporaries are). Our layer takes its large buffers from
``moe_proto.buffer_pool`` (reused across steps, so they would not show up as
allocations): pooling is off while peaks are measured, and the bytes the pool holds
between steps after the timed run (all modes' layers share one pool) are printed below
the table.

Expert parallelism (``--ep 2``): ``ep`` gloo processes on 127.0.0.1
(``sparse_scale.multiproc.run_distributed``), one intra-op thread each, every rank with
its own S tokens and E/ep of the E experts; our layer and DeepSpeed's join DeepSpeed's
``ep_size_{ep}`` groups (``set_deepspeed_parallelism``), so both exchange rows with
all-to-alls over gloo. Before every timed step the ranks meet at a barrier (not
timed); a step's time is the slower rank's, and the table gives the median over
repetitions. Wall time is the main measure here: gloo runs the exchange on its own
threads, so the calling thread's CPU time leaves it out. "ideal" is the same dense
FFN over S x K rows on each rank (the rows a rank's experts get with a perfectly
balanced router), timed in the same rounds; it has no communication.

Run::

    .venv/bin/python benchmarks/moe_layer.py            # full size, 12 repetitions
    .venv/bin/python benchmarks/moe_layer.py --reps 20 --modes top-1,top-2
    .venv/bin/python benchmarks/moe_layer.py --ep 2     # 2 processes, expert parallelism
    .venv/bin/python benchmarks/moe_layer.py --steady-malloc   # no allocator page faults in any variant
"""
from __future__ import annotations

import argparse
import ctypes
import itertools
import os
import resource
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

from moe_proto import MoE
from moe_proto.args import MoEArgs
from moe_proto.buffer_pool import default_pool

EP2_UNAVAILABLE = "ep=2: expert parallelism not available in this build"
EP2_HINT = "ep=2: run with --ep 2 (2 gloo processes) for the expert-parallel table"


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
    faults: List[int] = field(default_factory=list)  # minor page faults of this thread during the step

    @property
    def thread_median(self) -> float:
        return statistics.median(self.thread)

    @property
    def wall_median(self) -> float:
        return statistics.median(self.wall)

    @property
    def faults_median(self) -> float:
        return statistics.median(self.faults)


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
    experts_only_s: Optional[float] = None  # single-process runs only
    pool_held: int = 0  # bytes moe_proto's buffer pool held after the timed run (one pool for every mode)
    ours_faults: float = 0.0  # median minor page faults per step
    ideal_faults: float = 0.0


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


def _experts_only_step(layer: MoE, rows: int, cfg: BenchConfig, gen: torch.Generator) -> Step:
    """Our expert stage alone over ``rows`` rows split evenly over the layer's experts (no routing)."""
    experts = layer.experts
    counts = torch.full((experts.num_experts,), rows // experts.num_experts, dtype=torch.long)
    counts[: rows % experts.num_experts] += 1
    buffer = torch.randn(rows, cfg.hidden, generator=gen)
    grad = torch.randn(rows, cfg.hidden, generator=gen)

    def step() -> None:
        for p in experts.parameters():
            p.grad = None
        experts(buffer.detach().requires_grad_(), counts).backward(grad)

    return step


def build_variants(cfg: BenchConfig, mode: Mode, with_deepspeed: bool = True, ep_size: int = 1,
                   rank: int = 0) -> Tuple[Dict[str, Step], float]:
    """The steps to time for one mode: ``ours``, ``ideal`` and (when supported) ``deepspeed``.

    Returns the steps and our layer's drop rate on the benchmark input. Both layers copy
    the same expert module and the same router weights, so they route alike (not
    identically: DeepSpeed drops by position and top-2 renormalises after drops).

    With ``ep_size > 1`` (inside an initialised process group of ``ep_size`` ranks, DeepSpeed's
    comm initialised) both layers hold E/ep_size experts and join DeepSpeed's ``ep_size_{ep}``
    groups; every rank seeds the modules alike and draws its own tokens (seed + rank).
    """
    gen = torch.Generator().manual_seed(cfg.seed + rank)
    torch.manual_seed(cfg.seed)
    mlp = expert_module(cfg)
    x = torch.randn(cfg.tokens, cfg.hidden, generator=gen)
    grad = torch.randn(cfg.tokens, cfg.hidden, generator=gen)
    common = dict(num_experts=cfg.experts, ep_size=ep_size, k=mode.k, capacity_factor=cfg.capacity_factor,
                  eval_capacity_factor=cfg.capacity_factor, use_rts=False, top2_2nd_expert_sampling=False)
    ours = MoE(cfg.hidden, mlp, num_prototypes=mode.prototypes, dropless=mode.dropless, **common)
    if ep_size > 1:
        ours.set_deepspeed_parallelism()
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
    if ep_size == 1:
        steps["experts only"] = _experts_only_step(ours, rows, cfg, gen)
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

    pool = default_pool()
    max_bytes, pool.max_bytes = pool.max_bytes, 0  # every buffer a plain allocation the profiler sees
    try:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            for name, step in steps.items():
                with record_function(f"peak::{name}"):
                    step()
    finally:
        pool.max_bytes = max_bytes
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


def time_round_robin(steps: Dict[str, Step], reps: int, warmup: int,
                     before_each: Optional[Callable[[], None]] = None) -> Dict[str, Timing]:
    """Run every step once per repetition, in a rotating order, and record thread and wall time.

    Rotation keeps any one variant from always following the same neighbour (whose
    freed memory and cache state it would inherit). ``before_each`` runs untimed before
    every step (the expert-parallel run puts a barrier there); the order depends only on
    the repetition, so every rank runs the same step at the same time.
    """
    names = list(steps)
    for _ in range(warmup):
        for name in names:
            if before_each is not None:
                before_each()
            steps[name]()
    timings = {name: Timing() for name in names}
    for rep in range(reps):
        shift = rep % len(names)
        for name in names[shift:] + names[:shift]:
            if before_each is not None:
                before_each()
            faults0 = _minor_faults()
            wall0, cpu0 = time.perf_counter(), time.thread_time()
            steps[name]()
            timings[name].thread.append(time.thread_time() - cpu0)
            timings[name].wall.append(time.perf_counter() - wall0)
            timings[name].faults.append(_minor_faults() - faults0)
    return timings


def _minor_faults() -> int:
    """Minor page faults of the calling thread so far (Linux; the process's elsewhere)."""
    who = getattr(resource, "RUSAGE_THREAD", resource.RUSAGE_SELF)
    return resource.getrusage(who).ru_minflt


def steady_malloc() -> None:
    """Raise glibc's mmap and trim thresholds for this process: freed memory is reused, not unmapped.

    Raises SystemExit when this is not glibc (``mallopt`` missing or refusing the settings).
    """
    m_trim_threshold, m_mmap_threshold = -1, -3  # glibc's malloc.h
    try:
        libc = ctypes.CDLL("libc.so.6")
        ok = libc.mallopt(m_mmap_threshold, 1 << 30) == 1 and libc.mallopt(m_trim_threshold, 2**31 - 1) == 1
    except (OSError, AttributeError) as err:
        raise SystemExit(f"--steady-malloc needs glibc's mallopt: {err}") from err
    if not ok:
        raise SystemExit("--steady-malloc: glibc's mallopt refused the mmap/trim thresholds")


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
    pool_held = default_pool().stats().held_bytes
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
            ideal_peak=peaks[f"{mode.name}|ideal"], ours_drop_rate=drop_rates[mode.name],
            experts_only_s=timings[f"{mode.name}|experts only"].thread_median, pool_held=pool_held,
            ours_faults=ours.faults_median, ideal_faults=ideal.faults_median))
    return rows


def tps(seconds: Optional[float], tokens: int) -> str:
    """Tokens per second, or n/a (a layer DeepSpeed does not have)."""
    return "n/a" if seconds is None else f"{tokens / seconds:,.0f}"


def ratio(a: Optional[float], b: Optional[float]) -> str:
    """a / b to two places, or n/a."""
    return "n/a" if a is None or b is None else f"{a / b:.2f}"


def mb(n: Optional[int]) -> str:
    """Bytes as whole MiB, or n/a."""
    return "n/a" if n is None else f"{n / 2**20:.0f}"


def format_table(rows: Sequence[Row]) -> str:
    """Markdown table: speeds from thread CPU time medians; the wall-time ratio alongside."""
    lines = [
        "| mode | ours tok/s | DeepSpeed tok/s | ideal tok/s | ours/ideal | DS/ideal | ours/DS "
        "| ours/ideal (wall) | DS/ideal (wall) | experts only/ideal | ours/experts only "
        "| peak MB ours / DS / ideal | ours drop rate | page faults per step ours / ideal |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r.mode} | {tps(r.ours_s, r.tokens)} | {tps(r.ds_s, r.tokens)} | {tps(r.ideal_s, r.tokens)} "
            f"| {ratio(r.ideal_s, r.ours_s)} | {ratio(r.ideal_s, r.ds_s)} | {ratio(r.ds_s, r.ours_s)} "
            f"| {ratio(r.ideal_wall_s, r.ours_wall_s)} | {ratio(r.ideal_wall_s, r.ds_wall_s)} "
            f"| {ratio(r.ideal_s, r.experts_only_s)} | {ratio(r.experts_only_s, r.ours_s)} "
            f"| {mb(r.ours_peak)} / {mb(r.ds_peak)} / {mb(r.ideal_peak)} | {r.ours_drop_rate:.1%} "
            f"| {r.ours_faults:,.0f} / {r.ideal_faults:,.0f} |")
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


# --- expert parallelism ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class EpRow:
    """One line of the expert-parallel table: medians over repetitions of the slower rank's seconds."""

    mode: str
    tokens: int  # per rank
    ep: int
    ours_wall_s: float
    ds_wall_s: Optional[float]
    ideal_wall_s: float
    ours_s: float  # thread CPU time (the exchange on gloo's threads is not in it)
    ds_s: Optional[float]
    ideal_s: float
    ours_peak: int  # the larger rank's peak bytes
    ds_peak: Optional[int]
    ideal_peak: int
    ours_drop_rate: float  # mean over ranks
    pool_held: int = 0  # the larger rank's buffer-pool bytes after the timed run


def _ep_worker(rank: int, world: int, cfg: BenchConfig, mode_names: Sequence[str],
               with_deepspeed: bool) -> Dict[str, object]:
    """One rank of the expert-parallel run (``run_distributed`` has initialised gloo): time every variant."""
    import deepspeed
    import torch.distributed as dist

    torch.set_num_threads(cfg.threads)
    # Our layer takes its expert-parallel group from DeepSpeed's groups (as under deepspeed.initialize),
    # so DeepSpeed's comm is initialised even when its layer is not timed.
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    modes = [m for m in MODES if m.name in mode_names]
    steps: Dict[str, Step] = {}
    drops: Dict[str, float] = {}
    for mode in modes:
        mode_steps, drops[mode.name] = build_variants(cfg, mode, with_deepspeed, ep_size=world, rank=rank)
        steps.update({f"{mode.name}|{name}": step for name, step in mode_steps.items()})
    timings = time_round_robin(steps, cfg.reps, cfg.warmup, before_each=dist.barrier)
    dist.barrier()
    held = default_pool().stats().held_bytes
    peaks = peak_bytes(steps)
    return {"port": os.environ.get("MASTER_PORT"), "drops": drops, "peaks": peaks, "pool_held": held,
            "thread": {name: t.thread for name, t in timings.items()},
            "wall": {name: t.wall for name, t in timings.items()}}


def remove_deepspeed_shm_buffers(port: Optional[str]) -> None:
    """DeepSpeed's CPU shm comm op can leave a 66 MB /dev/shm buffer per rank and port: remove ours only."""
    import glob

    if not port:
        return
    for path in glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_*_127.0.0.1_{port}_*"):
        try:
            os.unlink(path)
        except OSError:
            pass


def run_ep(cfg: BenchConfig, ep: int = 2, modes: Sequence[Mode] = MODES, with_deepspeed: bool = True,
           timeout_s: Optional[float] = None) -> List[EpRow]:
    """Time every mode on ``ep`` gloo processes with expert parallelism; one row per mode."""
    from sparse_scale.multiproc import run_distributed

    if cfg.experts % ep:
        raise ValueError(f"{cfg.experts} experts cannot be split over ep={ep} ranks")
    if timeout_s is None:  # generous: a loaded 2-core machine runs these steps several times slower
        timeout_s = 120.0 + 40.0 * len(modes) * (cfg.reps + cfg.warmup)
    results = run_distributed(_ep_worker, world_size=ep, args=(cfg, [m.name for m in modes], with_deepspeed),
                              timeout_s=timeout_s, threads_per_rank=cfg.threads)
    remove_deepspeed_shm_buffers(results[0]["port"])

    def slowest(key: str, name: str) -> Optional[List[float]]:
        if name not in results[0][key]:
            return None
        return [max(per_rank) for per_rank in zip(*(r[key][name] for r in results))]

    def median(values: Optional[List[float]]) -> Optional[float]:
        return None if values is None else statistics.median(values)

    rows = []
    for mode in modes:
        ours, ds, ideal = (f"{mode.name}|{v}" for v in ("ours", "deepspeed", "ideal"))
        ds_peaks = [r["peaks"].get(ds) for r in results]
        rows.append(EpRow(
            mode=mode.name, tokens=cfg.tokens, ep=ep,
            ours_wall_s=median(slowest("wall", ours)), ds_wall_s=median(slowest("wall", ds)),
            ideal_wall_s=median(slowest("wall", ideal)),
            ours_s=median(slowest("thread", ours)), ds_s=median(slowest("thread", ds)),
            ideal_s=median(slowest("thread", ideal)),
            ours_peak=max(r["peaks"][ours] for r in results),
            ds_peak=None if None in ds_peaks else max(ds_peaks),
            ideal_peak=max(r["peaks"][ideal] for r in results),
            ours_drop_rate=statistics.mean(r["drops"][mode.name] for r in results),
            pool_held=max(r["pool_held"] for r in results)))
    return rows


def format_ep_table(rows: Sequence[EpRow]) -> str:
    """Markdown table for the expert-parallel run: speeds from wall-time medians (slower rank per step)."""
    lines = [
        "| mode | ours tok/s per rank | DeepSpeed tok/s per rank | ideal tok/s per rank | ours/ideal | DS/ideal "
        "| ours/DS | ours/ideal (thread CPU) | DS/ideal (thread CPU) | peak MB ours / DS / ideal | ours drop rate |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r.mode} | {tps(r.ours_wall_s, r.tokens)} | {tps(r.ds_wall_s, r.tokens)} "
            f"| {tps(r.ideal_wall_s, r.tokens)} | {ratio(r.ideal_wall_s, r.ours_wall_s)} "
            f"| {ratio(r.ideal_wall_s, r.ds_wall_s)} | {ratio(r.ds_wall_s, r.ours_wall_s)} "
            f"| {ratio(r.ideal_s, r.ours_s)} | {ratio(r.ideal_s, r.ds_s)} "
            f"| {mb(r.ours_peak)} / {mb(r.ds_peak)} / {mb(r.ideal_peak)} | {r.ours_drop_rate:.1%} |")
    return "\n".join(lines)


def _parse_modes(text: Optional[str]) -> Tuple[Mode, ...]:
    if not text:
        return MODES
    by_name = {m.name: m for m in MODES}
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in by_name]
    if unknown:
        raise SystemExit(f"unknown mode(s) {unknown}; choose from {list(by_name)}")
    return tuple(by_name[n] for n in names)


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=BenchConfig.reps)
    parser.add_argument("--warmup", type=int, default=BenchConfig.warmup)
    parser.add_argument("--tokens", type=int, default=BenchConfig.tokens, help="tokens per process")
    parser.add_argument("--modes", default=None, help="comma-separated subset of: " + ", ".join(m.name for m in MODES))
    parser.add_argument("--ep", type=int, default=1,
                        help="expert-parallel size: >1 runs that many gloo processes (default 1: one process)")
    parser.add_argument("--no-deepspeed", action="store_true", help="time moe_proto and the ideal only")
    parser.add_argument("--steady-malloc", action="store_true",
                        help="raise glibc's mmap/trim thresholds first, so no variant page-faults its memory in")
    args = parser.parse_args(argv)
    if args.steady_malloc:
        if args.ep > 1:
            parser.error("--steady-malloc applies to the one-process run (the ranks are separate processes)")
        steady_malloc()
    cfg = BenchConfig(tokens=args.tokens, reps=args.reps, warmup=args.warmup)
    modes = _parse_modes(args.modes)
    load_before = os.getloadavg()
    if args.ep > 1:
        rows = run_ep(cfg, ep=args.ep, modes=modes, with_deepspeed=not args.no_deepspeed)
        table = format_ep_table(rows)
        how = f"ep={args.ep} gloo processes, S={cfg.tokens} tokens per rank, median of the slower rank's wall time"
    else:
        rows = run(cfg, modes=modes, with_deepspeed=not args.no_deepspeed)
        table = format_table(rows)
        how = "one process, median thread CPU time"
        remove_deepspeed_shm_buffers(os.environ.get("MASTER_PORT"))
    load_after = os.getloadavg()
    if args.steady_malloc:
        how += ", --steady-malloc"
    print(f"S={cfg.tokens} d={cfg.hidden} ffn={cfg.ffn} E={cfg.experts} cf={cfg.capacity_factor} "
          f"threads={cfg.threads} reps={cfg.reps} ({how}) torch {torch.__version__}; "
          f"{os.cpu_count()} CPUs, load average (1/5/15 min) {_load(load_before)} before, "
          f"{_load(load_after)} after")
    print(table)
    print(f"moe_proto buffer pool: {mb(rows[0].pool_held)} MiB held between steps after the timed run (one pool "
          f"shared by all modes' layers{', the larger rank' if args.ep > 1 else ''}; peaks above are measured with "
          "pooling off)")
    if args.ep == 1:
        print(EP2_HINT if ep_available() else EP2_UNAVAILABLE)


def _load(load: Tuple[float, float, float]) -> str:
    return "/".join(f"{v:.1f}" for v in load)


if __name__ == "__main__":
    main()
