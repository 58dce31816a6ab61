"""Routing invariants and hand computations for moe_proto.routing.route."""
import itertools
import math

import pytest
import torch
import torch.nn.functional as F

from moe_proto.routing import (expert_capacity, gumbel_noise, multiplicative_jitter, route, router_z_loss)


def _check_invariants(rec, capacity):
    s, k = rec.expert_index.shape
    e = rec.num_experts
    assert torch.equal(rec.tokens_per_expert, torch.bincount(rec.expert_index[rec.keep], minlength=e))
    assert int(rec.tokens_per_expert.sum()) == int(rec.keep.sum())
    assert rec.capacity == capacity
    if capacity is not None:
        assert int(rec.tokens_per_expert.max()) <= capacity
    assert torch.all(rec.gate[~rec.keep] == 0) and torch.all(rec.slot[~rec.keep] == -1)
    for expert in range(e):
        slots = rec.slot[rec.keep & (rec.expert_index == expert)]
        assert torch.equal(slots.sort().values, torch.arange(int(rec.tokens_per_expert[expert]))), expert
    # a token never takes two routes to one expert
    assert torch.all(rec.expert_index.sort(dim=1).values.diff(dim=1) != 0)


def _groups(rec, num_prototypes):
    return rec.expert_index // (rec.num_experts // num_prototypes)


@pytest.mark.parametrize("policy", ["probs", "position"])
def test_invariants_over_shapes(policy):
    cases = itertools.product([1, 37, 300], [4, 16], [1, 2, 4], [1, 2], [None, 0.5, 1.25])
    for s, e, p, k, cf in cases:
        if e % p or k > e // p:
            continue
        logits = torch.randn(s, e, generator=torch.Generator().manual_seed(s + e + p + k)) * 3
        rec = route(logits, top_k=k, num_prototypes=p, capacity_factor=cf, min_capacity=0, drop_policy=policy)
        capacity = None if cf is None else math.ceil(cf * p * k * s / e)
        _check_invariants(rec, capacity)
        assert int(rec.routed_per_expert.sum()) == s * p * k
        assert torch.equal(_groups(rec, p), torch.arange(p).repeat_interleave(k).expand(s, -1))


def test_capacity_formula():
    assert expert_capacity(4096, 16, 1, 1.25) == 320
    assert expert_capacity(4096, 16, 2, 1.25) == 640
    assert expert_capacity(10, 1, 1, 1.1) == 11  # decimal cf: binary 1.1 * 10 would ceil to 12
    assert expert_capacity(8, 16, 1, 1.0, min_capacity=4) == 4
    rec = route(torch.randn(100, 8), top_k=1, num_prototypes=2, capacity_factor=1.5, min_capacity=0)
    assert rec.capacity == math.ceil(1.5 * 2 * 100 / 8)


def test_position_policy_keeps_earliest_tokens():
    logits = torch.randn(200, 4, generator=torch.Generator().manual_seed(0))
    logits[:, 1] += 2.0  # overload expert 1
    rec = route(logits, capacity_factor=0.5, min_capacity=0, drop_policy="position")
    capacity = rec.capacity
    for expert in range(4):
        routed_tokens = (rec.expert_index[:, 0] == expert).nonzero().flatten()
        kept_tokens = (rec.keep[:, 0] & (rec.expert_index[:, 0] == expert)).nonzero().flatten()
        assert torch.equal(kept_tokens, routed_tokens[:capacity])
        assert torch.equal(rec.slot[kept_tokens, 0], torch.arange(kept_tokens.numel()))
    assert int(rec.tokens_per_expert[1]) == capacity and not rec.keep.all()


def test_probs_policy_keeps_highest_gates():
    logits = torch.randn(300, 8, generator=torch.Generator().manual_seed(1)) * 2
    logits[:, 3] += 1.5
    rec = route(logits, top_k=2, capacity_factor=0.5, min_capacity=0, drop_policy="probs")
    probs = F.softmax(logits, dim=-1)
    raw = probs.gather(1, rec.expert_index)
    assert not rec.keep.all()
    for expert in range(8):
        on_expert = rec.expert_index == expert
        kept, dropped = raw[on_expert & rec.keep], raw[on_expert & ~rec.keep]
        if dropped.numel():
            assert kept.min() >= dropped.max(), expert
        # slots follow token order among the kept routes
        tokens = (on_expert & rec.keep).any(dim=1).nonzero().flatten()
        slots = rec.slot[on_expert & rec.keep]
        assert torch.equal(slots, torch.arange(tokens.numel()))


def test_dropless_drops_nothing():
    logits = torch.zeros(64, 8)
    logits[:, 0] = 10.0  # every token wants expert 0
    rec = route(logits, top_k=2, capacity_factor=None)
    assert rec.capacity is None and rec.keep.all()
    assert torch.equal(rec.tokens_per_expert, rec.routed_per_expert)
    assert int(rec.tokens_per_expert[0]) == 64
    assert rec.stats().drop_rate == 0


def test_p1_top1_is_switch():
    logits = torch.randn(50, 6, generator=torch.Generator().manual_seed(2))
    rec = route(logits, top_k=1, num_prototypes=1, capacity_factor=None)
    probs = F.softmax(logits, dim=-1)
    assert torch.equal(rec.expert_index[:, 0], probs.argmax(dim=-1))
    torch.testing.assert_close(rec.gate[:, 0], probs.max(dim=-1).values)  # raw prob, not renormalised
    f = torch.bincount(probs.argmax(-1), minlength=6).float() / 50
    torch.testing.assert_close(rec.aux_loss, 6 * (f * probs.mean(0)).sum())


def test_prototypes_route_one_expert_per_group():
    e, p = 16, 4
    logits = torch.randn(40, e, generator=torch.Generator().manual_seed(3))
    rec = route(logits, top_k=1, num_prototypes=p, capacity_factor=None)
    assert rec.expert_index.shape == (40, p)
    for g in range(p):
        probs = F.softmax(logits[:, 4 * g:4 * g + 4], dim=-1)
        assert torch.equal(rec.expert_index[:, g], probs.argmax(-1) + 4 * g)
        torch.testing.assert_close(rec.gate[:, g], probs.max(-1).values)
    rec2 = route(logits, top_k=2, num_prototypes=p, capacity_factor=None)
    assert torch.equal(_groups(rec2, p), torch.arange(p).repeat_interleave(2).expand(40, -1))
    torch.testing.assert_close(rec2.gate.view(40, p, 2).sum(-1), torch.ones(40, p))


def test_prototype_aux_loss_hand_computed_and_equals_deepspeed_top1_per_slice():
    e, p, s = 8, 2, 64
    logits = torch.randn(s, e, generator=torch.Generator().manual_seed(4)) * 2
    rec = route(logits, top_k=1, num_prototypes=p, capacity_factor=None)
    per_group = []
    for g in range(p):
        probs = F.softmax(logits[:, 4 * g:4 * g + 4], dim=-1)
        f = torch.bincount(probs.argmax(-1), minlength=4).float() / s
        per_group.append(4 * (f * probs.mean(0)).sum())
    torch.testing.assert_close(rec.aux_loss, torch.stack(per_group).mean())
    sharded_moe = pytest.importorskip("deepspeed.moe.sharded_moe")
    ds = [sharded_moe.top1gating(logits[:, 4 * g:4 * g + 4].clone(), 100.0, 0, use_rts=False)[0] for g in range(p)]
    torch.testing.assert_close(rec.aux_loss, torch.stack(ds).mean())


def test_topk_aux_loss_counts_all_routes():
    logits = torch.randn(30, 5, generator=torch.Generator().manual_seed(5))
    rec = route(logits, top_k=2, capacity_factor=None)
    probs = F.softmax(logits, dim=-1)
    f = torch.bincount(probs.topk(2).indices.flatten(), minlength=5).float() / (2 * 30)
    torch.testing.assert_close(rec.aux_loss, 5 * (f * probs.mean(0)).sum())


def test_z_loss_hand_computed():
    logits = torch.randn(20, 8)
    torch.testing.assert_close(route(logits).z_loss, torch.logsumexp(logits, -1).square().mean())
    by_group = torch.logsumexp(logits.view(20, 2, 4), -1).square().mean()
    torch.testing.assert_close(route(logits, num_prototypes=2).z_loss, by_group)
    torch.testing.assert_close(router_z_loss(logits, 2), by_group)


def test_topk_gate_normalisation():
    logits = torch.randn(32, 8, generator=torch.Generator().manual_seed(6))
    probs = F.softmax(logits, dim=-1)
    rec = route(logits, top_k=2, capacity_factor=None)
    torch.testing.assert_close(rec.gate.sum(-1), torch.ones(32))
    raw = route(logits, top_k=2, capacity_factor=None, normalize_topk=False)
    torch.testing.assert_close(raw.gate, probs.topk(2).values)


def test_drops_do_not_renormalise_surviving_gates():
    logits = torch.randn(100, 4, generator=torch.Generator().manual_seed(7))
    full = route(logits, top_k=2, capacity_factor=None)
    capped = route(logits, top_k=2, capacity_factor=0.5, min_capacity=0)
    assert not capped.keep.all()
    assert torch.equal(capped.expert_index, full.expert_index)
    torch.testing.assert_close(capped.gate, full.gate * capped.keep)


def test_used_token_masks_routes_and_capacity():
    logits = torch.zeros(12, 2)
    logits[:, 0] = 5.0
    used = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1])
    rec = route(logits, capacity_factor=0.5, min_capacity=0, drop_policy="position", used_token=used)
    assert rec.capacity == 3
    assert not rec.keep[:4].any()
    assert rec.keep[4:7, 0].all() and not rec.keep[7:].any()  # masked tokens took no capacity
    assert int(rec.routed_per_expert.sum()) == 8


def test_rts_priority_decides_drops():
    logits = torch.zeros(10, 2)
    logits[:, 1] = 5.0
    priority = torch.arange(10.0).unsqueeze(1)  # later tokens win
    rec = route(logits, capacity_factor=0.5, min_capacity=0, rts_priority=priority)
    assert torch.equal(rec.keep[:, 0].nonzero().flatten(), torch.tensor([7, 8, 9]))
    assert torch.equal(rec.slot[7:, 0], torch.arange(3))


def test_selection_noise_changes_choice_not_gate():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0]]).repeat(4, 1)
    noise = torch.zeros(4, 4)
    noise[:, 3] = 100.0
    second = route(logits, top_k=2, capacity_factor=None, normalize_topk=False, selection_noise=noise,
                   noise_from_choice=1)
    assert torch.equal(second.expert_index, torch.tensor([[0, 3]]).repeat(4, 1))
    probs = F.softmax(logits, dim=-1)
    torch.testing.assert_close(second.gate, probs[:, [0, 3]])
    first = route(logits, top_k=1, capacity_factor=None, selection_noise=noise)
    assert torch.equal(first.expert_index[:, 0], torch.full((4, ), 3))


def test_inputs_not_modified_and_deterministic():
    logits = torch.randn(64, 8, requires_grad=True)
    used = (torch.arange(64) % 5 != 0).float()
    rts = torch.rand(64, 4)
    noise = gumbel_noise((64, 8), logits.device)
    copies = [t.detach().clone() for t in (logits, used, rts, noise)]
    kwargs = dict(top_k=2, num_prototypes=2, capacity_factor=0.75, used_token=used, rts_priority=rts,
                  selection_noise=noise, noise_from_choice=1)
    a, b = route(logits, **kwargs), route(logits, **kwargs)
    for t, c in zip((logits, used, rts, noise), copies):
        assert torch.equal(t, c)
    strided = route(logits.detach().t().contiguous().t(), **kwargs)  # non-contiguous logits route the same
    for field in ("expert_index", "gate", "slot", "keep", "tokens_per_expert", "routed_per_expert"):
        assert torch.equal(getattr(a, field), getattr(b, field)), field
        assert torch.equal(getattr(a, field).detach(), getattr(strided, field)), field


def test_gate_and_losses_are_differentiable():
    logits = torch.randn(32, 8, requires_grad=True)
    rec = route(logits, top_k=1, num_prototypes=2, capacity_factor=1.0)
    (rec.gate.sum() + rec.aux_loss + rec.z_loss).backward()
    assert logits.grad is not None and logits.grad.abs().sum() > 0


def test_multiplicative_jitter():
    x = torch.randn(100, 8)
    before = x.clone()
    y = multiplicative_jitter(x, 0.01)
    assert torch.equal(x, before) and y is not x
    ratio = y / x
    assert ratio.min() >= 0.99 - 1e-6 and ratio.max() <= 1.01 + 1e-6 and not torch.equal(y, x)
    assert multiplicative_jitter(x, 0.0) is x


@pytest.mark.parametrize("kwargs,match", [
    (dict(num_prototypes=3), "num_prototypes=3"),
    (dict(top_k=5), "top_k=5"),
    (dict(num_prototypes=2, top_k=3), "top_k=3"),
    (dict(drop_policy="random"), "drop_policy='random'"),
    (dict(top_k=2, selection_noise=torch.zeros(4, 4), noise_from_choice=2), "noise_from_choice=2"),
    (dict(used_token=torch.ones(3)), "used_token has 3 entries"),
    (dict(rts_priority=torch.rand(4, 2)), "rts_priority must be"),
    (dict(selection_noise=torch.zeros(4, 3)), "selection_noise must match"),
])
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        route(torch.randn(4, 4), **kwargs)
    with pytest.raises(ValueError, match="logits must be"):
        route(torch.randn(4))


@pytest.mark.parametrize("top_k,prototypes", [(1, 1), (2, 1), (1, 2), (3, 2)])
def test_z_loss_from_the_softmax_equals_logsumexp_and_its_gradient(top_k, prototypes):
    """route() takes logsumexp from its softmax (l_j - log p_j at the top choice): same value and gradient."""
    logits = (4 * torch.randn(64, 8, generator=torch.Generator().manual_seed(1))).requires_grad_()
    mask = torch.arange(64) % 5 != 0
    rec = route(logits, top_k=top_k, num_prototypes=prototypes, capacity_factor=None, used_token=mask)
    (grad_fast, ) = torch.autograd.grad(rec.z_loss, logits)
    ref_logits = logits.detach().clone().requires_grad_()
    ref = router_z_loss(ref_logits, prototypes, mask)
    ref.backward()
    torch.testing.assert_close(rec.z_loss, ref)
    torch.testing.assert_close(grad_fast, ref_logits.grad)
