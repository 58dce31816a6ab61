"""picasso_ops' hot-row cache in front of gba_engine's parameter servers, over real gloo processes.

A worker trains a CachedEmbeddingTable (10% of the rows in the fast tier, row-wise Adagrad fused
into backward) whose slow store is a table on 2 parameter servers (TableRowStore over PSClient: every
miss is a pull, every eviction a put). The same training against an in-memory store gives the
reference: the rows on the servers must equal it after the flush.
"""
from __future__ import annotations

import torch

from sparse_scale.multiproc import run_distributed

ROWS, DIM, CAPACITY, STEPS = 200, 4, 20, 12
OPT = {"lr": 0.1}


def _table0() -> torch.Tensor:
    return torch.randn(ROWS, DIM, generator=torch.Generator().manual_seed(3)) * 0.1


def _ids(step: int) -> torch.Tensor:
    # Zipf-like: a hot head and a long tail, so the 20-row cache hits and evicts
    g = torch.Generator().manual_seed(step)
    u = torch.rand(16, generator=g)
    return (ROWS * u.pow(3)).long().clamp_max(ROWS - 1)


def _train(table) -> list[float]:
    losses = []
    for step in range(STEPS):
        out = table(_ids(step))
        loss = (out - 1.0).pow(2).mean()
        loss.backward()  # the row-wise Adagrad update is fused into backward
        losses.append(loss.item())
    table.flush()
    return losses


def _job(rank: int, world_size: int) -> dict:
    from gba_engine import GBAConfig, OptimizerSpec, ParameterServer, PSClient, init_runtime
    from gba_engine.ps import ServerTableSpec
    from picasso_ops.cache import CachedEmbeddingTable, TableRowStore

    cfg = GBAConfig(mode="gba", num_servers=2, timeout_s=15, heartbeat_s=0.2)
    spec = ServerTableSpec("user", ROWS, DIM)
    rt = init_runtime(cfg)
    if rt.is_server:  # a pure row store here: nothing is pushed, so no server optimizer runs
        ps = ParameterServer(rt, cfg, 0, [spec], OptimizerSpec.of("sgd", lr=0.0), table_init={"user": _table0()})
        stats = ps.serve(until_version=None, max_seconds=40)
        rt.close()
        return {"updates": stats.updates}
    client = PSClient(rt, 0, [spec])
    table = CachedEmbeddingTable(TableRowStore(client, "user", ROWS, DIM, {"momentum1": 1}), CAPACITY,
                                 optimizer="rowwise_adagrad", optimizer_params=OPT)
    losses = _train(table)
    rows = client.get_rows("user", torch.arange(ROWS))
    stats = table.stats
    client.close()
    rt.close()
    return {"losses": losses, "rows": rows, "stats": stats}


def test_cache_over_parameter_servers_trains_like_an_in_memory_store():
    from picasso_ops.cache import CachedEmbeddingTable, HostRowStore

    worker, s0, s1 = run_distributed(_job, world_size=3, timeout_s=60)
    ref_store = HostRowStore(ROWS, DIM, {"momentum1": 1}, weight=_table0())
    ref_losses = _train(CachedEmbeddingTable(ref_store, CAPACITY, optimizer="rowwise_adagrad", optimizer_params=OPT))
    assert worker["losses"] == ref_losses
    torch.testing.assert_close(worker["rows"], ref_store.weight, rtol=0, atol=0)
    assert not torch.equal(worker["rows"], _table0())  # the servers hold the trained rows (written back)
    assert s0["updates"] == s1["updates"] == 0  # rows came and went by get/put only
    st = worker["stats"]
    assert st.hits > 0 and st.evictions > 0 and st.writebacks > 0  # the cache did hit, evict and write back
