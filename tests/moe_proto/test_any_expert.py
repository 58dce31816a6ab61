"""Any expert module: the stacked path for FFNs (gated too), the per-expert path (DeepSpeed-style deep copies)
for the rest, each against DeepSpeed's layer, and the per-expert path across ep sizes.

A gated block with a norm inside cannot be stacked, so the layer deep-copies it per expert; its
routing, capacity and outputs must equal DeepSpeed's layer with the same module and weights
(deepspeed_compat top-1/top-2), prototypes and expert parallelism must work as on the stacked
path, and DeepSpeed's engine.save_checkpoint must split it per expert.
"""
import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from moe_proto import MoE
from moe_proto.checkpoint import expert_buffers, expert_params
from moe_proto.ds_layout import EXPERTS_PREFIX
from moe_proto.experts import GroupedExperts
from moe_proto.module_experts import ModuleExperts
from moe_proto.zero3 import to_zero3
from sparse_scale.multiproc import run_distributed

D, E = 8, 4


class GatedBlock(nn.Module):
    """LayerNorm -> SwiGLU: nothing the stacked path recognises."""

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.gate_proj = nn.Linear(D, 16)
        self.up_proj = nn.Linear(D, 16)
        self.down_proj = nn.Linear(16, D)

    def forward(self, x):
        x = self.norm(x)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class SwiGLU(nn.Module):
    """A gated FFN the stacked path copies; ``up_first`` registers up before gate (the other reading)."""

    def __init__(self, up_first=False, bias=True):
        super().__init__()
        if up_first:
            self.up_proj = nn.Linear(D, 16, bias=bias)
        self.gate_proj = nn.Linear(D, 16, bias=bias)
        if not up_first:
            self.up_proj = nn.Linear(D, 16, bias=bias)
        self.down_proj = nn.Linear(16, D, bias=bias)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def _perturb_experts(experts):
    with torch.no_grad():
        for i, expert in enumerate(experts):
            for p in expert.parameters():
                p.add_(0.1 * (i + 1) * torch.randn_like(p))


def test_paths_are_chosen_by_the_module_and_logged(caplog):
    caplog.set_level("INFO", logger="moe_proto.layer")
    ffn = MoE(D, nn.Sequential(nn.Linear(D, 16), nn.GELU(), nn.Linear(16, D)), num_experts=E)
    assert isinstance(ffn.experts, GroupedExperts)
    for module in (GatedBlock(), nn.Linear(D, D), nn.Sequential(nn.Linear(D, 16), nn.Linear(16, D))):
        assert isinstance(MoE(D, module, num_experts=E).experts, ModuleExperts)
    assert "takes the stacked path" in caplog.text and "GatedBlock takes the per-expert path" in caplog.text


@pytest.mark.parametrize("up_first,bias", [(False, True), (True, False)])
def test_gated_ffns_take_the_stacked_path_and_equal_deepspeeds_layer(up_first, bias):
    from deepspeed.moe.layer import MoE as DeepSpeedMoE

    torch.manual_seed(0)
    kw = dict(num_experts=E, k=2, use_rts=False, top2_2nd_expert_sampling=False, min_capacity=2)
    theirs = DeepSpeedMoE(D, SwiGLU(up_first, bias), **kw)
    _perturb_experts(theirs.deepspeed_moe.experts.deepspeed_experts)
    ours = MoE(D, SwiGLU(up_first, bias), deepspeed_compat=True, **kw)
    assert isinstance(ours.experts, GroupedExperts) and ours.experts.activation == "swiglu"
    assert sorted(ours.state_dict()) == sorted(theirs.state_dict())
    ours.load_state_dict(theirs.state_dict())
    x = torch.randn(3, 10, D)
    assert torch.allclose(ours(x)[0], theirs(x)[0], atol=1e-5)
    for key, value in theirs.state_dict().items():
        assert torch.equal(ours.state_dict()[key], value), key


@pytest.mark.parametrize("k", [1, 2])
def test_per_expert_path_equals_deepspeeds_layer(k):
    from deepspeed.moe.layer import MoE as DeepSpeedMoE

    torch.manual_seed(0)
    kw = dict(num_experts=E, k=k, use_rts=False, capacity_factor=1.0, min_capacity=2,
              top2_2nd_expert_sampling=False)
    theirs = DeepSpeedMoE(D, GatedBlock(), **kw)
    _perturb_experts(theirs.deepspeed_moe.experts.deepspeed_experts)
    ours = MoE(D, GatedBlock(), deepspeed_compat=True, **kw)
    ours.load_state_dict(theirs.state_dict())
    x = torch.randn(2, 12, D)
    for mode in ("train", "eval"):  # noise is off: both modes are deterministic
        getattr(theirs, mode)(), getattr(ours, mode)()
        (a, aux_a, counts_a), (b, aux_b, counts_b) = theirs(x), ours(x)
        assert torch.allclose(a, b, atol=1e-6) and torch.allclose(aux_a, aux_b) and torch.equal(counts_a, counts_b)
    (theirs(x)[0].square().sum()).backward()
    (ours(x)[0].square().sum()).backward()
    for (name, p), (_, q) in zip(theirs.deepspeed_moe.experts.named_parameters(), ours.experts.named_parameters()):
        assert torch.allclose(p.grad, q.grad, atol=1e-5), name


def test_per_expert_layers_convert_to_zero3_name_per_expert_buffers_and_refuse_bad_shapes():
    model = nn.Sequential(MoE(D, GatedBlock(), num_experts=E))
    assert sorted(expert_params(model)) == sorted(f"0.experts.{n}" for n, _ in model[0].experts.named_parameters())
    layer = to_zero3(model[0])  # the ZeRO-3 layer takes per-expert modules too (test_module_experts_zero3.py)
    assert isinstance(layer.experts, ModuleExperts)
    assert {p.ds_zero_placement_family for p in layer.experts.parameters()} == {"autoep_expert"}
    with_buffers = nn.Sequential(MoE(D, nn.Sequential(nn.Linear(D, D), nn.BatchNorm1d(D)), num_experts=E))
    # per-expert buffers are saved per global expert (tests/moe_proto/test_pyramid_checkpoint.py), not refused
    assert "0.experts.deepspeed_experts.3.1.running_mean" in expert_buffers(with_buffers)
    assert not any("running" in name for name in expert_params(with_buffers))
    bad = MoE(D, nn.Linear(D, 2 * D), num_experts=E)
    with pytest.raises(ValueError, match=r"maps rows \(\d+, 8\) to \(\d+, 16\)"):
        bad(torch.randn(6, D))


def ep_run(rank, world_size, root):
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    kw = dict(num_experts=E, k=1, num_prototypes=2, use_rts=False, capacity_factor=2.0, min_capacity=0)
    torch.manual_seed(0)
    full = MoE(D, GatedBlock(), **kw)
    _perturb_experts(full.experts.deepspeed_experts)
    layer = MoE(D, GatedBlock(), ep_size=2, **kw)
    layer.set_deepspeed_parallelism()
    local = E // 2
    state = {}
    for key, value in full.state_dict().items():  # this rank's experts, renumbered local
        if key.startswith(EXPERTS_PREFIX):
            g, rest = key[len(EXPERTS_PREFIX):].split(".", 1)
            if rank * local <= int(g) < (rank + 1) * local:
                state[f"{EXPERTS_PREFIX}{int(g) - rank * local}.{rest}"] = value
        else:
            state[key] = value
    layer.load_state_dict(state)
    inputs = [torch.randn(10, D, generator=torch.Generator().manual_seed(r)) for r in range(world_size)]
    out = layer(inputs[rank])[0]
    out.square().sum().backward()
    ref_outs = []
    for x in inputs:  # the reference: every rank's tokens through the one-process layer, gradients summed
        y = full(x)[0]
        y.square().sum().backward()
        ref_outs.append(y.detach())
    grads_match = all(
        torch.allclose(p.grad, full.experts.deepspeed_experts[rank * local + i].get_parameter(n).grad, atol=1e-5)
        for i in range(local) for n, p in layer.experts.deepspeed_experts[i].named_parameters())
    # DeepSpeed's engine trains the per-expert layer (ZeRO 2, ep 2) and splits it into its expert files.
    model = nn.Sequential(nn.Linear(D, D), MoE(D, GatedBlock(), ep_size=2, **kw))
    engine, *_ = deepspeed.initialize(model=model, model_parameters=list(model.parameters()), config={
        "train_micro_batch_size_per_gpu": 10,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
        "zero_optimization": {"stage": 2}, "steps_per_print": 10**6})
    before = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    for step in range(2):
        loss = engine(inputs[rank])[0].square().mean()
        engine.backward(loss)
        engine.step()
    moved = all(not torch.equal(p, before[n]) for n, p in engine.module.named_parameters())
    engine.save_checkpoint(root, tag="t")
    trained = {k: v.clone() for k, v in engine.module.state_dict().items()}
    with torch.no_grad():
        for p in engine.module.parameters():
            p.zero_()
    engine.load_checkpoint(root, tag="t", load_optimizer_states=False)
    restored = all(torch.equal(v, trained[k]) for k, v in engine.module.state_dict().items())
    return {"out": torch.allclose(out, ref_outs[rank], atol=1e-5), "grads": grads_match, "moved": moved,
            "restored": restored,
            "files": sorted(f for f in os.listdir(os.path.join(root, "t")) if f.startswith("layer_"))}


def test_per_expert_path_under_expert_parallelism_and_deepspeeds_checkpoint(tmp_path):
    results = run_distributed(ep_run, 2, args=(str(tmp_path),), timeout_s=40)
    for r in results:
        assert r["out"] and r["grads"] and r["moved"] and r["restored"]
        assert r["files"] == [f"layer_0_expert_{g}_mp_rank_00_model_states.pt" for g in range(E)]


@pytest.mark.parametrize("module", [lambda: nn.Sequential(nn.Linear(D, 16), nn.ReLU(), nn.Linear(16, D)),
                                    lambda: SwiGLU(), lambda: GatedBlock()])
def test_building_from_an_expert_module_leaves_the_global_rng_as_deepspeeds_layer_does(module):
    """The layers after an MoE layer must start from the weights they get beside DeepSpeed's layer (a deep copy)."""
    from deepspeed.moe.layer import MoE as DeepSpeedMoE

    expert = module()
    after = {}
    for name, build in (("ds", DeepSpeedMoE), ("ours", MoE)):
        torch.manual_seed(0)
        build(D, expert, num_experts=E, use_rts=False)
        after[name] = torch.rand(4)
    assert torch.equal(after["ours"], after["ds"])
