"""sparse_core.zero_state on a real 1-process DeepSpeed engine (ZeRO 0, 1, 2; torch's AdamW).

Both views of ZeRO's flat partitions are read after two steps: per partition (what GBA's
hand-over uses) and per parameter (what MoE checkpoints use) must agree with each other and
with the same model trained without ZeRO; the moments written back into a fresh engine read
back equal, and the fresh engine's next step equals the original's.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from sparse_scale.multiproc import run_distributed

_DS = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "steps_per_print": 10 ** 6,
       "optimizer": {"type": "AdamW", "params": {"lr": 0.05, "weight_decay": 0.01, "torch_adam": True}}}
MOMENTS = ("exp_avg", "exp_avg_sq")


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 1))


def _step(engine, step: int) -> float:
    g = torch.Generator().manual_seed(31 * step)
    x = torch.randn(4, 5, generator=g)
    loss = F.mse_loss(engine(x), x[:, :1] - x[:, 1:2])
    engine.backward(loss)
    engine.step()
    return loss.item()


def _engine(stage: int, seed: int):
    import deepspeed

    model = _model(seed)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=list(model.parameters()),
                                      config=dict(_DS, zero_optimization={"stage": stage}))
    return engine


def _per_param(engine) -> dict[str, list]:
    """Every parameter's full fp32 value and moments, through the per-parameter reader."""
    from sparse_core.zero_state import read_full_param

    return {key: [read_full_param(engine, p, None if key == "param" else key) for p in engine.module.parameters()]
            for key in ("param", *MOMENTS)}


def _launch(rank: int, world_size: int) -> dict:
    import deepspeed

    from sparse_core.zero_state import (base_optimizer, bind_partition_state, flat_partitions, gather_flat,
                                              is_partitioned, partition_state, step_of, write_param_fragment,
                                              zero_stage)

    deepspeed.init_distributed(dist_backend="gloo")
    plain = _engine(0, seed=1)
    for s in range(2):
        _step(plain, s)
    opt = base_optimizer(plain)
    reference = {key: [opt.state[p][key].clone() for p in plain.module.parameters()] for key in MOMENTS}
    out = {"stage0": (zero_stage(plain), is_partitioned(plain), isinstance(opt, torch.optim.AdamW))}
    try:
        flat_partitions(plain)
    except ValueError as err:
        out["stage0_refusal"] = str(err)
    for stage in (1, 2):
        eng = _engine(stage, seed=1)
        for s in range(2):
            _step(eng, s)
        parts = flat_partitions(eng)
        views = _per_param(eng)
        # Per partition: each parameter's span of the gathered flat moments.
        spans = {key: {} for key in MOMENTS}
        for part in parts:
            st = partition_state(eng, part)
            for key in MOMENTS:
                full = gather_flat(part, st[key].float().reshape(-1))
                for p, start, end in part.param_spans():
                    spans[key][id(p)] = full[start:end].view(p.shape)
        params = list(eng.module.parameters())
        agree = all(torch.equal(spans[key][id(p)], views[key][i]) for key in MOMENTS for i, p in enumerate(params))
        like_plain = all(torch.allclose(views[key][i], reference[key][i], rtol=1e-6, atol=1e-9)
                         for key in MOMENTS for i in range(len(params)))
        steps = {step_of(partition_state(eng, part)) for part in parts}

        fresh = _engine(stage, seed=2)
        _step(fresh, 0)  # gives the fresh optimizer state to overwrite
        for part, fresh_part in zip(parts, flat_partitions(fresh)):
            copied = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in partition_state(eng, part).items()}
            bind_partition_state(fresh, fresh_part, copied)
        for p, q, value in zip(params, fresh.module.parameters(), views["param"]):
            with torch.no_grad():
                q.copy_(value)
            write_param_fragment(fresh, q, value)  # the fp32 master copy, through the per-parameter writer
        back = _per_param(fresh)
        round_trip = all(torch.equal(a, b) for key in views for a, b in zip(views[key], back[key]))
        # Moments written per parameter too: overwrite with zeros, then the saved values, and read again.
        for q, value in zip(fresh.module.parameters(), views["exp_avg"]):
            write_param_fragment(fresh, q, torch.zeros_like(value), "exp_avg")
        zeroed = all(float(v.abs().sum()) == 0 for v in _per_param(fresh)["exp_avg"])
        for q, value in zip(fresh.module.parameters(), views["exp_avg"]):
            write_param_fragment(fresh, q, value, "exp_avg")
        rewritten = all(torch.equal(a, b) for a, b in zip(views["exp_avg"], _per_param(fresh)["exp_avg"]))
        next_losses = (_step(eng, 2), _step(fresh, 2))
        after = all(torch.equal(a, b) for key in views for a, b in zip(_per_param(eng)[key], _per_param(fresh)[key]))
        out[f"stage{stage}"] = {"stage": zero_stage(eng), "partitioned": is_partitioned(eng), "agree": agree,
                                "like_plain": like_plain, "steps": sorted(steps), "round_trip": round_trip,
                                "zeroed": zeroed, "rewritten": rewritten, "next_losses": next_losses,
                                "next_exact": after}
    return out


@pytest.fixture(scope="module")
def launch() -> dict:
    (out,) = run_distributed(_launch, world_size=1, timeout_s=240)
    return out


def test_stage_0_is_not_partitioned_and_says_so(launch):
    assert launch["stage0"] == (0, False, True)
    assert "stages 1 and 2" in launch["stage0_refusal"] and "stage 0" in launch["stage0_refusal"]


@pytest.mark.parametrize("stage", [1, 2])
def test_both_views_read_the_moments_of_plain_adamw(launch, stage):
    got = launch[f"stage{stage}"]
    assert got["stage"] == stage and got["partitioned"]
    assert got["agree"]  # per partition == per parameter, bit for bit
    assert got["like_plain"]  # and both equal the moments of the same training without ZeRO
    assert got["steps"] == [2]


@pytest.mark.parametrize("stage", [1, 2])
def test_moments_written_back_read_back_equal_and_train_on_identically(launch, stage):
    got = launch[f"stage{stage}"]
    assert got["round_trip"]
    assert got["zeroed"] and got["rewritten"]  # the per-parameter writer really writes
    loss_a, loss_b = got["next_losses"]
    assert loss_a == loss_b and got["next_exact"]
