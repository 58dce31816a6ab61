"""Checkpoints saved at one ep_size load at another, optimizer state included (DeepSpeed #6589).

One 4-rank launch: train 2 steps, save with moe_proto.checkpoint, take step 3 (the
continuing run). Then fresh engines at other ep sizes (and other ZeRO stages) load the
checkpoint and take step 3: loss and parameters after the update must equal the
continuing run's, which needs the Adam moments and step count, not just the weights.
"""
import numpy as np
import pytest
import torch

from moe_proto.checkpoint import full_state_dict, load_checkpoint, save_checkpoint
from sparse_scale.multiproc import run_distributed

from .test_moe_deepspeed import WORLD, batch, build, ds_config

SCENARIOS = {  # name: (save ep, save stage) -> [(load ep, load stage)]
    "ep4_to_ep2_ep1": ((4, 2), [(2, 1), (1, 0), (4, 2)]),
    "ep1_to_ep2": ((1, 0), [(2, 2)]),
}


def _engine(ep, stage):
    import deepspeed

    full, model = build(ep)
    if ep > 1:
        model.moe.set_deepspeed_parallelism()
    from moe_proto.checkpoint import load_full_state_dict

    load_full_state_dict(model, full.state_dict())
    engine, *_ = deepspeed.initialize(model=model, model_parameters=list(model.parameters()),
                                      config=ds_config(stage))
    return engine


def _step(engine, step, rank):
    loss = engine(*batch(step, rank))
    engine.backward(loss)
    engine.step()
    return float(loss)


def _launch(rank, world, ckpt_dir):
    import deepspeed

    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")
    out = {}
    for name, ((save_ep, save_stage), loads) in SCENARIOS.items():
        engine = _engine(save_ep, save_stage)
        for step in range(2):
            _step(engine, step, rank)
        save_checkpoint(engine, ckpt_dir, name)
        expected = {"loss": _step(engine, 2, rank), "steps": engine.global_steps,
                    "params": {k: v.numpy() for k, v in full_state_dict(engine.module).items()}}
        got = []
        for ep, stage in loads:
            engine = _engine(ep, stage)
            meta = load_checkpoint(engine, ckpt_dir, name)
            got.append({"ep": ep, "stage": stage, "loss": _step(engine, 2, rank), "steps": engine.global_steps,
                        "saved_step": meta["step"],
                        "params": {k: v.numpy() for k, v in full_state_dict(engine.module).items()}})
        out[name] = (expected, got)
    return out


@pytest.fixture(scope="module")
def launch(tmp_path_factory):
    ckpt_dir = str(tmp_path_factory.mktemp("ckpt"))
    return run_distributed(_launch, world_size=WORLD, args=(ckpt_dir, ), timeout_s=100), ckpt_dir


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_resume_at_other_ep_size_gives_identical_next_step(launch, scenario):
    results, _ = launch
    for rank, per_rank in enumerate(results):
        expected, got = per_rank[scenario]
        for g in got:
            where = (scenario, rank, g["ep"], g["stage"])
            assert g["saved_step"] == 2.0, where
            assert g["steps"] == expected["steps"] == 3, where
            assert g["loss"] == pytest.approx(expected["loss"], rel=1e-6, abs=1e-7), where
            for k, v in expected["params"].items():
                np.testing.assert_allclose(g["params"][k], v, rtol=1e-5, atol=1e-6, err_msg=f"{where} {k}")


def test_checkpoint_layout_is_one_file_per_expert_range(launch):
    import os

    _, ckpt_dir = launch
    files = sorted(os.listdir(os.path.join(ckpt_dir, "ep4_to_ep2_ep1", "moe_proto")))
    assert files == ["dense.pt", "experts_000000-000002.pt", "experts_000002-000004.pt",
                     "experts_000004-000006.pt", "experts_000006-000008.pt", "meta.json"]
    files = sorted(os.listdir(os.path.join(ckpt_dir, "ep1_to_ep2", "moe_proto")))
    assert files == ["dense.pt", "experts_000000-000008.pt", "meta.json"]
    blob = torch.load(os.path.join(ckpt_dir, "ep4_to_ep2_ep1", "moe_proto", "experts_000002-000004.pt"))
    assert set(blob["params"]["moe.experts.w1"]) == {"param", "exp_avg", "exp_avg_sq"}
    assert float(blob["params"]["moe.experts.w1"]["exp_avg_sq"].abs().sum()) > 0
