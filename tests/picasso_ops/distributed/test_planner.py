"""The sharding planner: its choices, its overrides and their errors, and mixed plans on real gloo ranks.

Mixed plans are checked the way the row-sharded tables are (tests/picasso_ops/distributed/test_sharded_tables.py, whose
batch, slicing and loss helpers this reuses): the ranks' forwards and their tables after each step
equal one process's on the global batch.
"""
from __future__ import annotations

import logging

import pytest
import torch
import torch.distributed as dist

import sparse_scale
from picasso_ops.config import PicassoConfig
from picasso_ops.distributed import shard_rows, sparse_step
from picasso_ops.distributed.mixed import MixedEmbeddingCollection
from picasso_ops.distributed.planner import CostModel, expected_unique_ids, plan_tables, resolve_overrides
from picasso_ops.embedding import PackedEmbeddingCollection, TableSpec
from sparse_scale.multiproc import run_distributed
from tests.sparse_scale.test_entry import FIELDS, PICASSO, VOCAB, OwnDLRM, _train_dlrm, ds_config
from tests.picasso_ops.distributed.test_sharded_tables import _global_batch, _loss, _slice, _specs

# t0 (two fields) and t2 (3 rows: fewer than some ranks) row-wise; t1 (mean) and t3 (another pack) replicated
MIXED = {"t0": "row_wise", "t1": "data_parallel", "t2": "row_wise", "t3": "data_parallel"}


# ----------------------------------------------------------------------------- the planner's choices

def test_tiny_tables_stay_data_parallel_and_huge_ones_go_row_wise():
    specs = [TableSpec("tiny", 10, 16), TableSpec("huge", 50_000_000, 16, optimizer="adam")]
    plan = plan_tables(specs, world_size=4, batch_size=256)
    assert plan.choice("tiny") == "data_parallel" and "hot" in plan.tables[0].why  # every row touched each step
    assert plan.choice("huge") == "row_wise" and "MiB" in plan.tables[1].why  # weights + Adam state: 9.6 GB
    assert plan.tables[1].memory_bytes["data_parallel"] == 50_000_000 * (16 * 4 + 2 * 16 * 4)
    assert plan.tables[1].memory_bytes["row_wise"] == 12_500_000 * (16 * 4 + 2 * 16 * 4)
    assert plan.uniform is None and plan.names("row_wise") == ("huge",)


def test_one_rank_and_sequence_tables_are_data_parallel():
    plan = plan_tables([TableSpec("big", 10**8, 16)], world_size=1, batch_size=256)
    assert plan.choice("big") == "data_parallel" and plan.tables[0].why.startswith("one rank")
    seq = plan_tables([TableSpec("s", 10**8, 16, pooling="none")], world_size=2, batch_size=256)
    assert seq.choice("s") == "data_parallel" and "sequence" in seq.tables[0].why


def test_cost_decides_between_them_and_the_fixed_exchange_cost_can_veto_it():
    # a 100k-row table touched by 4096 ids per rank: row-wise halves the update and moves fewer bytes
    cheap_net = CostModel(latency_s=1e-6)
    plan = plan_tables([TableSpec("t", 100_000, 64, optimizer="rowwise_adagrad")], world_size=4, batch_size=4096,
                       cost=cheap_net)
    t = plan.tables[0]
    assert t.choice == "row_wise" and t.seconds["row_wise"] < t.seconds["data_parallel"]
    # the same table when a collective costs a second: the saving cannot pay for row-wise's extra exchanges
    slow_net = CostModel(latency_s=1.0)
    vetoed = plan_tables([TableSpec("t", 100_000, 64, optimizer="rowwise_adagrad")], world_size=4, batch_size=4096,
                         cost=slow_net)
    assert vetoed.choice("t") == "data_parallel" and "fixed cost" in vetoed.tables[0].why


def test_the_pipeline_takes_the_row_wise_forward_exchange_off_the_step():
    # DLRM's shape: 26 tables x 100,000 rows, 256 ids per rank and table; the pipeline prepares the lookups ahead
    specs = [TableSpec(f"t{i}", 100_000, 16) for i in range(26)]
    plain = plan_tables(specs, world_size=2, batch_size=256)
    piped = plan_tables(specs, world_size=2, batch_size=256, pipelined=True)
    assert plain.uniform == "data_parallel" and piped.uniform == "row_wise"
    a, b = plain.tables[0].seconds, piped.tables[0].seconds
    assert a["data_parallel"] == b["data_parallel"] and b["row_wise"] < a["row_wise"]
    # a hot table stays replicated either way: a replica keeps its lookups local
    hot = plan_tables([TableSpec("hot", 40, 16)], world_size=2, batch_size=256, pipelined=True)
    assert hot.choice("hot") == "data_parallel" and "hot" in hot.tables[0].why


def test_the_rec_job_plans_pipelined_and_an_own_script_on_the_step():
    from picasso_ops.models.field_embeddings import SparseArgs
    from sparse_scale.planned_tables import planned_field_embeddings

    def placed(pipelined: bool) -> str:
        make = planned_field_embeddings(PicassoConfig(), world_size=2, batch_size=256, pipelined=pipelined)
        emb = make([20_000] * 8, 16, "sum", SparseArgs(), 0.01, "emb")
        return type(emb.collection).__name__

    assert placed(pipelined=True) == "RowShardedEmbeddingCollection"  # the rec job's loop runs the pipeline
    assert placed(pipelined=False) == "DataParallelEmbeddingCollection"  # tables_from_block: lookups on the step


def test_a_callers_unique_id_estimate_replaces_the_uniform_one():
    spec = TableSpec("t", 100_000, 64, optimizer="rowwise_adagrad")
    assert plan_tables([spec], world_size=4, batch_size=4096, cost=CostModel(latency_s=1e-6)).choice("t") == "row_wise"
    skewed = plan_tables([spec], world_size=4, batch_size=4096, unique_ids={"t": 3.0}, cost=CostModel(latency_s=1e-6))
    assert skewed.choice("t") == "data_parallel" and skewed.tables[0].unique_ids == 3.0
    assert expected_unique_ids(100, 0) == 0.0 and expected_unique_ids(100, 10**6) == pytest.approx(100.0)


def test_overrides_win_and_the_plan_prints_one_line_per_table(caplog):
    specs = [TableSpec("tiny", 10, 16), TableSpec("huge", 50_000_000, 16)]
    plan = plan_tables(specs, world_size=4, batch_size=256, overrides={"tiny": "row_wise", "huge": "data_parallel"})
    assert (plan.choice("tiny"), plan.choice("huge")) == ("row_wise", "data_parallel")
    with caplog.at_level(logging.INFO, logger="picasso_ops.distributed.planner"):
        plan.log(rank=1)
        assert not caplog.records  # rank 0 only
        plan.log(rank=0)
    text = caplog.records[0].getMessage()
    assert "table  rows" in text and "tiny   10" in text and "override (table_sharding)" in text
    assert "50,000,000" in text and len(text.splitlines()) == 1 + 1 + len(specs)


def test_override_keys_name_tables_or_fields_and_bad_ones_are_named():
    specs = [TableSpec("emb0", 5, 4), TableSpec("emb1", 5, 4), TableSpec("wide1", 5, 1)]
    index = {"emb0": 0, "emb1": 1, "wide1": 1}
    got = resolve_overrides({"1": "row_wise", "emb0": "data_parallel"}, specs, index)
    assert got == {"emb0": "data_parallel", "emb1": "row_wise", "wide1": "row_wise"}
    with pytest.raises(ValueError, match=r"table_sharding\.emb7: no table is named 'emb7'"):
        resolve_overrides({"emb7": "row_wise"}, specs, index)
    with pytest.raises(ValueError, match=r"table_sharding\.emb0: placement must be one of"):
        resolve_overrides({"emb0": "table_wise"}, specs, index)
    with pytest.raises(ValueError, match=r"table_sharding\.emb1: table 'emb1' is also overridden"):
        resolve_overrides({"1": "row_wise", "emb1": "data_parallel"}, specs, index)
    with pytest.raises(ValueError, match=r"overrides name tables \['nope'\]"):
        plan_tables(specs, world_size=2, batch_size=8, overrides={"nope": "row_wise"})


def test_the_block_validates_table_sharding_once_naming_the_key():
    block = PicassoConfig.model_validate({"sharding": "auto", "table_sharding": {"3": "row_wise"}})
    assert block.table_sharding == {"3": "row_wise"}
    with pytest.raises(ValueError, match=r"table_sharding\.emb3\n  Input should be 'data_parallel' or 'row_wise'"):
        PicassoConfig.model_validate({"sharding": "auto", "table_sharding": {"emb3": "rowwise"}})
    with pytest.raises(ValueError, match='applies with sharding "auto" only'):
        PicassoConfig.model_validate({"sharding": "data_parallel", "table_sharding": {"3": "row_wise"}})
    assert PicassoConfig.model_validate({"table_sharding": {"3": "row_wise"}}).planned  # "auto" is the default
    with pytest.raises(ValueError, match="with a cache every table stays data-parallel"):
        PicassoConfig.model_validate({"table_sharding": {"3": "row_wise"}, "cache": {"rows": 10}})
    with pytest.raises(ValueError, match='with bounds_check "clamp" every table stays data-parallel'):
        PicassoConfig.model_validate({"table_sharding": {"3": "row_wise"}, "bounds_check": "clamp"})
    with pytest.raises(sparse_scale.ConfigError, match=r"picasso.table_sharding.emb9: no table is named 'emb9'"):
        sparse_scale.tables_from_block(ds_config(picasso={**PICASSO, "sharding": "auto",
                                                          "table_sharding": {"emb9": "row_wise"}}), [10, 20])


def test_tables_from_block_builds_the_plans_class():
    auto = {**PICASSO, "sharding": "auto"}
    uniform = sparse_scale.tables_from_block(ds_config(picasso=auto), [10, 20], dim=4)  # one rank: replicas
    assert type(uniform).__name__ == "PackedFieldEmbeddings"
    assert type(uniform.collection).__name__ == "DataParallelEmbeddingCollection"
    mixed = sparse_scale.tables_from_block(ds_config(picasso={**auto, "table_sharding": {"1": "row_wise"}}),
                                           [10, 20], dim=4)
    assert type(mixed).__name__ == "PlannedFieldEmbeddings"
    assert mixed.collection.placement("emb0") == "data_parallel" and mixed.collection.placement("emb1") == "row_wise"
    assert mixed(torch.tensor([1, 2, 3]), torch.tensor([[1, 1], [1, 0]])).shape == (2, 2, 4)


# ----------------------------------------------------------------------------- mixed plans against one process

# Row-wise Adagrad divides each row's step by the root of its mean squared gradient, which turns the last-bit
# differences of a few near-zero gradients (the replicated part's fused C++ forward against the reference's torch
# forward) into a few 1e-6 of weight; sgd and adam agree to 1e-7. A lost or doubled update moves rows by ~lr.
ATOL = {"adam": 1e-6, "rowwise_adagrad": 2e-5}


def _assert_close(name: str, got: dict, want: dict, atol: float) -> None:
    """Weights to ``atol`` absolute, optimizer state (sums of squares, can be >> 1) to 1e-5 relative."""
    assert set(got) == set(want), (name, sorted(got), sorted(want))
    for key in want:
        tol = (atol, 0.0) if key.endswith(".weight") else (1e-6, 1e-5)
        torch.testing.assert_close(got[key].float(), want[key].float(), atol=tol[0], rtol=tol[1], msg=f"{name}: {key}")


def _check_mixed(rank: int, world: int, steps: int = 2, batch: int = 8) -> dict:
    """Each step's forward, the tables after the steps and eval of a mixed plan = one process on the global batch."""
    report = {}
    for optimizer, atol in ATOL.items():
        torch.manual_seed(0)  # same reference (and initial rows) on every rank
        ref = PackedEmbeddingCollection(_specs(optimizer), custom_ops=False, rank_local=True)
        init = {k: v.clone() for k, v in ref.state_dict().items()}
        torch.manual_seed(rank)  # the ranks' own draws differ: agreement must come from the loads and exchanges
        mixed = MixedEmbeddingCollection(_specs(optimizer), MIXED)
        mixed.load_full_state_dict(init)
        # each rank holds every replicated row and only its own rows of the row-wise tables
        assert mixed.table_weight("t1").shape[0] == 30 and mixed.table_weight("t3").shape[0] == 40
        assert mixed.table_weight("t0").shape[0] == shard_rows(50, rank, world)
        for step in range(steps):
            full = _global_batch(step, batch * world, weighted=step % 2 == 1)
            local = _slice(full, rank, world)
            want = ref(full)
            _loss(want.values, step).backward()
            got = mixed(local)
            assert got.keys == want.keys and got.column_offsets == want.column_offsets
            b = batch
            torch.testing.assert_close(got.values, want.values[rank * b:(rank + 1) * b], atol=atol, rtol=1e-6)
            _loss(got.values, step).backward()
            assert sparse_step(mixed) == 2  # both parts, each once: the container is not stepped itself
        _assert_close(f"mixed/{optimizer}", mixed.full_state_dict(), ref.state_dict(), atol)  # gathers the shards
        with torch.no_grad():  # eval: a collective for the row-wise part, local for the replicas
            local = _slice(_global_batch(99, batch * world, False), rank, world)
            torch.testing.assert_close(mixed(local).values, ref(local).values, atol=atol, rtol=1e-6)
        replicated = mixed.data_parallel.state_dict()
        report[optimizer] = float(sum(v.double().sum() for v in replicated.values()))
    return report


def test_a_mixed_plan_matches_one_process_on_the_global_batch_on_two_ranks():
    reports = run_distributed(_check_mixed, 2, timeout_s=60)
    assert reports[0] == reports[1]  # the replicated part is bit-identical across ranks


def test_a_mixed_plan_on_one_process_equals_the_plain_collection():
    _check_mixed(0, 1, steps=2)


def test_a_plan_must_place_every_table_once():
    with pytest.raises(ValueError, match=r"tables without a placement \['t3'\]"):
        MixedEmbeddingCollection(_specs("sgd"), {k: v for k, v in MIXED.items() if k != "t3"})
    with pytest.raises(ValueError, match=r"bad placements \{'t0': 'table_wise'\}"):
        MixedEmbeddingCollection(_specs("sgd"), {**MIXED, "t0": "table_wise"})


# ----------------------------------------------------------------------------- an own script with sharding auto

def _own_script_auto(rank: int, world: int, config: dict, steps: int) -> dict:
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda r: records.append(r.getMessage())  # type: ignore[method-assign]
    logging.getLogger("picasso_ops.distributed.planner").addHandler(handler)
    logging.getLogger("picasso_ops.distributed.planner").setLevel(logging.INFO)
    torch.manual_seed(0)
    tables = sparse_scale.tables_from_block(config, [VOCAB] * FIELDS)
    engine, _, _, _ = sparse_scale.initialize(model=OwnDLRM(tables), config=config)
    losses = _train_dlrm(engine, rank, steps)
    coll = engine.module.tables.collection
    mine = torch.tensor([float(sum(v.double().sum() for v in coll.data_parallel.state_dict().values()))],
                        dtype=torch.float64)
    sums = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(sums, mine)
    full = coll.full_state_dict()  # a collective: the shards gathered
    return {"class": type(tables).__name__, "placement": {f"emb{i}": coll.placement(f"emb{i}") for i in range(FIELDS)},
            "losses": losses, "replica_sums": [float(s) for s in sums], "plan_logs": len(records),
            "full_sum": float(sum(v.double().sum() for v in full.values())),
            "shard_rows": coll.table_weight("emb1").shape[0]}


def test_an_own_script_trains_with_sharding_auto_and_a_mixed_plan_on_two_ranks():
    picasso = {**PICASSO, "sharding": "auto", "table_sharding": {"1": "row_wise", "emb3": "row_wise"}}
    results = run_distributed(_own_script_auto, world_size=2, args=(ds_config(picasso=picasso), 8), timeout_s=60)
    for rank, r in enumerate(results):
        assert r["class"] == "PlannedFieldEmbeddings"
        assert r["placement"] == {"emb0": "data_parallel", "emb1": "row_wise", "emb2": "data_parallel",
                                  "emb3": "row_wise"}
        assert r["shard_rows"] == shard_rows(VOCAB, rank, 2)
        assert r["replica_sums"][0] == r["replica_sums"][1]  # replicated tables stay identical
        assert all(torch.isfinite(torch.tensor(r["losses"])))
    assert results[0]["full_sum"] == results[1]["full_sum"]  # both ranks see the same full tables
    assert [r["plan_logs"] for r in results] == [1, 0]  # the plan logged once, on rank 0


# ----------------------------------------------------------------------------- the rec job with sharding auto

def _rec_auto(tmp_path, name: str, steps: int, *extra: str, model: str = "dlrm") -> list[dict]:
    from tests.e2e.test_train_rec_picasso import BLOCK, SMALL, _config, _run

    block = {**BLOCK, "sharding": "auto", "table_sharding": {"0": "row_wise", "5": "row_wise"}}
    cfg = _config(tmp_path / "cfg", block)
    argv = [*SMALL, "--model", model, "--steps", str(steps), "--config", cfg, "--out", str(tmp_path / name),
            "--save-every", "2", *extra]
    return run_distributed(_run, 2, args=(argv,), timeout_s=55, init_process_group=False)


@pytest.mark.soak  # a whole rec job on 2 ranks: 19 s on the loaded 2-core machine
def test_the_rec_job_trains_a_mixed_plan_on_two_ranks(tmp_path):
    ranks = _rec_auto(tmp_path, "a", 3)
    for r in ranks:
        assert r["summary"]["steps"] == 3 and 0.0 < r["summary"]["auc"] < 1.0
    assert ranks[0]["summary"]["auc"] == ranks[1]["summary"]["auc"]  # one eval over both ranks' samples
    keys = ranks[0]["state"].keys()
    assert any(k.startswith("embeddings.collection.row_wise.") for k in keys), sorted(keys)[:5]
    replicated = [k for k in keys if k.startswith("embeddings.collection.data_parallel.")]
    assert replicated and all((ranks[0]["state"][k] == ranks[1]["state"][k]).all() for k in replicated)


@pytest.mark.soak
def test_the_rec_job_resumes_a_mixed_plan_exactly(tmp_path):
    straight = _rec_auto(tmp_path, "straight", 4)
    _rec_auto(tmp_path, "half", 2)
    resumed = _rec_auto(tmp_path, "half", 4, "--resume")
    for want, got in zip(straight, resumed):  # each rank: its replicas and its own shards
        assert got["summary"]["steps"] == 4 and got["summary"]["samples"] == want["summary"]["samples"]
        assert want["state"].keys() == got["state"].keys()
        assert all((want["state"][k] == got["state"][k]).all() for k in want["state"]), "resumed weights differ"
        assert got["summary"]["auc"] == pytest.approx(want["summary"]["auc"], abs=1e-6)
