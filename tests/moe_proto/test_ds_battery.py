"""DeepSpeed's MoE test scenarios (its tests/unit/moe/test_moe.py), run on moe_proto.MoE and on DeepSpeed's layer
side by side with real gloo processes (4 ranks, CPU accelerator).

* DeepSpeed's simple model (two MoE layers sharing one ``Sequential(Linear, Linear)`` expert, a dense
  layer between them) at ep 2 and 4, ZeRO 0/1/2, with and without the residual MLP (``use_residual``);
* PR-MoE, a pyramid: 2 experts at ep 2 in the first layer, 4 at ep 4 in the second (two expert groups in
  one model), with and without the residual, ZeRO 0 and 2;
* fp16 and bf16 under ZeRO 0/1/2 (DeepSpeed's CPU accelerator takes both);
* expert weight gradients (``deepspeed.utils.safe_get_full_grad``) equal at ep 1, 2 and 4, per global
  expert, for the per-expert path and the stacked path, ZeRO 0/1/2 (DeepSpeed's
  TestExpertWeightGradWithZero, with different data on every rank).

Our layer runs with ``deepspeed_compat=True`` (DeepSpeed's top-1 decisions), so with the same weights the two
layers must give the same losses step by step (fp32) or within rounding (fp16/bf16). Checkpoints with
DeepSpeed's own calls are in test_ds_checkpoint.py.
"""
import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from moe_proto import MoE, MoEBase
from moe_proto.module_experts import ModuleExperts
from sparse_scale.multiproc import run_distributed

H, WORLD, STEPS = 16, 4, 3
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def layer_class(which: str):
    if which == "ds":
        from deepspeed.moe.layer import MoE as DeepSpeedMoE
        return DeepSpeedMoE
    return functools.partial(MoE, deepspeed_compat=True)


def plain_expert():
    return nn.Sequential(nn.Linear(H, H), nn.Linear(H, H))  # DeepSpeed's: no activation (our per-expert path)


def ffn_expert():
    return nn.Sequential(nn.Linear(H, 2 * H), nn.ReLU(), nn.Linear(2 * H, H))  # our stacked path


class SimpleMoEModel(nn.Module):
    """DeepSpeed's unit-test model: two MoE layers copying one expert module, dense layers around them."""

    def __init__(self, which, ep_size, use_residual=False, num_experts=4, expert=plain_expert):
        super().__init__()
        cls, module = layer_class(which), expert()
        self.linear1 = nn.Linear(H, H)
        self.moe_1 = cls(H, module, num_experts=num_experts, ep_size=ep_size, use_residual=use_residual, k=1,
                         use_rts=False)
        self.linear2 = nn.Linear(H, H)
        self.moe_2 = cls(H, module, num_experts=num_experts, ep_size=ep_size, use_residual=use_residual, k=1,
                         use_rts=False)
        self.linear3 = nn.Linear(H, H)

    def forward(self, x, y):
        hidden = self.linear1(x)
        out = self.moe_2(self.linear2(self.moe_1(hidden)[0]))[0]
        return F.cross_entropy((hidden + self.linear3(out)).mean(1).float(), y)


class PRMoEModel(nn.Module):
    """PR-MoE: more experts in the later layer (a pyramid), each layer at its own ep size."""

    def __init__(self, which, num_experts=(2, 4), ep_sizes=(2, 4), use_residual=False):
        super().__init__()
        cls = layer_class(which)
        self.linear = nn.Linear(H, H)
        self.moes = nn.ModuleList([
            cls(H, nn.Linear(H, H), num_experts=e, ep_size=ep, use_residual=use_residual, k=1, use_rts=False)
            for e, ep in zip(num_experts, ep_sizes)])

    def features(self, x):
        hidden = self.linear(x)
        out = hidden
        for moe in self.moes:
            out = moe(out)[0]
        return hidden + out

    def forward(self, x, y):
        return F.cross_entropy(self.features(x).mean(1).float(), y)


def moe_layers(model):
    from deepspeed.moe.layer import MoE as DeepSpeedMoE

    return [m for m in model.modules() if isinstance(m, (DeepSpeedMoE, MoEBase))]


def which_of(layer):
    return "ds" if hasattr(layer, "deepspeed_moe") else "ours"


def local_experts(layer):
    """The layer's local expert modules (per-expert paths of both layers), or None for our stacked experts."""
    if hasattr(layer, "deepspeed_moe"):
        return list(layer.deepspeed_moe.experts.deepspeed_experts)
    if isinstance(layer.experts, ModuleExperts):
        return list(layer.experts.deepspeed_experts)
    return None


def perturb_experts(model, rank):
    """Make expert g's weights depend on g (both layers deep-copy one module), on the ranks that hold it."""
    with torch.no_grad():
        for layer in moe_layers(model):
            ep_rank, local = rank % layer.ep_size, layer.num_local_experts
            modules = local_experts(layer)
            for i in range(local):
                g = ep_rank * local + i
                params = modules[i].parameters() if modules is not None else (p[i] for p in layer.experts.parameters())
                for p in params:
                    p.add_(0.05 * (g + 1))


def batch(step, rank, dtype=torch.float32):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(2, 8, H, generator=g).to(dtype), torch.randint(0, H, (2,), generator=g)


def make_engine(model, stage, dtype="fp32", lr=1e-2):
    import deepspeed

    cfg = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**6, "zero_optimization": {"stage": stage},
           "optimizer": {"type": "AdamW", "params": {"lr": lr, "torch_adam": True}}}
    if dtype == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 8}
    elif dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=list(model.parameters()), config=cfg)
    return engine


def train_losses(build, stage, rank, dtype="fp32"):
    torch.manual_seed(0)
    model = build()
    perturb_experts(model, rank)
    engine = make_engine(model, stage, dtype)
    losses = []
    for step in range(STEPS):
        loss = engine(*batch(step, rank, DTYPES[dtype]))
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    layer = moe_layers(engine.module)[0]
    expert_dtype = next((layer.deepspeed_moe if which_of(layer) == "ds" else layer).experts.parameters()).dtype
    return {"losses": losses, "expert_dtype": str(expert_dtype)}


SIMPLE = [(ep, stage, res) for ep in (2, 4) for stage in (0, 1, 2) for res in (False, True)]
PRMOE = [(stage, res) for stage in (0, 2) for res in (False, True)]


def fp32_battery(rank, world_size):
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    out = {}
    for which in ("ours", "ds"):
        for ep, stage, res in SIMPLE:
            out["simple", ep, stage, res, which] = train_losses(
                lambda: SimpleMoEModel(which, ep, res), stage, rank)
        for stage, res in PRMOE:
            out["prmoe", stage, res, which] = train_losses(lambda: PRMoEModel(which, use_residual=res), stage, rank)
    return out


@pytest.fixture(scope="module")
def fp32_results():
    return run_distributed(fp32_battery, WORLD, timeout_s=50)


@pytest.mark.soak
@pytest.mark.parametrize("ep,stage,res", SIMPLE)
def test_simple_model_trains_as_deepspeeds_layer(fp32_results, ep, stage, res):
    for rank, r in enumerate(fp32_results):
        ours, theirs = r["simple", ep, stage, res, "ours"], r["simple", ep, stage, res, "ds"]
        assert ours["losses"] == pytest.approx(theirs["losses"], rel=1e-5, abs=1e-6), rank
        assert len(set(ours["losses"])) == STEPS  # it trains: every step's loss differs


@pytest.mark.soak
@pytest.mark.parametrize("stage,res", PRMOE)
def test_pyramid_residual_moe_trains_as_deepspeeds_layer(fp32_results, stage, res):
    for rank, r in enumerate(fp32_results):
        ours, theirs = r["prmoe", stage, res, "ours"], r["prmoe", stage, res, "ds"]
        assert ours["losses"] == pytest.approx(theirs["losses"], rel=1e-5, abs=1e-6), rank


def expert_grads(engine):
    """{(layer index, global expert id): {expert-module key: full gradient}} for this rank's experts.

    A collective under ZeRO 1/2 (``safe_get_full_grad`` all-reduces over the parameter's group): every
    rank walks the same layers, experts and keys in the same order.
    """
    from deepspeed.utils import safe_get_full_grad

    out = {}
    for index, layer in enumerate(moe_layers(engine.module)):
        local, ep_rank = layer.num_local_experts, torch.distributed.get_rank() % layer.ep_size
        modules = local_experts(layer)
        if modules is None:  # stacked: experts.w1 [E_local, d, f] row i is Linear(d, f).weight transposed
            stacked = {key: safe_get_full_grad(getattr(layer.experts, name))
                       for name, key in layer.experts.expert_keys.items()}
            for i in range(local):
                out[index, ep_rank * local + i] = {
                    key: (g[i].t() if g[i].dim() == 2 else g[i]).clone().numpy() for key, g in stacked.items()}
        else:
            for i, module in enumerate(modules):
                out[index, ep_rank * local + i] = {
                    key: safe_get_full_grad(p).clone().numpy() for key, p in module.named_parameters()}
    return out


GRAD_CASES = [(kind, ep, stage) for kind in ("plain", "ffn") for ep in (1, 2, 4) for stage in (0, 1, 2)]
DTYPE_CASES = [(dtype, stage) for dtype in ("fp16", "bf16") for stage in (0, 1, 2)]


def grads_and_dtypes_battery(rank, world_size):
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    out = {}
    for kind, ep, stage in GRAD_CASES:
        for which in ("ours", "ds"):
            torch.manual_seed(0)
            model = SimpleMoEModel(which, ep, expert=plain_expert if kind == "plain" else ffn_expert)
            perturb_experts(model, rank)
            engine = make_engine(model, stage)
            loss = engine(*batch(0, rank))
            engine.backward(loss)
            out["grads", kind, ep, stage, which] = expert_grads(engine)
            if which == "ours":
                out["path", kind] = type(moe_layers(engine.module)[0].experts).__name__
            engine.step()
    for dtype, stage in DTYPE_CASES:
        for which in ("ours", "ds"):
            out[dtype, stage, which] = train_losses(lambda: SimpleMoEModel(which, 2, True), stage, rank, dtype)
    return out


@pytest.fixture(scope="module")
def grad_results():
    return run_distributed(grads_and_dtypes_battery, WORLD, timeout_s=50)


def _merged(results, key):
    """Every global expert's gradients, from whichever ranks hold it (they must agree)."""
    merged = {}
    for rank, r in enumerate(results):
        for expert, grads in r[key].items():
            if expert in merged:
                for name, g in grads.items():
                    assert torch.allclose(torch.from_numpy(g), torch.from_numpy(merged[expert][name]),
                                          rtol=1e-5, atol=1e-7), (key, expert, name, rank)
            else:
                merged[expert] = grads
    return merged


@pytest.mark.soak
@pytest.mark.parametrize("kind", ["plain", "ffn"])
@pytest.mark.parametrize("stage", [0, 1, 2])
def test_expert_weight_gradients_equal_across_ep_sizes_and_layers(grad_results, kind, stage):
    assert grad_results[0]["path", kind] == ("ModuleExperts" if kind == "plain" else "GroupedExperts")
    reference = _merged(grad_results, ("grads", kind, 1, stage, "ds"))
    assert sorted(reference) == [(layer, g) for layer in (0, 1) for g in range(4)]
    assert any(abs(v).max() > 0 for grads in reference.values() for v in grads.values())
    for ep in (1, 2, 4):
        for which in ("ours", "ds"):
            got = _merged(grad_results, ("grads", kind, ep, stage, which))
            assert sorted(got) == sorted(reference), (ep, which)
            for expert, grads in reference.items():
                assert sorted(got[expert]) == sorted(grads), (ep, which, expert)
                for name, ref in grads.items():
                    assert torch.allclose(torch.from_numpy(got[expert][name]), torch.from_numpy(ref), rtol=1e-4,
                                          atol=1e-6), (ep, which, expert, name)


@pytest.mark.soak
@pytest.mark.parametrize("dtype,stage", DTYPE_CASES)
def test_half_precision_trains_as_deepspeeds_layer(grad_results, dtype, stage):
    tolerance = {"fp16": 2e-3, "bf16": 1e-2}[dtype]
    for rank, r in enumerate(grad_results):
        ours, theirs = r[dtype, stage, "ours"], r[dtype, stage, "ds"]
        assert ours["expert_dtype"] == theirs["expert_dtype"] == str(DTYPES[dtype])  # the engine cast both
        assert all(torch.isfinite(torch.tensor(ours["losses"])))
        assert ours["losses"] == pytest.approx(theirs["losses"], rel=tolerance), rank
