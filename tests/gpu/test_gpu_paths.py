"""CUDA paths checked against the CPU ones; run by `make gpu-check`, skipped without a GPU."""
import pytest
import torch

from moe_proto import MoE
from picasso_ops.embedding import PackedEmbeddingCollection, TableSpec
from picasso_ops.jagged import JaggedBatch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("k,prototypes,dropless", [(1, 1, False), (2, 1, False), (1, 2, True)])
def test_moe_layer_cuda_matches_cpu(k, prototypes, dropless):
    torch.manual_seed(0)
    cpu = MoE(64, num_experts=8, k=k, capacity_factor=1.25, num_prototypes=prototypes, dropless=dropless,
              ffn_hidden_size=128, use_rts=False, noisy_gate_policy=None, top2_2nd_expert_sampling=False).eval()
    gpu = MoE(64, num_experts=8, k=k, capacity_factor=1.25, num_prototypes=prototypes, dropless=dropless,
              ffn_hidden_size=128, use_rts=False, noisy_gate_policy=None, top2_2nd_expert_sampling=False).eval().cuda()
    gpu.load_state_dict(cpu.state_dict())
    x = torch.randn(512, 64, requires_grad=True)
    xg = x.detach().cuda().requires_grad_()
    out_c, aux_c, _ = cpu(x)
    out_g, aux_g, _ = gpu(xg)
    torch.testing.assert_close(out_g.cpu(), out_c, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(aux_g.cpu(), aux_c, rtol=1e-4, atol=1e-5)
    out_c.square().sum().backward()
    out_g.square().sum().backward()
    torch.testing.assert_close(xg.grad.cpu(), x.grad, rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad", "adam"])
def test_packed_embeddings_cuda_match_cpu(optimizer):
    specs = [TableSpec(f"t{i}", 1000, 16, pooling="sum", optimizer=optimizer, optimizer_params={"lr": 0.1})
             for i in range(8)]
    cpu = PackedEmbeddingCollection(specs)
    gpu = PackedEmbeddingCollection(specs, device=torch.device("cuda"))
    gpu.load_state_dict(cpu.state_dict())
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        lengths = torch.randint(0, 4, (8, 64), generator=g)
        values = torch.randint(0, 1000, (int(lengths.sum()),), generator=g)
        batch = JaggedBatch([s.name for s in specs], values, lengths)
        target = torch.randn(64, 8 * 16, generator=g)
        (cpu(batch).values * target).sum().backward()
        (gpu(batch.to("cuda")).values * target.cuda()).sum().backward()
    for key, value in cpu.state_dict().items():
        torch.testing.assert_close(gpu.state_dict()[key].cpu(), value, rtol=1e-5, atol=1e-6)


def _packed_model(seed: int = 0):
    from picasso_ops.models import SparseArgs, WideAndDeepArgs, packed_wide_and_deep

    torch.manual_seed(seed)
    return packed_wide_and_deep(WideAndDeepArgs(vocab_sizes=[300] * 26, num_dense=4, embedding_dim=8, hidden=(32, 16)),
                                SparseArgs(optimizer="rowwise_adagrad", optimizer_params={"lr": 0.1})).cuda()


def _cuda_batches(n: int, size: int):
    from picasso_ops.data import SyntheticConfig, SyntheticCTRStream

    cfg = SyntheticConfig(num_fields=26, vocab_sizes=300, num_dense=4, seed=7)
    return [b.to("cuda") for b in SyntheticCTRStream(cfg, size, num_batches=n)]


def test_interleaved_trainer_on_cuda_streams_equals_plain_steps():
    import torch.nn.functional as F

    from picasso_ops.distributed import sparse_step
    from picasso_ops.interleave import InterleavedTrainer
    from picasso_ops.interleave.streams import CudaStageStreams

    ref, inter = _packed_model(), _packed_model()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    inter_opt = torch.optim.SGD(inter.parameters(), lr=0.1, momentum=0.9)
    with InterleavedTrainer(inter, inter_opt, micro_batches=4, timeout_s=60) as trainer:
        assert isinstance(trainer.pipeline.streams, CudaStageStreams)
        for batch in _cuda_batches(3, 512):
            loss = F.binary_cross_entropy_with_logits(ref(batch.dense, batch.values, batch.lengths),
                                                      batch.labels.float())
            ref_opt.zero_grad(set_to_none=True)
            loss.backward()
            ref_opt.step()
            sparse_step(ref)
            assert trainer.step(batch) == pytest.approx(float(loss), rel=1e-4)
    torch.cuda.synchronize()
    for key, value in ref.state_dict().items():
        torch.testing.assert_close(inter.state_dict()[key], value, rtol=1e-4, atol=1e-5)


def test_interleaved_forward_on_cuda_streams_equals_one_micro_batch():
    import torch.nn.functional as F

    from picasso_ops.distributed import sparse_step
    from picasso_ops.interleave import InterleavedForward
    from picasso_ops.interleave.streams import CudaStageStreams

    one, inter = InterleavedForward(_packed_model(), 1), InterleavedForward(_packed_model(), 4, timeout_s=60)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (one, inter)]
    for batch in _cuda_batches(3, 512):
        for model, opt in zip((one, inter), opts):
            opt.zero_grad(set_to_none=True)
            F.binary_cross_entropy_with_logits(model(batch.dense, batch.values, batch.lengths),
                                               batch.labels.float()).backward()
            opt.step()
            sparse_step(model)  # waits for the sparse stream's marks before the tables' step
    assert isinstance(inter._streams, CudaStageStreams)
    torch.cuda.synchronize()
    for key, value in one.state_dict().items():
        torch.testing.assert_close(inter.state_dict()[key], value, rtol=1e-4, atol=1e-5)
    inter.close()
