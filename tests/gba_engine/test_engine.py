"""gba_engine.initialize end to end on real processes (2 workers + 1 server, gloo on 127.0.0.1).

One launch runs several phases (each a fresh initialize: its own groups and control plane),
because starting ranks with deepspeed imported costs many seconds on the shared 2-core machine:
  sync run; gba lockstep run (tuning-free) + server checkpoint; restore; auto run with a
  straggler (sync -> gba -> sync); gba run where worker 1 is killed (last: it ends the process).
"""
from __future__ import annotations

import os
import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parameters_to_vector

from sparse_scale.multiproc import run_distributed

STEPS = 6
AUTO_STEPS = 16
SLOW = range(2, 8)


def _model() -> nn.Module:
    torch.manual_seed(7)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))


def _batch(step: int, worker: int):
    g = torch.Generator().manual_seed(100 * step + worker)
    x = torch.randn(8, 6, generator=g)
    return x, (x[:, :1] * 0.7 - x[:, 1:2] * 0.3)


WARMUP_DECAY = {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.05,
                                                    "warmup_num_steps": 3, "total_num_steps": STEPS + 2,
                                                    "warmup_type": "linear"}}


def _config(mode: str, stage: int = 0, scheduler: dict | None = None, **gba) -> dict:
    extra = {"scheduler": scheduler} if scheduler else {}
    return {**extra, "train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": 0.02, "weight_decay": 0.0, "torch_adam": True}},
            "zero_optimization": {"stage": stage}, "steps_per_print": 10 ** 6,
            "gradient_clipping": 0.0,  # off (DeepSpeed's default is 1.0); clipping has its own test
            "gba": {"mode": mode, "num_servers": 1, "timeout_s": 20, "heartbeat_s": 0.2, **gba}}


def _train(engine, steps: int, rank: int, slow=(), die_after=None) -> list:
    losses = []
    for step in range(steps):
        x, y = _batch(step, rank)
        loss = F.mse_loss(engine(x), y)
        time.sleep(0.04 + (0.2 if rank == 1 and step in slow else 0.0))  # straggler knob on top of a base time
        engine.backward(loss)
        engine.step()
        losses.append((loss.item(), engine.mode))
        if die_after is not None and step + 1 == die_after:
            os._exit(17)
    return losses


def _phase(rank, mode, steps, tmp, stage=0, slow=(), die_after=None, save=None, load=None, scheduler=None, **gba):
    import gba_engine

    t0 = time.monotonic()
    engine = gba_engine.initialize(model=_model(), config=_config(mode, stage, scheduler, **gba))
    if engine.is_server:
        return {"server": engine.server_stats, "wall_s": time.monotonic() - t0}
    out = {}
    if load:
        out["loaded"] = engine.load_checkpoint(os.path.join(tmp, load))[0]
        x, y = _batch(0, rank)
        engine(x)  # pulls the restored parameters
        out["restored_params"] = parameters_to_vector(engine.module.parameters()).detach().clone()
        out["restored_version"] = engine.version
        engine.switch_to_sync("test: read the restored optimizer state back into DeepSpeed")
        opt = engine.ds_engine.optimizer
        out["restored_moments"] = torch.cat([opt.state[p]["exp_avg"].reshape(-1) for p in engine.module.parameters()])
        out["restored_step"] = int(opt.state[next(engine.module.parameters())]["step"])
    else:
        out["losses"] = _train(engine, steps, rank, slow=slow, die_after=die_after)
        if engine.mode == "gba":
            got = engine.client.pull(dense=True, min_version=steps if gba.get("max_lead") == 0 else None)
            out["params"] = got.dense
        else:
            out["params"] = parameters_to_vector(engine.module.parameters()).detach().clone()
        if save:
            out["saved"] = engine.save_checkpoint(os.path.join(tmp, save), tag="t1")
    out["summary"] = engine.summary()
    engine.close()
    out["wall_s"] = time.monotonic() - t0
    return out


def _claims_phase(rank, mode, total, slow_s, **gba):
    """Train on numbered batches from claim_batches; worker 0 returns every worker's numbers."""
    import torch.distributed as dist

    import gba_engine

    engine = gba_engine.initialize(model=_model(), config=_config(mode, **gba))
    if engine.is_server:
        return {"server": engine.server_stats}
    taken = []
    for index in engine.claim_batches(total):
        x, y = _batch(index, 0)
        loss = F.mse_loss(engine(x), y)
        time.sleep(0.01 + (slow_s if rank == 1 else 0.0))
        engine.backward(loss)
        engine.step()
        taken.append(index)
    everyone = [None, None]
    dist.all_gather_object(everyone, taken, group=engine.worker_group)
    out = {"taken": everyone, "batches_taken": engine.batches_taken, "mode": engine.mode}
    engine.close()
    return out


def _launch(rank: int, world_size: int, tmp: str) -> dict:
    out = {"sync": _phase(rank, "sync", STEPS, tmp)}
    out["gba"] = _phase(rank, "gba", STEPS, tmp, max_lead=0, save="ck")
    out["restore"] = _phase(rank, "gba", 0, tmp, max_lead=0, load="ck")
    out["auto"] = _phase(rank, "auto", AUTO_STEPS, tmp, stage=1, slow=SLOW, max_lead=0,
                         switch={"window": 2, "min_dwell_steps": 2, "slow_ratio": 1.5, "recover_ratio": 1.2})
    out["sync16"] = _phase(rank, "sync", AUTO_STEPS, tmp, stage=1)
    out["sched_sync"] = _phase(rank, "sync", STEPS, tmp, scheduler=WARMUP_DECAY)
    out["sched_gba"] = _phase(rank, "gba", STEPS, tmp, scheduler=WARMUP_DECAY, max_lead=0)
    out["claims_sync"] = _claims_phase(rank, "sync", 9, 0.0)
    out["claims_async"] = _claims_phase(rank, "gba", 24, 0.08)
    out["claims_lockstep"] = _claims_phase(rank, "gba", 11, 0.08, max_lead=0)
    try:
        import gba_engine
        gba_engine.initialize(model=_model(), config=_config("gba", num_servers=3))
    except ValueError as exc:
        out["bad"] = str(exc)
    out["killed"] = _phase(rank, "gba", 12, tmp, die_after=3 if rank == 1 else None, timeout_s=5)
    return out


@pytest.fixture(scope="module")
def launch(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("gba_engine"))
    t0 = time.monotonic()
    res = run_distributed(_launch, world_size=3, args=(tmp,), timeout_s=170, expect_exit={1: 17})
    return {"w0": res[0], "server": res[2], "wall_s": time.monotonic() - t0, "tmp": tmp}


@pytest.mark.soak
def test_tuning_free_gba_lockstep_equals_sync(launch):
    sync, gba = launch["w0"]["sync"], launch["w0"]["gba"]
    torch.testing.assert_close(gba["params"], sync["params"], rtol=1e-5, atol=1e-6)
    assert [round(a, 5) for a, _ in gba["losses"]] == [round(a, 5) for a, _ in sync["losses"]]
    assert launch["server"]["gba"]["server"]["staleness"] == {"0": 2 * STEPS}


@pytest.mark.soak
def test_learning_rate_schedule_runs_on_the_servers_like_deepspeed(launch):
    sync, gba = launch["w0"]["sched_sync"], launch["w0"]["sched_gba"]
    torch.testing.assert_close(gba["params"], sync["params"], rtol=1e-5, atol=1e-6)
    # and the schedule mattered: a constant learning rate ends elsewhere
    assert not torch.allclose(sync["params"], launch["w0"]["sync"]["params"], atol=1e-4)


@pytest.mark.soak
def test_server_checkpoint_restores_exactly(launch):
    from gba_engine.checkpoint import load_shard
    w0 = launch["w0"]
    shard = load_shard(w0["gba"]["saved"], 0, 1)
    assert shard.version == STEPS and shard.step == STEPS
    torch.testing.assert_close(shard.params, w0["gba"]["params"], rtol=0, atol=0)
    r = w0["restore"]
    assert r["restored_version"] == STEPS and r["restored_step"] == STEPS
    assert torch.equal(r["restored_params"], shard.params)
    assert torch.equal(r["restored_moments"], shard.moments["exp_avg"])


@pytest.mark.soak
def test_auto_switches_both_ways_without_a_loss_jump(launch):
    auto, ref = launch["w0"]["auto"], launch["w0"]["sync16"]
    modes = [m for _, m in auto["losses"]]
    assert "gba" in modes and modes[-1] == "sync", modes
    sw = auto["summary"]["switches"]
    assert [(e["src"], e["dst"]) for e in sw][:2] == [("sync", "gba"), ("gba", "sync")]
    assert all(e["seconds"] < 5 and e["nbytes"] > 0 for e in sw)
    # lockstep gba + exact hand-over of params and Adam moments: the curve is the pure sync curve
    for (a, _), (b, _) in zip(auto["losses"], ref["losses"]):
        assert abs(a - b) <= 1e-4 * max(1.0, abs(b))
    torch.testing.assert_close(auto["params"], ref["params"], rtol=1e-4, atol=1e-5)


@pytest.mark.soak
def test_claimed_batches_sync_lockstep_and_async(launch):
    w0 = launch["w0"]
    sync = w0["claims_sync"]["taken"]
    assert sync == [[0, 2, 4, 6], [1, 3, 5, 7]]  # lockstep k*N + w; the odd 9th batch is dropped (drop-last)
    for name in ("claims_async", "claims_lockstep"):
        got = w0[name]["taken"]
        assert sorted(got[0] + got[1]) == list(range(24 if name == "claims_async" else 11)), (name, got)
        assert w0[name]["mode"] == "gba"
    fast, slow = w0["claims_async"]["taken"]
    assert len(fast) > len(slow)  # worker 1 sleeps 8x longer per step: worker 0 takes more batches
    # lockstep: a worker never runs ahead, so the counts differ by the one last batch at most
    fast, slow = w0["claims_lockstep"]["taken"]
    assert abs(len(fast) - len(slow)) <= 1


@pytest.mark.soak
def test_killed_worker_in_gba_mode_job_continues(launch):
    k = launch["w0"]["killed"]
    server = launch["server"]["killed"]["server"]
    # 3 updates with both workers, then worker 0 alone fills M = 2 with two pushes per update
    assert len(k["losses"]) == 12 and server["version"] >= 6 and server["pushes"]["0"] == 12
    assert server["lost_workers"] == [1] and k["summary"]["server_version"] >= 3  # published at every server tick


@pytest.mark.soak
def test_bad_config_is_a_clear_error_on_every_rank(launch):
    assert "gba.num_servers=3 leaves no worker in a launch of 3 ranks" in launch["w0"]["bad"]
    assert "gba.num_servers=3" in launch["server"]["bad"]


@pytest.mark.parametrize("mode,ds,gba,match", [
    ("auto", {}, {"num_servers": 3}, "gba.num_servers=3 leaves no worker in a launch of 3 ranks"),
    ("auto", {"scheduler": {"type": "OneCycle", "params": {}}}, {}, "cannot run on the parameter servers"),
    ("gba", {"scheduler": {"type": "WarmupLR", "params": {"warmup_steps": 3}}}, {}, "scheduler 'WarmupLR'"),
    ("gba", {"zero_optimization": {"stage": 2}}, {}, "stage 0 or 1, got 2"),
    ("gba", {"bf16": {"enabled": True}}, {}, "needs fp32 training"),
    ("auto", {"gradient_clipping": -1.0}, {}, "gradient_clipping must be a number >= 0"),
    ("gba", {"optimizer": {"type": "Lamb", "params": {"lr": 0.1}}}, {}, "cannot run on the parameter servers"),
])
def test_bad_configs_are_clear_errors_before_any_collective(mode, ds, gba, match):
    from gba_engine.startup import check_config, load_config

    cfg = {**_config(mode), **ds}
    cfg["gba"] = {**cfg["gba"], **gba}
    ds_dict, block, source = load_config(cfg)
    with pytest.raises(ValueError, match=match):
        check_config(ds_dict, block, 3, source)


def test_auto_without_servers_and_missing_optimizer_are_clear_errors():
    from gba_engine.startup import check_config, load_config
    from sparse_scale.config import ConfigError

    with pytest.raises(ConfigError, match="num_servers"):
        load_config({**_config("auto"), "gba": {"mode": "auto", "num_servers": 0}})
    cfg = _config("gba")
    del cfg["optimizer"]
    with pytest.raises(ValueError, match="needs an \"optimizer\" block"):
        check_config(*load_config(cfg)[:2], 3, "<dict>")
