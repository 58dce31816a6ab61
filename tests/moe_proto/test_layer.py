"""moe_proto.MoE against a naive per-token reference: forward, backward, training, arguments."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from moe_proto import MoE, GroupedExperts, grouped_matmul, grouped_mm_supported
from moe_proto.module_experts import ModuleExperts

D, FFN = 16, 32


def _naive_ffn(experts, e, x):
    h = x @ experts.w1[e]
    if experts.b1 is not None:
        h = h + experts.b1[e]
    if experts.activation == "swiglu":
        h = F.silu(h) * (x @ experts.w3[e])
    else:
        h = {"gelu": F.gelu, "relu": F.relu}[experts.activation](h)
    y = h @ experts.w2[e]
    return y + experts.b2[e] if experts.b2 is not None else y


def _naive_moe(moe, x, record):
    """Per token, per kept route: gate (recomputed from the logits) times that expert's FFN."""
    args = moe.args
    group = args.num_experts // args.num_prototypes
    logits = x.float() @ moe.gate.weight.float().t()
    rows = []
    for t in range(x.shape[0]):
        out = torch.zeros(x.shape[1], dtype=x.dtype)
        for j in range(record.routes_per_token):
            if not record.keep[t, j]:
                continue
            e = int(record.expert_index[t, j])
            p = e // group
            probs = F.softmax(logits[t, p * group:(p + 1) * group], dim=-1)
            gate = probs[e - p * group]
            if args.k > 1:
                chosen = record.expert_index[t, p * args.k:(p + 1) * args.k] - p * group
                gate = gate / probs[chosen].sum()
            out = out + gate * _naive_ffn(moe.experts, e, x[t])
        rows.append(out)
    return torch.stack(rows)


CONFIGS = {
    "switch_top1": dict(k=1, capacity_factor=1.0),
    "top2": dict(k=2, capacity_factor=1.0),
    "proto2": dict(k=1, num_prototypes=2, capacity_factor=1.0),
    "proto2_top2_dropless": dict(k=2, num_prototypes=2, dropless=True),
    "proto2_swiglu_position": dict(k=1, num_prototypes=2, capacity_factor=0.75, drop_policy="position",
                                   activation="swiglu"),
}


def _make(config, **extra):
    torch.manual_seed(0)
    kwargs = dict(num_experts=8, use_rts=False, top2_2nd_expert_sampling=False, min_capacity=0)
    kwargs.update(config)
    kwargs.update(extra)
    if "expert" not in kwargs:
        kwargs["ffn_hidden_size"] = FFN
    moe = MoE(D, **kwargs)
    with torch.no_grad():  # spread the router so that experts overflow and drops happen
        moe.gate.weight.mul_(4)
    return moe


@pytest.mark.parametrize("name", list(CONFIGS))
def test_forward_and_backward_match_naive_reference(name):
    moe = _make(CONFIGS[name])
    x = torch.randn(48, D, generator=torch.Generator().manual_seed(1))
    record = moe.route(x)
    if not moe.args.is_dropless:
        assert not record.keep.all(), "config should drop some routes"

    x1 = x.clone().requires_grad_()
    out, l_aux, counts = moe(x1)
    grad_out = torch.randn_like(out)
    params = [p for p in moe.parameters()]
    got = torch.autograd.grad((out * grad_out).sum(), [x1] + params)

    x2 = x.clone().requires_grad_()
    ref = _naive_moe(moe, x2, record)
    want = torch.autograd.grad((ref * grad_out).sum(), [x2] + params, allow_unused=True)

    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(counts, record.routed_per_expert)
    torch.testing.assert_close(l_aux, record.aux_loss)
    for g, w, name_ in zip(got, want, ["input"] + [n for n, _ in moe.named_parameters()]):
        torch.testing.assert_close(g, w if w is not None else torch.zeros_like(g), rtol=1e-4, atol=1e-5,
                                   msg=lambda m: f"grad of {name_}: {m}")


def test_expert_module_is_copied_into_every_expert_and_marked():
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(D, FFN), nn.GELU(), nn.Linear(FFN, D))
    moe = _make(dict(k=2, capacity_factor=1.0), expert=mlp)
    x = torch.randn(5, D)
    for e in range(8):
        torch.testing.assert_close(_naive_ffn(moe.experts, e, x), mlp(x))
    for name, param in moe.experts.named_parameters():
        assert param.allreduce is False and param.group_name == "ep_size_1", name
    assert not hasattr(moe.gate.weight, "allreduce")
    # the copy is real: training the experts leaves the user's module alone
    out, _, _ = moe(x)
    out.sum().backward()
    assert mlp[0].weight.grad is None


def test_naive_reference_forward_with_copied_bias_experts():
    mlp = nn.Sequential(nn.Linear(D, FFN), nn.ReLU(), nn.Dropout(0.0), nn.Linear(FFN, D))
    moe = _make(dict(k=2, num_prototypes=2, capacity_factor=1.0), expert=mlp)
    with torch.no_grad():
        for p in moe.experts.parameters():
            p.add_(torch.randn_like(p) * 0.1)  # make the experts differ
    x = torch.randn(40, D)
    record = moe.route(x)
    torch.testing.assert_close(moe(x)[0], _naive_moe(moe, x, record), rtol=1e-5, atol=1e-5)


def test_grouped_mm_and_loop_paths_agree():
    torch.manual_seed(0)
    experts = GroupedExperts(4, D, FFN, activation="swiglu", bias=True)
    counts = torch.tensor([5, 0, 9, 2])
    x = torch.randn(16, D, requires_grad=True)
    assert grouped_mm_supported(x, experts.w1), "torch 2.13 CPU should take the grouped_mm path"
    experts64 = GroupedExperts(4, D, FFN, activation="swiglu", bias=True).double()
    experts64.load_state_dict({k: v.double() for k, v in experts.state_dict().items()})
    x64 = x.detach().double().requires_grad_()
    assert not grouped_mm_supported(x64, experts64.w1), "float64 takes the loop"
    y, y64 = experts(x, counts), experts64(x64, counts)
    torch.testing.assert_close(y.double(), y64, rtol=1e-5, atol=1e-5)
    y.sum().backward()  # a stride-0 gradient: grouped_mm's backward needs it made contiguous
    y64.sum().backward()
    torch.testing.assert_close(x.grad.double(), x64.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(experts.w2.grad.double(), experts64.w2.grad, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="sums to 15"):
        grouped_matmul(x64, experts64.w1, torch.tensor([5, 0, 8, 2]))


def test_layer_trains_on_toy_task():
    torch.manual_seed(0)
    n, d = 256, 8
    x = torch.randn(n, d)
    # piecewise teacher: a different linear map depending on the sign of the first feature
    a, b = torch.randn(d, d), torch.randn(d, d)
    y = torch.where(x[:, :1] > 0, x @ a, x @ b).tanh()
    moe = MoE(d, num_experts=4, k=1, num_prototypes=2, ffn_hidden_size=32, capacity_factor=1.5,
              use_rts=False, z_loss_coef=1e-3)
    opt = torch.optim.Adam(moe.parameters(), lr=1e-2)
    losses = []
    for _ in range(100):
        out, l_aux, _ = moe(x)
        loss = F.mse_loss(out, y)
        opt.zero_grad()
        (loss + 0.01 * l_aux).backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.3 * losses[0], (losses[0], losses[-1])
    assert moe.gate.weight.grad.abs().sum() > 0


def test_used_token_and_stats():
    moe = _make(dict(k=1, capacity_factor=1.0))
    x = torch.randn(2, 20, D)
    used = (torch.arange(40) % 4 != 0).view(2, 20)
    before = x.clone()
    out, l_aux, counts = moe(x, used_token=used)
    assert torch.equal(x, before)
    assert torch.all(out.view(40, D)[~used.flatten()] == 0)
    assert int(counts.sum()) == 30
    stats = moe.last_stats
    assert stats.capacity == 5
    torch.testing.assert_close(stats.drop_rate, 1 - stats.tokens_per_expert.sum() / 30)
    assert stats.aux_loss.requires_grad is False and stats.z_loss > 0


def test_z_loss_coef_adds_to_l_aux():
    moe = _make(dict(k=1, capacity_factor=1.0), z_loss_coef=0.5)
    x = torch.randn(30, D)
    record = moe.route(x)
    _, l_aux, _ = moe(x)
    torch.testing.assert_close(l_aux, record.aux_loss + 0.5 * record.z_loss)


def test_eval_is_deterministic_and_uses_eval_capacity():
    moe = _make(dict(k=2, capacity_factor=2.0, eval_capacity_factor=0.5, noisy_gate_policy="Jitter",
                     use_rts=True, top2_2nd_expert_sampling=True))
    x = torch.randn(64, D)
    moe.eval()
    a, b = moe(x)[0], moe(x)[0]
    assert torch.equal(a, b) and moe.last_stats.capacity == 8
    moe.train()
    c, d = moe(x)[0], moe(x)[0]
    assert not torch.equal(c, d), "jitter / sampling / RTS should act in training"
    assert moe.last_stats.capacity == 32


def test_residual_moe_mixes_dense_mlp():
    moe = _make(dict(k=1, capacity_factor=1.0), use_residual=True)
    x = torch.randn(3, 10, D, requires_grad=True)
    out, _, _ = moe(x)
    flat = x.reshape(-1, D)
    record = moe.route(flat)
    expert_out = _naive_moe(moe, flat, record).view_as(x)
    dense = _naive_ffn(moe.mlp, 0, flat).view_as(x)
    coef = F.softmax(moe.coefficient(x), dim=-1)
    torch.testing.assert_close(out, expert_out * coef[..., :1] + dense * coef[..., 1:], rtol=1e-5, atol=1e-5)
    assert not hasattr(moe.mlp.w1, "allreduce"), "the dense MLP is not an expert parameter"


@pytest.mark.parametrize("kwargs,match", [
    (dict(num_experts=6, ep_size=4), "divisible by ep_size"),
    (dict(ep_size=2, dropless=True, ep_fixed_splits=True), "leave ep_fixed_splits False"),
    (dict(use_tutel=1), "use_tutel must be True or False"),
    (dict(noisy_gate_policy="Gumbel"), "noisy_gate_policy='Gumbel'"),
    (dict(k=0), "k must be"),
    (dict(num_experts=8, num_prototypes=3), "num_prototypes=3"),
    (dict(num_experts=8, num_prototypes=4, k=3), "k=3 exceeds"),
    (dict(capacity_factor=0.0), "capacity_factor must be"),
    (dict(min_capacity=-1), "min_capacity"),
    (dict(drop_policy="random"), "drop_policy='random'"),
    (dict(dropless=True, drop_policy="probs"), "no effect in dropless"),
    (dict(z_loss_coef=-1.0), "z_loss_coef"),
    (dict(activation="tanh"), "activation='tanh'"),
    (dict(deepspeed_compat=True), "use_rts=False"),
    (dict(deepspeed_compat=True, use_rts=False, k=2), "top2_2nd_expert_sampling=False"),
    (dict(deepspeed_compat=True, use_rts=False, k=3), "k must be 1 or 2"),
    (dict(deepspeed_compat=True, use_rts=False, num_prototypes=2), "num_prototypes=1"),
    (dict(deepspeed_compat=True, use_rts=False, noisy_gate_policy="RSample"), "RSample"),
])
def test_bad_constructor_arguments(kwargs, match):
    base = dict(num_experts=8, ffn_hidden_size=FFN)
    base.update(kwargs)
    with pytest.raises(ValueError, match=match):
        MoE(D, **base)


def test_bad_expert_arguments():
    with pytest.raises(ValueError, match="pass ffn_hidden_size"):
        MoE(D, num_experts=4)
    mlp = nn.Sequential(nn.Linear(D, FFN), nn.GELU(), nn.Linear(FFN, D))
    with pytest.raises(ValueError, match="leave them None"):
        MoE(D, mlp, num_experts=4, ffn_hidden_size=FFN)
    # an FFN the stacked path does not know takes the per-expert path (tests/moe_proto/test_any_expert.py)
    assert isinstance(MoE(D, nn.Sequential(nn.Linear(D, FFN), nn.Tanh(), nn.Linear(FFN, D)), num_experts=4).experts,
                      ModuleExperts)
    with pytest.raises(ValueError, match="works on width"):
        MoE(D + 4, mlp, num_experts=4)

    class Skip(nn.Module):  # layers look right, but forward adds a skip connection
        def __init__(self):
            super().__init__()
            self.fc1, self.act, self.fc2 = nn.Linear(D, FFN), nn.GELU(), nn.Linear(FFN, D)

        def forward(self, x):
            return x + self.fc2(self.act(self.fc1(x)))

    with pytest.raises(ValueError, match="forward is not Linear"):  # the stacked copy's own check
        GroupedExperts.from_module(Skip(), 4)
    skip = MoE(D, Skip(), num_experts=4)  # so the layer deep-copies it: the skip connection is kept
    rows = torch.randn(3, D)
    assert torch.allclose(skip.experts(rows, torch.tensor([3, 0, 0, 0])), Skip.forward(
        skip.experts.deepspeed_experts[0], rows))
    layer = MoE(D, num_experts=4, ffn_hidden_size=FFN, k=2, use_rts=False, top2_2nd_expert_sampling=False,
                deepspeed_compat=True)
    with pytest.raises(ValueError, match="ignores used_token"):
        layer(torch.randn(8, D), used_token=torch.ones(8))
    with pytest.raises(ValueError, match="last dim"):
        layer(torch.randn(8, D + 1))


def test_the_finiteness_check_passes_masked_nan_tokens_and_logits_whose_sum_overflows():
    # the check first tests the sum of the logits: a NaN of a masked token or an overflowing sum of
    # finite logits must fall through to the per-token check and pass, a used NaN token must not
    moe = _make(dict(k=1, capacity_factor=2.0))
    x = torch.randn(8, D)
    x[3] = float("nan")
    used = torch.ones(8)
    used[3] = 0
    out, _, _ = moe(x, used_token=used)
    assert torch.isfinite(out).all() and torch.all(out[3] == 0)
    with torch.no_grad():
        moe.gate.weight.fill_(3e37)
    assert torch.isfinite(moe(torch.ones(8, D) / D)[0]).all()  # every logit 3e37: finite, their sum is not
    with pytest.raises(FloatingPointError, match="1 of 8 tokens"):
        moe(x)


def test_router_logits_function_has_linears_gradients():
    from moe_proto.router import _RouterLogits

    x = torch.randn(12, 6, dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b: _RouterLogits.apply(a, b), (x, w))
    g = torch.randn(12, 4, dtype=torch.float64)
    ours = torch.autograd.grad(_RouterLogits.apply(x, w)[0], (x, w), g)
    ref = torch.autograd.grad(torch.nn.functional.linear(x, w), (x, w), g)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("other_use", [False, True])
def test_dispatch_hands_its_backward_to_the_router(other_use, monkeypatch):
    """With a DispatchGradHandoff the dispatch's backward deposits the buffer gradient and the router's backward
    gathers it (one C++ pass): x's gradient equals the plain path's, also when the router's view of x has another
    consumer whose gradient autograd sums into the dispatch's zero placeholder."""
    from moe_proto import dispatch
    from moe_proto.router import _RouterLogits
    from moe_proto.routing import route

    if dispatch.cpu_ops_for(torch.zeros(1)) is None:
        pytest.fail("the C++ op library did not build: the handoff path cannot run")
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(24, 8, generator=gen, requires_grad=True)
    w = torch.randn(6, 8, generator=gen, requires_grad=True)
    g = torch.randn(24, 8, generator=gen)
    deposits = []
    put = dispatch.DispatchGradHandoff.put
    monkeypatch.setattr(dispatch.DispatchGradHandoff, "put",
                        lambda self, *args: deposits.append(args[0].shape) or put(self, *args))

    def loss(handoff):
        logits, xv = _RouterLogits.apply(x, w, handoff)
        plan = dispatch.plan_dispatch(route(logits, top_k=2, capacity_factor=0.5))  # drops: empty bags
        out = dispatch.unpermute(dispatch.permute(xv, plan, handoff), plan, num_tokens=24)
        extra = (xv[:5] * 3).sum() if other_use else 0
        return (out * g).sum() + extra

    ours = torch.autograd.grad(loss(dispatch.DispatchGradHandoff()), (x, w))
    assert len(deposits) == 1
    ref = torch.autograd.grad(loss(None), (x, w))
    assert len(deposits) == 1
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("alias_grad", ["fresh", "shared", "none"])
def test_router_logits_second_output_sums_both_gradients_of_the_input(alias_grad):
    """The router's view of x carries the dispatch's gradient; the router adds its own into it (in place only
    when nothing else holds that gradient) and the result is x's gradient through both uses."""
    from moe_proto.router import _RouterLogits

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(10, 6, generator=gen, requires_grad=True)
    w = torch.randn(4, 6, generator=gen, requires_grad=True)
    g = torch.randn(10, 4, generator=gen)
    rows = torch.tensor([3, 1, 1, 7])
    kept = []

    def use(xv):
        if alias_grad == "none":
            return xv.sum() * 0
        if alias_grad == "shared":  # a hook keeps the incoming gradient: it must not be changed under it
            xv.register_hook(lambda grad: kept.append((grad, grad.clone())))
        return (xv[rows] * 2).sum()

    logits, xv = _RouterLogits.apply(x, w)
    ours = torch.autograd.grad((logits * g).sum() + use(xv), (x, w))
    ref = torch.autograd.grad((torch.nn.functional.linear(x, w) * g).sum() + use(x), (x, w))
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b)
    for held, copy in kept:
        assert torch.equal(held, copy)
