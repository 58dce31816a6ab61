"""DeepSpeed's own engine.save_checkpoint / load_checkpoint with moe_proto.MoE, and DeepSpeed's state-dict keys.

One 4-rank launch (gloo, CPU) saves and loads across layers, ep sizes and ZeRO stages:
DeepSpeed's layer at ep 2 (ZeRO 1) -> ours at ep 4 (ZeRO 0), both PR-MoE (use_residual);
ours at ep 2 (ZeRO 2, the save that hung before: two ranks write expert files, two do not)
-> DeepSpeed's at ep 1 (ZeRO 0); ours built without an expert module (stacked keys until
deepspeed.initialize binds it) at ep 2 resumes exactly under ZeRO 1. Each load is checked
against the expert files DeepSpeed wrote and by the eval output on one batch, which must
equal the saving model's. A second launch runs DeepSpeed's test_checkpoint_moe_and_zero scenario on a
PR-MoE pyramid (2 experts at ep 2, 4 at ep 4, residual MLPs) in fp16 under ZeRO 2: an exact resume with
optimizer states and loss scaler, and the weights loaded into ours at ep (1, 2) and DeepSpeed's layer at ep (2, 2).
"""
import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from moe_proto import MoE
from moe_proto.ds_layout import EXPERTS_PREFIX, GATE_KEY, expert_state, stacked_layout
from sparse_scale.multiproc import run_distributed

D, FFN, E, B = 8, 16, 8, 16
WORLD = 4


def _mlp():
    return nn.Sequential(nn.Linear(D, FFN), nn.ReLU(), nn.Linear(FFN, D))


class Net(nn.Module):
    def __init__(self, layer: str, ep_size: int):
        super().__init__()
        self.inp = nn.Linear(D, D)
        kw = dict(num_experts=E, ep_size=ep_size, k=1, min_capacity=0, use_rts=False, capacity_factor=2.0,
                  eval_capacity_factor=2.0)
        if layer == "deepspeed":  # both with PR-MoE's residual MLP (its keys: mlp.*, coefficient.*)
            from deepspeed.moe.layer import MoE as DeepSpeedMoE
            self.moe = DeepSpeedMoE(D, _mlp(), use_residual=True, **kw)
        elif layer == "ours":
            self.moe = MoE(D, _mlp(), deepspeed_compat=True, use_residual=True, **kw)
        else:  # ours, experts built by the layer (stacked keys until bound to the engine)
            self.moe = MoE(D, None, ffn_hidden_size=FFN, **kw)
        self.head = nn.Linear(D, 1)

    def forward(self, x, y):
        h = torch.tanh(self.inp(x))
        m, aux, _ = self.moe(h)
        return F.mse_loss(self.head(h + m).squeeze(-1), y) + 0.01 * aux


def _batch(step, rank):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(B, D, generator=g), torch.randn(B, generator=g)


def _engine(layer, ep_size, stage, rank):
    import deepspeed

    torch.manual_seed(0)
    model = Net(layer, ep_size)
    with torch.no_grad():  # distinct experts: expert g's weights depend on g (DeepSpeed deep-copies one module)
        ep_rank, local = rank % ep_size, E // ep_size
        for i in range(local):
            g = ep_rank * local + i
            if layer == "deepspeed":
                for p in model.moe.deepspeed_moe.experts.deepspeed_experts[i].parameters():
                    p.add_(0.1 * g)
            else:
                for p in model.moe.experts.parameters():
                    p[i].add_(0.1 * g)
    cfg = {"train_micro_batch_size_per_gpu": B, "gradient_accumulation_steps": 1,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.0, "torch_adam": True}},
           "zero_optimization": {"stage": stage}, "steps_per_print": 10**6}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=list(model.parameters()), config=cfg)
    return engine


def _train(engine, rank, steps=(0,)):
    losses = []
    engine.train()
    for step in steps:
        loss = engine(*_batch(step, rank))
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
    return losses


def _eval_output(engine, rank):
    engine.eval()
    x, _ = _batch(99, rank)
    with torch.no_grad():
        h = torch.tanh(engine.module.inp(x))
        return engine.module.moe(h)[0].numpy()


def _expert_files_match(engine, save_dir, tag):
    """Every local expert of ``engine``'s layer equals the file DeepSpeed wrote for its global id."""
    layer = engine.module.moe
    ep_rank = layer.ep_rank
    for i in range(layer.num_local_experts):
        g = ep_rank * layer.num_local_experts + i
        saved = torch.load(os.path.join(save_dir, tag, f"layer_0_expert_{g}_mp_rank_00_model_states.pt"))
        prefix = f"moe.{EXPERTS_PREFIX}{g}."
        saved = {k[len(prefix):]: v for k, v in saved.items()}
        ours = expert_state(layer, i)
        if sorted(saved) != sorted(ours) or not all(torch.equal(saved[k], ours[k]) for k in ours):
            return False
    return True


def ds_roundtrip(rank, world_size, root):
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    out = {}
    # 1. DeepSpeed's layer (ep 2, ZeRO 1) saves; ours (ep 4, ZeRO 0) loads it.
    a = _engine("deepspeed", 2, 1, rank)
    _train(a, rank)
    a.save_checkpoint(os.path.join(root, "ds"), tag="t")
    out["ds_output"] = _eval_output(a, rank)
    b = _engine("ours", 4, 0, rank)
    b.load_checkpoint(os.path.join(root, "ds"), tag="t", load_optimizer_states=False)
    out["ours_from_ds_output"] = _eval_output(b, rank)
    out["ours_from_ds_files"] = _expert_files_match(b, os.path.join(root, "ds"), "t")
    # 2. Ours (ep 2, ZeRO 2) saves; DeepSpeed's layer (ep 1, ZeRO 0) loads it.
    c = _engine("ours", 2, 2, rank)
    _train(c, rank)
    c.save_checkpoint(os.path.join(root, "ours"), tag="t")
    out["ours_output"] = _eval_output(c, rank)
    out["files"] = sorted(os.listdir(os.path.join(root, "ours", "t")))
    d = _engine("deepspeed", 1, 0, rank)
    d.load_checkpoint(os.path.join(root, "ours"), tag="t", load_optimizer_states=False)
    out["ds_from_ours_output"] = _eval_output(d, rank)
    # 3. Ours with its own experts (stacked keys until bound), ep 2, ZeRO 1: an exact resume.
    e = _engine("stacked", 2, 1, rank)
    _train(e, rank, steps=(0,))
    e.save_checkpoint(os.path.join(root, "stacked"), tag="t")
    out["continued"] = _train(e, rank, steps=(1, 2))
    f = _engine("stacked", 2, 1, rank)
    f.load_checkpoint(os.path.join(root, "stacked"), tag="t")
    out["resumed"] = _train(f, rank, steps=(1, 2))
    return out


@pytest.mark.soak
def test_deepspeed_checkpoints_load_across_layers_ep_sizes_and_zero_stages(tmp_path):
    results = run_distributed(ds_roundtrip, WORLD, args=(str(tmp_path),), timeout_s=45)
    for rank, r in enumerate(results):
        # eval routing is deterministic and our layer reproduces DeepSpeed's top-1 (deepspeed_compat)
        assert torch.allclose(torch.tensor(r["ours_from_ds_output"]), torch.tensor(r["ds_output"]), atol=1e-5), rank
        assert torch.allclose(torch.tensor(r["ds_from_ours_output"]), torch.tensor(r["ours_output"]), atol=1e-5), rank
        assert r["ours_from_ds_files"], rank
        assert r["resumed"] == r["continued"], rank
    assert [f for f in results[0]["files"] if f.startswith("layer_0_expert_")] == sorted(
        f"layer_0_expert_{g}_mp_rank_00_model_states.pt" for g in range(E))


def test_state_dict_uses_deepspeeds_keys_and_loads_both_layouts():
    from deepspeed.moe.layer import MoE as DeepSpeedMoE

    torch.manual_seed(0)
    theirs = DeepSpeedMoE(D, _mlp(), num_experts=4, use_rts=False, use_residual=True)
    with torch.no_grad():
        for i, expert in enumerate(theirs.deepspeed_moe.experts.deepspeed_experts):
            for p in expert.parameters():
                p.add_(i)
    ours = MoE(D, _mlp(), num_experts=4, use_rts=False, use_residual=True, deepspeed_compat=True)
    assert sorted(ours.state_dict()) == sorted(theirs.state_dict())
    ours.load_state_dict(theirs.state_dict())  # strict
    for key, value in theirs.state_dict().items():
        assert torch.equal(ours.state_dict()[key], value), key
    x = torch.randn(2, 16, D)
    assert torch.allclose(ours.eval()(x)[0], theirs.eval()(x)[0], atol=1e-6)
    # the layer's own (stacked) keys load too, and a layer that built its experts writes them by default
    with stacked_layout(ours):
        stacked = ours.state_dict()
    assert "experts.w1" in stacked and GATE_KEY not in stacked
    again = MoE(D, _mlp(), num_experts=4, use_rts=False, use_residual=True)
    again.load_state_dict(stacked)
    assert torch.equal(again.experts.w1, ours.experts.w1)
    own = MoE(D, None, num_experts=4, ffn_hidden_size=FFN, use_rts=False)
    assert sorted(own.state_dict()) == ["experts.w1", "experts.w2", "gate.weight"]


def test_missing_experts_in_deepspeed_keys_are_named():
    ours = MoE(D, _mlp(), num_experts=4, use_rts=False)
    state = ours.state_dict()
    del state[f"{EXPERTS_PREFIX}3.0.weight"]
    with pytest.raises(RuntimeError, match=r"deepspeed_experts\.3\.0\.weight \(1 of the layer's 4 local experts"):
        ours.load_state_dict(state)


def test_full_state_helpers_name_deepspeeds_layout():
    from moe_proto.checkpoint import load_full_state_dict

    source = nn.Sequential(MoE(D, _mlp(), num_experts=4, use_rts=False))  # DeepSpeed's keys
    target = nn.Sequential(MoE(D, _mlp(), num_experts=4, use_rts=False))
    with pytest.raises(KeyError, match="in DeepSpeed's layout; take it as `with moe_proto.ds_layout.stacked_layout"):
        load_full_state_dict(target, source.state_dict())
    with stacked_layout(source):
        load_full_state_dict(target, source.state_dict())
    assert torch.equal(target[0].experts.w1, source[0].experts.w1)
    assert source[0].state_dict_layout == "deepspeed"  # restored after the block


def pyramid_roundtrip(rank, world_size, root):
    """PR-MoE (2 experts at ep 2, then 4 at ep 4; residual MLPs) in fp16 under ZeRO 2, as DeepSpeed's
    test_checkpoint_moe_and_zero: an exact resume with optimizer states, then the weights at other ep sizes."""
    import deepspeed

    from tests.moe_proto.test_ds_battery import PRMoEModel, batch, make_engine, perturb_experts

    deepspeed.init_distributed(dist_backend="gloo")

    def engine_of(which, ep_sizes, stage):
        torch.manual_seed(0)
        model = PRMoEModel(which, ep_sizes=ep_sizes, use_residual=True)
        perturb_experts(model, rank)
        return make_engine(model, stage, "fp16")

    def steps(engine, which):
        losses = []
        for step in which:
            loss = engine(*batch(step, rank, torch.float16))
            engine.backward(loss)
            engine.step()
            losses.append(float(loss.detach()))
        return losses

    def features(engine):
        engine.eval()
        with torch.no_grad():
            return engine.module.features(batch(99, rank, torch.float16)[0]).float().numpy()

    out = {}
    a = engine_of("ours", (2, 4), 2)
    steps(a, (0, 1))
    a.save_checkpoint(root, tag="t")
    out["saved"] = features(a)
    a.train()
    out["continued"] = steps(a, (2, 3))
    out["files"] = sorted(f for f in os.listdir(os.path.join(root, "t")) if f.startswith("layer_"))
    b = engine_of("ours", (2, 4), 2)
    b.load_checkpoint(root, tag="t")  # optimizer states and the loss scaler too
    out["resumed"] = steps(b, (2, 3))
    for name, which, ep_sizes, stage in (("ours_ep_1_2", "ours", (1, 2), 0), ("ds_ep_2_2", "ds", (2, 2), 1)):
        c = engine_of(which, ep_sizes, stage)
        c.load_checkpoint(root, tag="t", load_optimizer_states=False)
        out[name] = features(c)
    out["untrained"] = features(engine_of("ours", (1, 2), 0))  # what a load that did nothing would give
    return out


@pytest.mark.soak
def test_pyramid_fp16_checkpoint_resumes_and_loads_at_other_ep_sizes_and_into_deepspeeds_layer(tmp_path):
    results = run_distributed(pyramid_roundtrip, WORLD, args=(str(tmp_path),), timeout_s=50)
    for rank, r in enumerate(results):
        assert r["resumed"] == r["continued"], rank
        for name in ("ours_ep_1_2", "ds_ep_2_2"):
            assert torch.allclose(torch.tensor(r[name]), torch.tensor(r["saved"]), atol=2e-3, rtol=2e-3), (name, rank)
        assert not torch.allclose(torch.tensor(r["untrained"]), torch.tensor(r["saved"]), atol=2e-2), rank
    assert results[0]["files"] == [f"layer_0_expert_{g}_mp_rank_00_model_states.pt" for g in range(2)] + [
        f"layer_1_expert_{g}_mp_rank_00_model_states.pt" for g in range(4)]
