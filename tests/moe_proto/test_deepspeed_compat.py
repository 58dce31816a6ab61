"""deepspeed_compat routing and layer against DeepSpeed 0.19.8's own top1gating/top2gating/MoE.

The dense [S, E, C] combine weights are built here, in the test, only to compare with
DeepSpeed's output format; moe_proto itself never builds them.
"""
import inspect
import itertools

import pytest
import torch
from torch import nn

from moe_proto import MoE, route_deepspeed_top1, route_deepspeed_top2

sharded_moe = pytest.importorskip("deepspeed.moe.sharded_moe")
ds_layer = pytest.importorskip("deepspeed.moe.layer")

SHAPES = [(8, 4), (8, 8), (64, 4), (64, 8), (64, 64), (256, 8), (256, 64), (512, 16)]
CAPACITY_FACTORS = [0.5, 1.0, 1.25, 2.0]
MIN_CAPACITIES = [0, 4]
GRAD_TOL = dict(rtol=1e-4, atol=1e-5)  # same maths, different summation order over routes


def _dense_combine(rec, capacity):
    s, _ = rec.expert_index.shape
    dense = torch.zeros(s, rec.num_experts, capacity)
    tokens = torch.arange(s).unsqueeze(1).expand_as(rec.expert_index)
    keep = rec.keep
    dense[tokens[keep], rec.expert_index[keep], rec.slot[keep]] = rec.gate[keep]
    return dense


def _logits(s, e, seed, ties):
    g = torch.Generator().manual_seed(seed)
    if ties:  # few distinct values: argmax and topk tie order must match too
        return torch.randint(0, 3, (s, e), generator=g).float()
    return torch.randn(s, e, generator=g) * 2


def _assert_same(rec, ds_out, where):
    l_aux, combine, dispatch, exp_counts = ds_out
    capacity = combine.shape[-1]
    if rec.capacity is not None:
        assert rec.capacity == capacity, where
    ours = _dense_combine(rec, capacity)
    assert torch.equal(ours.bool(), dispatch), f"dispatch mask differs: {where}"
    torch.testing.assert_close(ours, combine, rtol=1e-6, atol=1e-7, msg=lambda m: f"{where}: {m}")
    torch.testing.assert_close(rec.aux_loss, l_aux, rtol=1e-6, atol=1e-7, msg=lambda m: f"{where}: {m}")
    assert torch.equal(rec.routed_per_expert.to(exp_counts.dtype), exp_counts), where
    assert torch.equal(rec.tokens_per_expert, dispatch.any(dim=2).sum(0)), where


@pytest.mark.parametrize("s,e", SHAPES)
@pytest.mark.parametrize("ties", [False, True])
def test_top1_matches_deepspeed(s, e, ties):
    for cf, min_cap, masked in itertools.product(CAPACITY_FACTORS, MIN_CAPACITIES, [False, True]):
        logits = _logits(s, e, seed=s * e + int(cf * 4) + min_cap, ties=ties)
        used = (torch.arange(s) % 3 != 1).long() if masked else None  # DeepSpeed's dense path needs integer masks
        where = f"S={s} E={e} cf={cf} min_cap={min_cap} used_token={masked} ties={ties}"
        ds = sharded_moe.top1gating(logits.clone(), cf, min_cap, used_token=used, noisy_gate_policy=None,
                                    drop_tokens=True, use_rts=False)
        rec = route_deepspeed_top1(logits, cf, min_cap, used_token=used)
        _assert_same(rec, ds, where)


@pytest.mark.parametrize("s,e", SHAPES)
@pytest.mark.parametrize("ties", [False, True])
def test_top2_matches_deepspeed(s, e, ties):
    for cf, min_cap in itertools.product(CAPACITY_FACTORS, MIN_CAPACITIES):
        logits = _logits(s, e, seed=7 * s + e + int(cf * 4) + min_cap, ties=ties)
        where = f"S={s} E={e} cf={cf} min_cap={min_cap} ties={ties}"
        ds = sharded_moe.top2gating(logits.clone(), cf, min_cap, drop_tokens=True, top2_2nd_expert_sampling=False)
        rec = route_deepspeed_top2(logits, cf, min_cap)
        _assert_same(rec, ds, where)


@pytest.mark.parametrize("s,e", [(8, 4), (64, 8), (256, 64)])
def test_no_drop_matches_deepspeed_drop_tokens_false(s, e):
    logits = _logits(s, e, seed=3, ties=False)
    ds1 = sharded_moe.top1gating(logits.clone(), 1.0, 4, drop_tokens=False, use_rts=False)
    ds2 = sharded_moe.top2gating(logits.clone(), 1.0, 4, drop_tokens=False, top2_2nd_expert_sampling=False)
    rec1 = route_deepspeed_top1(logits, None, 4)
    rec2 = route_deepspeed_top2(logits, None, 4)
    assert rec1.capacity is None and rec1.keep.all() and rec2.keep.all()
    _assert_same(rec1, ds1, "top1 drop_tokens=False")
    _assert_same(rec2, ds2, "top2 drop_tokens=False")


def test_top1_keeps_deepspeed_tie_order_not_token_order():
    # 16 tokens on one expert, C=4: DeepSpeed keeps topk's tie choice, which is not tokens 0-3 on CPU.
    logits = torch.zeros(16, 4)
    logits[:, 0] = 5.0
    rec = route_deepspeed_top1(logits, 1.0, 4)
    ds_combine = sharded_moe.top1gating(logits.clone(), 1.0, 4, use_rts=False)[1]
    kept_ds = ds_combine[:, 0].sum(-1).nonzero().flatten()
    assert torch.equal(rec.keep[:, 0].nonzero().flatten(), kept_ds)


def test_compat_routing_does_not_modify_inputs():
    logits = torch.randn(64, 8)
    used = (torch.arange(64) % 2).float()
    before, used_before = logits.clone(), used.clone()
    route_deepspeed_top1(logits, 1.0, 4, used_token=used)
    route_deepspeed_top2(logits, 1.0, 4)
    assert torch.equal(logits, before) and torch.equal(used, used_before)


def _mlp(d, f):
    return nn.Sequential(nn.Linear(d, f), nn.GELU(), nn.Linear(f, d))


@pytest.mark.parametrize("k,masked", [(1, False), (1, True), (2, False)])
def test_layer_matches_deepspeed_moe(k, masked):
    torch.manual_seed(0)
    d, f, e = 16, 32, 8
    expert = _mlp(d, f)
    ds = ds_layer.MoE(d, expert, num_experts=e, k=k, capacity_factor=0.75, eval_capacity_factor=0.5,
                      min_capacity=2, use_rts=False, top2_2nd_expert_sampling=False)
    ours = MoE(d, expert, num_experts=e, k=k, capacity_factor=0.75, eval_capacity_factor=0.5, min_capacity=2,
               use_rts=False, top2_2nd_expert_sampling=False, deepspeed_compat=True)
    with torch.no_grad():
        ours.gate.weight.copy_(ds.deepspeed_moe.gate.wg.weight)
    x = torch.randn(3, 40, d) * 3
    used = (torch.arange(120) % 4 != 0).float() if masked else None
    for mode in ("train", "eval"):
        ds.train(mode == "train")
        ours.train(mode == "train")
        x_ds = x.clone().requires_grad_()
        x_ours = x.clone().requires_grad_()
        out_ds, aux_ds, counts_ds = ds(x_ds, used)
        out_ours, aux_ours, counts_ours = ours(x_ours, used)
        torch.testing.assert_close(out_ours, out_ds, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(aux_ours, aux_ds)
        assert torch.equal(counts_ours.to(counts_ds.dtype), counts_ds)
        assert ours.last_stats.drop_rate > 0, "the test should exercise drops"
        grad = torch.randn_like(out_ds)
        (out_ds * grad).sum().add(aux_ds).backward()
        (out_ours * grad).sum().add(aux_ours).backward()
        torch.testing.assert_close(x_ours.grad, x_ds.grad, **GRAD_TOL)
    torch.testing.assert_close(ours.gate.weight.grad, ds.deepspeed_moe.gate.wg.weight.grad, **GRAD_TOL)
    for i, ds_expert in enumerate(ds.deepspeed_moe.experts.deepspeed_experts):
        torch.testing.assert_close(ours.experts.w1.grad[i], ds_expert[0].weight.grad.t(), **GRAD_TOL)
        torch.testing.assert_close(ours.experts.b2.grad[i], ds_expert[2].bias.grad, **GRAD_TOL)


def test_constructor_is_a_drop_in_for_deepspeed_moe():
    ds_params = list(inspect.signature(ds_layer.MoE.__init__).parameters.values())
    ours = list(inspect.signature(MoE.__init__).parameters.values())
    assert [p.name for p in ours[:len(ds_params)]] == [p.name for p in ds_params]
    for d, o in zip(ds_params, ours):
        if d.name != "expert":  # DeepSpeed requires it; None here builds stacked experts
            assert o.default == d.default, d.name
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in ours[len(ds_params):])
