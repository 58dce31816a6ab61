"""moe_proto.buffer_pool: reuse only what nothing refers to, stay under the cap, same maths as no pool."""
import threading

import pytest
import torch

from moe_proto import MoE
from moe_proto.buffer_pool import HostBufferPool, default_pool, size_class
from moe_proto.experts import GroupedExperts


def test_size_class_rounds_up_by_at_most_an_eighth():
    for n in list(range(1, 300)) + [4095, 4096, 4097, 1 << 20, (1 << 20) + 1, 3 * 10 ** 7]:
        c = size_class(n)
        assert n <= c <= n * 9 / 8, n
        assert size_class(c) == c, n
    assert size_class(4000 * 1024 * 4) == size_class(4096 * 1024 * 4) == 4096 * 1024 * 4


def test_a_freed_buffer_is_reused_and_a_live_one_is_not():
    pool = HostBufferPool(max_bytes=1 << 20, min_bytes=0)
    a = pool.empty((64, 64))
    ptr = a.data_ptr()
    b = pool.empty((64, 64))
    assert b.data_ptr() != ptr  # a is alive
    view = a[3:]
    del a
    c = pool.empty((64, 64))
    assert c.data_ptr() not in (ptr, b.data_ptr())  # a view keeps a's storage in use
    del view
    d = pool.empty((62, 64), torch.float32)  # same size class: reuses a's storage
    assert d.data_ptr() == ptr and d.shape == (62, 64) and d.is_contiguous()
    stats = pool.stats()
    assert (stats.hits, stats.misses, stats.buffers) == (1, 3, 3)


def test_dtypes_share_storage_classes_by_bytes():
    pool = HostBufferPool(max_bytes=1 << 20, min_bytes=0)
    a = pool.empty((128, ), torch.float64)
    ptr = a.data_ptr()
    del a
    b = pool.empty((256, ), torch.int32)  # 1 KiB either way: the storage is untyped
    assert b.data_ptr() == ptr and b.dtype == torch.int32


def test_the_cap_evicts_free_buffers_then_bypasses():
    pool = HostBufferPool(max_bytes=3 * 4096, min_bytes=0)
    a, b = pool.empty((1024, )), pool.empty((1024, ))  # 4 KiB each
    del a
    c = pool.empty((2048, ))  # 8 KiB: needs a's room, a is free -> evicted
    assert pool.stats().held_bytes <= 3 * 4096
    d = pool.empty((2048, ))  # b and c are live: no room, a plain tensor
    stats = pool.stats()
    assert stats.held_bytes <= 3 * 4096 and stats.bypasses == 1
    assert d.shape == (2048, ) and len({b.data_ptr(), c.data_ptr(), d.data_ptr()}) == 3
    assert HostBufferPool(max_bytes=0).empty((4, 4)).shape == (4, 4)


def test_small_and_non_cpu_requests_are_not_pooled():
    pool = HostBufferPool(min_bytes=1024)
    pool.empty((8, ))
    assert pool.empty((16, 16), device="meta").device.type == "meta"
    stats = pool.stats()
    assert (stats.bypasses, stats.buffers) == (2, 0)


def test_clear_forgets_free_buffers_only():
    pool = HostBufferPool(max_bytes=1 << 20, min_bytes=0)
    live, free = pool.empty((256, )), pool.empty((512, ))
    del free
    pool.clear()
    assert pool.stats().buffers == 1 and pool.stats().held_bytes == size_class(1024)
    live.fill_(1.0)
    assert float(live.sum()) == 256


def test_threads_never_share_a_live_buffer():
    pool = HostBufferPool(max_bytes=1 << 24, min_bytes=0)
    held, errors = [], []
    barrier = threading.Barrier(4)

    def grab():
        try:
            barrier.wait(timeout=10)
            mine = [pool.empty((256, )) for _ in range(50)]
            held.extend(mine)
        except Exception as err:  # pragma: no cover - reported below
            errors.append(err)

    threads = [threading.Thread(target=grab) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=20)
    assert not errors
    assert len({t.data_ptr() for t in held}) == 200


def _train_steps(experts: GroupedExperts, steps: int, set_to_none: bool):
    gen = torch.Generator().manual_seed(0)
    counts = torch.tensor([40, 0, 70, 18])
    outs = []
    for _ in range(steps):
        if set_to_none:
            experts.zero_grad(set_to_none=True)
        x = torch.randn(128, 32, generator=gen, requires_grad=True)
        y = experts(x, counts)
        y.backward(torch.randn(128, 32, generator=gen))
        outs.append((y.detach().clone(), x.grad.clone()))
    return outs, {n: p.grad.clone() for n, p in experts.named_parameters()}


@pytest.mark.parametrize("set_to_none", [True, False])
def test_pooled_experts_equal_unpooled_over_steps(set_to_none):
    """Gradients kept across steps (accumulation) and gradients set to None: pooled == fresh buffers, bit for bit."""
    results = []
    for pool in (HostBufferPool(max_bytes=1 << 26, min_bytes=0), HostBufferPool(max_bytes=0)):
        torch.manual_seed(0)
        experts = GroupedExperts(4, 32, 64, activation="gelu", bias=True)
        experts.buffer_pool = pool
        results.append(_train_steps(experts, 3, set_to_none))
        if pool.max_bytes:
            stats = pool.stats()
            assert stats.hits > 0 and stats.buffers > 0
    (outs_p, grads_p), (outs_u, grads_u) = results
    for (y_p, dx_p), (y_u, dx_u) in zip(outs_p, outs_u):
        assert torch.equal(y_p, y_u) and torch.equal(dx_p, dx_u)
    for name in grads_u:
        assert torch.equal(grads_p[name], grads_u[name]), name


def test_a_kept_gradient_is_never_handed_out_again():
    pool = HostBufferPool(max_bytes=1 << 26, min_bytes=0)
    experts = GroupedExperts(2, 16, 32, bias=True)
    experts.buffer_pool = pool
    counts = torch.tensor([10, 6])
    experts(torch.randn(16, 16), counts).sum().backward()
    kept = experts.w1.grad
    assert pool.stats().buffers > 0
    kept_values = kept.clone()
    held_grad_ptrs = {p.grad.data_ptr() for p in experts.parameters()}
    for p in experts.parameters():
        p.grad = None  # the user keeps `kept` (w1's gradient) alive after this
    experts(torch.randn(16, 16), counts).sum().backward()
    assert experts.w1.grad.data_ptr() != kept.data_ptr()
    assert torch.equal(kept, kept_values)
    # the gradients nobody kept were reused for the second step
    assert {p.grad.data_ptr() for p in experts.parameters()} & (held_grad_ptrs - {kept.data_ptr()})


def test_the_layer_uses_the_default_pool_for_its_experts():
    moe = MoE(16, num_experts=4, ffn_hidden_size=32, use_rts=False)
    assert moe.experts.buffer_pool is default_pool()


def test_the_config_key_sizes_one_pool_per_model():
    from moe_proto.config import MoEProtoConfig
    from moe_proto.models import MoEModelConfig, MoETransformerArgs, MoETransformerLM

    block = MoEProtoConfig(num_experts=4, host_buffer_pool_mb=3)
    model_cfg = MoEModelConfig(num_layers=2, d_model=16, num_heads=2, ffn_hidden_size=32, seq_len=8)
    model = MoETransformerLM(MoETransformerArgs.from_configs(model_cfg, block))
    pools = {id(layer.experts.buffer_pool) for layer in model.moe_layers()}
    assert len(pools) == 1
    assert model.moe_layers()[0].experts.buffer_pool.max_bytes == 3 << 20
    with pytest.raises(ValueError, match="host_buffer_pool_mb"):
        MoEProtoConfig(num_experts=4, host_buffer_pool_mb=-1)
