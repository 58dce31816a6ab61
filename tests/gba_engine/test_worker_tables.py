"""Auto mode keeps the server tables on the workers in sync phases and hands them over at each switch.

Real processes: 2 workers + 1 server (gloo on 127.0.0.1), a wide-and-deep model over packed
server tables with row-wise Adagrad (one accumulator per row: optimizer state that must travel).
An auto run is forced sync -> gba at step 3 and back at step 6 (lockstep, ``max_lead`` 0):

* at the return, the workers' rows equal, bit for bit, the rows the servers hold at the end of
  the gba phase, and their Adagrad accumulators and step counts equal what the servers saved in
  a checkpoint written at that point;
* both workers' tables are identical at the end (no rank diverges);
* the whole run equals a plain sync run whose rows stay on the servers (the same updates: the
  hand-overs lose nothing), to float rounding;
* a checkpoint written in a sync phase (rows on the workers) and resumed continues exactly.

Plus, in one process, the workers' update of a global batch equals the servers' (``WorkerTables``
against ``ParameterServer``'s row optimizer on the same gradients).
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from sparse_scale.multiproc import run_distributed
from tests.gba_engine.test_packed_tables import ADAGRAD, DENSE_LR, SCHEDULER, _batch, _group_tables, _server_model

STEPS = 8
TO_GBA, TO_SYNC = 3, 6
SWITCH = {"window": 2, "min_dwell_steps": 1000, "slow_ratio": 1000.0, "recover_ratio": 999.0}  # forced only


def _config(mode: str, **gba) -> dict:
    return {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1,
            "optimizer": {"type": "SGD", "params": {"lr": DENSE_LR}}, "zero_optimization": {"stage": 0},
            "steps_per_print": 10 ** 6, "gradient_clipping": 0.0, "scheduler": SCHEDULER,
            "gba": {"mode": mode, "num_servers": 1, "timeout_s": 20, "heartbeat_s": 0.2, "max_lead": 0, **gba}}


def _rows(engine, model) -> dict[str, torch.Tensor]:
    return {n: engine.table_rows(n, torch.arange(rows)).clone() for n, (rows, _) in _group_tables(model).items()}


def _train(engine, step: int, rank: int) -> None:
    dense, values, lengths, labels = _batch(step, rank)
    engine.backward(F.binary_cross_entropy_with_logits(engine(dense, values, lengths), labels))
    engine.step()


def _held_state(engine) -> dict[str, dict]:
    return {n: t.state_dict() for n, t in engine.ctx.worker_tables.tables.items()}


def _auto(rank: int, tmp: str) -> dict:
    import gba_engine
    from gba_engine.checkpoint import load_tables

    model = _server_model(ADAGRAD)
    engine = gba_engine.initialize(model=model, config=_config("auto", switch=SWITCH))
    if engine.is_server:
        return {}
    out: dict = {"modes": []}
    for step in range(STEPS):
        if step == TO_GBA:
            engine.switch_to_gba("forced")
        if step == TO_SYNC:
            engine.client.pull(dense=False, min_version=TO_SYNC)  # every push of the phase is applied
            out["servers_rows"] = _rows(engine, model)  # gba: the servers' rows
            engine.save_checkpoint(os.path.join(tmp, "gba_end"), tag="t")  # the servers' rows and Adagrad state
            engine.switch_to_sync("forced")
            out["returned_rows"] = _rows(engine, model)  # sync: this worker's copy
            out["returned_state"] = _held_state(engine)
            out["saved_state"] = load_tables(os.path.join(tmp, "gba_end", "t"), 0, 1)
        _train(engine, step, rank)
        out["modes"].append(engine.mode)
    out["rows"] = _rows(engine, model)
    out["switches"] = engine.summary()["switches"]
    engine.close()
    return out


def _sync_reference(rank: int) -> dict:
    import gba_engine

    model = _server_model(ADAGRAD)
    engine = gba_engine.initialize(model=model, config=_config("sync"))
    if engine.is_server:
        return {}
    for step in range(STEPS):
        _train(engine, step, rank)
    out = {"rows": _rows(engine, model)}
    engine.close()
    return out


def _resumed(rank: int, tmp: str, first: int, save: str | None = None, load: str | None = None) -> dict:
    import gba_engine

    model = _server_model(ADAGRAD)
    engine = gba_engine.initialize(model=model, config=_config("auto", switch=SWITCH))
    if engine.is_server:
        return {}
    if load:
        engine.load_checkpoint(os.path.join(tmp, load))
    for step in range(first, first + STEPS // 2):
        _train(engine, step, rank)
    if save:
        engine.save_checkpoint(os.path.join(tmp, save), tag="t")  # sync phase, rows on the workers
    out = {"rows": _rows(engine, model), "here": engine.ctx.tables_here}
    engine.close()
    return out


def _round_trip(rank: int, world_size: int, tmp: str) -> dict:
    return {"auto": _auto(rank, tmp), "sync": _sync_reference(rank)}


def _checkpoint(rank: int, world_size: int, tmp: str) -> dict:
    return {"first": _resumed(rank, tmp, 0, save="half"), "second": _resumed(rank, tmp, STEPS // 2, load="half")}


@pytest.fixture(scope="module")
def launch(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("gba_worker_tables"))
    out: dict = {"w0": {}, "w1": {}}
    for fn in (_round_trip, _checkpoint):  # two launches, each well inside its deadline
        res = run_distributed(fn, world_size=3, args=(tmp,), timeout_s=50)
        out["w0"].update(res[0])
        out["w1"].update(res[1])
    return out


@pytest.mark.soak
def test_the_rows_and_their_optimizer_state_come_back_as_the_servers_trained_them(launch):
    run = launch["w0"]["auto"]
    assert run["modes"] == ["sync"] * TO_GBA + ["gba"] * (TO_SYNC - TO_GBA) + ["sync"] * (STEPS - TO_SYNC)
    for name, rows in run["servers_rows"].items():
        assert torch.equal(run["returned_rows"][name], rows), name
    for name, saved in run["saved_state"].items():  # rows, Adagrad accumulators, step count: the servers' own
        held = run["returned_state"][name]
        assert set(held) == set(saved) == {"weight", "momentum1", "steps"}, (set(held), set(saved))
        assert held["steps"] == saved["steps"] == TO_SYNC
        for key in ("weight", "momentum1"):
            assert torch.equal(held[key], saved[key]), (name, key)
    assert all(run["returned_state"][n]["momentum1"].abs().sum() > 0 for n in run["returned_state"])


@pytest.mark.soak
def test_no_worker_diverges_and_the_switch_moves_the_rows_both_ways(launch):
    w0, w1 = launch["w0"]["auto"], launch["w1"]["auto"]
    for name in w0["rows"]:
        assert torch.equal(w0["rows"][name], w1["rows"][name]), name
    switches = w0["switches"]
    assert [(e["src"], e["dst"]) for e in switches] == [("sync", "gba"), ("gba", "sync")]
    table_bytes = sum((r.numel() + r.shape[0]) * 4 for r in w0["rows"].values())  # rows + an accumulator per row
    assert switches[0]["nbytes"] == switches[1]["nbytes"] > table_bytes, switches  # the dense part on top


@pytest.mark.soak
def test_an_auto_run_with_round_trip_equals_sync_with_rows_on_the_servers(launch):
    auto, sync = launch["w0"]["auto"], launch["w0"]["sync"]
    for name, rows in sync["rows"].items():
        torch.testing.assert_close(auto["rows"][name], rows, rtol=1e-5, atol=1e-6)


@pytest.mark.soak
def test_a_checkpoint_of_a_sync_phase_with_rows_on_the_workers_resumes_exactly(launch):
    second, sync = launch["w0"]["second"], launch["w0"]["sync"]
    assert launch["w0"]["first"]["here"] and second["here"]
    for name, rows in sync["rows"].items():
        torch.testing.assert_close(second["rows"][name], rows, rtol=1e-5, atol=1e-6)


def test_the_workers_update_of_a_global_batch_equals_the_servers():
    from gba_engine.ps.optim import OptimizerSpec, TableOptimizerSpec
    from gba_engine.ps.sharding import ServerTableSpec
    from gba_engine.tokens import GlobalBatchBuffer
    from gba_engine.worker_tables import WorkerTables

    spec = ServerTableSpec("t", 12, 3, init_std=0.1, seed=4, optimizer=TableOptimizerSpec.of("rowwise_adagrad", lr=0.2))
    held = WorkerTables([spec], OptimizerSpec.of("sgd", lr=0.1), num_servers=1, schedule=None)
    server = spec.optimizer.build_rows(spec.initial_table(1))
    assert torch.equal(held.tables["t"].weight, server.weight)
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        ids = torch.unique(torch.randint(0, 12, (6,), generator=g))
        grads = torch.randn(ids.numel(), 3, generator=g)
        held.step({"t": ids}, {"t": grads}, version=0, local_samples=8, group=None)
        buf = GlobalBatchBuffer(0, {"t": 3})
        buf.add(1.0, 8, None, {"t": ids}, {"t": grads})
        batch = buf.mean()
        server.step(batch.ids["t"], batch.rows["t"])
    assert torch.equal(held.tables["t"].weight, server.weight)
    assert torch.equal(held.tables["t"].state["momentum1"], server.state["momentum1"])
    assert held.tables["t"].steps == server.steps == 3
    shard = held.shard(1, 2)  # server 1 of 2 holds ids 1, 3, 5, ...
    assert torch.equal(shard["t"]["weight"], server.weight[1::2]) and shard["t"]["steps"] == 3


def test_worker_tables_refuse_bad_gradients_and_unknown_tables_by_name():
    from gba_engine.ps.optim import OptimizerSpec
    from gba_engine.ps.sharding import ServerTableSpec
    from gba_engine.worker_tables import WorkerTables

    held = WorkerTables([ServerTableSpec("t", 5, 2)], OptimizerSpec.of("sgd", lr=0.1), 1, None)
    with pytest.raises(KeyError, match="no server table 'u'"):
        held.rows({"u": torch.tensor([0])})
    with pytest.raises(IndexError, match="table 't'"):
        held.rows({"t": torch.tensor([7])})
    with pytest.raises(ValueError, match="table 't': gradient shape"):
        held.step({"t": torch.tensor([1])}, {"t": torch.zeros(2, 2)}, version=0, local_samples=4, group=None)


def test_the_table_hand_over_commands_travel_the_control_plane():
    from gba_engine.protocol import GetTables, PutTables, decode_command, encode_command

    for command in (PutTables(src=0, version=12), GetTables(src=1)):
        assert decode_command(encode_command(command)) == command
