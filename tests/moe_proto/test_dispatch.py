"""The dispatch autograd functions (moe_proto.dispatch) and the routing fast paths against the
straightforward implementations they replaced, plus float64 gradchecks."""
import dataclasses
import itertools

import pytest
import torch
import torch.nn.functional as F

from moe_proto import routing
from moe_proto.dispatch import permute, plan_dispatch, unpermute
from moe_proto.routing import route

D = 5


# --- the previous straightforward implementations, kept here as references -----------------------------

def _permute_ref(hidden, plan):
    return hidden.index_select(0, plan.token_index)


def _unpermute_ref(expert_output, plan, num_tokens):
    acc = torch.promote_types(expert_output.dtype, torch.float32)
    weighted = expert_output.to(acc) * plan.gate.to(acc).unsqueeze(1)
    out = weighted.new_zeros(num_tokens, expert_output.shape[1])
    return out.index_add(0, plan.token_index, weighted).to(expert_output.dtype)


def _assign_slots_ref(expert_index, eligible, num_experts, capacity, priority):
    """routing._assign_slots before the over-capacity-only sort (three sorts over all routes)."""
    s, k = expert_index.shape
    flat = expert_index.reshape(-1)
    key = torch.where(eligible.reshape(-1), flat, num_experts)
    counts = torch.bincount(key, minlength=num_experts + 1)
    if capacity is None or int(counts[:num_experts].max()) <= capacity:
        priority = None
        capacity = None
    if priority is None:
        order = torch.argsort(key, stable=True)
    else:
        by_priority = torch.argsort(priority.reshape(-1), descending=True, stable=True)
        order = by_priority[torch.argsort(key[by_priority], stable=True)]
    rank = routing._rank_within_key(key, order, num_experts, counts)
    keep = key < num_experts
    if capacity is not None:
        keep = keep & (rank < capacity)
    if priority is not None:
        kept_key = torch.where(keep, flat, num_experts)
        rank = routing._rank_within_key(kept_key, torch.argsort(kept_key, stable=True), num_experts)
    slot = torch.where(keep, rank, -1)
    return keep.view(s, k), slot.view(s, k)


# --- records covering drops, several routes per token, unrouted tokens and nothing kept ------------------

def _record(case, s=23, e=6):
    gen = torch.Generator().manual_seed(len(case) * 7 + s)
    logits = torch.randn(s, e, generator=gen) * 3
    logits[:, 1] += 1.5  # overload expert 1 so that capacity drops happen
    if case == "top1_capacity":
        return route(logits, top_k=1, capacity_factor=0.75, min_capacity=0)
    if case == "top2_capacity":
        return route(logits, top_k=2, capacity_factor=0.75, min_capacity=0)
    if case == "proto2_dropless":
        return route(logits, top_k=1, num_prototypes=2, capacity_factor=None)
    if case == "proto2_top2_position":
        return route(logits, top_k=2, num_prototypes=2, capacity_factor=0.6, min_capacity=0, drop_policy="position")
    if case == "masked_tokens":
        used = (torch.arange(s) % 3 != 0).long()
        return route(logits, top_k=2, capacity_factor=1.0, min_capacity=0, used_token=used)
    if case == "nothing_kept":
        return route(logits, top_k=1, capacity_factor=None, used_token=torch.zeros(s, dtype=torch.long))
    raise KeyError(case)


CASES = ["top1_capacity", "top2_capacity", "proto2_dropless", "proto2_top2_position", "masked_tokens",
         "nothing_kept"]


def test_cases_cover_what_they_claim():
    assert not _record("top1_capacity").keep.all() and not _record("top2_capacity").keep.all()
    assert _record("proto2_dropless").keep.all()
    assert (_record("masked_tokens").keep.sum(1) == 0).any()
    assert int(_record("nothing_kept").keep.sum()) == 0


@pytest.mark.parametrize("case", CASES)
def test_plan_inverse_maps(case):
    rec = _record(case)
    plan = plan_dispatch(rec)
    s, k = rec.expert_index.shape
    r = int(rec.keep.sum())
    assert plan.token_index.shape == (r, ) and plan.route_row.shape == (r, ) and plan.route_offsets.shape == (s, )
    # route_row is a permutation of the buffer rows and the inverse of the buffer's route order
    assert torch.equal(plan.route_row.sort().values, torch.arange(r))
    assert torch.equal(plan.token_index[plan.route_row], plan.route_token)
    assert torch.equal(plan.route_token, torch.arange(s).repeat_interleave(k)[rec.keep.reshape(-1)])
    assert torch.equal(plan.route_offsets, torch.cumsum(rec.keep.sum(1), 0) - rec.keep.sum(1))
    # buffer rows are expert-major with tokens_per_expert rows each
    experts = torch.repeat_interleave(torch.arange(rec.num_experts), plan.tokens_per_expert)
    flat_expert = rec.expert_index.reshape(-1)[rec.keep.reshape(-1)]
    assert torch.equal(flat_expert[torch.argsort(plan.route_row)], experts)


@pytest.mark.parametrize("case", CASES)
def test_permute_and_unpermute_match_previous_implementation(case):
    rec = _record(case)
    plan = plan_dispatch(rec)
    s = rec.num_tokens
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(s, D, generator=gen)
    grad_buffer = torch.randn(plan.token_index.shape[0], D, generator=gen)
    grad_out = torch.randn(s, D, generator=gen)
    # the buffer row values must matter: use the gathered rows plus noise as "expert output"
    y_data = torch.randn(plan.token_index.shape[0], D, generator=gen)

    results = []
    for perm, unperm in ((permute, unpermute), (_permute_ref, _unpermute_ref)):
        xx = x.clone().requires_grad_()
        yy = y_data.clone().requires_grad_()
        gate = plan.gate.detach().clone().requires_grad_()
        p = dataclasses.replace(plan, gate=gate)
        buffer = perm(xx, p)
        out = unperm(yy, p, s)
        torch.autograd.backward([buffer, out], [grad_buffer, grad_out])
        results.append((buffer.detach(), out.detach(), xx.grad, yy.grad, gate.grad))
    (buf, out, gx, gy, gg), (buf_r, out_r, gx_r, gy_r, gg_r) = results
    assert torch.equal(buf, buf_r)
    assert torch.equal(gy, gy_r)  # one product per row either way
    torch.testing.assert_close(out, out_r, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(gx, gx_r, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(gg, gg_r, rtol=1e-5, atol=1e-6)
    if rec.routes_per_token == 1:  # one term per token: no summation order to differ in
        assert torch.equal(out, out_r) and torch.equal(gx, gx_r)


@pytest.mark.parametrize("case", ["top2_capacity", "masked_tokens", "proto2_top2_position", "nothing_kept"])
def test_gradcheck_float64(case):
    rec = _record(case, s=7, e=4)
    plan = plan_dispatch(rec)
    s, r = rec.num_tokens, plan.token_index.shape[0]
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(s, 3, generator=gen, dtype=torch.float64, requires_grad=True)
    y = torch.randn(r, 3, generator=gen, dtype=torch.float64, requires_grad=True)
    gate = torch.rand(r, generator=gen, dtype=torch.float64).requires_grad_()

    assert torch.autograd.gradcheck(lambda t: permute(t, plan), (x, ))
    assert torch.autograd.gradcheck(lambda t, g: unpermute(t, dataclasses.replace(plan, gate=g), s), (y, gate))
    assert unpermute(y, dataclasses.replace(plan, gate=gate), s).dtype == torch.float64


def test_unpermute_bf16_accumulates_in_fp32():
    rec = _record("top2_capacity")
    plan = plan_dispatch(rec)
    y = torch.randn(plan.token_index.shape[0], D).to(torch.bfloat16).requires_grad_()
    out = unpermute(y, plan, rec.num_tokens)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, _unpermute_ref(y.detach(), plan, rec.num_tokens), rtol=0, atol=0)
    out.float().sum().backward()
    assert y.grad.dtype == torch.bfloat16


def test_unpermute_with_a_different_token_count_falls_back():
    rec = _record("top1_capacity")
    plan = plan_dispatch(rec)
    y = torch.randn(plan.token_index.shape[0], D)
    torch.testing.assert_close(unpermute(y, plan, rec.num_tokens + 2), _unpermute_ref(y, plan, rec.num_tokens + 2))


# --- routing fast paths -----------------------------------------------------------------------------------

@pytest.mark.parametrize("masked", [False, True])
def test_assign_slots_matches_three_sort_version(masked):
    gen = torch.Generator().manual_seed(0)
    for trial, (s, e, k) in enumerate(itertools.product([1, 9, 64, 257], [3, 8], [1, 2])):
        expert_index = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(s)])
        expert_index[: s // 2, 0] = 0  # overload expert 0
        eligible = torch.ones(s, k, dtype=torch.bool)
        if masked:
            eligible &= (torch.rand(s, 1, generator=gen) > 0.3)
        # few distinct priorities: ties must go to the lower route index, as before
        priorities = [None, torch.randint(0, 3, (s, k), generator=gen).float(), torch.rand(s, k, generator=gen)]
        for capacity, priority in itertools.product([None, 0, 1, 2, s // 4 + 1, s * k], priorities):
            keep, slot, routed, kept = routing._assign_slots(expert_index, None if not masked else eligible, e,
                                                             capacity, priority)
            keep_r, slot_r = _assign_slots_ref(expert_index, eligible, e, capacity, priority)
            where = f"trial {trial} s={s} e={e} k={k} capacity={capacity} priority={priority is not None}"
            assert torch.equal(keep, keep_r), where
            assert torch.equal(slot, slot_r), where
            assert torch.equal(routed, torch.bincount(expert_index[eligible], minlength=e)), where
            assert torch.equal(kept, torch.bincount(expert_index[keep_r], minlength=e)), where


@pytest.mark.parametrize("num_prototypes", [1, 2])
def test_top1_selection_is_topk_also_with_ties(num_prototypes):
    gen = torch.Generator().manual_seed(1)
    for distinct in (2, 3, 1000):
        logits = torch.randint(0, distinct, (300, 8), generator=gen).float()
        rec = route(logits, top_k=1, num_prototypes=num_prototypes, capacity_factor=None)
        probs = routing._group_softmax(logits.view(300, num_prototypes, -1))
        values, local = probs.topk(1, dim=-1)
        offset = torch.arange(num_prototypes).view(1, -1, 1) * (8 // num_prototypes)
        assert torch.equal(rec.expert_index, (local + offset).view(300, -1)), distinct
        assert torch.equal(rec.gate, values.view(300, -1))


def test_top1_nan_logits_follow_topk():
    logits = torch.randn(10, 4)
    logits[3] = float("nan")
    rec = route(logits, top_k=1, capacity_factor=None)
    assert torch.equal(rec.expert_index, F.softmax(logits, -1).topk(1, -1).indices)


@pytest.mark.parametrize("shape", [(50, 2, 8), (50, 4, 4), (50, 1, 16), (7, 3, 5)])
def test_group_softmax_equals_softmax(shape):
    logits = (torch.randn(shape) * 4).requires_grad_()
    probs = routing._group_softmax(logits)
    assert probs.shape == shape and probs.is_contiguous()
    torch.testing.assert_close(probs, F.softmax(logits, -1), rtol=1e-6, atol=1e-7)
    grad = torch.randn(shape)
    g1, = torch.autograd.grad(probs, logits, grad)
    g2, = torch.autograd.grad(F.softmax(logits, -1), logits, grad)
    torch.testing.assert_close(g1, g2, rtol=1e-5, atol=1e-6)


def test_parallel_permute_rows_gradcheck_and_matches_index_select():
    from moe_proto.experts import PermuteRows as _PermuteRows

    gen = torch.Generator().manual_seed(2)
    index = torch.randperm(9, generator=gen)
    inverse = torch.empty_like(index).index_copy_(0, index, torch.arange(9))
    x = torch.randn(9, 3, generator=gen, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: _PermuteRows.apply(t, index, inverse), (x, ))
    grad = torch.randn(9, 3, generator=gen, dtype=torch.float64)
    got, = torch.autograd.grad(_PermuteRows.apply(x, index, inverse), x, grad)
    want, = torch.autograd.grad(x.index_select(0, index), x, grad)
    assert torch.equal(_PermuteRows.apply(x, index, inverse), x.index_select(0, index))
    assert torch.equal(got, want)


def test_cpp_routing_decisions_equal_the_torch_expressions(monkeypatch):
    """select_top1 and assign_slots from moe_proto's C++ library against the torch path they stand in for,
    with tied scores and priorities, masks, NaN priorities (the C++ side declines; torch decides) and every policy."""
    from moe_proto import ops

    lib = ops.load_cpu_ops()
    assert lib is not None, ops._state["failed"]
    gen = torch.Generator().manual_seed(5)
    scores = torch.softmax(torch.randint(0, 4, (200, 2, 8), generator=gen).float(), -1)
    _, unique = lib.select_top1(scores)
    assert not unique  # ties: the caller must take topk's choice
    scores = torch.softmax(torch.randn(200, 2, 8, generator=gen), -1)
    index, unique = lib.select_top1(scores)
    assert unique and torch.equal(index, scores.max(-1, keepdim=True).indices)

    cases = []
    for s, e, k in itertools.product([1, 40, 300], [4, 16], [1, 2]):
        expert_index = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(s)])
        expert_index[: s // 3, 0] = 1
        eligible = torch.rand(s, 1, generator=gen).expand(s, k) > 0.2
        nan_priority = torch.rand(s, k, generator=gen)
        nan_priority[0, 0] = float("nan")
        for capacity, priority, mask in itertools.product(
                [None, 0, 3, s // 5 + 1], [None, torch.randint(0, 3, (s, k), generator=gen).float(),
                                           torch.rand(s, k, generator=gen), nan_priority], [None, eligible]):
            cases.append((expert_index, mask, e, capacity, priority))
    calls = []

    class Counting:  # proves the first pass ran the C++ kernel: a patch that missed would compare torch with torch
        def assign_slots(self, *args):
            calls.append(args)
            return lib.assign_slots(*args)

    monkeypatch.setattr(routing, "load_cpu_ops", Counting)
    with_cpp = [routing._assign_slots(*case) for case in cases]
    assert len(calls) == len(cases)
    monkeypatch.setattr(routing, "load_cpu_ops", lambda: None)
    for case, ours in zip(cases, with_cpp):
        for a, b in zip(ours, routing._assign_slots(*case)):
            assert torch.equal(a, b), (case[0].shape, case[3], case[4] is not None)
