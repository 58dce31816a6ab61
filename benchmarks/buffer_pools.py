"""Could one CPU buffer pool serve both packages? Each pool on the other's workload, side by side.

The project has two caching pools for large CPU buffers: picasso_ops' C++ ``pooled_empty``
(``picasso_ops/ops/csrc/output_pool.cpp``: 2 MiB-aligned blocks advised as huge pages, exact-size
reuse, returned by the tensor's deleter) for the packed lookup's ``[B, sum D]`` output, and
moe_proto's ``HostBufferPool`` (``moe_proto/buffer_pool.py``: torch storages, 8 size classes per
power of two, returned when only the pool refers to them) for the expert FFN's buffers. This
script times each workload with its own pool, with the other package's pool, and with plain
``torch.empty``, interleaved (round robin, rotating order), and reports median wall ms and the
minor page faults per call:

* picasso: ``PackedEmbeddingCollection`` forward with the C++ ops, F fields of dim D, batch B;
* MoE: ``GroupedExperts`` forward + backward (fp32, GELU, C++ FFN), ``rows`` routed rows with a
  row count that moves from step to step as routing does (``--jitter``).

Run (writes nothing; paste the table into benchmarks/RESULTS.md)::

    .venv/bin/python benchmarks/buffer_pools.py --reps 9
"""
from __future__ import annotations

import argparse
import platform
import resource
import statistics
import time
from typing import Callable, Dict, List, Optional, Sequence

import torch
from torch import Tensor

from moe_proto.buffer_pool import HostBufferPool
from moe_proto.experts import GroupedExperts
from picasso_ops import ops as custom_ops
from picasso_ops.embedding import PackedEmbeddingCollection, TableSpec
from picasso_ops.embedding import packed as packed_module
from picasso_ops.jagged import JaggedBatch
from picasso_ops.ops import builder


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt


def _timed(fn: Callable[[], object]) -> tuple[float, int]:
    w0, f0 = time.perf_counter(), _faults()
    fn()
    return (time.perf_counter() - w0) * 1e3, _faults() - f0


class CppPoolAdapter:
    """``HostBufferPool.empty`` over the C++ pool: a ``[numel, 1]`` block viewed as ``shape`` (what sharing it would be)."""

    def empty(self, shape: Sequence[int], dtype: torch.dtype = torch.float32,
              device: Optional[torch.device] = None) -> Tensor:
        numel = 1
        for s in shape:
            numel *= int(s)
        if (device is not None and torch.device(device).type != "cpu") or numel * dtype.itemsize < (256 << 10):
            return torch.empty(tuple(shape), dtype=dtype, device=device)
        return custom_ops.pooled_empty(numel, 1, dtype=dtype).view(tuple(shape))


class TorchEmpty:
    """No pool: ``torch.empty`` every time."""

    def empty(self, shape: Sequence[int], dtype: torch.dtype = torch.float32,
              device: Optional[torch.device] = None) -> Tensor:
        return torch.empty(tuple(shape), dtype=dtype, device=device)


def _round_robin(calls: Dict[str, Callable[[], object]], reps: int, warmup: int) -> Dict[str, tuple[float, float]]:
    names = list(calls)
    walls: Dict[str, List[float]] = {n: [] for n in names}
    faults: Dict[str, List[int]] = {n: [] for n in names}
    for r in range(warmup + reps):
        for n in names[r % len(names):] + names[: r % len(names)]:
            wall, fault = _timed(calls[n])
            if r >= warmup:
                walls[n].append(wall)
                faults[n].append(fault)
    return {n: (statistics.median(walls[n]), statistics.median(faults[n])) for n in names}


def picasso_rows(fields: int, dim: int, batch: int, rows: int, reps: int, warmup: int) -> Dict[str, tuple]:
    """The packed lookup's forward with its output from each allocator."""
    keys = [f"f{i}" for i in range(fields)]
    specs = [TableSpec(f"t{i}", rows, dim, "sum", "rowwise_adagrad", {"lr": 0.01}, feature_names=(keys[i],))
             for i in range(fields)]
    coll = PackedEmbeddingCollection(specs, packing=True, custom_ops=True)
    gen = torch.Generator().manual_seed(0)
    lengths = (1 + torch.poisson(torch.full((fields, batch), 2.0), generator=gen)).to(torch.int64)
    values = torch.randint(0, rows, (int(lengths.sum()),), generator=gen)
    python_pool = HostBufferPool(max_bytes=1 << 30)
    allocators = {
        "C++ pooled_empty (today)": custom_ops.pooled_empty,
        "HostBufferPool (MoE's)": lambda r, c, dtype=torch.float32: python_pool.empty((r, c), dtype),
        "torch.empty": lambda r, c, dtype=torch.float32: torch.empty(r, c, dtype=dtype),
    }
    original = packed_module.custom_ops.pooled_empty

    def forward_with(alloc: Callable) -> Callable[[], object]:
        def call() -> None:
            packed_module.custom_ops.pooled_empty = alloc
            try:
                with torch.no_grad():
                    coll(JaggedBatch(keys, values, lengths, validate=False)).values
            finally:
                packed_module.custom_ops.pooled_empty = original
        return call

    return _round_robin({n: forward_with(a) for n, a in allocators.items()}, reps, warmup)


def moe_rows(experts: int, hidden: int, ffn: int, rows: int, jitter: int, reps: int, warmup: int) -> Dict[str, tuple]:
    """GroupedExperts forward + backward with its buffers from each pool; the row count moves by up to ``jitter``."""
    layer = GroupedExperts(experts, hidden, ffn, activation="gelu")
    gen = torch.Generator().manual_seed(1)
    pools = {"HostBufferPool (today)": HostBufferPool(max_bytes=1 << 30), "C++ pooled_empty (picasso's)":
             CppPoolAdapter(), "torch.empty": TorchEmpty()}
    sizes = [rows - int(torch.randint(0, jitter + 1, (1,), generator=gen)) for _ in range(8)]
    step = {"i": 0}

    def call_with(pool) -> Callable[[], object]:
        def call() -> None:
            n = sizes[step["i"] % len(sizes)]
            step["i"] += 1
            counts = torch.full((experts,), n // experts, dtype=torch.int64)
            x = torch.randn(int(counts.sum()), hidden, generator=gen, requires_grad=True)
            layer.buffer_pool = pool
            y = layer(x, counts)
            y.backward(torch.ones_like(y))
            for p in layer.parameters():
                p.grad = None
        return call

    return _round_robin({n: call_with(p) for n, p in pools.items()}, reps, warmup)


def _table(title: str, results: Dict[str, tuple]) -> str:
    first = next(iter(results.values()))[0]
    lines = [f"**{title}**", "", "| allocator | wall ms (median) | vs the package's own | minor faults / call |",
             "|---|---|---|---|"]
    for name, (wall, faults) in results.items():
        lines.append(f"| {name} | {wall:.1f} | {wall / first:.2f}x | {faults:.0f} |")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--fields", type=int, default=1000)
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--batch", type=int, default=2048)
    p.add_argument("--rows", type=int, default=2000, help="rows per table")
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--ffn", type=int, default=2048)
    p.add_argument("--tokens", type=int, default=4096, help="routed rows per MoE step")
    p.add_argument("--jitter", type=int, default=256, help="the MoE step's row count moves by up to this")
    p.add_argument("--reps", type=int, default=9)
    p.add_argument("--warmup", type=int, default=2)
    args = p.parse_args(argv)
    if not builder.load_ops():
        raise SystemExit("the picasso C++ ops did not build: pooled_empty is the thing measured")
    load0 = open("/proc/loadavg").read().split()[:3]
    print(f"# {platform.processor() or platform.machine()}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, load before {' '.join(load0)}")
    print(_table(f"picasso forward, F={args.fields} D={args.dim} B={args.batch} "
                 f"(output {args.batch * args.fields * args.dim * 4 / 2**20:.0f} MiB)",
                 picasso_rows(args.fields, args.dim, args.batch, args.rows, args.reps, args.warmup)))
    print()
    print(_table(f"MoE GroupedExperts forward+backward, E={args.experts} d={args.hidden} ffn={args.ffn}, "
                 f"{args.tokens} rows (minus up to {args.jitter})",
                 moe_rows(args.experts, args.hidden, args.ffn, args.tokens, args.jitter, args.reps, args.warmup)))
    print(f"\n# load after {' '.join(open('/proc/loadavg').read().split()[:3])}")


if __name__ == "__main__":
    main()
