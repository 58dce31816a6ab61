"""Keeps benchmarks/moe_layer.py from rotting: its functions once on tiny sizes (no timing asserts)."""
import contextlib
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moe_proto import GroupedExperts

_BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "moe_layer.py"


def _load_bench():
    # benchmarks/ is a folder of scripts, not a package: load the file by path.
    spec = importlib.util.spec_from_file_location("moe_layer_bench", _BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve the module's annotations through sys.modules
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def bench():
    before = torch.get_num_threads()
    yield _load_bench()
    torch.set_num_threads(before)  # run() sets the benchmark's thread count


def test_benchmark_runs_every_mode_on_tiny_sizes(bench):
    cfg = bench.BenchConfig(tokens=64, hidden=16, ffn=32, experts=4, reps=1, warmup=0)
    # Without DeepSpeed: deepspeed.init_distributed JIT-builds its shm op on first use (minutes on
    # this shared machine), which does not belong in a smoke test; the full run covers that path.
    rows = bench.run(cfg, with_deepspeed=False)
    assert [r.mode for r in rows] == [m.name for m in bench.MODES]
    for row in rows:
        assert row.ours_s > 0 and row.ideal_s > 0 and row.ours_peak >= 0 and row.ds_s is None
        assert row.experts_only_s > 0
        assert 0.0 <= row.ours_drop_rate <= 1.0
        assert row.ours_faults >= 0 and row.ideal_faults >= 0
    table = bench.format_table(rows)
    assert table.count("\n") == len(rows) + 1 and "P=2 dropless" in table


def test_fault_counter_sees_fresh_pages_and_steady_malloc_applies(bench):
    before = bench._minor_faults()
    torch.ones(8 << 20, dtype=torch.uint8)  # 8 MiB: fresh pages, one fault per page touched at least
    assert bench._minor_faults() - before >= 100
    # In a child process: the thresholds hold for the process's life, which must not be this test run's.
    code = ("import importlib.util, sys; spec = importlib.util.spec_from_file_location('b', sys.argv[1]); "
            "b = importlib.util.module_from_spec(spec); sys.modules['b'] = b; spec.loader.exec_module(b); "
            "b.steady_malloc(); print('steady')")
    done = subprocess.run([sys.executable, "-c", code, str(_BENCH)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip().endswith("steady"), done.stderr[-2000:]


def test_ep_probe_answers_without_raising(bench):
    assert isinstance(bench.ep_available(), bool)


@pytest.fixture
def importable_bench():
    """The benchmark imported by name: spawned ranks unpickle its worker function by module name."""
    import importlib

    folder = str(_BENCH.parent)
    sys.path.append(folder)  # appended: the folder's other scripts must not shadow installed modules
    try:
        yield importlib.import_module(_BENCH.stem)
    finally:
        sys.path.remove(folder)
        sys.modules.pop(_BENCH.stem, None)


def test_expert_parallel_run_on_tiny_sizes(importable_bench):
    """--ep 2: two gloo processes, 2 of the 4 experts each over DeepSpeed's ep_size_2 group (its layer off)."""
    bench = importable_bench
    cfg = bench.BenchConfig(tokens=32, hidden=16, ffn=32, experts=4, reps=2, warmup=0)
    modes = [m for m in bench.MODES if m.name in ("top-1", "P=2 dropless")]
    rows = bench.run_ep(cfg, ep=2, modes=modes, with_deepspeed=False, timeout_s=55)
    assert [r.mode for r in rows] == ["top-1", "P=2 dropless"]
    for row in rows:
        assert row.ep == 2 and row.ours_wall_s > 0 and row.ideal_wall_s > 0 and row.ds_wall_s is None
        assert 0.0 <= row.ours_drop_rate <= 1.0 and row.ours_peak > 0
    table = bench.format_ep_table(rows)
    assert table.count("\n") == len(rows) + 1 and "per rank" in table


def test_mode_subset_parsing(bench):
    assert [m.name for m in bench._parse_modes("top-1, P=2")] == ["top-1", "P=2"]
    assert bench._parse_modes(None) == bench.MODES
    with pytest.raises(SystemExit, match="unknown mode"):
        bench._parse_modes("top-3")


def test_peak_bytes_sees_allocations(bench):
    def step():
        torch.ones(1 << 20).sum()  # 4 MiB live for a moment

    assert bench.peak_bytes({"ones": step})["ones"] >= 4 << 20


def test_peak_bytes_counts_the_layers_pooled_buffers(bench):
    from moe_proto.buffer_pool import default_pool

    pool = default_pool()
    cap = pool.max_bytes

    def step():
        pool.empty((1 << 20, )).fill_(1.0)  # 4 MiB from the pool: pooling is off while peaks are taken

    assert bench.peak_bytes({"pooled": step})["pooled"] >= 4 << 20
    assert pool.max_bytes == cap


def test_fused_cpu_experts_frozen_weights_and_stride0_grad():
    torch.manual_seed(0)
    experts = GroupedExperts(3, 8, 16, activation="gelu", bias=True)
    for p in experts.parameters():
        p.requires_grad_(False)
    x = torch.randn(7, 8, requires_grad=True)
    experts(x, torch.tensor([3, 4, 0])).sum().backward()  # sum() hands back a stride-0 gradient
    assert x.grad is not None and all(p.grad is None for p in experts.parameters())
    with pytest.raises(ValueError, match="sums to 6"):
        experts(x, torch.tensor([3, 3, 0]))


def test_kernel_ab_benchmark_runs_both_arms_and_they_agree():
    """benchmarks/moe_layer_kernels.py on tiny sizes: both arms run, and the layer computes the same in both."""
    spec = importlib.util.spec_from_file_location("moe_layer_kernels", _BENCH.parent / "moe_layer_kernels.py")
    ab = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ab)
    bench = ab._load_layer_bench()
    before = torch.get_num_threads()
    try:
        cfg = bench.BenchConfig(tokens=64, hidden=16, ffn=32, experts=4)
        rows = ab.run(cfg, ["top-1", "P=2 dropless"], reps=1, warmup=0)
    finally:
        torch.set_num_threads(before)
    assert [r[0] for r in rows] == ["top-1", "P=2 dropless"] and all(r[1] > 0 and r[2] > 0 for r in rows)
    from moe_proto import MoE

    def grads():
        torch.manual_seed(0)
        moe = MoE(16, None, 4, k=1, num_prototypes=2, ffn_hidden_size=32, capacity_factor=1.0, use_rts=False)
        x = torch.randn(40, 16, generator=torch.Generator().manual_seed(1), requires_grad=True)
        out, l_aux, _ = moe(x)
        (out.square().sum() + l_aux).backward()
        return [out.detach(), x.grad] + [p.grad for p in moe.parameters()]

    with_kernels = grads()
    from moe_proto import dispatch, router, routing

    with ab.torch_paths():
        # the switch reaches every caller of the non-expert kernels (else both arms would be the same code)
        assert router.cpu_ops_for(torch.ones(1)) is None and dispatch.cpu_ops_for(torch.ones(1)) is None
        assert routing.load_cpu_ops() is None
        without = grads()
    assert router.cpu_ops_for(torch.ones(1)) is not None and routing.load_cpu_ops() is not None
    for a, b in zip(with_kernels, without):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_ep_layout_benchmark_arms_compute_the_same_and_it_runs_on_two_ranks():
    """benchmarks/moe_ep_layout.py: its "reordered" arm really reorders and changes nothing computed; --ep 2 runs."""
    import importlib

    folder = str(_BENCH.parent)
    sys.path.append(folder)  # spawned ranks unpickle the worker by module name
    try:
        ab = importlib.import_module("moe_ep_layout")
        torch.manual_seed(0)
        experts = GroupedExperts(3, 8, 16, bias=True)
        experts.min_block_rows = 0  # these short blocks in place (the default would gather them in both arms)
        blocks = torch.tensor([[2, 0, 3], [1, 4, 0]])
        x, grad = torch.randn(10, 8), torch.randn(10, 8)
        outs = []
        for reordered in (False, True):
            experts.zero_grad(set_to_none=True)
            xx = x.clone().requires_grad_()
            with ab.reordered_blocks() if reordered else contextlib.nullcontext():
                y = experts(xx, blocks)
            assert (y.grad_fn.name() == "PermuteRowsBackward") == reordered
            y.backward(grad)
            outs.append((y.detach(), xx.grad, experts.w1.grad.clone(), experts.b2.grad.clone()))
        for ours, theirs in zip(*outs):
            torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
        bench = ab._load_layer_bench()
        before = torch.get_num_threads()
        try:
            cfg = bench.BenchConfig(tokens=32, hidden=16, ffn=32, experts=4)
            rows = ab.run(cfg, ["top-1", "top-2 dropless"], reps=1, warmup=0, timeout_s=55)
        finally:
            torch.set_num_threads(before)
        assert [r[0] for r in rows] == ["top-1", "top-2 dropless"] and all(min(r[1:]) > 0 for r in rows)
    finally:
        sys.path.remove(folder)
        sys.modules.pop("moe_ep_layout", None)
        sys.modules.pop("moe_layer_bench", None)


def test_router_grad_benchmark_arms_agree_on_tiny_sizes():
    """benchmarks/moe_router_grad.py: both arms run and compute the same gradient (no timing asserts)."""
    spec = importlib.util.spec_from_file_location("moe_router_grad_bench", _BENCH.parent / "moe_router_grad.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    before = torch.get_num_threads()
    try:
        for routes in (1, 2):
            two, one, difference = module.run(tokens=37, hidden=70, experts=5, routes=routes, reps=2,
                                              evict_bytes=1 << 16)
            assert two > 0 and one > 0 and difference < 1e-5
    finally:
        torch.set_num_threads(before)
