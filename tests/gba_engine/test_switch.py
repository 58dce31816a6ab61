"""Mode hand-over (gba_engine/switch.py) and the parameter server's public state hooks.

* ``gba.max_lead`` config validation (no processes);
* :class:`TrainState` shard/join (no processes);
* one launch of 2 workers + 1 server (gloo on 127.0.0.1): for DeepSpeed ZeRO stage 0 and
  stage 1, the optimizer state of a trained engine goes DeepSpeed -> server
  (``ParameterServer.import_state``) -> back (``export_state``) -> a fresh DeepSpeed engine,
  bit for bit, and the next step of the fresh engine equals the original's; the server's
  ``on_tick`` hook runs inside ``serve`` and a client pulls the imported parameters and version.
"""
from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from gba_engine.config import GBAConfig
from gba_engine.switch import TrainState, moment_names
from sparse_scale.config import ConfigError, parse_config
from sparse_scale.multiproc import run_distributed


# ====================================================================== units
def test_max_lead_config_defaults_to_async_and_validates():
    assert GBAConfig().max_lead is None  # fully asynchronous GBA unless asked
    assert GBAConfig.model_validate({"max_lead": 0}).max_lead == 0  # lockstep
    assert parse_config({"gba": {"mode": "gba", "max_lead": 3}}).blocks["gba"].max_lead == 3
    with pytest.raises(ConfigError, match="max_lead"):
        parse_config({"gba": {"max_lead": -1}})
    with pytest.raises(ConfigError, match="max_lead"):
        parse_config({"gba": {"max_lead": "two"}})


def test_train_state_shard_join_round_trip():
    st = TrainState(torch.arange(10.0), {"exp_avg": torch.arange(10.0) * 2}, step=4, version=3)
    parts = [st.shard(0, 4), st.shard(4, 10)]
    assert TrainState.join(parts).equal(st) and st.nbytes == 80
    with pytest.raises(RuntimeError, match="disagree"):
        TrainState.join([parts[0], TrainState(parts[1].params, parts[1].moments, step=5, version=3)])


# ====================================================================== hand-over on real processes
_DS = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "steps_per_print": 10 ** 6,
       "optimizer": {"type": "AdamW", "params": {"lr": 0.05, "weight_decay": 0.01, "torch_adam": True}}}


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 1))


def _ds_step(engine, step: int, rank: int) -> float:
    g = torch.Generator().manual_seed(31 * step + rank)
    x = torch.randn(4, 5, generator=g)
    loss = F.mse_loss(engine(x), x[:, :1] - x[:, 1:2])
    engine.backward(loss)
    engine.step()
    return loss.item()


def _handover_phase(rank: int, stage: int) -> dict:
    """Workers: train, hand the state to the server and back into a fresh engine; server: import, serve, export."""
    import deepspeed

    from gba_engine.startup import WorkerMPU
    from gba_engine.ps import OptimizerSpec, ParameterServer, PSClient, init_runtime
    from gba_engine.switch import recv_state, send_state, state_from_deepspeed, state_from_server, \
        state_into_deepspeed, state_into_server, wait_sent

    cfg = GBAConfig(num_servers=1, timeout_s=20, heartbeat_s=0.1)
    rt = init_runtime(cfg)
    singles = [dist.new_group(ranks=[r], backend="gloo") for r in range(dist.get_world_size())]
    spec = OptimizerSpec.from_deepspeed(_DS["optimizer"])
    names = moment_names(spec)
    server, first = rt.layout.servers[0], rt.layout.workers[0]
    numel = sum(p.numel() for p in _model(1).parameters())
    if rt.is_server:
        st = recv_state(first, rt.ps_group, names)
        ps = ParameterServer(rt, cfg, numel, [], spec, on_tick=lambda p: ticks.append(p.version))
        ticks: list[int] = []
        state_into_server(ps, st)
        stats = ps.serve(until_version=None, max_seconds=15)  # both workers pull once, then say goodbye
        back = state_from_server(ps)
        works = send_state(back, first, rt.ps_group)
        rt.store.set("test/state_back", "1")  # the doorbell: our sends are posted
        wait_sent(works)
        rt.close()
        return {"exact": back.equal(st), "ticks": len(ticks), "tick_versions": sorted(set(ticks)),
                "version": stats.version}
    ds = dict(_DS, zero_optimization={"stage": stage})
    mpu = WorkerMPU(rt.worker_group, singles[rt.rank])
    eng, _, _, _ = deepspeed.initialize(model=_model(1), config=ds, mpu=mpu, model_parameters=None)
    for step in range(3):
        _ds_step(eng, step, rank)
    before = state_from_deepspeed(eng, spec, version=3)  # collective under ZeRO 1
    if rank == first:
        wait_sent_works = send_state(before, server, rt.ps_group)
    client = PSClient(rt, numel, [])
    got = client.pull(dense=True)
    time.sleep(0.35)  # a few server ticks while this client is connected
    client.close()
    if rank == first:
        wait_sent(wait_sent_works)
        deadline = time.monotonic() + 20
        while not rt.store.check(["test/state_back"]):
            if time.monotonic() > deadline:
                raise TimeoutError("server did not send the state back")
            time.sleep(0.01)
        back = recv_state(server, rt.ps_group, names)
        flat = torch.cat([back.params] + [back.moments[k] for k in sorted(names)])
        meta = torch.tensor([back.step, back.version])
    else:
        flat, meta = torch.empty(numel * (1 + len(names))), torch.zeros(2, dtype=torch.int64)
    dist.broadcast(flat, src=first, group=rt.worker_group)
    dist.broadcast(meta, src=first, group=rt.worker_group)
    parts = flat.split(numel)
    back = TrainState(parts[0], {k: parts[1 + i] for i, k in enumerate(sorted(names))}, int(meta[0]), int(meta[1]))
    fresh, _, _, _ = deepspeed.initialize(model=_model(2), config=ds, mpu=mpu, model_parameters=None)
    state_into_deepspeed(fresh, back, spec)
    again = state_from_deepspeed(fresh, spec, version=back.version)
    loss_a, loss_b = _ds_step(eng, 3, rank), _ds_step(fresh, 3, rank)
    after_a = state_from_deepspeed(eng, spec, version=4)
    after_b = state_from_deepspeed(fresh, spec, version=4)
    rt.close()
    return {"round_trip": again.equal(before), "back": back.equal(before), "step": before.step,
            "moment_norm": float(before.moments["exp_avg"].norm()), "pulled": torch.equal(got.dense, before.params),
            "token": got.token, "next_loss": (loss_a, loss_b), "next_exact": after_a.equal(after_b)}


def _launch(rank: int, world_size: int) -> dict:
    return {stage: _handover_phase(rank, stage) for stage in (0, 1)}


@pytest.fixture(scope="module")
def launch() -> list:
    return run_distributed(_launch, world_size=3, timeout_s=120)


@pytest.mark.parametrize("stage", [0, 1])
def test_handover_deepspeed_to_server_and_back_is_exact(launch, stage):
    w0, w1, server = (r[stage] for r in launch)
    for w in (w0, w1):
        assert w["step"] == 3 and w["moment_norm"] > 0  # a real Adam state, not zeros
        assert w["back"] and w["round_trip"], "params, moments, step or version changed on the way"
        assert w["pulled"] and w["token"] == (3,), "the server serves the imported parameters at the imported version"
        assert w["next_loss"][0] == w["next_loss"][1] and w["next_exact"], "the fresh engine must continue identically"
    assert server["exact"] and server["version"] == 3
    assert server["ticks"] >= 2 and server["tick_versions"] == [3]


def test_grads_per_update_config():
    from gba_engine.config import GBAConfig
    from sparse_scale.config import ConfigError, parse_config

    assert GBAConfig().grads_per_update is None  # one gradient per worker: the sync global batch
    assert GBAConfig(grads_per_update=1).grads_per_update == 1  # plain asynchronous PS
    with pytest.raises(ConfigError, match=r"gba\.grads_per_update: .*greater than 0 \(got 0\)"):
        parse_config({"gba": {"grads_per_update": 0}})
