"""moe_proto's MoE layer under ZeRO stage 3 (``ZeRO3MoE``, an AutoEP layer class, ``moe_class(3)``) on gloo ranks.

As in tests/moe_proto/test_deepspeed.py, every rank builds the full model from one seed and keeps
its experts, and the reference is one process taking the global batch as one chunk per rank
(capacity is per rank) with torch's AdamW and clip_grad_norm_: losses, clipped norms and the
gathered parameters after 3 steps must match it. Modes: k=1 with 2 prototypes and capacity
(k top-1), top-2 dropless. 2 ranks run ep=1 (experts ZeRO-partitioned over both ranks) and
ep=2 (experts sharded by EP); 4 ranks (slow) run ep=2 (experts partitioned over pairs of
ranks) and ep=4.

Checkpoints: the k top-1 run saves with moe_proto.checkpoint after step 2 under ZeRO-3; fresh
engines at another ep_size (ZeRO-3), the same ep_size, and ZeRO-2 with the plain layer load it
and take step 3, which must equal the continuing run's step 3 (Adam moments and step included).
"""
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import inspect
import warnings

from moe_proto import MoE, MoEBase, moe_class
from moe_proto.checkpoint import full_state_dict, load_checkpoint, load_full_state_dict, save_checkpoint
from moe_proto.zero3 import ZeRO3MoE
from sparse_scale.multiproc import run_distributed

D, FFN, E, B, STEPS, LR, MAX_NORM = 8, 16, 8, 16, 3, 1e-2, 0.05
MODES = {
    "top1_prototypes_capacity": dict(k=1, num_prototypes=2, capacity_factor=1.0, min_capacity=0, z_loss_coef=0.1),
    "top2_dropless": dict(k=2, dropless=True, top2_2nd_expert_sampling=False),
}
CKPT_MODE = "top1_prototypes_capacity"


class Net(nn.Module):
    def __init__(self, mode, ep_size, zero_stage=None):
        super().__init__()
        self.inp = nn.Linear(D, D)
        self.moe = moe_class(zero_stage)(D, num_experts=E, ep_size=ep_size, use_rts=False, ffn_hidden_size=FFN,
                                         zero_stage=zero_stage, **MODES[mode])
        self.head = nn.Linear(D, 1)

    def forward(self, x, y):
        h = torch.tanh(self.inp(x))
        m, aux, _ = self.moe(h)
        return F.mse_loss(self.head(h + m).squeeze(-1), y) + 0.01 * aux


def batch(step, rank):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(B, D, generator=g), torch.randn(B, generator=g)


def ds_config(stage):
    return {"train_micro_batch_size_per_gpu": B, "gradient_accumulation_steps": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0, "torch_adam": True}},
            "gradient_clipping": MAX_NORM, "zero_optimization": {"stage": stage}, "steps_per_print": 10**6}


def reference_run(mode, world):
    """One process: per step the mean of the per-rank chunk losses, torch clipping, torch AdamW."""
    torch.manual_seed(0)
    model = Net(mode, 1)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    losses, norms = [], []
    for step in range(STEPS):
        loss = sum(model(*batch(step, r)) for r in range(world)) / world
        opt.zero_grad()
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        opt.step()
        losses.append(float(loss.detach()))
    return losses, norms, {k: v.detach().clone() for k, v in model.named_parameters()}


def _engine(mode, ep, stage):
    import deepspeed

    torch.manual_seed(0)
    full = Net(mode, 1)
    model = Net(mode, ep, zero_stage=3 if stage == 3 else None)
    model.moe.set_deepspeed_parallelism()  # groups first, so the full init can be sliced by EP rank
    load_full_state_dict(model, full.state_dict())
    engine, *_ = deepspeed.initialize(model=model, model_parameters=list(model.parameters()),
                                      config=ds_config(stage))
    return engine


def _step(engine, step, rank, world):
    loss = engine(*batch(step, rank))
    engine.backward(loss)
    engine.step()
    mean = loss.detach().clone()
    dist.all_reduce(mean)
    return float(mean) / world, float(engine.get_global_grad_norm())


def _state(engine, rank):
    state = full_state_dict(engine.module)  # collective
    # numpy, not tensors: torch pickles tensors through shared memory that dies with the process.
    return {k: v.numpy() for k, v in state.items()} if rank == 0 else None


def train(rank, world, mode, ep, ckpt_dir=None):
    """3 ZeRO-3 steps; with ``ckpt_dir``, save after step 2 (the continuing run is this one)."""
    engine = _engine(mode, ep, 3)
    assert isinstance(engine.module.moe, ZeRO3MoE)
    # Which group ZeRO-3 partitions each layer parameter over (size), and this rank's share.
    placement = {name: (p.ds_zero_placement_family, dist.get_world_size(group=p.ds_process_group),
                        p.partition_numel(), p.ds_numel) for name, p in engine.module.moe.named_parameters()}
    losses, norms = [], []
    for step in range(STEPS):
        if ckpt_dir is not None and step == STEPS - 1:
            save_checkpoint(engine, ckpt_dir, tag="z3")
        loss, norm = _step(engine, step, rank, world)
        losses.append(loss)
        norms.append(norm)
    return {"losses": losses, "norms": norms, "params": _state(engine, rank), "placement": placement}


def resume(rank, world, ckpt_dir, ep, stage):
    """A fresh engine loads the ZeRO-3 checkpoint and takes the last step."""
    engine = _engine(CKPT_MODE, ep, stage)
    meta = load_checkpoint(engine, ckpt_dir, tag="z3")
    loss, norm = _step(engine, STEPS - 1, rank, world)
    return {"loss": loss, "norm": norm, "global_steps": meta["global_steps"], "params": _state(engine, rank)}


def _launch(rank, world, ckpt_dir, eps, resumes):
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")  # wraps the harness's process group
    out = {}
    for mode in MODES:
        for ep in eps:
            save = ckpt_dir if (mode == CKPT_MODE and ep == eps[-1]) else None
            out[(mode, ep)] = train(rank, world, mode, ep, save)
    for ep, stage in resumes:
        out[("resume", ep, stage)] = resume(rank, world, ckpt_dir, ep, stage)
    return out


# 2 ranks: save at ep=2 (ZeRO-3); load at ep=1 and ep=2 (ZeRO-3) and at ep=2 under ZeRO-2 (the plain layer).
TWO_RANKS = dict(world=2, eps=(1, 2), resumes=[(1, 3), (2, 3), (2, 2)])
# 4 ranks: save at ep=4; load at ep=2 (ZeRO-3).
FOUR_RANKS = dict(world=4, eps=(2, 4), resumes=[(2, 3)])


def _run(setup, tmp_path_factory):
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    ckpt_dir = str(tmp_path_factory.mktemp(f"z3ckpt{setup['world']}"))
    return run_distributed(_launch, world_size=setup["world"], args=(ckpt_dir, setup["eps"], setup["resumes"]),
                           timeout_s=55)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return _run(TWO_RANKS, tmp_path_factory)


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    return _run(FOUR_RANKS, tmp_path_factory)


@pytest.fixture(scope="module")
def references():
    return {(mode, world): reference_run(mode, world) for mode in MODES for world in (2, 4)}


def _check_training(results, reference, mode, ep):
    ref_losses, ref_norms, ref_params = reference
    assert min(ref_norms) > MAX_NORM  # clipping really acts, so the norm must count every expert once
    world = len(results)
    for rank_results in results:
        got = rank_results[(mode, ep)]
        for name, (family, group_size, part, numel) in got["placement"].items():
            # Experts: over their expert-data-parallel group (world/ep ranks); the router: over all ranks.
            expert = name.startswith("experts.")
            assert family == ("autoep_expert" if expert else "replicated"), name
            assert group_size == (world // ep if expert else world), name
            assert part == -(-numel // group_size), name  # each rank holds only its share
        assert got["losses"] == pytest.approx(ref_losses, rel=1e-5, abs=1e-6)
        assert got["norms"] == pytest.approx(ref_norms, rel=1e-5)
    params = results[0][(mode, ep)]["params"]
    assert set(params) == set(ref_params)
    for name, ref in ref_params.items():
        value = torch.from_numpy(params[name])
        assert value.shape == ref.shape, name
        assert torch.allclose(value, ref, atol=2e-6, rtol=1e-5), (name, mode, ep)


def _check_resume(results, setup):
    cont = results[0][(CKPT_MODE, setup["eps"][-1])]
    for key in [k for k in results[0] if k[0] == "resume"]:
        for rank_results in results:
            got = rank_results[key]
            assert got["global_steps"] == STEPS - 1
            assert got["loss"] == pytest.approx(cont["losses"][-1], rel=1e-6), key
            assert got["norm"] == pytest.approx(cont["norms"][-1], rel=1e-5), key
        params = results[0][key]["params"]
        for name, value in cont["params"].items():
            assert torch.allclose(torch.from_numpy(params[name]), torch.from_numpy(value), atol=1e-6, rtol=1e-6), \
                (key, name)


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("ep", TWO_RANKS["eps"])
def test_zero3_two_ranks_match_single_process_reference(two_ranks, references, mode, ep):
    _check_training(two_ranks, references[(mode, 2)], mode, ep)


def test_zero3_checkpoint_loads_at_other_ep_size_and_stage_two_ranks(two_ranks):
    _check_resume(two_ranks, TWO_RANKS)


@pytest.mark.slow
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("ep", FOUR_RANKS["eps"])
@pytest.mark.soak
def test_zero3_four_ranks_match_single_process_reference(four_ranks, references, mode, ep):
    _check_training(four_ranks, references[(mode, 4)], mode, ep)


@pytest.mark.slow
@pytest.mark.soak
def test_zero3_checkpoint_saved_at_ep4_loads_at_ep2(four_ranks):
    _check_resume(four_ranks, FOUR_RANKS)


# Single process: the class, its markers, its forward and the errors for wrong combinations.

def test_zero_stage_3_builds_the_autoep_layer_class_deepspeed_accepts():
    from deepspeed.module_inject.auto_ep_layer import AutoEPMoELayer
    from deepspeed.moe.layer import MoE as DeepSpeedMoE

    layer = ZeRO3MoE(D, None, num_experts=E, ep_size=2, ffn_hidden_size=FFN)
    assert type(layer) is ZeRO3MoE and moe_class(3) is ZeRO3MoE and moe_class(2) is MoE and moe_class(None) is MoE
    assert isinstance(layer, AutoEPMoELayer) and not isinstance(layer, DeepSpeedMoE)
    # One shared base, real inheritance (DeepSpeed refuses its MoE class under ZeRO-3, so ZeRO3MoE cannot derive MoE).
    assert isinstance(layer, MoEBase) and issubclass(ZeRO3MoE, MoEBase) and issubclass(MoE, MoEBase)
    assert issubclass(MoE, DeepSpeedMoE) and not issubclass(ZeRO3MoE, MoE)
    assert inspect.signature(ZeRO3MoE) == inspect.signature(MoE)
    assert type(MoE(D, None, num_experts=E, ffn_hidden_size=FFN, zero_stage=2)) is MoE
    assert layer._z3_leaf  # ZeRO-3 gathers the whole layer at once
    for name, param in layer.named_parameters():
        if name.startswith("experts."):
            assert (param.allreduce, param.group_name) == (False, "ep_size_2"), name
            assert param.ds_zero_placement_family == "autoep_expert", name
            assert param.ds_zero_partition_group_name == "ep_size_2", name
        else:
            assert param.ds_zero_placement_family == "replicated", name
            assert not hasattr(param, "allreduce"), name


@pytest.mark.parametrize("mode", list(MODES))
def test_zero3_layer_computes_what_the_plain_layer_computes(mode):
    torch.manual_seed(0)
    plain = Net(mode, 1)
    torch.manual_seed(0)
    zero3 = Net(mode, 1, zero_stage=3)
    x, y = batch(0, 0)
    loss_plain, loss_zero3 = plain(x, y), zero3(x, y)
    loss_plain.backward()
    loss_zero3.backward()
    assert torch.equal(loss_plain, loss_zero3)
    grads = dict(zero3.named_parameters())
    for name, param in plain.named_parameters():
        assert torch.equal(param.grad, grads[name].grad), name
    assert zero3.moe.last_stats.drop_rate == plain.moe.last_stats.drop_rate


def test_the_deprecated_zero_stage_3_call_warns_and_builds_the_zero3_layer():
    torch.manual_seed(0)
    with pytest.warns(DeprecationWarning, match=r"MoE\(\.\.\., zero_stage=3\) is deprecated.*ZeRO3MoE"):
        old = MoE(D, None, num_experts=E, ep_size=2, ffn_hidden_size=FFN, zero_stage=3)
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the new spellings do not warn
        new = ZeRO3MoE(D, None, num_experts=E, ep_size=2, ffn_hidden_size=FFN)
    assert type(old) is ZeRO3MoE and old.zero_stage == 3 and old.state_dict_layout == "stacked"
    assert all(torch.equal(a, b) for a, b in zip(old.state_dict().values(), new.state_dict().values()))
    assert [p.ds_zero_placement_family for p in old.parameters()] == [p.ds_zero_placement_family
                                                                     for p in new.parameters()]


def test_wrong_zero_stage_combinations_are_refused_before_training():
    with pytest.raises(ValueError, match="zero_stage=4"):
        MoE(D, None, num_experts=E, ffn_hidden_size=FFN, zero_stage=4)
    with pytest.raises(ValueError, match="ZeRO3MoE is the ZeRO stage 3 layer"):
        ZeRO3MoE(D, None, num_experts=E, ffn_hidden_size=FFN, zero_stage=1)

    class Custom(MoE):
        pass

    with pytest.raises(ValueError, match="subclass moe_proto.zero3.ZeRO3MoE"):
        Custom(D, None, num_experts=E, ffn_hidden_size=FFN, zero_stage=3)
    layer = ZeRO3MoE(D, None, num_experts=E, ffn_hidden_size=FFN)
    with pytest.raises(ValueError, match="tensor-parallel folding"):
        layer.set_deepspeed_parallelism(folding_group_handles=object())


def test_planner_zero3_rows_say_what_zero3_needs_and_partition_experts_over_edp():
    from moe_proto.models import MoETransformerArgs
    from moe_proto.plan import ZERO3_NOTE, Choices, build_meta_model, count_parameters, plan_memory

    args = MoETransformerArgs(num_layers=2, d_model=32, num_heads=4, ffn_hidden_size=64, vocab_size=257,
                              max_seq_len=16, num_experts=8, moe_every=1)
    counts = count_parameters(build_meta_model(args))
    gpus, ep = 8, 4
    plans = {stage: plan_memory(counts, args, Choices(stage, "fp32", "adam", "none", False), gpus=gpus, ep_size=ep,
                                micro_batch=1, gpu_mem_gb=32) for stage in (2, 3)}
    assert ZERO3_NOTE in plans[3].notes and ZERO3_NOTE not in plans[2].notes
    assert "zero_stage=3" in ZERO3_NOTE and "refuses" not in ZERO3_NOTE
    # Stage 3: dense parameters over all 8 ranks, an EP rank's 2 experts a layer over its 2 expert-DP ranks.
    assert plans[3].params == pytest.approx(4 * (counts.dense / gpus + counts.expert / ep / (gpus // ep)))
    assert plans[2].params == pytest.approx(4 * (counts.dense + counts.expert / ep))
