"""Cache over gba_engine's parameter server (issue 4 items 5 and 9): training samples/s with the PS as the slow store.

The same model and data as ``benchmarks/cache.py`` (b): ``fields`` pooled lookups
in one table of ``vocab`` rows, then an MLP, row-wise Adagrad on the table,
Zipf(1.1) ids. Here the table lives on a real parameter server (a separate
process, gloo over 127.0.0.1; ``PSClient`` pulls and puts rows, the worker keeps
the Adagrad state) and three runs in the worker process train on three copies
of it, alternating in chunks of ``CHUNK`` steps:

* ``no cache``: every step pulls its unique rows from the server and puts them
  back after the update (``cache.py``'s ``StoreTable`` over ``TableRowStore``);
* ``cache``: a ``CachedEmbeddingTable`` at 10% of the rows in front of the
  server (LFU, write-back, prefetch of the next batch's misses);
* ``cache, no prefetch``: the same without the prefetch.

The worker waits for a cache's in-flight store I/O at the end of its chunk
(``wait_io``: one ``PSClient`` must not be used by two threads at once), and
that wait counts in the cached run's time. All three tables must end equal
(checked after a flush). Each run of this script is added to RESULTS.md.

Run::

    .venv/bin/python benchmarks/cache_ps.py            # ~3 minutes
    .venv/bin/python benchmarks/cache_ps.py --quick    # small, no RESULTS.md
"""
from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent

SECTION = "## Cache over the parameter server (issue 4 items 5 and 9)"
RUNS = ("no_cache", "cache", "cache_no_prefetch")
PARAMS = {"lr": 0.05}


def _worker(rt: Any, cfg: dict[str, int], specs: list) -> dict[str, Any]:
    from cache import CHUNK, Model, StoreTable, train, zipf_batches  # benchmarks/cache.py

    from gba_engine import PSClient
    from picasso_ops.cache import CachedEmbeddingTable, TableRowStore

    vocab, dim, batch, fields, pool = cfg["vocab"], cfg["dim"], cfg["batch"], cfg["fields"], cfg["pool"]
    warmup, steps = cfg["warmup"], cfg["steps"]
    client = PSClient(rt, 0, specs)
    state_dims = {"momentum1": 1}
    stores = {name: TableRowStore(client, name, vocab, dim, state_dims) for name in RUNS}
    tables: dict[str, Any] = {"no_cache": StoreTable(stores["no_cache"], "rowwise_adagrad", PARAMS)}
    for name in RUNS[1:]:
        tables[name] = CachedEmbeddingTable(stores[name], vocab // 10, optimizer="rowwise_adagrad",
                                            optimizer_params=PARAMS)
    models = {name: Model(tables[name], fields, dim) for name in RUNS}
    opts = {name: torch.optim.SGD(models[name].mlp.parameters(), lr=0.01) for name in RUNS}
    flat = zipf_batches(vocab, batch * fields * pool, warmup + steps, seed=2)
    batches = [b.view(batch, fields, pool) for b in flat]
    gen = torch.Generator().manual_seed(4)
    labels = [torch.randint(0, 2, (batch,), generator=gen).float() for _ in batches]

    def chunk(name: str, lo: int, hi: int) -> float:
        t0 = time.perf_counter()
        prefetch = name == "cache"
        after = batches[hi] if prefetch and hi < len(batches) else None
        train(models[name], opts[name], batches[lo:hi], labels[lo:hi], prefetch=prefetch, following=after)
        if name != "no_cache":
            tables[name].wait_io()  # the client is free for the next run (and this run pays its own I/O)
        return time.perf_counter() - t0

    for name in RUNS:
        chunk(name, 0, warmup)
    for name in RUNS[1:]:
        tables[name].reset_stats()
    secs = dict.fromkeys(RUNS, 0.0)
    for lo in range(warmup, warmup + steps, CHUNK):
        hi = min(lo + CHUNK, warmup + steps)
        for name in RUNS:
            secs[name] += chunk(name, lo, hi)
    out: dict[str, Any] = {name: batch * steps / secs[name] for name in RUNS}
    out["hit_rate"] = tables["cache"].stats.hit_rate
    out["prefetched"] = tables["cache"].stats.prefetched / max(1, tables["cache"].stats.misses)
    for name in RUNS[1:]:
        tables[name].flush()
        tables[name].wait_io()
    probe = torch.arange(vocab)
    got = {name: stores[name].get_rows(probe) for name in RUNS}
    ref = got["no_cache"]
    out["max_weight_diff"] = max(float((ref.rows - got[n].rows).abs().max()) for n in RUNS[1:])
    out["max_state_diff"] = max(float((ref.state["momentum1"] - got[n].state["momentum1"]).abs().max())
                                for n in RUNS[1:])
    for name in RUNS[1:]:
        tables[name].close()
    client.close()
    return out


def job(rank: int, world_size: int, cfg: dict[str, int]) -> dict[str, Any]:
    """Rank 0 trains (the worker), rank 1 serves the three tables."""
    from gba_engine import GBAConfig, OptimizerSpec, ParameterServer, init_runtime
    from gba_engine.ps import ServerTableSpec
    from picasso_ops.vocab.dynamic_table import hashed_init

    torch.set_num_threads(1)
    gba = GBAConfig(mode="gba", num_servers=1, timeout_s=60, heartbeat_s=0.2)
    specs = [ServerTableSpec(name, cfg["vocab"], cfg["dim"]) for name in RUNS]
    rt = init_runtime(gba)
    try:
        if rt.is_server:  # a pure row store: nothing is pushed, so its optimizer never runs
            w0 = hashed_init(torch.arange(cfg["vocab"]), cfg["dim"], 0.05, seed=3)
            ps = ParameterServer(rt, gba, 0, specs, OptimizerSpec.of("sgd", lr=0.0),
                                 table_init={name: w0.clone() for name in RUNS})
            stats = ps.serve(until_version=None, max_seconds=cfg["max_seconds"])
            return {"server": True, "updates": stats.updates}
        return _worker(rt, cfg, specs)
    finally:
        rt.close()


def run(cfg: dict[str, int], timeout_s: float) -> dict[str, Any]:
    """One worker and one server process over gloo; the worker's figures."""
    from sparse_scale.multiproc import run_distributed

    worker, server = run_distributed(job, world_size=2, args=(cfg,), timeout_s=timeout_s)
    if server.get("updates"):
        raise RuntimeError(f"the server applied {server['updates']} updates; it should only serve rows")
    return worker


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small sizes, no RESULTS.md")
    args = parser.parse_args()
    if args.quick:
        cfg = dict(vocab=50_000, dim=32, batch=256, fields=8, pool=3, steps=10, warmup=20, max_seconds=120)
    else:
        cfg = dict(vocab=1_000_000, dim=32, batch=256, fields=8, pool=3, steps=40, warmup=100, max_seconds=900)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    from embedding import load_average  # benchmarks/embedding.py

    load_before = load_average()
    t0 = time.perf_counter()
    out = run(cfg, timeout_s=cfg["max_seconds"] + 60)
    total = time.perf_counter() - t0
    from cache import CHUNK

    cmd = " ".join([".venv/bin/python benchmarks/cache_ps.py", *sys.argv[1:]])
    text = f"""Command: `{cmd}` ({platform.machine()}, torch {torch.__version__}, 1 thread per process,
{os.cpu_count()} cores, 1-minute load average {load_before} before, {load_average()} after; {total:.0f} s in all).
One worker and one parameter-server process (gloo over 127.0.0.1). Table of {cfg['vocab']:,} x {cfg['dim']} on the
server (three copies, one per run; row-wise Adagrad state on the worker); {cfg['fields']} fields x pooling
{cfg['pool']}, MLP 256-256-1, batch {cfg['batch']}, Zipf(1.1) ids; {cfg['warmup']} warm-up steps, then
{cfg['steps']} timed steps, the runs alternating in chunks of {CHUNK} steps.

| run | samples/s | vs no cache |
|---|---|---|
| no cache (each step pulls its rows from the server and puts them back) | {out['no_cache']:,.0f} | 1.00x |
| cache 10% (LFU, write-back, prefetch of the next batch) | {out['cache']:,.0f} | {out['cache'] / out['no_cache']:.2f}x |
| cache 10%, no prefetch | {out['cache_no_prefetch']:,.0f} | {out['cache_no_prefetch'] / out['no_cache']:.2f}x |

Cache hit rate in the timed steps {out['hit_rate']:.3f}; {100 * out['prefetched']:.0f}% of misses served by the
prefetch; prefetch on vs off: {out['cache'] / out['cache_no_prefetch']:.2f}x. All three server tables end equal
(max |diff|: weights {out['max_weight_diff']:.1e}, Adagrad state {out['max_state_diff']:.1e}). Target (issue 4):
>= 2x with the cache at 10%.
"""
    print(text)
    if not args.quick:
        from embedding import write_section  # benchmarks/embedding.py: dated runs under one heading

        write_section(HERE / "RESULTS.md", SECTION, text,
                      title=f"{time.strftime('%Y-%m-%d %H:%M')}, benchmarks/cache_ps.py")
        print(f"wrote {HERE / 'RESULTS.md'}")


if __name__ == "__main__":
    main()
