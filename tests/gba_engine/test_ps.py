"""The GBA parameter server: units (layout, sharding, wire, optimizers) and real multi-process runs.

Multi-process tests (gloo on 127.0.0.1, each with a hard deadline):
* the tuning-free property: with no stragglers and M = N, GBA updates equal synchronous
  all-reduce steps (SGD and Adam, 2 workers + 1 or 2 servers, dense and embeddings);
* a slowed worker: staleness appears and the fast worker pushes more;
* a killed worker (rank 0, the default store's host): the server finishes with the other;
* the cache-store calls (get_rows/put_rows), put_dense, stall detection and bad configs.
"""
from __future__ import annotations

import dataclasses
import os
import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parameters_to_vector, vector_to_parameters
from torch.optim.adam import adam as torch_adam_kernel

from gba_engine.config import GBAConfig
from gba_engine.ps import (DenseSharding, ServerTableSpec, Header, Kind, OptimizerSpec, ParameterServer, ProtocolError,
                           PSClient, PSStalledError, RowRoute, init_runtime, layout)
from gba_engine.ps import wire
from gba_engine.ps.sharding import local_index
from sparse_scale.multiproc import run_distributed


# ====================================================================== units
def test_layout_roles_and_bad_num_servers():
    lay = layout(5, 2)
    assert lay.workers == (0, 1, 2) and lay.servers == (3, 4)
    assert [lay.role(r) for r in range(5)] == ["worker"] * 3 + ["server"] * 2
    assert lay.server_index(4) == 1 and lay.worker_index(2) == 2
    with pytest.raises(ValueError, match="is a worker"):
        lay.server_index(0)
    with pytest.raises(ValueError, match="outside a launch of 5"):
        lay.role(5)
    with pytest.raises(ValueError, match=r"gba.num_servers=2 leaves no worker in a launch of 2 ranks"):
        layout(2, 2)
    with pytest.raises(ValueError, match="num_servers=3 leaves no worker"):
        layout(2, 3)
    with pytest.raises(ValueError, match=">= 1"):
        layout(2, 0)


def test_dense_sharding_is_balanced_and_round_trips():
    sh = DenseSharding(10, 3)
    assert sh.bounds == ((0, 4), (4, 7), (7, 10))
    flat = torch.arange(10.0)
    parts = sh.split(flat)
    assert [p.tolist() for p in parts] == [[0, 1, 2, 3], [4, 5, 6], [7, 8, 9]]
    assert torch.equal(sh.join(parts), flat)
    assert DenseSharding(2, 3).bounds == ((0, 1), (1, 2), (2, 2))
    with pytest.raises(ValueError, match="shard sizes"):
        sh.join([torch.zeros(3)] * 3)


def test_row_route_splits_by_id_mod_s_and_restores_order():
    ids = torch.tensor([7, 2, 4, 9, 2, 7])
    route = RowRoute.build(ids, num_servers=2)
    assert route.counts == (2, 2)
    assert [t.tolist() for t in route.server_ids()] == [[2, 4], [7, 9]]
    assert local_index(torch.tensor([2, 4, 7, 9]), 2).tolist() == [1, 2, 3, 4]
    table = torch.arange(10.0).unsqueeze(1) * torch.tensor([[1.0, 10.0]])  # row id = [id, 10 id]
    blocks = [table[t] for t in route.server_ids()]  # what the servers would send back
    rows = route.merge(blocks)[route.inverse]
    assert torch.equal(rows, table[ids])
    summed = route.coalesce(torch.ones(6, 2))
    assert dict(zip(route.unique.tolist(), summed[:, 0].tolist())) == {2: 2.0, 4: 1.0, 7: 2.0, 9: 1.0}
    assert torch.equal(torch.cat(route.split(route.unique.unsqueeze(1).float())).squeeze(1).long(),
                       torch.cat(route.server_ids()))


def test_embedding_spec_rows_and_id_checks():
    spec = ServerTableSpec("t", num_rows=10, dim=2)
    assert [spec.local_rows(s, 3) for s in range(3)] == [4, 3, 3]
    with pytest.raises(IndexError, match=r"ids must be in \[0, 10\)"):
        spec.check_ids(torch.tensor([3, 10]))
    with pytest.raises(TypeError, match="int64"):
        spec.check_ids(torch.tensor([1], dtype=torch.int32))
    with pytest.raises(ValueError, match="num_rows and dim"):
        ServerTableSpec("t", 0, 2)


def test_wire_header_and_payloads_round_trip():
    h = Header(kind=Kind.PUSH, seq=3, src=1, schema=77, version=5, min_version=-1, num_samples=8, flags=1,
               n_ints=4, n_floats=6)
    t = h.to_tensor()
    assert t.shape == (wire.HEADER_LEN,) and Header.from_tensor(t) == h
    bad = t.clone()
    bad[0] = 1
    with pytest.raises(ProtocolError, match="bad magic"):
        Header.from_tensor(bad)
    bad = t.clone()
    bad[1] = 99
    with pytest.raises(ProtocolError, match="unknown message kind"):
        Header.from_tensor(bad)
    ints = wire.pack_ints([torch.tensor([4, 5]), torch.empty(0, dtype=torch.int64), torch.tensor([9])])
    assert ints.tolist() == [2, 0, 1, 4, 5, 9]
    assert [b.tolist() for b in wire.unpack_ints(ints, 3)] == [[4, 5], [], [9]]
    with pytest.raises(ProtocolError, match="do not match"):
        wire.unpack_ints(torch.tensor([3, 1]), 1)
    floats = wire.pack_floats(torch.arange(3.0), [torch.ones(2, 2), torch.zeros(1, 3)])
    dense, rows = wire.unpack_floats(floats, 3, [2, 1], [2, 3])
    assert dense.tolist() == [0, 1, 2] and rows[0].shape == (2, 2) and rows[1].shape == (1, 3)
    with pytest.raises(ProtocolError, match="implies"):
        wire.unpack_floats(floats, 2, [2, 1], [2, 3])
    specs = [ServerTableSpec("a", 5, 2)]
    assert wire.schema_id(3, specs) == wire.schema_id(3, specs) != wire.schema_id(4, specs)


def test_optimizer_spec_follows_deepspeed_naming():
    assert OptimizerSpec.from_deepspeed({"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}}).type == "adamw"
    spec = OptimizerSpec.from_deepspeed({"type": "Adam", "params": {"lr": 1e-3, "adam_w_mode": False,
                                                                    "betas": [0.8, 0.9]}})
    assert spec.type == "adam" and spec.kwargs == {"lr": 1e-3, "betas": (0.8, 0.9)}
    assert isinstance(spec.build_dense([nn.Parameter(torch.zeros(2))]), torch.optim.Adam)
    assert OptimizerSpec.from_deepspeed({"type": "AdamW", "params": {"adam_w_mode": False}}).type == "adamw"
    assert OptimizerSpec.from_deepspeed({"type": "SGD", "params": {"lr": 0.1}}).type == "sgd"
    with pytest.raises(ValueError, match="cannot run on the parameter servers"):
        OptimizerSpec.from_deepspeed({"type": "Lamb", "params": {}})
    with pytest.raises(ValueError, match="optimizer 'sgd' with params"):
        OptimizerSpec.of("sgd", lr=0.1, bogus=1)
    with pytest.raises(ValueError, match="amsgrad"):
        OptimizerSpec.of("adam", amsgrad=True)


@pytest.mark.parametrize("spec", [
    OptimizerSpec.of("sgd", lr=0.1, momentum=0.9, weight_decay=0.01, nesterov=True),
    OptimizerSpec.of("sgd", lr=0.1, momentum=0.5, dampening=0.3),
    OptimizerSpec.of("adam", lr=0.01, weight_decay=0.1),
    OptimizerSpec.of("adamw", lr=0.01, betas=(0.8, 0.99)),
    OptimizerSpec.of("adagrad", lr=0.1, lr_decay=0.05, initial_accumulator_value=0.1),
], ids=["sgd-nesterov", "sgd-dampening", "adam-l2", "adamw", "adagrad"])
def test_row_optimizer_equals_torch_when_every_row_is_present(spec):
    torch.manual_seed(0)
    w0 = torch.randn(5, 3)
    ref = nn.Parameter(w0.clone())
    opt = spec.build_dense([ref])
    rows = spec.build_rows(w0)
    for _ in range(4):
        g = torch.randn(5, 3)
        ref.grad = g.clone()
        opt.step()
        perm = torch.randperm(5)  # row order of the request must not matter
        rows.step(perm, g[perm])
    torch.testing.assert_close(rows.weight, ref.detach(), rtol=1e-5, atol=1e-6)
    assert torch.equal(w0, w0.clone())


def test_row_optimizer_is_lazy_for_absent_rows():
    w0 = torch.ones(4, 2)
    lazy = OptimizerSpec.of("adam", lr=0.1).build_rows(w0)
    lazy.step(torch.tensor([0, 1]), torch.ones(2, 2))
    after_one = lazy.weight.clone()
    lazy.step(torch.tensor([1]), torch.ones(1, 2))  # row 0 absent: unchanged, though its moment is non-zero
    assert torch.equal(lazy.weight[0], after_one[0]) and torch.equal(lazy.weight[2:], w0[2:])
    assert not torch.equal(lazy.weight[1], after_one[1]) and lazy.steps == 2
    lazy.put(torch.tensor([3]), torch.full((1, 2), 7.0))
    assert lazy.weight[3].tolist() == [7.0, 7.0]


# ====================================================================== shared model and data
SMALL = ServerTableSpec("small", num_rows=6, dim=3)  # every local batch holds all 6 ids
BIG = ServerTableSpec("big", num_rows=40, dim=4)  # a local batch holds a few of the 40 ids
SPECS = (SMALL, BIG)
LOCAL_BATCH = 8
STEPS = 4


class _RefModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.small = nn.EmbeddingBag(SMALL.num_rows, SMALL.dim, mode="mean")
        self.big = nn.EmbeddingBag(BIG.num_rows, BIG.dim, mode="sum")
        self.mlp = nn.Sequential(nn.Linear(4 + SMALL.dim + BIG.dim, 8), nn.Tanh(), nn.Linear(8, 1))

    def forward(self, x, small_ids, big_ids):
        h = torch.cat([x, self.small(small_ids), self.big(big_ids)], 1)
        return self.mlp(h).squeeze(1)


def _initial_model() -> _RefModel:
    torch.manual_seed(1234)
    return _RefModel()


def _dense_numel() -> int:
    return sum(p.numel() for p in _initial_model().mlp.parameters())


def _batch(step: int, worker: int):
    g = torch.Generator().manual_seed(1000 * step + worker)
    x = torch.randn(LOCAL_BATCH, 4, generator=g)
    shift = torch.randint(0, SMALL.num_rows, (1,), generator=g)
    small = (torch.arange(LOCAL_BATCH * 3).reshape(LOCAL_BATCH, 3) + shift) % SMALL.num_rows
    big = torch.randint(0, BIG.num_rows, (LOCAL_BATCH, 2), generator=g)
    y = torch.randint(0, 2, (LOCAL_BATCH,), generator=g).float()
    return x, small, big, y


def _local_gradient(mlp: nn.Module, client: PSClient, batch, min_version=None):
    """Pull, forward/backward the local mean loss, return (pulled, dense grad, ids, row grads)."""
    x, small, big, y = batch
    us, inv_s = torch.unique(small, return_inverse=True)
    ub, inv_b = torch.unique(big, return_inverse=True)
    got = client.pull({"small": us, "big": ub}, min_version=min_version)
    vector_to_parameters(got.dense, mlp.parameters())
    rs = got.rows["small"].clone().requires_grad_(True)
    rb = got.rows["big"].clone().requires_grad_(True)
    mlp.zero_grad(set_to_none=True)
    h = torch.cat([x, F.embedding_bag(inv_s, rs, mode="mean"), F.embedding_bag(inv_b, rb, mode="sum")], 1)
    F.binary_cross_entropy_with_logits(mlp(h).squeeze(1), y).backward()
    dense_grad = parameters_to_vector([p.grad for p in mlp.parameters()])
    return got, dense_grad, {"small": us, "big": ub}, {"small": rs.grad, "big": rb.grad}


def _server(rt, cfg, spec: OptimizerSpec, **serve_kwargs) -> dict:
    model = _initial_model()
    ps = ParameterServer(rt, cfg, _dense_numel(), SPECS, spec,
                         dense_init=parameters_to_vector(model.mlp.parameters()).detach(),
                         table_init={"small": model.small.weight.detach(), "big": model.big.weight.detach()})
    return dataclasses.asdict(ps.serve(**serve_kwargs))


# ====================================================================== multi-process launches
# Starting a rank costs seconds of CPU (torch import; 11-28 s for a launch measured on the shared
# 2-core machine, the phases themselves take about 3 s), so two launches
# run several phases each, every phase on a fresh runtime (its own groups and store), and the
# tests below assert on their parts:
#   launch A: 2 workers + 1 server: bad config, tuning-free (SGD, Adam), straggler, rank 0 killed;
#   launch B: 2 workers + 2 servers: tuning-free (SGD, Adam), cache-store calls and stall detection.
OPTIMIZER_CASES = {
    "sgd": {"type": "SGD", "params": {"lr": 0.5}},
    "adam": {"type": "Adam", "params": {"lr": 0.05, "torch_adam": True}},  # DeepSpeed: AdamW, torch's wd 0.01
}
HEARTBEAT_S = 0.3
KILLED_UNTIL = 10
STRAGGLER_UNTIL = 30
STRAGGLER_DELAYS = (0.02, 0.2)  # seconds per batch: worker 1 is 10x slower


def _config(num_servers: int, **staleness) -> GBAConfig:
    return GBAConfig(mode="gba", num_servers=num_servers, staleness=staleness or {}, timeout_s=15,
                     heartbeat_s=HEARTBEAT_S)


def _bad_config_phase(world_size: int) -> str:
    try:
        init_runtime(_config(world_size))
    except ValueError as exc:
        return str(exc)
    return "no error"


def _equivalence_phase(rank: int, num_servers: int) -> dict:
    out = {}
    for case, block in OPTIMIZER_CASES.items():
        cfg = _config(num_servers)
        rt = init_runtime(cfg)
        spec = OptimizerSpec.from_deepspeed(block)
        if rt.is_server:
            out[case] = _server(rt, cfg, spec, until_version=STEPS, max_seconds=30)
        else:
            client = PSClient(rt, _dense_numel(), SPECS)
            mlp = _initial_model().mlp
            tokens = []
            for step in range(STEPS):
                # the no-straggler schedule: start step k from version k (no worker runs ahead)
                got, dg, ids, rows = _local_gradient(mlp, client, _batch(step, rank), min_version=step)
                tokens.append(got.token)
                client.push(dg, ids, rows, got.token, num_samples=LOCAL_BATCH)
            final = client.pull({"small": torch.arange(SMALL.num_rows), "big": torch.arange(BIG.num_rows)},
                                min_version=STEPS)
            client.close()
            out[case] = {"tokens": tokens, "final_token": final.token, "finished": final.finished,
                         "dense": final.dense, "small": final.rows["small"], "big": final.rows["big"]}
        rt.close()
    return out


def _async_worker(rt, delay_s: float, die_after: int | None = None) -> dict:
    client = PSClient(rt, _dense_numel(), SPECS)
    mlp = _initial_model().mlp
    tokens, pushes = [], 0
    while True:
        got, dg, ids, rows = _local_gradient(mlp, client, _batch(pushes, rt.rank))
        if got.finished:
            break
        tokens.append(got.token[0])
        time.sleep(delay_s)  # the straggler knob
        client.push(dg, ids, rows, got.token, num_samples=LOCAL_BATCH)
        pushes += 1
        if die_after is not None and pushes == die_after:
            os._exit(17)  # dies with its last push still in flight
    client.close()
    return {"pushes": pushes, "tokens": tokens}


def _straggler_phase(rank: int) -> dict:
    cfg = _config(1, threshold=1, decay="inverse")
    rt = init_runtime(cfg)
    if rt.is_server:
        out = _server(rt, cfg, OptimizerSpec.of("sgd", lr=0.1), until_version=STRAGGLER_UNTIL, max_seconds=30)
    else:
        out = _async_worker(rt, STRAGGLER_DELAYS[rank])
    rt.close()
    return out


def _killed_phase(rank: int) -> dict:
    cfg = _config(1)
    rt = init_runtime(cfg)
    t0 = time.monotonic()
    if rt.is_server:
        out = _server(rt, cfg, OptimizerSpec.of("adamw", lr=0.01), until_version=KILLED_UNTIL, max_seconds=30)
    else:  # rank 0 (also the host of torch's default store) dies after its second push, long before the end
        out = _async_worker(rt, delay_s=0.05, die_after=2 if rank == 0 else None)
    rt.close()
    out["wall_s"] = time.monotonic() - t0
    return out


def _launch_a(rank: int, world_size: int) -> dict:
    out = {"bad_config": _bad_config_phase(world_size)}
    out["equivalence"] = _equivalence_phase(rank, num_servers=1)
    out["straggler"] = _straggler_phase(rank)
    out["killed"] = _killed_phase(rank)
    return out


def _api_phase(rank: int) -> dict:
    cfg = _config(2)
    rt = init_runtime(cfg)
    out = {"layout": (rt.layout.workers, rt.layout.servers, rt.is_server, rt.worker_group is None)}
    spec = ServerTableSpec("t", num_rows=11, dim=2)
    if rt.is_server:
        ps = ParameterServer(rt, cfg, 7, [spec], OptimizerSpec.of("sgd", lr=1.0))  # M = 2 workers
        out["stats"] = dataclasses.asdict(ps.serve(max_seconds=30))
        out["table"] = ps.table_shard("t")
    elif rank == 1:
        PSClient(rt, 7, [spec]).close()  # leaves at once: worker 0 alone must still make progress
    else:
        c = PSClient(rt, 7, [spec])
        rows = c.get_rows("t", torch.tensor([[5, 2], [5, 9]]))
        out["dup_rows_equal"] = rows.shape == (2, 2, 2) and torch.equal(rows[0, 0], rows[1, 0])
        c.put_rows("t", torch.tensor([2, 9, 2]), torch.tensor([[1.0, 1.0], [2.0, 2.0], [3.0, 3.0]]))
        out["put_get"] = c.get_rows("t", torch.tensor([9, 2])).tolist()
        c.put_dense(torch.arange(7.0))
        p = c.pull()
        out["pull"] = (p.dense.tolist(), p.token, p.finished, p.rows)
        for name, call in {
            "unknown_table": lambda: c.get_rows("nope", torch.tensor([1])),
            "out_of_range": lambda: c.get_rows("t", torch.tensor([11])),
            "token_len": lambda: c.push(torch.ones(7), {}, {}, (0,), num_samples=1),
            "dense_shape": lambda: c.push(torch.ones(6), {}, {}, p.token, num_samples=1),
        }.items():
            try:
                call()
            except (KeyError, IndexError, ValueError) as exc:
                out[name] = f"{type(exc).__name__}: {exc}"
        one = ({"t": torch.tensor([2, 2])}, {"t": torch.ones(2, 2)})  # duplicates: summed per id
        c.push(torch.ones(7), *one, p.token, num_samples=4)
        t0 = time.monotonic()
        try:  # M = 2 but the only live worker waits for the update: the servers say so instead of hanging
            c.pull(min_version=1)
        except PSStalledError as exc:
            out["stalled"] = (str(exc), time.monotonic() - t0)
        c.push(torch.ones(7), *one, p.token, num_samples=4)
        p2 = c.pull({"t": torch.tensor([2])}, min_version=1)
        out["after_update"] = (p2.dense.tolist(), p2.rows["t"].tolist(), p2.token)
        c.close()
    rt.close()
    return out


def _launch_b(rank: int, world_size: int) -> dict:
    return {"equivalence": _equivalence_phase(rank, num_servers=2), "api": _api_phase(rank)}


@pytest.fixture(scope="module")
def launch_a() -> dict:
    t0 = time.monotonic()
    results = run_distributed(_launch_a, world_size=3, timeout_s=50, expect_exit={0: 17})
    out = {r: v for r, v in enumerate(results) if v is not None}
    out["wall_s"] = time.monotonic() - t0
    return out


@pytest.fixture(scope="module")
def launch_b() -> list:
    return run_distributed(_launch_b, world_size=4, timeout_s=50)


# ====================================================================== tuning-free property
def _lazy_adamw_rows(table, exp_avg, exp_avg_sq, steps_done, rows, grad, lr, weight_decay):
    """Reference lazy AdamW: torch's own Adam kernel on the gathered present rows; returns new (table, m, v)."""
    p, m, v = table[rows].clone(), exp_avg[rows].clone(), exp_avg_sq[rows].clone()
    torch_adam_kernel([p], [grad[rows]], [m], [v], [], [torch.tensor(float(steps_done))], foreach=False,
                      decoupled_weight_decay=True, amsgrad=False, beta1=0.9, beta2=0.999, lr=lr,
                      weight_decay=weight_decay, eps=1e-8, maximize=False)
    return table.index_put((rows,), p), exp_avg.index_put((rows,), m), exp_avg_sq.index_put((rows,), v)


def _sync_reference(case: str, num_workers: int) -> dict:
    """Single process: each step averages the N local mean-loss gradients (all-reduce) and steps torch's optimizer."""
    model = _initial_model()
    lr = OPTIMIZER_CASES[case]["params"]["lr"]
    if case == "sgd":  # plain SGD leaves absent rows alone: dense nn.EmbeddingBag gradients are the reference
        opt = torch.optim.SGD(model.parameters(), lr=lr)
        moments = None
    else:  # dense AdamW for the MLP and the always-present small table; lazy rows for the big table
        opt = torch.optim.AdamW(list(model.mlp.parameters()) + [model.small.weight], lr=lr)
        moments = (torch.zeros(BIG.num_rows, BIG.dim), torch.zeros(BIG.num_rows, BIG.dim))
    for step in range(STEPS):
        model.zero_grad(set_to_none=True)
        present = []
        for worker in range(num_workers):
            x, small, big, y = _batch(step, worker)
            present.append(big.reshape(-1))
            loss = F.binary_cross_entropy_with_logits(model(x, small, big), y)
            (loss / num_workers).backward()  # the all-reduce mean of the local mean losses
        opt.step()
        if moments is not None:
            table, *moments = _lazy_adamw_rows(model.big.weight.detach(), *moments, step,
                                               torch.unique(torch.cat(present)), model.big.weight.grad,
                                               lr=lr, weight_decay=0.01)
            with torch.no_grad():
                model.big.weight.copy_(table)
    return {"dense": parameters_to_vector(model.mlp.parameters()).detach(), "small": model.small.weight.detach(),
            "big": model.big.weight.detach()}


def _check_equivalence(results: dict, workers: list, servers: list, num_servers: int) -> None:
    for case in OPTIMIZER_CASES:
        ref = _sync_reference(case, num_workers=2)
        assert not torch.allclose(ref["big"], _initial_model().big.weight.detach())  # not a vacuous comparison
        for w in workers:
            got = results[w]["equivalence"][case]
            assert got["tokens"] == [(k,) * num_servers for k in range(STEPS)], "no straggler: no staleness"
            assert got["final_token"] == (STEPS,) * num_servers and got["finished"]
            for key in ("dense", "small", "big"):
                torch.testing.assert_close(got[key], ref[key], rtol=1e-5, atol=1e-6, msg=f"{case}/{key}")
        for s in servers:
            stats = results[s]["equivalence"][case]
            assert stats["version"] == STEPS and stats["lost_workers"] == []
            assert stats["tokens"]["staleness"] == {0: STEPS * 2}
            assert stats["tokens"]["counted"] == STEPS * 2 and stats["tokens"]["dropped"] == 0


def test_tuning_free_gba_equals_sync_allreduce_2_workers_1_server(launch_a):
    # worker 0 of launch A is killed in its last phase, so its results stay with it; worker 1 pulled the same
    _check_equivalence(launch_a, workers=[1], servers=[2], num_servers=1)


@pytest.mark.soak
def test_tuning_free_gba_equals_sync_allreduce_2_workers_2_servers(launch_b):
    _check_equivalence(dict(enumerate(launch_b)), workers=[0, 1], servers=[2, 3], num_servers=2)


# ====================================================================== stragglers and failures
def test_slow_worker_produces_staleness_and_fast_worker_pushes_more(launch_a):
    slow, stats = launch_a[1]["straggler"], launch_a[2]["straggler"]
    tok = stats["tokens"]
    assert stats["version"] == STRAGGLER_UNTIL and tok["counted"] == 2 * STRAGGLER_UNTIL  # M = 2 per update
    assert max(tok["staleness"]) >= 2 and tok["decayed"] >= 1  # the slow worker's gradients arrived stale
    assert tok["received"] == tok["counted"] + tok["dropped"]
    fast_pushes = stats["pushes"].get(0, 0)
    assert fast_pushes > 2 * stats["pushes"][1] and stats["pushes"][1] >= 1, stats["pushes"]
    assert sum(stats["pushes"].values()) + stats["drained"] >= slow["pushes"]
    assert slow["tokens"] == sorted(slow["tokens"])  # tokens never go back


def test_killed_worker_loses_its_token_and_training_finishes_with_the_rest(launch_a):
    survivor, stats = launch_a[1]["killed"], launch_a[2]["killed"]
    assert stats["version"] == KILLED_UNTIL and stats["tokens"]["counted"] == 2 * KILLED_UNTIL
    assert stats["lost_workers"] == [0]
    assert stats["pushes"].get(0, 0) <= 2 and survivor["pushes"] >= 2 * KILLED_UNTIL - 2
    assert survivor["wall_s"] < 20 and launch_a["wall_s"] < 50


# ====================================================================== cache-store API, stalls, bad configs
def test_bad_num_servers_is_a_clear_error_on_every_rank(launch_a):
    for rank in (1, 2):
        assert "gba.num_servers=3 leaves no worker in a launch of 3 ranks" in launch_a[rank]["bad_config"]


@pytest.mark.soak
def test_cache_store_calls_and_stall_detection(launch_b):
    worker, idle, s0, s1 = (r["api"] for r in launch_b)
    assert worker["layout"] == ((0, 1), (2, 3), False, False) and s0["layout"] == ((0, 1), (2, 3), True, True)
    assert worker["dup_rows_equal"]
    assert worker["put_get"] == [[2.0, 2.0], [3.0, 3.0]]  # the last duplicate wins
    dense, token, finished, rows = worker["pull"]
    assert dense == list(range(7)) and token == (0, 0) and not finished and rows == {}
    assert "KeyError" in worker["unknown_table"] and "unknown embedding table 'nope'" in worker["unknown_table"]
    assert "ids must be in [0, 11)" in worker["out_of_range"]
    assert "one version per server (2)" in worker["token_len"]
    assert "shape (7,)" in worker["dense_shape"]
    msg, waited = worker["stalled"]
    assert "every live worker waits" in msg and waited < 5
    # SGD lr=1 on the mean of two pushes of ones: dense -1; row 2 got 2 per push (duplicate ids summed)
    dense, row2, token = worker["after_update"]
    assert dense == [float(i) - 1.0 for i in range(7)] and row2 == [[1.0, 1.0]] and token == (1, 1)
    assert s0["stats"]["stalls"] == 1 and s0["stats"]["version"] == 1 and s1["stats"]["version"] == 1
    assert s0["table"][1].tolist() == [1.0, 1.0]  # id 2 lives on server 0 at local row 1


def test_a_serve_stays_open_for_timeout_s_while_dead_or_silent_workers_may_be_replaced():
    # CI, stop 19: both workers' pairs broke at once and the server ended the job before the replacements joined
    from gba_engine.ps.server import PeerState as P, serve_is_over

    assert not serve_is_over([P.DEAD, P.DEAD], finished=False, idle_s=2.0, timeout_s=15.0)
    assert serve_is_over([P.DEAD, P.DEAD], finished=False, idle_s=15.5, timeout_s=15.0)
    assert not serve_is_over([P.BYE, P.DEAD], finished=False, idle_s=0.0, timeout_s=15.0)
    assert not serve_is_over([P.SILENT, P.BYE], finished=False, idle_s=14.0, timeout_s=15.0)
    assert not serve_is_over([P.ACTIVE, P.DEAD], finished=True, idle_s=99.0, timeout_s=15.0)
    assert serve_is_over([P.DEAD, P.BYE], finished=True, idle_s=0.0, timeout_s=15.0)  # finished: no rejoin awaited
    # a worker silent past its lease may still be inside a finished phase: it is waited for too, so that
    # its late pull does not land in the next phase
    assert not serve_is_over([P.SILENT, P.BYE], finished=True, idle_s=3.0, timeout_s=15.0)
    assert serve_is_over([P.SILENT, P.BYE], finished=True, idle_s=15.5, timeout_s=15.0)
    assert serve_is_over([P.BYE, P.BYE], finished=False, idle_s=0.0, timeout_s=15.0)
