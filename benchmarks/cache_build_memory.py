"""Peak memory of building a cached wide-and-deep model: straight into the store vs packed tables converted.

``train_rec.py`` with a ``picasso.cache`` block builds each field-embedding module straight into its
store (``picasso_ops.block.cached_field_embeddings``); before, it built the packed tables in RAM and
copied them into the store (``apply_picasso_block`` on a packed model). Each variant runs in its own
process (so ``ru_maxrss`` is its own) and builds the same model: F fields of V rows, dim D, row-wise
Adagrad state, an mmap store of the given cache size. Memory is the process's anonymous resident
memory (``RssAnon``, sampled every 2 ms): the mmap store's pages are file-backed and reclaimable, so
they are not counted. Prints a table and, unless ``--no-results``,
appends it to benchmarks/RESULTS.md with the command.

    python benchmarks/cache_build_memory.py --fields 26 --vocab 500000 --dim 16
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "RESULTS.md"


def _rss_anon_mb() -> float:
    # anonymous memory only: the mmap store's written pages are file-backed (the kernel may drop them), not heap
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no RssAnon in /proc/self/status (Linux only)")


def _build(variant: str, fields: int, vocab: int, dim: int, cache_rows: int, workdir: str) -> dict:
    """Runs in a child process: build the model one way, report its peak anonymous memory and seconds."""
    import threading

    import torch

    from picasso_ops.block import apply_picasso_block, cached_field_embeddings
    from picasso_ops.config import PicassoConfig
    from picasso_ops.models import SparseArgs, WideAndDeepArgs, packed_wide_and_deep

    torch.set_num_threads(1)
    block = PicassoConfig.model_validate({"embedding_dim": dim, "cache": {"rows": cache_rows, "store": "mmap"}})
    args = WideAndDeepArgs(vocab_sizes=[vocab] * fields, num_dense=13, embedding_dim=dim)
    sparse = SparseArgs(optimizer="rowwise_adagrad", optimizer_params={"lr": 0.05})
    base = _rss_anon_mb()
    peak, done = [base], threading.Event()

    def sample() -> None:
        while not done.wait(0.002):
            peak[0] = max(peak[0], _rss_anon_mb())

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    t0 = time.perf_counter()
    torch.manual_seed(0)
    if variant == "straight":
        model = packed_wide_and_deep(args, sparse, field_embeddings=cached_field_embeddings(block, workdir=Path(workdir)))
    else:
        model = packed_wide_and_deep(args, sparse)
    model = apply_picasso_block(model, block, workdir=Path(workdir))
    seconds = time.perf_counter() - t0
    done.set()
    sampler.join()
    peak[0] = max(peak[0], _rss_anon_mb())
    return {"variant": variant, "peak_anon_mb": peak[0], "before_build_mb": base, "seconds": seconds}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--fields", type=int, default=26)
    p.add_argument("--vocab", type=int, default=500_000, help="rows per field")
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--cache-rows", type=int, default=100_000)
    p.add_argument("--no-results", action="store_true", help="do not append to benchmarks/RESULTS.md")
    p.add_argument("--child", nargs=2, help=argparse.SUPPRESS)  # variant, workdir
    a = p.parse_args(argv)
    if a.child:
        print(json.dumps(_build(a.child[0], a.fields, a.vocab, a.dim, a.cache_rows, a.child[1])))
        return
    rows = []
    for variant in ("converted", "straight"):
        with tempfile.TemporaryDirectory(dir=ROOT / "runs" if (ROOT / "runs").exists() else None) as tmp:
            cmd = [sys.executable, __file__, "--fields", str(a.fields), "--vocab", str(a.vocab), "--dim", str(a.dim),
                   "--cache-rows", str(a.cache_rows), "--child", variant, tmp]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=ROOT,
                                 env={**os.environ, "PYTHONPATH": str(ROOT)})
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    table_mb = a.fields * a.vocab * (a.dim + 1 + 1 + 1) * 4 / 2**20  # deep rows + Adagrad state, wide rows + state
    lines = ["| build | peak anonymous memory, MB (RssAnon, sampled every 2 ms) | before the build, MB | build added, MB | "
             "seconds |", "|---|---|---|---|---|"]
    lines += [f"| {r['variant']} | {r['peak_anon_mb']:,.0f} | {r['before_build_mb']:,.0f} | "
              f"{r['peak_anon_mb'] - r['before_build_mb']:,.0f} | {r['seconds']:.1f} |" for r in rows]
    text = "\n".join(lines)
    print(f"F={a.fields} V={a.vocab:,} D={a.dim}: tables + row-wise Adagrad state {table_mb:,.0f} MB\n{text}")
    if not a.no_results:
        cmd = " ".join(["python benchmarks/cache_build_memory.py", "--fields", str(a.fields), "--vocab", str(a.vocab),
                        "--dim", str(a.dim), "--cache-rows", str(a.cache_rows)])
        RESULTS.write_text(RESULTS.read_text().rstrip("\n") + f"""

## Building a cached model: peak memory (issue 4 item 5, {datetime.now():%Y-%m-%d %H:%M})

`{cmd}` (each build in its own process; x86_64, torch {__import__('torch').__version__}; memory = anonymous resident
memory, `RssAnon` sampled every 2 ms, the file-backed mmap pages excluded). Wide-and-deep with
{a.fields} fields of {a.vocab:,} rows, dim {a.dim} (deep) and 1 (wide), row-wise Adagrad, an mmap store behind a
cache of {a.cache_rows:,} rows: {table_mb:,.0f} MB of rows and optimizer state. "converted": packed tables built in
RAM, then copied into the store (`apply_picasso_block`); "straight": each module built into its store
(`cached_field_embeddings`, what `train_rec.py` does). Same model bit for bit
(`tests/e2e/test_train_rec_picasso.py::test_cache_built_straight_into_the_store_equals_the_converted_packed_model`).

{text}
""")


if __name__ == "__main__":
    main()
