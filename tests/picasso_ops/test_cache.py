"""Hot-row cache: same weights as no cache, policies on handmade traces, flush, prefetch, stores, errors."""

import inspect
import os
import threading
import time
from typing import Optional

import pytest
import torch

from picasso_ops.cache import (CachedEmbeddingTable, HostRowStore, MmapRowStore, RowStore, StoredRows, TableRowService,
                               TableRowStore, belady_hit_rate)
from picasso_ops.embedding import PackedEmbeddingCollection, TableSpec
from picasso_ops.jagged import JaggedBatch

N, D, B, L = 2000, 8, 32, 4  # table rows, dim, samples per batch, ids per sample


def _batches(steps: int, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    probs = torch.arange(1, N + 1, dtype=torch.float64).pow(-1.1)
    perm = torch.randperm(N, generator=gen)  # hot ids scattered over the table
    return [perm[torch.multinomial(probs, B * L, replacement=True, generator=gen)].view(B, L) for _ in range(steps)]


def _targets(steps: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randn(B, D, generator=gen) for _ in range(steps)]


def _reference(batches: list[torch.Tensor], targets: list[torch.Tensor], w0: torch.Tensor, optimizer: str,
               params: dict) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The plain full table: PackedEmbeddingCollection, sum pooling, its fused optimizer.

    On the pure-torch kernels, whose arithmetic (and summation order) the cache's update
    shares: the C++ kernels agree to float rounding (tests/picasso_ops/ops/test_kernels.py), not bit for bit.
    """
    emb = PackedEmbeddingCollection([TableSpec("t", N, D, pooling="sum", optimizer=optimizer, optimizer_params=params)],
                                    custom_ops=False)
    with torch.no_grad():
        emb.table_weight("t").copy_(w0)
    for ids, tgt in zip(batches, targets):
        out = emb(JaggedBatch(["t"], ids.reshape(-1), torch.full((B,), L)))
        (out["t"] - tgt).pow(2).sum().backward()
    return emb.table_weight("t").clone(), {k: v.clone() for k, v in emb.table_state("t").items()}


def _train_cached(table: CachedEmbeddingTable, batches: list[torch.Tensor], targets: list[torch.Tensor],
                  prefetch: Optional[str]) -> None:
    for i, (ids, tgt) in enumerate(zip(batches, targets)):
        nxt = batches[i + 1] if i + 1 < len(batches) else None
        if prefetch == "early" and nxt is not None:
            table.prefetch(nxt)  # before this batch's lookup: the next batch's rows may change meanwhile
        pooled = table(ids).sum(1)
        if prefetch == "overlap" and nxt is not None:
            table.prefetch(nxt)  # the intended place: overlapped with this step's compute
        (pooled - tgt).pow(2).sum().backward()


@pytest.mark.parametrize("optimizer,prefetch", [("sgd", None), ("rowwise_adagrad", None),
                                                ("rowwise_adagrad", "overlap"), ("sgd", "early"), ("adam", None)])
def test_cache_equals_no_cache(optimizer: str, prefetch: Optional[str]) -> None:
    steps = 40
    batches, targets = _batches(steps), _targets(steps)
    w0 = torch.empty(N, D).uniform_(-0.1, 0.1, generator=torch.Generator().manual_seed(2))
    params = {"lr": 0.005 if optimizer == "sgd" else 0.05}  # plain SGD at 0.05 diverges on the hot rows
    ref_w, ref_state = _reference(batches, targets, w0, optimizer, params)
    state_dims = {"rowwise_adagrad": {"momentum1": 1}, "adam": {"momentum1": D, "momentum2": D}}.get(optimizer, {})
    store = HostRowStore(N, D, state_dims, weight=w0)
    table = CachedEmbeddingTable(store, capacity=N // 10, optimizer=optimizer, optimizer_params=params, policy="lfu")
    _train_cached(table, batches, targets, prefetch)
    assert table.stats.evictions > 500 and table.stats.writebacks > 500  # the 10% cache really churned
    if prefetch:
        assert table.stats.prefetched > 0
    table.flush()
    assert torch.allclose(store.weight, ref_w, atol=1e-6, rtol=0)
    if optimizer == "rowwise_adagrad":
        assert torch.allclose(store.state["momentum1"].squeeze(1), ref_state["momentum1"], atol=1e-6, rtol=0)


class _SlowStore(HostRowStore):
    """A host store whose reads take a while, so a prefetch is still in flight when the step goes on."""

    def get_rows(self, ids: torch.Tensor) -> StoredRows:
        time.sleep(0.05)
        return super().get_rows(ids)


def test_prefetch_racing_update_of_same_row() -> None:
    """Row 7 is prefetched (old value) while the current step updates and evicts it: the next lookup sees the update."""
    store = _SlowStore(20, 2, weight=torch.zeros(20, 2))
    table = CachedEmbeddingTable(store, capacity=2, optimizer_params={"lr": 1.0})
    table.prefetch(torch.tensor([7, 8]))  # in flight: reads 7 = [0, 0]
    table(torch.tensor([7])).sum().backward()  # 7 -> [-1, -1] in the cache
    table.lookup(torch.tensor([1, 2]))  # evicts 7: write-back queued
    got = table.lookup(torch.tensor([7, 8]))
    assert store.weight[7].tolist() == [-1.0, -1.0]
    assert got.tolist() == [[-1.0, -1.0], [0.0, 0.0]]
    # 7 came from the prefetch at its first lookup (then fresh); 8 at the last one; 7's copy was not reused
    assert table.stats.prefetched == 2


def test_prefetch_reads_the_right_rows_in_background() -> None:
    w = torch.arange(40.0).view(20, 2)
    store = HostRowStore(20, 2, weight=w)
    table = CachedEmbeddingTable(store, capacity=6)
    table.lookup(torch.tensor([1, 2]))
    reader = []
    orig = store.get_rows

    def spy(ids: torch.Tensor) -> StoredRows:
        reader.append((threading.current_thread().name, ids.tolist()))
        return orig(ids)

    store.get_rows = spy  # type: ignore[method-assign]
    table.prefetch(torch.tensor([[2, 5], [9, 5]]))
    got = table.lookup(torch.tensor([5, 2, 9]))
    assert reader == [(reader[0][0], [5, 9])] and reader[0][0].startswith("cache-io")  # misses only, one read
    assert torch.equal(got, w[[5, 2, 9]])
    assert table.stats.prefetched == 2 and table.stats.misses == 4 and table.stats.hits == 1
    table.close()


def test_wait_io_leaves_the_store_idle() -> None:
    """After wait_io no store call is in flight: a slow prefetch and a slow write-back have both finished."""
    store = HostRowStore(20, 2, weight=torch.arange(40.0).view(20, 2))
    table = CachedEmbeddingTable(store, capacity=2, optimizer="sgd", optimizer_params={"lr": 1.0})
    busy, calls = threading.Event(), []
    get, put = store.get_rows, store.put_rows

    def slow(fn, name):
        def call(*a, **k):
            busy.set()
            time.sleep(0.2)
            calls.append(name)
            busy.clear()
            return fn(*a, **k)
        return call

    table.lookup(torch.tensor([1, 2]))
    table.apply_gradients(torch.tensor([1, 2]), torch.ones(2, 2))  # both dirty
    store.get_rows, store.put_rows = slow(get, "get"), slow(put, "put")  # type: ignore[method-assign]
    table.lookup(torch.tensor([3, 4]))  # evicts 1 and 2: their write-back goes to the I/O thread
    table.prefetch(torch.tensor([5, 6]))
    table.wait_io()
    assert not busy.is_set() and "put" in calls and calls.count("get") == 2  # the lookup's miss and the prefetch
    assert torch.equal(get(torch.tensor([1])).rows, torch.tensor([[1.0, 2.0]]))  # 2, 3 minus the SGD step
    table.close()


def test_lru_and_lfu_on_handmade_traces() -> None:
    def resident(policy: str, trace: list[list[int]], **kw: float) -> set[int]:
        t = CachedEmbeddingTable(HostRowStore(10, 1), capacity=2, policy=policy, **kw)  # type: ignore[arg-type]
        for ids in trace:
            t.lookup(torch.tensor(ids))
        return set(t._index.items()[0].tolist())

    trace = [[1], [1], [1], [2], [3]]
    assert resident("lru", trace) == {2, 3}  # 1 is least recent
    assert resident("lfu", trace) == {1, 3}  # 2 is least frequent
    aging = [[1], [1], [1], [1], [2], [2], [3]]
    assert resident("lfu", aging) == {1, 3}  # 1: 4 uses vs 2: 2 uses
    # aging at lookup 6 multiplies counts by 0.25: 1 -> 1.0, 2 -> 0.25 + 1: the once-hot row 1 goes
    assert resident("lfu", aging, aging_interval=6, aging_factor=0.25) == {2, 3}


def test_lfu_remembers_evicted_rows_frequency() -> None:
    """The sketch counts ids that are not cached: a row that was hot, evicted and re-read outranks a newcomer."""
    t = CachedEmbeddingTable(HostRowStore(10, 1), capacity=2, policy="lfu")
    for ids in ([1], [1], [1], [2, 3], [2, 3], [2, 3], [2, 3]):  # 1 is evicted at the first [2, 3]
        t.lookup(torch.tensor(ids))
    assert t.frequency(torch.tensor([1, 2, 4])).tolist() == [3.0, 4.0, 0.0]
    t.lookup(torch.tensor([1, 2]))  # 1 comes back (count 4), evicting 3
    t.lookup(torch.tensor([4]))  # newcomer: evicts the lower of 1 (4) and 2 (5)
    assert set(t._index.items()[0].tolist()) == {2, 4}
    t.lookup(torch.tensor([5]))  # 4 has 1 use, 2 has 5: 4 goes
    assert set(t._index.items()[0].tolist()) == {2, 5}


def test_flush_and_state_dict_write_back() -> None:
    store = HostRowStore(10, 2, {"momentum1": 1})
    table = CachedEmbeddingTable(store, capacity=4, optimizer="rowwise_adagrad", optimizer_params={"lr": 0.1})
    table(torch.tensor([3, 4])).sum().backward()
    assert store.weight.abs().sum() == 0  # write-back: nothing reached the store yet
    table.flush()
    assert torch.allclose(store.weight[3], torch.full((2,), -0.1)) and store.state["momentum1"][3].item() == 1.0
    assert not table.dirty.any() and table.stats.writebacks == 2
    table.flush()
    assert table.stats.writebacks == 2  # clean rows are not written again
    table(torch.tensor([3])).sum().backward()
    sd = table.state_dict()  # a checkpoint flushes first
    assert int(sd["optimizer_steps"]) == 2 and store.state["momentum1"][3].item() == 2.0


def test_hit_rate_stats_and_belady() -> None:
    table = CachedEmbeddingTable(HostRowStore(10, 1), capacity=2, policy="lru")
    for ids in ([1, 2], [1, 2, 2], [2], [3], [1]):  # hits: 1, 2, 2; [3] evicts 1, [1] evicts 2
        table.lookup(torch.tensor(ids))
    s = table.stats
    assert (s.hits, s.misses, s.evictions) == (3, 4, 2) and s.hit_rate == pytest.approx(3 / 7)
    table.reset_stats()
    assert table.stats.hit_rate == 0.0
    assert belady_hit_rate(torch.tensor([1, 2, 3, 1, 2, 3, 1]), 2) == pytest.approx(2 / 7)


def test_mmap_store_round_trip(tmp_path) -> None:
    path = tmp_path / "rows.bin"
    w = torch.randn(300, 4)
    store = MmapRowStore(path, 300, 4, {"momentum1": 1}, create=True, weight=w, drop_page_cache=True)
    assert os.path.getsize(path) == 300 * 5 * 4
    store.put_rows(torch.tensor([5, 299]), torch.ones(2, 4), {"momentum1": torch.tensor([[3.0], [4.0]])})
    store.put_rows(torch.tensor([6]), torch.full((1, 4), 2.0))  # rows only: state kept
    store.close()
    again = MmapRowStore(path, 300, 4, {"momentum1": 1})
    got = again.get_rows(torch.tensor([299, 5, 0, 6]))
    assert torch.equal(got.rows[:2], torch.ones(2, 4)) and torch.equal(got.rows[2], w[0])
    assert torch.equal(got.rows[3], torch.full((4,), 2.0))
    assert got.state["momentum1"].squeeze(1).tolist() == [4.0, 3.0, 0.0, 0.0]
    again.close()
    with pytest.raises(ValueError, match="bytes, expected"):
        MmapRowStore(path, 301, 4, {"momentum1": 1})
    cached = CachedEmbeddingTable(MmapRowStore(path, 300, 4, {"momentum1": 1}), 20, optimizer="rowwise_adagrad")
    cached(torch.tensor([5])).sum().backward()
    cached.close()
    assert cached.store.get_rows(torch.tensor([5])).state["momentum1"].item() == 3.0 + 1.0


def test_ps_client_adapter_signature() -> None:
    """X"""
    from gba_engine.ps.client import PSClient

    for name in ("get_rows", "put_rows"):
        want = list(inspect.signature(getattr(TableRowService, name)).parameters)
        assert list(inspect.signature(getattr(PSClient, name)).parameters) == want

    class FakePS:
        def __init__(self) -> None:
            self.rows = torch.zeros(50, 3)

        def get_rows(self, table: str, ids: torch.Tensor) -> torch.Tensor:
            return self.rows[ids]

        def put_rows(self, table: str, ids: torch.Tensor, rows: torch.Tensor) -> None:
            self.rows[ids] = rows

    ps = FakePS()
    assert isinstance(ps, TableRowService)
    store = TableRowStore(ps, "user", 50, 3, {"momentum1": 1})
    assert isinstance(store, RowStore)
    table = CachedEmbeddingTable(store, 5, optimizer="rowwise_adagrad", optimizer_params={"lr": 0.1})
    table(torch.tensor([4, 4])).sum().backward()
    table.flush()
    assert torch.allclose(ps.rows[4], torch.full((3,), -0.1))


def test_bad_ids_and_configs_give_clear_errors() -> None:
    store = HostRowStore(10, 2)
    table = CachedEmbeddingTable(store, 3)
    with pytest.raises(IndexError, match=r"in \[0, 10\).*-1"):
        table.lookup(torch.tensor([1, -1]))
    with pytest.raises(IndexError, match=r"in \[0, 10\).*10"):
        table(torch.tensor([10]))
    with pytest.raises(IndexError, match="MmapRowStore|HostRowStore"):
        store.get_rows(torch.tensor([11]))
    with pytest.raises(TypeError, match="int64"):
        table.lookup(torch.tensor([1], dtype=torch.int32))
    with pytest.raises(ValueError, match="does not fit a cache of 3 rows"):
        table.lookup(torch.tensor([1, 2, 3, 4]))
    with pytest.raises(ValueError, match="state_dims"):
        CachedEmbeddingTable(store, 3, optimizer="rowwise_adagrad")
    with pytest.raises(ValueError, match="unique"):
        store.put_rows(torch.tensor([1, 1]), torch.zeros(2, 2))
    assert len(table) == 0  # failed lookups left nothing behind


def test_slot_index_matches_a_dict_under_random_inserts_and_erases() -> None:
    from picasso_ops.cache.slot_index import SlotIndex
    from picasso_ops.vocab.hash_table import TableFullError

    index, model = SlotIndex(64), {}
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        ids = torch.randint(0, 500, (int(torch.randint(1, 12, (1,), generator=g)),), generator=g)
        if bool(torch.rand(1, generator=g) < 0.5):
            fresh = set(ids.tolist()) - model.keys()
            if len(model) + len(fresh) > 64:
                with pytest.raises(TableFullError, match="free slots"):
                    index.insert(ids)
                continue
            slots = index.insert(ids)
            for i, s in zip(ids.tolist(), slots.tolist()):
                assert model.setdefault(i, s) == s  # an id keeps its slot
        else:
            freed = index.erase(ids)
            assert sorted(freed.tolist()) == sorted(model.pop(i) for i in set(ids.tolist()) if i in model)
        assert len(index) == len(model) and len(set(model.values())) == len(model)
        probe = torch.arange(500)
        assert index.find(probe).tolist() == [model.get(i, -1) for i in range(500)]
        held, slots = index.items()
        assert held.tolist() == sorted(model) and index.ids_of(slots).tolist() == held.tolist()
        assert int(index.occupied().sum()) == len(model)
    assert index.find(torch.tensor([-3])).tolist() == [-1]
    with pytest.raises(ValueError, match="never negative"):
        index.insert(torch.tensor([4, -3]))
    index.clear()
    assert len(index) == 0 and not bool(index.occupied().any())
