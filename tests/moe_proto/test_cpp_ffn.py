"""moe_proto.ops: the C++ expert FFN against torch's activations, autograd and the torch loop; the combine's and
the router's backward kernels against the torch expressions they replace."""
import logging

import pytest
import torch
import torch.nn.functional as F

from moe_proto import ops
from moe_proto.experts import GroupedExperts

REFERENCE = {
    "gelu": F.gelu,
    "gelu_tanh": lambda v: F.gelu(v, approximate="tanh"),
    "relu": F.relu,
    "silu": F.silu,
}


@pytest.fixture(scope="module")
def cpp():
    module = ops.load_cpu_ops()
    if module is None:
        pytest.fail(f"the C++ expert FFN did not build here: {ops._state['failed']}")
    return module


@pytest.mark.parametrize("activation", sorted(ops.ACTIVATION_CODES))
def test_activation_and_derivative_match_torch(cpp, activation):
    v = torch.cat([torch.linspace(-12, 12, 4001), torch.tensor([0.0, -0.0, 1e-8, -1e-8, 40.0, -40.0, 100.0,
                                                                -100.0])])
    """Against float64 torch: within a few float32 ulps, and no worse than torch's own float32 kernels (x1.5)."""
    f, df = cpp.activation_with_derivative(v, ops.ACTIVATION_CODES[activation])
    v64 = v.double().requires_grad_()
    want = REFERENCE[activation](v64)
    want.sum().backward()
    v32 = v.clone().requires_grad_()
    torch32 = REFERENCE[activation](v32)
    torch32.sum().backward()
    for ours, theirs, exact in ((f, torch32.detach(), want.detach()), (df, v32.grad, v64.grad)):
        torch.testing.assert_close(ours.double(), exact, rtol=1e-6, atol=1.5e-6)
        assert (ours.double() - exact).abs().max() <= 1.5 * (theirs.double() - exact).abs().max() + 1e-12
    if activation == "relu":  # the derivative at exactly 0 is 0 in torch and here
        assert torch.equal(df, (v > 0).float())


def _forward_backward(experts, x, counts, grad):
    experts.zero_grad(set_to_none=True)
    xx = x.clone().requires_grad_()
    y = experts(xx, counts)
    y.backward(grad)
    return y.detach(), xx.grad, {n: p.grad.clone() for n, p in experts.named_parameters()}


# CPU paths of GroupedExperts: (fused_cpu, cpp_ffn); the grouped_matmul composition is the reference.
PATHS = {"C++ loop": (True, True), "torch loop": (True, False)}


@pytest.mark.parametrize("path", sorted(PATHS))
@pytest.mark.parametrize("activation,bias", [(a, b) for a in sorted(ops.ACTIVATION_CODES) for b in (True, False)]
                         + [("swiglu", True), ("swiglu", False)])
def test_cpu_paths_equal_the_grouped_matmul_composition(cpp, path, activation, bias):
    torch.manual_seed(0)
    experts = GroupedExperts(4, 24, 40, activation=activation, bias=bias)
    counts = torch.tensor([11, 0, 30, 7])  # an empty expert: zero gradients, not garbage
    x, grad = torch.randn(48, 24), torch.randn(48, 24)
    experts.fused_cpu, experts.cpp_ffn = PATHS[path]
    y_p, dx_p, g_p = _forward_backward(experts, x, counts, grad)
    experts.fused_cpu = False
    y_r, dx_r, g_r = _forward_backward(experts, x, counts, grad)
    torch.testing.assert_close(y_p, y_r, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dx_p, dx_r, rtol=1e-5, atol=1e-5)
    for name in g_r:
        torch.testing.assert_close(g_p[name], g_r[name], rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")
    assert torch.count_nonzero(g_p["w1"][1]) == 0 and torch.count_nonzero(g_p["w2"][1]) == 0


@pytest.mark.parametrize("path", sorted(PATHS) + ["grouped matmul"])
@pytest.mark.parametrize("activation,bias", [("gelu", True), ("relu", False), ("swiglu", True)])
def test_blocks_of_expert_major_rows_equal_the_expert_major_buffer(cpp, path, activation, bias):
    """[B, E] counts (the rows from B expert-parallel peers, as received): same rows out, same gradients."""
    from moe_proto.experts import blocks_to_expert_major, segment_rows

    assert segment_rows(torch.tensor([5, 0]), torch.tensor([2, 3])).tolist() == [5, 6, 0, 1, 2]

    torch.manual_seed(1)
    experts = GroupedExperts(3, 16, 24, activation=activation, bias=bias)
    # Expert 1 has rows in block 1 only, expert 2 in none: zero gradients, not garbage.
    blocks = torch.tensor([[5, 0, 0], [2, 6, 0], [4, 0, 0]])
    x, grad = torch.randn(17, 16), torch.randn(17, 16)
    index = blocks_to_expert_major(blocks)
    assert index.tolist() == [0, 1, 2, 3, 4, 5, 6, 13, 14, 15, 16, 7, 8, 9, 10, 11, 12]
    experts.fused_cpu, experts.cpp_ffn = PATHS.get(path, (False, False))
    experts.min_block_rows = 0  # in place however short the segments (the default gathers these)
    y_b, dx_b, g_b = _forward_backward(experts, x, blocks, grad)
    experts.fused_cpu = False
    y_r, dx_r, g_r = _forward_backward(experts, x[index], blocks.sum(dim=0), grad[index])
    torch.testing.assert_close(y_b[index], y_r, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dx_b[index], dx_r, rtol=1e-5, atol=1e-5)
    for name in g_r:
        torch.testing.assert_close(g_b[name], g_r[name], rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")
    assert all(torch.count_nonzero(g_b[name][2]) == 0 for name in g_b)
    experts.fused_cpu, experts.cpp_ffn = PATHS.get(path, (False, False))  # each path really ran its own code
    want = {"C++ loop": "_CppExpertFFN", "torch loop": "_FusedExpertFFN", "grouped matmul": "PermuteRows"}[path]
    if path == "C++ loop" and activation == "swiglu":
        want = "_FusedExpertFFN"  # gated experts have no C++ kernel
    assert experts(x, blocks).grad_fn.name().startswith(want)


def test_short_blocks_are_gathered_expert_major_and_long_ones_computed_in_place(cpp):
    torch.manual_seed(2)
    experts = GroupedExperts(2, 8, 16)  # default min_block_rows: ffn // 2 = 8 rows per nonempty segment
    short, long = torch.tensor([[3, 4], [5, 0]]), torch.tensor([[8, 9], [8, 0]])
    assert experts(torch.randn(12, 8), short).grad_fn.name() == "PermuteRowsBackward"
    assert experts(torch.randn(25, 8), long).grad_fn.name().startswith("_CppExpertFFN")
    experts.min_block_rows = 4
    assert experts(torch.randn(12, 8), short).grad_fn.name().startswith("_CppExpertFFN")
    x = torch.randn(12, 8)
    gathered = (GroupedExperts._blocks_in_place.__get__(experts)(short), experts(x, short))
    experts.min_block_rows = 100
    torch.testing.assert_close(experts(x, short), gathered[1], rtol=1e-5, atol=1e-5)
    assert gathered[0] and experts(torch.zeros(0, 8), torch.zeros(2, 2, dtype=torch.long)).shape == (0, 8)


def test_counts_of_the_wrong_shape_are_refused(cpp):
    experts = GroupedExperts(3, 8, 16)
    with pytest.raises(ValueError, match=r"must be \[3\] .* or \[blocks, 3\], got shape \(2, 2\)"):
        experts(torch.randn(4, 8), torch.tensor([[1, 1], [1, 1]]))
    with pytest.raises(ValueError, match="sums to 5 but the buffer has 4 rows"):
        experts(torch.randn(4, 8), torch.tensor([[1, 1, 1], [1, 1, 0]]))
    with pytest.raises(RuntimeError, match="6 row counts for 4 experts"):
        cpp.expert_ffn_forward(torch.randn(4, 8), [1, 1, 1, 1, 0, 0], 0, torch.randn(4, 8, 16), None,
                               torch.randn(4, 16, 8), None, torch.empty(4, 16), torch.empty(4, 16), torch.empty(4, 8))
    with pytest.raises(RuntimeError, match="sum to 9, more than the 4 rows"):
        cpp.expert_ffn_forward(torch.randn(4, 8), [1, 8, 0, 0], 0, torch.randn(4, 8, 16), None,
                               torch.randn(4, 16, 8), None, torch.empty(4, 16), torch.empty(4, 16), torch.empty(4, 8))


def test_cpp_loop_with_frozen_weights_a_stride0_gradient_and_rows_past_the_counts(cpp):
    torch.manual_seed(0)
    experts = GroupedExperts(3, 8, 16, activation="gelu", bias=True)
    experts.w1.requires_grad_(False)
    experts.b1.requires_grad_(False)
    x = torch.randn(7, 8, requires_grad=True)
    experts(x, torch.tensor([3, 4, 0])).sum().backward()  # sum() hands back a stride-0 gradient
    assert x.grad is not None and experts.w1.grad is None and experts.b1.grad is None
    assert experts.w2.grad is not None and experts.b2.grad is not None


def test_other_dtypes_and_gated_experts_keep_the_torch_loop(cpp):
    x = torch.randn(4, 8, dtype=torch.float64)
    experts = GroupedExperts(2, 8, 16, dtype=torch.float64)
    y = experts(x, torch.tensor([1, 3]))
    assert y.dtype == torch.float64 and y.grad_fn.name().startswith("_FusedExpertFFN")
    swiglu = GroupedExperts(2, 8, 16, activation="swiglu")
    assert swiglu(torch.randn(4, 8), torch.tensor([2, 2])).grad_fn.name().startswith("_FusedExpertFFN")
    gelu = GroupedExperts(2, 8, 16)
    assert gelu(torch.randn(4, 8), torch.tensor([2, 2])).grad_fn.name().startswith("_CppExpertFFN")


def test_a_failed_build_falls_back_with_one_warning(monkeypatch, caplog):
    monkeypatch.setitem(ops._state, "module", None)
    monkeypatch.setitem(ops._state, "failed", None)

    def broken(**kwargs):
        raise RuntimeError("simulated: error: command 'c++' failed")

    monkeypatch.setattr(ops.jit_build, "build_extension", broken)
    experts = GroupedExperts(2, 8, 16)
    with caplog.at_level(logging.WARNING, logger="moe_proto.ops"):
        for _ in range(3):
            y = experts(torch.randn(4, 8), torch.tensor([1, 3]))
            assert y.grad_fn.name().startswith("_FusedExpertFFN")
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "simulated" in warnings[0].getMessage()
    assert "python -m sparse_scale.prebuild" in warnings[0].getMessage()


def test_the_build_folder_is_keyed_by_cpu_kind(tmp_path):
    assert ops.build_directory("x86-64-v2", tmp_path) == tmp_path / "moe_proto_cpu-x86-64-v2"
    assert ops.build_directory("native", tmp_path).name.startswith("moe_proto_cpu-native-")


def test_combine_backward_kernel_matches_the_torch_expressions(cpp):
    gen = torch.Generator().manual_seed(0)
    tokens, rows, d = 37, 50, 21  # d not a multiple of a vector width
    grad_out = torch.randn(tokens, d, generator=gen)
    y = torch.randn(rows, d, generator=gen)
    gate = torch.rand(rows, generator=gen)
    token_index = torch.randint(0, tokens, (rows, ), generator=gen)
    grad_y, grad_gate = torch.empty(rows, d), torch.empty(rows)
    cpp.combine_backward(grad_out, y, gate, token_index, grad_y, grad_gate)
    assert torch.equal(grad_y, gate[:, None] * grad_out[token_index])  # one product per element either way
    torch.testing.assert_close(grad_gate, (grad_out[token_index] * y).sum(1), rtol=1e-6, atol=1e-6)
    only_gate = torch.empty(rows)
    cpp.combine_backward(grad_out, y, gate, token_index, None, only_gate)
    assert torch.equal(only_gate, grad_gate)
    with pytest.raises(RuntimeError, match="buffer row 3 names token 37 outside"):
        bad = token_index.clone()
        bad[3] = tokens
        cpp.combine_backward(grad_out, y, gate, bad, grad_y, None)
    with pytest.raises(RuntimeError, match="contiguous float32"):
        cpp.combine_backward(grad_out.double(), y, gate, token_index, grad_y, None)


@pytest.mark.parametrize("width", [19, 70, 256])  # the vector blocks of 64 columns, a tail, and both
def test_add_router_input_grad_kernel_matches_addmm(cpp, width):
    gen = torch.Generator().manual_seed(1)
    grad_x, grad_logits, w = torch.randn(33, width, generator=gen), torch.randn(33, 5, generator=gen), \
        torch.randn(5, width, generator=gen)
    out = torch.empty_like(grad_x)
    cpp.add_router_input_grad(grad_x, grad_logits, w, out)
    torch.testing.assert_close(out, torch.addmm(grad_x, grad_logits, w), rtol=1e-6, atol=1e-6)
    with pytest.raises(RuntimeError, match="shapes do not match"):
        cpp.add_router_input_grad(grad_x, grad_logits, torch.randn(5, 7), out)


@pytest.mark.parametrize("width", [19, 70, 256])
def test_add_router_input_grad_kernel_gathers_the_dispatch_buffer_rows(cpp, width):
    """With route_row/route_offsets: token t's term is the sum of its buffer rows (0, 1 or 2 here), as
    embedding_bag sums them, plus grad_logits @ w."""
    gen = torch.Generator().manual_seed(2)
    tokens, experts = 33, 5
    routes_of_token = torch.randint(0, 3, (tokens,), generator=gen)
    routes_of_token[-1] = 0  # an empty last bag: its end is the number of routes
    route_offsets = torch.cumsum(routes_of_token, 0) - routes_of_token
    rows = int(routes_of_token.sum())
    route_row = torch.randperm(rows, generator=gen)
    buffer_grad = torch.randn(rows, width, generator=gen)
    grad_logits, w = torch.randn(tokens, experts, generator=gen), torch.randn(experts, width, generator=gen)
    out = torch.empty(tokens, width)
    cpp.add_router_input_grad(buffer_grad, grad_logits, w, out, route_row, route_offsets)
    gathered = F.embedding_bag(route_row, buffer_grad, route_offsets, mode="sum")
    torch.testing.assert_close(out, torch.addmm(gathered, grad_logits, w), rtol=1e-6, atol=1e-6)
    assert torch.equal(out[routes_of_token == 0], (grad_logits @ w)[routes_of_token == 0])
    bad = route_row.clone()
    bad[4] = rows
    with pytest.raises(RuntimeError, match=f"route_row\\[4\\] = {rows} is outside the buffer's {rows} rows"):
        cpp.add_router_input_grad(buffer_grad, grad_logits, w, out, bad, route_offsets)
    with pytest.raises(RuntimeError, match="non-decreasing"):
        cpp.add_router_input_grad(buffer_grad, grad_logits, w, out, route_row, route_offsets.flip(0))
    with pytest.raises(RuntimeError, match="come together"):
        cpp.add_router_input_grad(buffer_grad, grad_logits, w, out, route_row, None)


@pytest.mark.parametrize("k", [1, 2])
def test_layer_gradients_equal_without_the_cpp_library(cpp, monkeypatch, k):
    """The layer with every C++ kernel against the layer with none (each falls back to its torch expression)."""
    from moe_proto import MoE, dispatch, experts, router, routing

    def grads():
        torch.manual_seed(0)
        moe = MoE(16, None, 4, k=k, ffn_hidden_size=24, capacity_factor=1.0, use_rts=False,
                  top2_2nd_expert_sampling=False)
        x = torch.randn(3, 10, 16, generator=torch.Generator().manual_seed(2), requires_grad=True)
        out, l_aux, _ = moe(x)
        (out.square().sum() + l_aux).backward()
        return [x.grad] + [p.grad for p in moe.parameters()]

    used = set()

    class Counting:  # the library, recording which kernels the layer called
        def __getattr__(self, name):
            used.add(name)
            return getattr(cpp, name)

    for module in (dispatch, router):
        monkeypatch.setattr(module, "cpu_ops_for", lambda *tensors: Counting())
    monkeypatch.setattr(experts, "load_cpu_ops", Counting)
    monkeypatch.setattr(routing, "load_cpu_ops", Counting)
    with_cpp = grads()
    assert used == {"assign_slots", "add_router_input_grad", "combine_backward", "expert_ffn_forward",
                    "expert_ffn_backward"} | ({"select_top1"} if k == 1 else set()), used
    monkeypatch.setattr(experts, "load_cpu_ops", lambda: None)
    for module in (dispatch, router):
        monkeypatch.setattr(module, "cpu_ops_for", lambda *tensors: None)
    monkeypatch.setattr(routing, "load_cpu_ops", lambda: None)
    without = grads()
    for a, b in zip(with_cpp, without):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_the_old_prebuild_command_still_builds_with_a_deprecation_warning(cpp):
    """`python -m moe_proto.prebuild` (the old command; `python -m sparse_scale.prebuild` is the one now): exit 0
    with the library ready, a DeprecationWarning naming the new command, and no runpy warning about a module run
    twice (the older `python -m moe_proto.ops --prebuild` printed one, and now names the new command)."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "moe_proto.prebuild"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "RuntimeWarning" not in done.stderr
    assert "DeprecationWarning" in done.stderr and "python -m sparse_scale.prebuild" in done.stderr
    assert "moe_proto C++ CPU ops ready" in done.stderr
    old = subprocess.run([sys.executable, "-m", "moe_proto.ops", "--prebuild"], capture_output=True, text=True,
                         timeout=120)
    assert old.returncode == 1 and "python -m sparse_scale.prebuild" in old.stderr  # not a silent exit 0
