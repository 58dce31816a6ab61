"""Embedding benchmark (issue 4 item 9): per-field EmbeddingBags, torchrec EBC, FBGEMM TBE (CPU) and ours.

All methods run in one process on the same threads (default 1), on the same
batches, with the same initial weights and the same optimizer (exact row-wise
Adagrad: one accumulator per row, ``acc += mean(g^2)``, ``w -= lr * g / (sqrt(acc) + eps)``):

(a) ``per-field``: one ``nn.EmbeddingBag(sparse=True)`` per field in a Python
    loop (what torchrec's unsharded collection does), sparse gradients, then
    row-wise Adagrad written with index ops (``coalesce``, ``index_select``,
    ``index_copy_``, ``index_add_``) per table.
(b) ``torchrec EBC``: torchrec's unsharded ``EmbeddingBagCollection`` fed a new
    ``KeyedJaggedTensor`` per call. It shares (a)'s ``nn.EmbeddingBag`` modules
    (so one copy of the weights), switched to ``sparse=True`` (torchrec's
    default is dense gradients: 2.5 GB per step at F=1000, D=64), and the same
    index-op row-wise Adagrad. So (a) vs (b) is exactly torchrec's KJT overhead.
(c) ``FBGEMM TBE``: ``SplitTableBatchedEmbeddingBagsCodegen`` with
    ``EmbeddingLocation.HOST``, ``ComputeDevice.CPU``, ``EXACT_ROWWISE_ADAGRAD``
    fused into backward (default ``bounds_check_mode=WARNING``; ours checks ids too).
(d) ``ours``: ``PackedEmbeddingCollection`` (packing on, row-wise Adagrad fused
    into backward), fed a new ``JaggedBatch`` per call. It measures whatever
    path the collection takes by default; the row's ``ours_path`` says which.
(e) optional (``--custom-ops``): ours with ``custom_ops=True`` (the C++ ops),
    when the collection takes that argument and the ops load.

Every call gets the field-major ``values`` and ``lengths [F, B]`` and does its
own input preparation inside the timed region (offsets, KJT / JaggedBatch).
"forward" is a ``torch.no_grad()`` lookup returning ``[B, F * D]``; "step" is
forward with autograd + ``backward(grad_out)`` with a fixed random
``grad_out`` + the optimizer update. Before timing, one forward and one step
from identical weights are compared against (a) (``max_fwd_diff``,
``max_step_diff`` in the JSON rows).

Timing: warm-up, then ``--reps`` rounds; each round runs every method's
forward, then every method's step, in an order rotated each round
(interleaved). Medians of wall time (``time.perf_counter``) and of the
thread's CPU time (``time.thread_time``) are reported; on a shared machine CPU
time is the less noisy of the two.
The JSON rows also hold each method's median minor page faults per call
(``*_fwd_faults``, ``*_step_faults``; ``getrusage(RUSAGE_THREAD)``), mostly
from the fresh ``[B, F * D]`` output every method allocates per call, and
the forward's CPU samples: the cost of those faults depends on the machine's
memory state (see RESULTS.md, Embeddings, 2026-11-29 21:12).

Run::

    .venv/bin/python benchmarks/embedding.py                 # full grid, writes benchmarks/RESULTS.md
    .venv/bin/python benchmarks/embedding.py --quick         # F=26, D=16, 3 reps, no RESULTS.md
"""

from __future__ import annotations

import argparse
import gc
import inspect
import json
import logging
import math
import os
import platform
import re
import statistics
import sys
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

try:
    import resource
except ImportError:  # not POSIX: no page-fault counts
    resource = None  # type: ignore[assignment]

import torch
from torch import Tensor, nn

from picasso_ops.data.zipf import ZipfSampler
from picasso_ops.embedding import PackedEmbeddingCollection, TableSpec
from picasso_ops.jagged import JaggedBatch

logger = logging.getLogger("benchmarks.embedding")
SECTION = "## Embeddings (issue 4 item 9)"
RESULTS = Path(__file__).resolve().parent / "RESULTS.md"
LR, EPS = 0.05, 1e-8
METHODS = ("per_field", "torchrec_ebc", "fbgemm_tbe", "ours", "ours_cpp")
LABELS = {
    "per_field": "per-field EB",
    "torchrec_ebc": "torchrec EBC",
    "fbgemm_tbe": "FBGEMM TBE",
    "ours": "ours",
    "ours_cpp": "ours+C++ ops",
}


# ------------------------------------------------------------------ data
def make_batch(num_fields: int, batch_size: int, rows: int, seed: int, zipf: float = 1.1) -> tuple[Tensor, Tensor]:
    """Field-major ids and ``lengths [F, B]``: pooling length ``1 + Poisson(2)``, Zipf(``zipf``) ids per field."""
    gen = torch.Generator().manual_seed(seed)
    lengths = (1 + torch.poisson(torch.full((num_fields, batch_size), 2.0), generator=gen)).to(torch.int64)
    sampler = ZipfSampler([rows] * num_fields, zipf, seed=seed)
    max_len = int(lengths.max())
    ids = sampler.sample(torch.rand(num_fields, batch_size, max_len, dtype=torch.float64, generator=gen))
    present = torch.arange(max_len).view(1, 1, -1) < lengths.unsqueeze(-1)
    return torch.masked_select(ids, present).contiguous(), lengths


def _offsets(lengths: Tensor) -> Tensor:
    out = torch.zeros(lengths.numel() + 1, dtype=torch.int64)
    torch.cumsum(lengths.reshape(-1), 0, out=out[1:])
    return out


@torch.no_grad()
def rowwise_adagrad_sparse(weight: Tensor, acc: Tensor, lr: float = LR, eps: float = EPS) -> None:
    """Exact row-wise Adagrad from ``weight``'s sparse ``.grad`` with index ops; clears the grad."""
    grad = weight.grad
    weight.grad = None
    if grad is None:
        return
    grad = grad.coalesce()
    rows, g = grad.indices()[0], grad.values()
    new_acc = acc.index_select(0, rows) + g.square().mean(1)
    acc.index_copy_(0, rows, new_acc)
    weight.index_add_(0, rows, g * new_acc.sqrt_().add_(eps).reciprocal_().mul_(-lr).unsqueeze(1))


# --------------------------------------------------------------- methods
@dataclass
class Method:
    name: str
    forward: Callable[[Tensor, Tensor], Tensor]  # (values, lengths) -> [B, F * D]
    step: Callable[[Tensor, Tensor, Tensor], None]  # (values, lengths, grad_out)
    tables: Callable[[], list[Tensor]]  # current per-table weights (views)
    note: str = ""


def _per_field(bags: nn.ModuleList, accs: list[Tensor]) -> Method:
    def lookup(values: Tensor, lengths: Tensor) -> Tensor:
        F, B = lengths.shape
        starts = _offsets(lengths)
        bounds = starts[:: B].tolist()  # F + 1 field boundaries
        pooled = []
        for f, bag in enumerate(bags):
            lo, hi = bounds[f], bounds[f + 1]
            pooled.append(bag(values[lo:hi], starts[f * B : (f + 1) * B + 1] - lo))
        return torch.cat(pooled, dim=1)

    def forward(values: Tensor, lengths: Tensor) -> Tensor:
        with torch.no_grad():
            return lookup(values, lengths)

    def step(values: Tensor, lengths: Tensor, grad_out: Tensor) -> None:
        lookup(values, lengths).backward(grad_out)
        for bag, acc in zip(bags, accs):
            rowwise_adagrad_sparse(bag.weight, acc)

    return Method("per_field", forward, step, lambda: [b.weight.detach() for b in bags])


def _torchrec(ebc: nn.Module, keys: list[str], bags: list[nn.Module], accs: list[Tensor]) -> Method:
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    def lookup(values: Tensor, lengths: Tensor) -> Tensor:
        kjt = KeyedJaggedTensor(keys=keys, values=values, lengths=lengths.reshape(-1))
        return ebc(kjt).values()

    def forward(values: Tensor, lengths: Tensor) -> Tensor:
        with torch.no_grad():
            return lookup(values, lengths)

    def step(values: Tensor, lengths: Tensor, grad_out: Tensor) -> None:
        lookup(values, lengths).backward(grad_out)
        for bag, acc in zip(bags, accs):
            rowwise_adagrad_sparse(bag.weight, acc)

    return Method("torchrec_ebc", forward, step, lambda: [b.weight.detach() for b in bags],
                  "shares per-field's EmbeddingBags (sparse=True)")


def _fbgemm(num_fields: int, rows: int, dim: int) -> Method:
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        ComputeDevice,
        SplitTableBatchedEmbeddingBagsCodegen,
    )

    tbe = SplitTableBatchedEmbeddingBagsCodegen(
        embedding_specs=[(rows, dim, EmbeddingLocation.HOST, ComputeDevice.CPU)] * num_fields,
        optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD,
        learning_rate=LR,
        eps=EPS,
        device=torch.device("cpu"),
    )

    def forward(values: Tensor, lengths: Tensor) -> Tensor:
        with torch.no_grad():
            return tbe(values, _offsets(lengths))

    def step(values: Tensor, lengths: Tensor, grad_out: Tensor) -> None:
        tbe(values, _offsets(lengths)).backward(grad_out)

    return Method("fbgemm_tbe", forward, step, lambda: list(tbe.split_embedding_weights()))


def ours_path(custom_ops: Optional[bool] = None) -> str:
    """Which path ``PackedEmbeddingCollection`` takes on CPU float32: its ``custom_ops`` default and the ops backend."""
    param = inspect.signature(PackedEmbeddingCollection.__init__).parameters.get("custom_ops")
    if param is None:
        return "pure torch (collection has no custom_ops switch)"
    use = param.default if custom_ops is None else custom_ops
    if not use:
        return "pure torch (custom_ops=False, the default)"
    try:
        from picasso_ops import ops

        backend = ops.select_backend(torch.device("cpu"), torch.float32)
    except Exception as exc:  # noqa: BLE001 - report, do not fail the benchmark
        return f"custom_ops=True but ops unavailable ({type(exc).__name__}: {exc})"
    return f"custom_ops=True, picasso_ops.ops backend {backend!r}"


def _ours(name: str, num_fields: int, rows: int, dim: int, custom_ops: Optional[bool]) -> Method:
    keys = [f"f{i}" for i in range(num_fields)]
    specs = [
        TableSpec(f"t{i}", rows, dim, "sum", "rowwise_adagrad", {"lr": LR, "eps": EPS}, feature_names=(keys[i],))
        for i in range(num_fields)
    ]
    kwargs: dict[str, Any] = {"packing": True}
    if custom_ops is not None:
        kwargs["custom_ops"] = custom_ops
    coll = PackedEmbeddingCollection(specs, **kwargs)

    def forward(values: Tensor, lengths: Tensor) -> Tensor:
        with torch.no_grad():
            return coll(JaggedBatch(keys, values, lengths, validate=False)).values

    def step(values: Tensor, lengths: Tensor, grad_out: Tensor) -> None:
        coll(JaggedBatch(keys, values, lengths, validate=False)).values.backward(grad_out)

    return Method(name, forward, step, lambda: [coll.table_weight(s.name) for s in specs],
                  ours_path(custom_ops))


def build_methods(num_fields: int, rows: int, dim: int, methods: Sequence[str], seed: int = 0) -> dict[str, Method]:
    """The requested methods for ``num_fields`` tables of ``rows x dim``, all starting from the same weights."""
    built: dict[str, Method] = {}
    bags: Optional[nn.ModuleList] = None
    accs: list[Tensor] = []
    if "per_field" in methods or "torchrec_ebc" in methods:
        keys = [f"f{i}" for i in range(num_fields)]
        if "torchrec_ebc" in methods:
            from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
            from torchrec.modules.embedding_modules import EmbeddingBagCollection

            ebc = EmbeddingBagCollection(tables=[
                EmbeddingBagConfig(num_embeddings=rows, embedding_dim=dim, name=f"t{i}", feature_names=[keys[i]],
                                   pooling=PoolingType.SUM)
                for i in range(num_fields)
            ], device=torch.device("cpu"))
            bags = nn.ModuleList(ebc.embedding_bags.values())
        else:
            bags = nn.ModuleList(nn.EmbeddingBag(rows, dim, mode="sum", include_last_offset=True)
                                 for _ in range(num_fields))
        for bag in bags:
            bag.sparse = True  # torchrec builds them dense; sparse gradients for the row-wise update
        accs = [torch.zeros(rows) for _ in range(num_fields)]
        if "per_field" in methods:
            built["per_field"] = _per_field(bags, accs)
        if "torchrec_ebc" in methods:
            built["torchrec_ebc"] = _torchrec(ebc, keys, list(bags), accs)
    if "fbgemm_tbe" in methods:
        built["fbgemm_tbe"] = _fbgemm(num_fields, rows, dim)
    if "ours" in methods:
        built["ours"] = _ours("ours", num_fields, rows, dim, None)
    if "ours_cpp" in methods:
        built["ours_cpp"] = _ours("ours_cpp", num_fields, rows, dim, True)
    # identical initial weights, table by table (no full copy in memory)
    gen = torch.Generator().manual_seed(seed)
    bound = math.sqrt(1.0 / rows)
    per_method_tables = {name: m.tables() for name, m in built.items()}
    with torch.no_grad():
        for t in range(num_fields):
            w = torch.empty(rows, dim).uniform_(-bound, bound, generator=gen)
            for tables in per_method_tables.values():
                tables[t].copy_(w)
    return built


def _max_table_diff(a: list[Tensor], b: list[Tensor]) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


def check_agreement(methods: dict[str, Method], values: Tensor, lengths: Tensor, grad_out: Tensor) -> dict[str, dict]:
    """Max |diff| to the first method: forward output, then tables after one step (from the same weights).

    Methods that share weights with an earlier one (torchrec EBC with
    per-field) are compared on the forward only, after that method stepped.
    """
    names = list(methods)
    ref_name = names[0]
    out: dict[str, dict] = {}
    ref = methods[ref_name].forward(values, lengths)
    for name in names[1:]:
        out[name] = {"max_fwd_diff": float((methods[name].forward(values, lengths) - ref).abs().max())}
    del ref
    methods[ref_name].step(values, lengths, grad_out)
    ref_tables = methods[ref_name].tables()
    shared = {"torchrec_ebc"} if ref_name == "per_field" else set()
    for name in names[1:]:
        if name in shared:
            out[name]["max_step_diff"] = None  # same modules as the reference
            continue
        methods[name].step(values, lengths, grad_out)
        out[name]["max_step_diff"] = _max_table_diff(methods[name].tables(), ref_tables)
    return out


# ---------------------------------------------------------------- timing
def _minor_faults() -> float:
    """This thread's minor page faults so far (exact, unlike the tick-sampled user/sys split); NaN where unavailable."""
    try:
        return float(resource.getrusage(resource.RUSAGE_THREAD).ru_minflt)
    except (AttributeError, OSError):  # not Linux / not POSIX
        return float("nan")


def _timed(fn: Callable[[], Any]) -> tuple[float, float, float]:
    """Wall ms, thread CPU ms and minor page faults of one call (the result is freed inside the timed region)."""
    w0, c0, f0 = time.perf_counter(), time.thread_time(), _minor_faults()
    fn()
    return (time.perf_counter() - w0) * 1e3, (time.thread_time() - c0) * 1e3, _minor_faults() - f0


def bench_config(
    num_fields: int,
    dim: int,
    batch_size: int = 2048,
    rows: int = 10_000,
    reps: int = 7,
    warmup: int = 1,
    methods: Sequence[str] = METHODS[:4],
    zipf: float = 1.1,
    num_batches: int = 2,
    check: bool = True,
) -> dict[str, Any]:
    """One grid point: median forward and step ms (wall and thread CPU) per method, interleaved."""
    built = build_methods(num_fields, rows, dim, methods)
    batches = [make_batch(num_fields, batch_size, rows, seed=100 + i, zipf=zipf) for i in range(num_batches)]
    gen = torch.Generator().manual_seed(7)
    grad_out = torch.randn(batch_size, num_fields * dim, generator=gen)
    row: dict[str, Any] = {
        "F": num_fields, "D": dim, "B": batch_size, "rows_per_table": rows, "reps": reps, "warmup": warmup,
        "threads": torch.get_num_threads(), "ids_per_batch": int(batches[0][0].numel()),
        "methods": list(built), "notes": {k: m.note for k, m in built.items() if m.note},
    }
    if check:
        row["agreement"] = check_agreement(built, *batches[0], grad_out)
    names = list(built)
    samples: dict[str, dict[str, list[float]]] = {
        n: {"fwd_wall": [], "fwd_cpu": [], "fwd_faults": [], "step_wall": [], "step_cpu": [], "step_faults": []}
        for n in names
    }
    for r in range(warmup + reps):
        order = names[r % len(names):] + names[: r % len(names)]
        values, lengths = batches[r % len(batches)]
        for n in order:
            wall, cpu, faults = _timed(lambda: built[n].forward(values, lengths))
            if r >= warmup:
                samples[n]["fwd_wall"].append(wall)
                samples[n]["fwd_cpu"].append(cpu)
                samples[n]["fwd_faults"].append(faults)
        for n in order:
            wall, cpu, faults = _timed(lambda: built[n].step(values, lengths, grad_out))
            if r >= warmup:
                samples[n]["step_wall"].append(wall)
                samples[n]["step_cpu"].append(cpu)
                samples[n]["step_faults"].append(faults)
    for n in names:
        for key, vals in samples[n].items():
            unit = "" if key.endswith("faults") else "_ms"
            row[f"{n}_{key}{unit}"] = statistics.median(vals) if vals else float("nan")
        row[f"{n}_fwd_cpu_samples_ms"] = [round(v, 1) for v in samples[n]["fwd_cpu"]]
    if "fbgemm_tbe" in built:
        for n in ("ours", "ours_cpp"):
            if n in built:
                for phase in ("fwd", "step"):
                    for clock in ("wall", "cpu"):
                        row[f"{n}_vs_fbgemm_{phase}_{clock}"] = (
                            row[f"fbgemm_tbe_{phase}_{clock}_ms"] / row[f"{n}_{phase}_{clock}_ms"]
                        )
    del built, batches
    gc.collect()
    return row


def rows_for(num_fields: int, rows: int, max_total_rows: int) -> int:
    """Rows per table: ``rows``, reduced so ``F * rows <= max_total_rows`` (memory at F=1000)."""
    return max(1, min(rows, max_total_rows // num_fields))


# ---------------------------------------------------------------- report
def format_table(results: list[dict[str, Any]], clock: str = "cpu") -> str:
    """Markdown: F, D, rows, forward and step ms per method (``clock``: ``cpu`` or ``wall``), ours/FBGEMM speed-ups."""
    methods = [m for m in METHODS if any(m in r["methods"] for r in results)]
    ours = [m for m in ("ours", "ours_cpp") if m in methods]
    head = ["F", "D", "rows/table"]
    head += [f"fwd {LABELS[m]}" for m in methods] + [f"step {LABELS[m]}" for m in methods]
    for m in ours:
        head += [f"{LABELS[m]}/FBGEMM fwd", f"{LABELS[m]}/FBGEMM step"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results:
        cells = [str(r["F"]), str(r["D"]), f"{r['rows_per_table']:,}"]
        for phase in ("fwd", "step"):
            for m in methods:
                v = r.get(f"{m}_{phase}_{clock}_ms")
                cells.append("-" if v is None else f"{v:.1f}")
        for m in ours:
            for phase in ("fwd", "step"):
                v = r.get(f"{m}_vs_fbgemm_{phase}_{clock}")
                cells.append("-" if v is None else f"{v:.2f}x")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_section(path: Path, section: str, body: str, title: Optional[str] = None) -> None:
    """Add a run to the ``section`` heading's block in ``path``: a ``### title`` subsection right under the
    heading (newest first), keeping the earlier runs and every other section; the section is created if missing."""
    text = path.read_text() if path.exists() else "# Benchmark results\n"
    title = title or f"{datetime.now():%Y-%m-%d %H:%M}, benchmarks/embedding.py"
    run = f"### {title}\n\n{body.strip()}\n"
    pattern = re.compile(rf"^{re.escape(section)}\n\n?", re.M)
    if pattern.search(text):
        text = pattern.sub(lambda _: f"{section}\n\n{run}\n", text, count=1)
    else:
        text = text.rstrip("\n") + f"\n\n{section}\n\n{run}"
    path.write_text(text.rstrip("\n") + "\n")


def load_average() -> str:
    """The 1-minute load average from /proc/loadavg, as text ('?' where unreadable)."""
    try:
        return Path("/proc/loadavg").read_text().split()[0]
    except OSError:
        return "?"


def results_body(results: list[dict[str, Any]], total_s: Optional[float] = None, load: str = "not recorded") -> str:
    r0 = results[0]
    agreement = []
    for r in results:
        for name, a in r.get("agreement", {}).items():
            step = a["max_step_diff"]
            agreement.append(max(a["max_fwd_diff"], step or 0.0))
    paths = sorted({r["notes"]["ours"] for r in results if "ours" in r["notes"]})
    commands: dict[str, list[str]] = {}
    for r in results:
        commands.setdefault(r.get("command", "?"), []).append(f"F={r['F']} D={r['D']} ({r['reps']} reps)")
    cmd_lines = "\n".join(f"- `{c}`: {', '.join(v)}" for c, v in commands.items())
    timing = f"; last run {total_s / 60:.1f} min" if total_s is not None else ""
    return f"""Commands ({platform.machine()}, {_versions()}, {r0['threads']} thread; 1-min load average at the start
and end of the run {load}{timing}):

{cmd_lines}

Setup: B={r0['B']}, pooling length 1 + Poisson(2) (about 3 ids per bag, sum pooling), Zipf(1.1) ids per
field, fp32. Rows per table: see the rows/table column (10,000 at F=26 and F=200; fewer at F=1000 to bound
memory). Optimizer for every
method: exact row-wise Adagrad (lr {LR}, eps {EPS}): fused into backward for FBGEMM
(`EXACT_ROWWISE_ADAGRAD`) and ours; for per-field and torchrec EBC, `sparse=True` gradients and a
row-wise Adagrad written with index ops (coalesce, index_select/index_copy_/index_add_ per table).
torchrec's EBC shares per-field's `nn.EmbeddingBag` modules (switched to sparse gradients). Each call
gets field-major ids + lengths [F, B] and builds its own offsets / KJT / JaggedBatch inside the timed
region. "fwd" = `torch.no_grad()` lookup to [B, F*D]; "step" = forward + `backward(grad_out)` + update.
Medians of the interleaved rounds (method order rotated each round) after {r0['warmup']} warm-up round,
two alternating batches. Largest |diff| to per-field over all grid points, from identical weights: forward
output and tables after one step, {max(agreement) if agreement else float('nan'):.1e}.
Paths measured: "ours" = `PackedEmbeddingCollection(specs)` as constructed by default: {'; '.join(paths)}.
"ours+C++ ops" (with `--custom-ops`) = the same with `custom_ops=True` (the C++ kernels in `picasso_ops/ops/`).

**Thread CPU time (`time.thread_time()`), ms, median** (the less noisy clock on this shared machine):

{format_table(results, "cpu")}

**Wall time (`time.perf_counter()`), ms, median**:

{format_table(results, "wall")}

{_missing(results)}Targets (issue 4 item 9): ours/FBGEMM >= 1.2x on forward and >= 1.0x on the step, at every F and D.
Rows of raw numbers: `benchmarks/embedding_results.json`."""


GRID = [(F, D) for F in (26, 200, 1000) for D in (16, 64)]


def _missing(results: list[dict[str, Any]]) -> str:
    have = {(r["F"], r["D"]) for r in results}
    missing = [f"F={F} D={D}" for F, D in GRID if (F, D) not in have]
    if not missing:
        return ""
    return (f"**Not measured: {', '.join(missing)}.** The full-grid run was killed by the kernel's OOM killer "
            "there (5.8 GB RSS at 2,500 rows/table: B x F x D output, output gradient and per-field sparse "
            "gradients of 6M ids are each 0.5-1.6 GB), with other jobs on this shared 23 GB machine also being "
            "OOM-killed; it was not repeated for lack of memory headroom.\n\n")


def _sorted(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return sorted(rows, key=lambda r: (r["F"], r["D"]))


def _versions() -> str:
    out = [f"torch {torch.__version__}"]
    for mod in ("torchrec", "fbgemm_gpu"):
        try:
            out.append(f"{mod} {__import__(mod).__version__}")
        except Exception:  # noqa: BLE001
            out.append(f"{mod} missing")
    return ", ".join(out)


def _available(methods: Sequence[str]) -> list[str]:
    ok = []
    for m in methods:
        try:
            if m == "torchrec_ebc":
                import torchrec  # noqa: F401
            if m == "fbgemm_tbe":
                import fbgemm_gpu  # noqa: F401
            if m == "ours_cpp" and "custom_ops" not in inspect.signature(PackedEmbeddingCollection.__init__).parameters:
                raise ImportError("PackedEmbeddingCollection has no custom_ops argument")
        except ImportError as exc:
            logger.warning("skipping %s: %s", m, exc)
            continue
        ok.append(m)
    return ok


def main(argv: Optional[list[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--fields", type=int, nargs="+", default=[26, 200, 1000])
    p.add_argument("--dims", type=int, nargs="+", default=[16, 64])
    p.add_argument("--batch", type=int, default=2048)
    p.add_argument("--rows", type=int, default=10_000, help="rows per table (capped by --max-total-rows)")
    p.add_argument("--max-total-rows", type=int, default=2_500_000, help="cap on F * rows (memory at F=1000)")
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--custom-ops", action="store_true", help="also time ours with custom_ops=True (C++ ops)")
    p.add_argument("--quick", action="store_true", help="F=26, D=16, 3 reps; does not touch RESULTS.md")
    p.add_argument("--no-results", action="store_true", help="do not write benchmarks/RESULTS.md")
    p.add_argument("--json", default=str(Path(__file__).resolve().parent / "embedding_results.json"))
    p.add_argument("--append", action="store_true",
                   help="keep the rows already in --json (other F, D; e.g. from a run cut short) and add these")
    p.add_argument("--report-only", action="store_true", help="rewrite the RESULTS.md section from --json, no timing")
    args = p.parse_args(argv)
    if args.report_only:
        write_section(RESULTS, SECTION, results_body(_sorted(json.loads(Path(args.json).read_text()))))
        print(f"wrote {RESULTS}")
        return
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.quick:
        args.fields, args.dims, args.reps, args.no_results = [26], [16], 3, True
    torch.set_num_threads(args.threads)
    methods = _available(list(METHODS[:4]) + (["ours_cpp"] if args.custom_ops else []))
    print(f"methods: {methods}; ours path: {ours_path()}", flush=True)
    t0, load0 = time.perf_counter(), load_average()
    cmd = ".venv/bin/python benchmarks/embedding.py " + " ".join(argv if argv is not None else sys.argv[1:])
    earlier: list[dict[str, Any]] = []
    if args.append and Path(args.json).exists():
        new = {(F, D) for F in args.fields for D in args.dims}
        earlier = [r for r in json.loads(Path(args.json).read_text()) if (r["F"], r["D"]) not in new]
    results: list[dict[str, Any]] = []
    for F in args.fields:
        for D in args.dims:
            rows = rows_for(F, args.rows, args.max_total_rows)
            ts = time.perf_counter()
            r = bench_config(F, D, args.batch, rows, args.reps, args.warmup, methods)
            r["command"] = cmd.strip()
            results.append(r)
            print(f"F={F} D={D} rows={rows} ({time.perf_counter() - ts:.0f}s): "
                  + ", ".join(f"{m} fwd {r[f'{m}_fwd_cpu_ms']:.1f} ({r[f'{m}_fwd_faults']:.0f} faults)"
                              f"/step {r[f'{m}_step_cpu_ms']:.1f}" for m in r["methods"]) + " ms cpu; "
                  + ", ".join(f"{k}={v:.2f}" for k, v in r.items() if "_vs_fbgemm_" in k and k.endswith("cpu"))
                  + f"; agreement {r.get('agreement')}", flush=True)
            if args.json and not args.quick:  # partial results survive an interrupted run
                Path(args.json).write_text(json.dumps(_sorted(earlier + results), indent=1))
    total = time.perf_counter() - t0
    results = _sorted(earlier + results)
    print("\nthread CPU time, ms:\n" + format_table(results, "cpu"))
    print("\nwall time, ms:\n" + format_table(results, "wall"))
    if not args.no_results:
        write_section(RESULTS, SECTION, results_body(results, total, load=f"{load0} and {load_average()}"))
        print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
