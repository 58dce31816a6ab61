"""Checkpoints saved at one ep_size load at another, optimizer state included (DeepSpeed #6589).

One 4-rank launch: train 2 steps, save with moe_proto.checkpoint, take step 3 (the
continuing run). Then fresh engines at other ep sizes (and other ZeRO stages) load the
checkpoint and take step 3: loss and parameters after the update must equal the
continuing run's, which needs the Adam moments and step count, not just the weights.

The ``*_moe_groups_warmup`` scenario trains as the MoE LM job does: the experts in their own
``moe: True`` param group (ZeRO 1/2 link optimizer-state views after the first group's step,
before the expert group has state) and a WarmupLR schedule (its ``load_state_dict`` does not
touch the groups' lr). There, DeepSpeed's ``safe_get_full_optimizer_state`` must also read
the saved moments after save and after load.
"""
import numpy as np
import pytest
import torch

from moe_proto.checkpoint import (expert_params, full_state_dict, iter_expert_files, load_checkpoint,
                                  save_checkpoint)
from sparse_scale.multiproc import run_distributed

from tests.moe_proto.test_deepspeed import LR, WORLD, batch, build, ds_config

SCENARIOS = {  # name: (save ep, save stage) -> [(load ep, load stage)]
    "ep4_to_ep2_ep1": ((4, 2), [(2, 1), (1, 0), (4, 2)]),
    "ep1_to_ep2": ((1, 0), [(2, 2)]),
    "ep2_moe_groups_warmup": ((2, 1), [(1, 2), (2, 1), (1, 0)]),
}
# Scenarios trained like launch/train_moe_lm.py: expert param group + an lr that changes every step.
MOE_GROUP_SCENARIOS = {"ep2_moe_groups_warmup"}
WARMUP = {"scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": LR / 10, "warmup_max_lr": LR,
                                                       "warmup_num_steps": 10}}}


def _engine(ep, stage, moe_groups=False):
    import deepspeed
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    full, model = build(ep)
    if ep > 1:
        model.moe.set_deepspeed_parallelism()
    from moe_proto.checkpoint import load_full_state_dict

    load_full_state_dict(model, full.state_dict())
    params = list(model.parameters())
    if moe_groups:
        params = split_params_into_different_moe_groups_for_optimizer({"params": params, "name": "params"})
    engine, *_ = deepspeed.initialize(model=model, model_parameters=params,
                                      config=ds_config(stage, WARMUP if moe_groups else None))
    return engine


def _saved_moments(engine, ckpt_dir, tag):
    """Max |DeepSpeed's safe_get_full_optimizer_state - checkpoint| per (param, key); None: not ZeRO 1/2."""
    import os

    from deepspeed.utils import safe_get_full_optimizer_state

    if engine.zero_optimization_stage() not in (1, 2):
        return None
    path = os.path.join(ckpt_dir, tag, "moe_proto")
    dense = torch.load(os.path.join(path, "dense.pt"), weights_only=False)["params"]
    blobs = [torch.load(os.path.join(path, f), weights_only=False)["params"] for *_, f in iter_expert_files(path)]
    owners = expert_params(engine.module)
    diffs = {}
    for name, param in engine.module.named_parameters():
        for key in ("exp_avg", "exp_avg_sq"):
            if name in owners:
                first, last = owners[name].expert_range
                saved = torch.cat([b[name][key] for b in blobs])[first:last]
            else:
                saved = dense[name][key]
            got = safe_get_full_optimizer_state(param, key)  # collective over the param's DP group
            diffs[f"{name}.{key}"] = float((got.cpu() - saved).abs().max())
    return diffs


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
        moe_groups = name in MOE_GROUP_SCENARIOS
        engine = _engine(save_ep, save_stage, moe_groups)
        for step in range(2):
            _step(engine, step, rank)
        save_checkpoint(engine, ckpt_dir, name)
        saved_moments, saved_lr = _saved_moments(engine, ckpt_dir, name), engine.get_lr()
        expected = {"loss": _step(engine, 2, rank), "steps": engine.global_steps, "lr": saved_lr,
                    "moments": saved_moments,
                    "params": {k: v.numpy() for k, v in full_state_dict(engine.module).items()}}
        got = []
        for ep, stage in loads:
            engine = _engine(ep, stage, moe_groups)
            meta = load_checkpoint(engine, ckpt_dir, name)
            moments, lr = _saved_moments(engine, ckpt_dir, name), engine.get_lr()
            got.append({"ep": ep, "stage": stage, "loss": _step(engine, 2, rank), "steps": engine.global_steps,
                        "saved_step": meta["step"], "groups": len(meta["param_groups"]), "lr": lr,
                        "moments": moments,
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
            assert g["groups"] == 2, where  # dense + experts: DeepSpeed splits MoE models' params itself too
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


def test_moe_group_resume_restores_lr_and_deepspeed_optimizer_state_views(launch):
    """Expert param group + WarmupLR: step 3 runs at the saved lr; ZeRO's state views read the checkpoint."""
    results, _ = launch
    for rank, per_rank in enumerate(results):
        expected, got = per_rank["ep2_moe_groups_warmup"]
        # Before the fix: the expert group's views were empty (KeyError 'exp_avg' in DeepSpeed).
        assert expected["moments"] and max(expected["moments"].values()) == 0.0, (rank, expected["moments"])
        for g in got:
            where = (rank, g["ep"], g["stage"])
            # get_lr() after load is the lr step 3 will use; before the fix it was warmup_min_lr.
            assert g["lr"] == pytest.approx(expected["lr"]) and g["lr"][0] > LR / 10, where
            if g["stage"] in (1, 2):
                assert max(g["moments"].values()) == 0.0, (where, g["moments"])
            else:
                assert g["moments"] is None, where
