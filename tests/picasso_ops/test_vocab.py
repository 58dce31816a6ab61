"""Dynamic vocabulary: the id hash table against a dict, admission, eviction policies, full table, state_dict."""

import random

import pytest
import torch

from picasso_ops.vocab import DynamicEmbeddingTable, IdHashTable, TableFullError, hashed_init


# ---------------------------------------------------------------- hash table
@pytest.mark.parametrize("load_factor", [0.5, 0.9])
def test_hash_table_matches_dict(load_factor: float) -> None:
    """Random batched inserts/finds/erases with duplicates and huge/negative ids; 90% of buckets in use at 0.9."""
    rng = random.Random(1)
    cap = 460
    table = IdHashTable(cap, load_factor=load_factor)
    ref: dict[int, int] = {}
    pool = [rng.randrange(-(2**63), 2**63) for _ in range(700)] + list(range(-50, 50))
    near_full_seen = False
    for _ in range(250):
        ids_list = [rng.choice(pool) for _ in range(rng.randrange(1, 80))]
        ids = torch.tensor(ids_list, dtype=torch.int64)
        op = rng.random()
        if op < 0.55:
            n_new = len(set(ids_list) - set(ref))
            if len(ref) + n_new > cap:
                with pytest.raises(TableFullError):
                    table.insert(ids)
            else:
                slots = table.insert(ids).tolist()
                for i, s in zip(ids_list, slots):
                    assert ref.setdefault(i, s) == s
        elif op < 0.8:
            freed = set(table.erase(ids).tolist())
            assert freed == {ref[i] for i in set(ids_list) if i in ref}
            for i in set(ids_list):
                ref.pop(i, None)
        assert table.find(ids).tolist() == [ref.get(i, -1) for i in ids_list]
        assert len(table) == len(ref)
        assert len(set(ref.values())) == len(ref) and all(0 <= s < cap for s in ref.values())  # no slot shared
        near_full_seen |= len(ref) >= cap - 5
    keys, slots = table.items()
    assert dict(zip(keys.tolist(), slots.tolist())) == ref
    if load_factor > 0.9:
        assert near_full_seen and table.num_buckets == 512


def test_hash_table_fills_exactly_and_reuses_slots() -> None:
    table = IdHashTable(64, load_factor=1.0)  # 128 buckets: capacity + 1 at least
    ids = torch.arange(64) * 1_000_003
    slots = table.insert(ids)
    assert sorted(slots.tolist()) == list(range(64)) and len(table) == 64
    with pytest.raises(TableFullError, match="free slots"):
        table.insert(torch.tensor([7]))
    assert len(table) == 64  # a failed insert changes nothing
    for round_ in range(20):  # churn: tombstones pile up and get rebuilt away
        gone = table.erase(ids[:10])
        ids = torch.cat([ids[10:], torch.arange(10) + 10**9 * (round_ + 1)])
        got = table.insert(ids[-10:])
        assert sorted(got.tolist()) == sorted(gone.tolist())
        assert (table.find(ids) >= 0).all()


def test_hash_table_rejects_non_int64() -> None:
    with pytest.raises(TypeError, match="int64"):
        IdHashTable(4).find(torch.tensor([1.0]))


# ---------------------------------------------------------------- dynamic table
def test_admission_by_min_frequency() -> None:
    t = DynamicEmbeddingTable(10, 4, min_frequency=3, optimizer_params={"lr": 1.0})
    t.lookup(torch.tensor([5, 5, 9]))
    assert len(t) == 0 and t.stats.pending == 2
    rows = t(torch.tensor([9, 5]))  # 5 reaches 3 here, 9 has 2
    assert len(t) == 1 and t.stats.admitted == 1
    assert rows[0].abs().sum() == 0  # not admitted: the default row
    assert torch.equal(rows[1], hashed_init(torch.tensor([5]), 4, 0.01, 0)[0])
    rows.sum().backward()  # only the admitted id is updated
    after = t.lookup(torch.tensor([9, 5]), admit=False)
    assert after[0].abs().sum() == 0
    assert torch.allclose(after[1], rows[1] - 1.0)


@pytest.mark.parametrize("eviction", ["lfu", "lru"])
def test_eviction_order(eviction: str) -> None:
    t = DynamicEmbeddingTable(3, 2, eviction=eviction)
    t.lookup(torch.tensor([1]))
    t.lookup(torch.tensor([1]))
    t.lookup(torch.tensor([1]))  # 1: three uses, oldest recent use among {1, 2} after the next steps
    t.lookup(torch.tensor([2]))
    t.lookup(torch.tensor([3]))
    t.lookup(torch.tensor([2]))  # 2: two uses, recent; 3: one use; 1: least recent
    t.lookup(torch.tensor([4]))  # full: one victim
    kept = set(t.state_dict()["ids"].tolist())
    victim = 3 if eviction == "lfu" else 1
    assert kept == {1, 2, 3, 4} - {victim}
    assert t.stats.evicted == 1


def test_ttl_expiry() -> None:
    t = DynamicEmbeddingTable(10, 2, eviction="ttl", ttl_steps=2)
    t.lookup(torch.tensor([1, 2]))
    t.lookup(torch.tensor([2]))
    t.lookup(torch.tensor([3]))  # step 3: 1 unseen for 2 steps: still alive
    assert set(t.state_dict()["ids"].tolist()) == {1, 2, 3}
    t.lookup(torch.tensor([3]))  # step 4: 1 unseen for 3 > 2 steps: expired
    assert set(t.state_dict()["ids"].tolist()) == {2, 3} and t.stats.expired == 1
    t.lookup(torch.tensor([3]))
    assert set(t.state_dict()["ids"].tolist()) == {3} and t.stats.expired == 2


def test_full_table_reject_policy_reports_and_keeps_rows(caplog: pytest.LogCaptureFixture) -> None:
    t = DynamicEmbeddingTable(3, 4, full_policy="reject", optimizer_params={"lr": 0.5})
    first = t(torch.tensor([10, 11, 12]))
    first.sum().backward()
    before = t.state_dict()
    with caplog.at_level("WARNING"):
        rows = t(torch.tensor([13, 13, 14, 10]))
    assert "full" in caplog.text
    assert rows[:3].abs().sum() == 0  # rejected ids read the default row
    assert t.stats.rejected == 2 and t.stats.evicted == 0 and len(t) == 3
    after = t.state_dict()
    assert torch.equal(after["ids"], before["ids"]) and torch.equal(after["weight"], before["weight"])


def test_full_table_evict_never_touches_rows_in_use() -> None:
    """Evict policy with every row in use by the batch: the surplus is rejected, rows are intact."""
    t = DynamicEmbeddingTable(2, 2, full_policy="evict")
    t.lookup(torch.tensor([1, 2]))
    w = t.state_dict()["weight"].clone()
    rows = t.lookup(torch.tensor([1, 2, 3]))
    assert t.stats.rejected == 1 and t.stats.evicted == 0
    assert torch.equal(rows[:2], w) and rows[2].abs().sum() == 0
    t.lookup(torch.tensor([3]))  # now 3 may evict: one of 1, 2 goes
    assert t.stats.evicted == 1 and 3 in t.state_dict()["ids"].tolist()


def test_optimizer_state_moves_with_row_and_new_rows_start_clean() -> None:
    t = DynamicEmbeddingTable(2, 2, optimizer="rowwise_adagrad", eviction="lru", optimizer_params={"lr": 0.1})
    t(torch.tensor([1, 2])).sum().backward()
    sd = t.state_dict()
    assert torch.allclose(sd["momentum1"], torch.ones(2))
    t(torch.tensor([2])).sum().backward()
    t(torch.tensor([3])).sum().backward()  # evicts 1 (least recent); 3 gets fresh state in 1's slot
    sd = t.state_dict()
    assert sd["ids"].tolist() == [2, 3]
    assert sd["momentum1"].tolist() == [2.0, 1.0]


def test_state_dict_by_raw_id_round_trip() -> None:
    src = DynamicEmbeddingTable(50, 3, optimizer="adam", min_frequency=2, optimizer_params={"lr": 0.01})
    gen = torch.Generator().manual_seed(0)
    for _ in range(10):
        ids = torch.randint(-(2**40), 2**40, (5,), generator=gen)
        ids = torch.cat([ids, ids[:3], torch.tensor([7, 7])])
        src(ids).pow(2).sum().backward()
    sd = src.state_dict()
    assert torch.equal(sd["ids"], torch.sort(sd["ids"]).values)  # ascending raw ids
    dst = DynamicEmbeddingTable(40, 3, optimizer="adam", min_frequency=2)  # a smaller table that holds them
    dst.load_state_dict(sd)
    probe = torch.cat([sd["ids"], torch.tensor([123456789])])
    assert torch.equal(dst.lookup(probe, admit=False), src.lookup(probe, admit=False))
    sd2 = dst.state_dict()
    for key in sd:
        assert torch.equal(sd[key], sd2[key]), key
    too_small = DynamicEmbeddingTable(2, 3, optimizer="adam")
    with pytest.raises(RuntimeError, match="do not fit"):
        too_small.load_state_dict(sd)


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="ttl_steps"):
        DynamicEmbeddingTable(4, 2, eviction="ttl")
    with pytest.raises(ValueError, match="full_policy"):
        DynamicEmbeddingTable(4, 2, full_policy="drop")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="int64"):
        DynamicEmbeddingTable(4, 2).lookup(torch.tensor([1], dtype=torch.int32))
