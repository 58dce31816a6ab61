"""Per-expert-module layers (any nn.Module expert, DeepSpeed-style deep copies) under ZeRO-3 and in
moe_proto.checkpoint, with real gloo processes (2 ranks).

The expert is LayerNorm -> SwiGLU, which the stacked path cannot copy. Every engine starts from one
full model (load_full_state_dict at its ep size) and takes the same per-rank batches, so:

* ZeRO-3 (``ZeRO3MoE``) at ep 2 and at ep 1 trains as ZeRO-2 with the plain layer at ep 2 (losses
  and the gathered parameters, ``full_state_dict``, after 3 steps);
* a moe_proto checkpoint saved after step 2 at ep 2 under ZeRO-2 loads at ep 1 under ZeRO-3 and at
  ep 1 under ZeRO 0, and the step taken there equals the continuing run's step 3 (Adam moments and
  step restored per global expert).
"""
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from moe_proto import moe_class
from moe_proto.checkpoint import full_state_dict, load_checkpoint, load_full_state_dict, save_checkpoint
from moe_proto.module_experts import ModuleExperts
from sparse_scale.multiproc import run_distributed
from tests.moe_proto.engines import adamw_engine
from tests.moe_proto.test_any_expert import GatedBlock  # LayerNorm -> SwiGLU, D=8: the per-expert path

D, E, B, STEPS = 8, 4, 12, 3
WORLD = 2


class Net(nn.Module):
    def __init__(self, ep_size, stage):
        super().__init__()
        self.inp = nn.Linear(D, D)
        self.moe = moe_class(stage)(D, GatedBlock(), num_experts=E, ep_size=ep_size, k=1, num_prototypes=2,
                                    capacity_factor=1.0, min_capacity=0, use_rts=False)
        self.head = nn.Linear(D, 1)

    def forward(self, x, y):
        h = torch.tanh(self.inp(x))
        m, aux, _ = self.moe(h)
        return F.mse_loss(self.head(h + m).squeeze(-1), y) + 0.01 * aux


def full_init():
    torch.manual_seed(0)
    full = Net(1, 0)
    with torch.no_grad():  # distinct experts: they start as deep copies of one module
        for g, expert in enumerate(full.moe.experts.deepspeed_experts):
            for p in expert.parameters():
                p.add_(0.1 * (g + 1) * torch.randn_like(p))
    return full.state_dict()


def batch(step, rank):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(B, D, generator=g), torch.randn(B, generator=g)


def engine_of(ep, stage, state):
    model = Net(ep, stage)
    assert isinstance(model.moe.experts, ModuleExperts)
    model.moe.set_deepspeed_parallelism()
    load_full_state_dict(model, state)
    return adamw_engine(model, stage=stage, lr=1e-2, batch_size=B)


def step(engine, i, rank):
    loss = engine(*batch(i, rank))
    engine.backward(loss)
    engine.step()
    mean = loss.detach().clone()
    dist.all_reduce(mean)
    return float(mean) / WORLD


def run(rank, world_size, root):
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    full = full_init()
    with torch.no_grad():  # the full init in per-global-expert keys, as full_state_dict writes it
        ref = Net(1, 0)
        ref.load_state_dict(full)
        state = full_state_dict(ref)
    out = {}
    for name, ep, stage in (("z2_ep2", 2, 2), ("z3_ep2", 2, 3), ("z3_ep1", 1, 3)):
        engine = engine_of(ep, stage, state)
        losses = []
        for i in range(STEPS):
            if name == "z2_ep2" and i == STEPS - 1:
                save_checkpoint(engine, root, "t")
            losses.append(step(engine, i, rank))
        out[name] = {"losses": losses, "params": {k: v.numpy() for k, v in full_state_dict(engine.module).items()}}
    for name, ep, stage in (("resumed_z3_ep1", 1, 3), ("resumed_z0_ep1", 1, 0)):
        engine = engine_of(ep, stage, state)
        load_checkpoint(engine, root, "t")
        out[name] = step(engine, STEPS - 1, rank)
    return out


@pytest.mark.soak
def test_per_expert_layers_train_under_zero3_and_checkpoint_across_ep_sizes(tmp_path):
    results = run_distributed(run, WORLD, args=(str(tmp_path),), timeout_s=50)
    r = results[0]
    reference = r["z2_ep2"]
    assert sorted(reference["params"]) == sorted(r["z3_ep1"]["params"])
    assert "moe.experts.deepspeed_experts.3.norm.weight" in reference["params"]  # global expert ids
    for name in ("z3_ep2", "z3_ep1"):
        assert r[name]["losses"] == pytest.approx(reference["losses"], rel=1e-5), name
        for key, value in reference["params"].items():
            assert torch.allclose(torch.from_numpy(r[name]["params"][key]), torch.from_numpy(value), atol=2e-6,
                                  rtol=1e-5), (name, key)
    for name in ("resumed_z3_ep1", "resumed_z0_ep1"):
        assert r[name] == pytest.approx(reference["losses"][-1], rel=1e-5), name
