"""The worker-side row cache in front of the parameter servers (gba_engine/row_cache.py), over real processes.

One launch of 2 workers + 1 server trains a model with two server tables (hot ids drawn
Zipf-like, so a 24-row cache hits and evicts) three times: sync without the cache, sync with it
(prefetching the next batch's rows during the step), and gba with it behind a straggler. The
consistency rule: sync with the cache equals sync without it; in gba no served cached row lags
its step's token by more than ``gba.staleness.threshold`` versions, and older rows are refreshed.
"""
from __future__ import annotations

import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parameters_to_vector

from sparse_scale.multiproc import run_distributed

STEPS = 8
TABLES = (("a", 60, 4, 1), ("b", 30, 3, 2))  # name, rows, dim, seed
CAPACITY = 24
THRESHOLD = 1


def _specs():
    from gba_engine.ps.sharding import ServerTableSpec

    return [ServerTableSpec(n, rows, dim, init_std=0.3, seed=seed) for n, rows, dim, seed in TABLES]


class ServerNet(nn.Module):
    def __init__(self):
        super().__init__()
        from gba_engine import ServerEmbeddingBagCollection

        self.emb = ServerEmbeddingBagCollection(_specs())
        torch.manual_seed(7)
        self.mlp = nn.Sequential(nn.Linear(4 + 3 + 2, 12), nn.Tanh(), nn.Linear(12, 1))

    def forward(self, x, ids, offsets):
        pooled = self.emb(ids, offsets)
        return self.mlp(torch.cat([pooled["a"], pooled["b"], x], dim=1))


def _batch(step: int, worker: int):
    g = torch.Generator().manual_seed(1000 * step + worker)
    x = torch.randn(8, 2, generator=g)
    ids, offsets = {}, {}
    for name, rows, _, _ in TABLES:
        lengths = torch.randint(1, 4, (8,), generator=g)
        u = torch.rand(int(lengths.sum()), generator=g)
        ids[name] = (rows * u.pow(3)).long().clamp_max(rows - 1)  # a hot head and a long tail
        offsets[name] = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)[:-1]])
    y = torch.tanh(x[:, :1] - 0.5 * x[:, 1:])
    return x, ids, offsets, y


def _config(mode: str) -> dict:
    return {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1,
            "optimizer": {"type": "SGD", "params": {"lr": 0.2}}, "zero_optimization": {"stage": 0},
            "steps_per_print": 10 ** 6, "gradient_clipping": 0.0,
            "gba": {"mode": mode, "num_servers": 1, "timeout_s": 20, "heartbeat_s": 0.2,
                    "staleness": {"threshold": THRESHOLD}}}


def _run(rank: int, mode: str, cached: bool, slow_s: float = 0.0, prefetch: bool = True) -> dict:
    import gba_engine
    from picasso_ops.config import CacheConfig

    cache = CacheConfig(rows=CAPACITY, store="ps", policy="lfu", prefetch=prefetch) if cached else None
    engine = gba_engine.initialize(model=ServerNet(), config=_config(mode), row_cache=cache)
    if engine.is_server:
        return {"server": engine.server_stats}
    for step in range(STEPS):
        x, ids, offsets, y = _batch(step, rank)
        loss = F.mse_loss(engine(x, ids, offsets), y)
        _, next_ids, _, _ = _batch(step + 1, rank)
        engine.prefetch_rows({n: torch.unique(t) for n, t in next_ids.items()})  # overlaps backward and the push
        time.sleep(slow_s if rank == 1 else 0.0)
        engine.backward(loss)
        engine.step()
    if engine.mode == "gba":
        engine.eval()  # some pushes were dropped as too stale: no version to wait for, the servers' current state
    out = {"dense": parameters_to_vector(engine.module.parameters()).detach().clone(),
           "tables": {n: engine.table_rows(n, torch.arange(rows)) for n, rows, _, _ in TABLES},
           "summary": engine.summary()}
    engine.close()
    return out


def _launch(rank: int, world_size: int, modes: str) -> dict:
    if modes == "sync":
        return {"sync": _run(rank, "sync", cached=False), "sync_cached": _run(rank, "sync", cached=True),
                "sync_validated": _run(rank, "sync", cached=True, prefetch=False)}
    return {"gba_cached": _run(rank, "gba", cached=True, slow_s=0.15, prefetch=False),
            # the last step's prefetch is still unread at close: the client drains it, the servers do not wait on it
            "gba_prefetch": _run(rank, "gba", cached=True, slow_s=0.05)}


@pytest.fixture(scope="module")
def launch():
    sync = run_distributed(_launch, world_size=3, args=("sync",), timeout_s=50)
    gba = run_distributed(_launch, world_size=3, args=("gba",), timeout_s=50)
    return {"w0": {**sync[0], **gba[0]}, "w1": {**sync[1], **gba[1]}}


@pytest.mark.soak
def test_sync_with_the_cache_equals_sync_without_it(launch):
    for w, run in ((w, run) for w in ("w0", "w1") for run in ("sync_cached", "sync_validated")):
        plain, cached = launch[w]["sync"], launch[w][run]
        torch.testing.assert_close(cached["dense"], plain["dense"], rtol=0, atol=1e-6)
        for name in plain["tables"]:
            torch.testing.assert_close(cached["tables"][name], plain["tables"][name], rtol=0, atol=1e-6)
        st = cached["summary"]["row_cache"]
        assert st["max_served_age"] == 0  # sync serves only rows read at the step's version
        assert st["evictions"] > 0 and st["lookups"] == st["served"] + st["misses"] + st["refreshes"], (run, str(st))
        assert "row_cache" not in plain["summary"]
    with_prefetch = launch["w0"]["sync_cached"]["summary"]["row_cache"]
    assert with_prefetch["prefetched"] > 0 and with_prefetch["served"] > 0, with_prefetch  # read ahead, then served
    validated = launch["w0"]["sync_validated"]["summary"]["row_cache"]
    # without prefetch every cached row is older than the step's version: validated, the changed ones sent again
    # (in sync every row a worker read was in the global batch that updated it, so all come back changed)
    assert validated["served"] == 0 and validated["refreshes"] > 0 and validated["refreshed_changed"] > 0, validated


@pytest.mark.soak
def test_gba_serves_no_cached_row_older_than_the_staleness_threshold(launch):
    st = launch["w0"]["gba_cached"]["summary"]["row_cache"]
    assert st["served"] > 0 and st["row_bytes_saved"] > 0 and 0 < st["hit_rate"] <= 1, st
    assert st["max_served_age"] <= THRESHOLD, st
    # the servers moved on by more than the bound while rows sat in the cache: those were refreshed, not served
    assert st["max_held_age"] > THRESHOLD and st["refreshes"] > 0, st


@pytest.mark.soak
def test_gba_prefetch_reads_ahead_under_the_same_bound(launch):
    for w in ("w0", "w1"):
        st = launch[w]["gba_prefetch"]["summary"]["row_cache"]
        assert st["prefetched"] > 0 and st["served"] > 0 and st["max_served_age"] <= THRESHOLD, st


def test_cache_refuses_a_store_that_is_not_the_servers():
    from gba_engine.row_cache import ServerRowCache
    from picasso_ops.config import CacheConfig

    with pytest.raises(ValueError, match="store 'ps'"):
        ServerRowCache(_specs(), CacheConfig(rows=4, store="memory"), num_servers=1)


class _FakeServers:
    """An in-process stand-in for PSClient's validating pulls: one table, row stamps, a version.

    A request is answered when collected (as a server answers a pull that waited for its min_version).
    """

    def __init__(self, rows: int, dim: int) -> None:
        self.weight = torch.randn(rows, dim, generator=torch.Generator().manual_seed(0))
        self.row_stamp = torch.zeros(rows, dtype=torch.int64)
        self.clock = self.version = 0
        self.requests = 0
        self.abandoned = 0

    def update(self, ids: torch.Tensor) -> None:  # one server update of rows `ids`
        self.clock += 1
        self.version += 1
        self.weight[ids] += 1.0
        self.row_stamp[ids] = self.clock

    def request_rows(self, ids, stamps, *, min_version=None, prefetch=False):
        from gba_engine.ps.client import RowRequest

        self.requests += 1
        mins = (-1 if min_version is None else min_version,)
        return RowRequest(seqs={}, ids={n: t.clone() for n, t in ids.items()}, routes={"stamps": stamps},
                          min_version=mins)

    def collect_rows(self, request):
        from gba_engine.ps.client import RowReply

        changed = {}
        for name, ids in request.ids.items():
            pos = (self.row_stamp[ids] > request.routes["stamps"][name]).nonzero().squeeze(1)
            changed[name] = (pos, self.weight[ids[pos]].clone())
        return RowReply(changed=changed, versions=(self.version,), stamps=(self.clock,), finished=False)

    def abandon(self, request) -> None:
        self.abandoned += 1


def _cache(rows: int, capacity: int, prefetch: bool = True):
    from gba_engine.ps.sharding import ServerTableSpec
    from gba_engine.row_cache import ServerRowCache
    from picasso_ops.config import CacheConfig

    return ServerRowCache([ServerTableSpec("t", rows, 2)], CacheConfig(rows=capacity, store="ps", prefetch=prefetch), 1)


def test_cache_reads_equal_the_servers_rows_under_updates_and_overflow():
    servers, cache = _FakeServers(50, 2), _cache(50, capacity=6)
    g = torch.Generator().manual_seed(1)
    for step in range(30):
        ids = torch.unique(torch.randint(0, 50, (10,), generator=g))  # often more distinct ids than slots
        need = (servers.version,)
        rows, _ = cache.fetch(servers, {"t": ids}, need=need, max_age=0, min_version=servers.version)
        torch.testing.assert_close(rows["t"], servers.weight[ids], rtol=0, atol=0)  # sync: exactly the servers'
        servers.update(ids[: ids.numel() // 2])
    st = cache.stats
    assert st.evictions > 0 and st.misses > 0 and st.refreshes > 0 and cache.capacity("t") == 6


def test_gba_rule_serves_rows_up_to_max_age_then_validates():
    servers, cache = _FakeServers(20, 2), _cache(20, capacity=20)
    ids = torch.tensor([1, 2, 3])
    cache.fetch(servers, {"t": ids}, need=(0,), max_age=2, min_version=None)
    servers.update(torch.tensor([7]))
    servers.update(torch.tensor([7]))  # version 2: rows 1-3 are 2 versions old, unchanged
    before = servers.requests
    rows, token = cache.fetch(servers, {"t": ids}, need=(2,), max_age=2, min_version=None)
    assert servers.requests == before and token is None  # served: nobody asked
    servers.update(torch.tensor([2]))  # version 3: past the bound, and row 2 changed
    rows, token = cache.fetch(servers, {"t": ids}, need=(3,), max_age=2, min_version=None)
    assert servers.requests == before + 1 and token == (3,)
    torch.testing.assert_close(rows["t"], servers.weight[ids], rtol=0, atol=0)
    assert cache.stats.max_served_age == 2 and cache.stats.refreshed_changed == 1


def test_a_prefetch_for_a_later_version_is_dropped_not_waited_for():
    servers, cache = _FakeServers(20, 2), _cache(20, capacity=20)
    cache.prefetch(servers, {"t": torch.tensor([4, 5])}, min_version=1)  # asks for the update after this step
    rows, _ = cache.fetch(servers, {"t": torch.tensor([4, 6])}, need=(0,), max_age=0, min_version=0)
    assert cache.stats.prefetches_dropped == 1 and servers.abandoned == 1
    torch.testing.assert_close(rows["t"], servers.weight[torch.tensor([4, 6])], rtol=0, atol=0)
    cache.prefetch(servers, {"t": torch.tensor([4, 9])}, min_version=1)  # answered once update 1 is applied
    servers.update(torch.tensor([9]))
    rows, token = cache.fetch(servers, {"t": torch.tensor([4, 9])}, need=(1,), max_age=0, min_version=1)
    assert cache.stats.prefetched == 2 and token is None  # both rows came with the prefetch, read at version 1
    torch.testing.assert_close(rows["t"], servers.weight[torch.tensor([4, 9])], rtol=0, atol=0)


@pytest.mark.slow
@pytest.mark.soak
def test_train_rec_runs_packed_server_tables_behind_the_cache_and_a_slow_link(tmp_path):
    import json
    from pathlib import Path

    from tests.e2e.test_train_rec_gba import _run as train_rec_rank

    root = Path(__file__).resolve().parents[2]
    cfg = json.loads((root / "ds_configs" / "gba_cpu.json").read_text())
    cfg["train_micro_batch_size_per_gpu"] = 32
    cfg["wandb"] = {"enabled": False}
    cfg["gba"].update(mode="gba", timeout_s=30, heartbeat_s=0.5)
    cfg["picasso"] = {"packing": True, "embedding_dim": 8, "optimizer": {"type": "sgd", "lr": 0.05},
                      "cache": {"rows": 520, "policy": "lru", "store": "ps", "prefetch": True}}
    config = tmp_path / "cached.json"
    config.write_text(json.dumps(cfg))
    argv = ["--eval-samples", "1024", "--vocab", "200", "--threads", "1", "--steps", "10", "--config", str(config),
            "--out", str(tmp_path / "out"), "--ps-link-latency-ms", "0.2", "--ps-link-mbit", "2000"]
    w0, w1, server = run_distributed(train_rec_rank, 3, args=(argv,), timeout_s=120, init_process_group=False)
    assert server == {"server": True}
    for w in (w0, w1):
        cache = w["gba"]["row_cache"]
        assert cache["lookups"] > 0 and cache["hits"] > 0, cache
        assert cache["max_served_age"] <= cfg["gba"]["staleness"]["threshold"], cache
        assert w["gba"]["ps_bytes"]["pulled"] > 0 and w["gba"]["ps_bytes"]["pushed"] > 0
    assert 0.0 < w0["auc"] < 1.0
