"""moe_proto.upcycle: MoE models initialised from a dense checkpoint (sparse upcycling)."""
import pytest
import torch

from moe_proto import MoE
from moe_proto.models import MoETransformerArgs, MoETransformerLM
from moe_proto.upcycle import upcycle_dense_ffn, upcycle_lm, zero_router_gate_sum


def dense_lm(activation="gelu", seed=0):
    torch.manual_seed(seed)
    return MoETransformerLM(MoETransformerArgs(num_layers=3, d_model=32, num_heads=4, ffn_hidden_size=64,
                                               activation=activation)).eval()


def batch():
    return torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
@pytest.mark.parametrize("routing", [dict(top_k=2), dict(top_k=1), dict(top_k=1, normalize_routes=True),
                                     dict(top_k=1, num_prototypes=2), dict(top_k=2, score_function="sigmoid")])
def test_zero_router_upcycled_model_equals_dense(activation, routing):
    dense = dense_lm(activation)
    args = dense.args.replace(num_experts=4, moe_every=1, dropless=True, **routing)
    moe = upcycle_lm(dense, args).eval()
    assert moe.args.num_moe_layers == 3
    tokens = batch()
    torch.testing.assert_close(moe(tokens).logits, dense(tokens).logits, rtol=1e-5, atol=1e-5)


def test_large_capacity_equals_dense_and_dense_layers_are_copied():
    dense = dense_lm()
    args = dense.args.replace(num_experts=4, top_k=2, moe_every=2, capacity_factor=4.0, eval_capacity_factor=4.0)
    moe = upcycle_lm(dense, args).eval()
    assert [b.is_moe for b in moe.blocks] == [False, True, False]
    assert torch.equal(moe.blocks[0].ffn.fc1.weight, dense.blocks[0].ffn.fc1.weight)
    experts = moe.blocks[1].ffn.experts
    assert torch.equal(experts.w1[3], dense.blocks[1].ffn.fc1.weight.t())
    tokens = batch()
    torch.testing.assert_close(moe(tokens).logits, dense(tokens).logits, rtol=1e-5, atol=1e-5)


def test_noise_makes_experts_differ_reproducibly_per_seed():
    dense = dense_lm()
    args = dense.args.replace(num_experts=4, top_k=2, moe_every=1, dropless=True)
    tokens = batch()
    noisy = upcycle_lm(dense, args, noise_std=0.1, seed=3).eval()
    again = upcycle_lm(dense, args, noise_std=0.1, seed=3).eval()
    other = upcycle_lm(dense, args, noise_std=0.1, seed=4).eval()
    w1 = noisy.blocks[0].ffn.experts.w1
    assert not torch.equal(w1[0], w1[1])
    assert not torch.allclose(noisy(tokens).logits, dense(tokens).logits, atol=1e-4)
    assert torch.equal(again.blocks[0].ffn.experts.w1, w1)
    assert not torch.equal(other.blocks[0].ffn.experts.w1, w1)


def test_router_std_gives_small_random_router_and_training_works():
    dense = dense_lm()
    args = dense.args.replace(num_experts=4, top_k=2, moe_every=1, dropless=True)
    moe = upcycle_lm(dense, args, router_std=0.01, seed=0)
    gate = moe.blocks[0].ffn.gate.weight
    assert 0 < gate.abs().max() < 0.1
    tokens = batch()
    out = moe(tokens, tokens)
    out.loss.backward()
    assert gate.grad is not None and gate.grad.abs().sum() > 0


def test_gate_sum_and_unmatched_scale():
    moe = MoE(8, num_experts=4, k=1, ffn_hidden_size=16, dropless=True, use_rts=False)
    assert zero_router_gate_sum(moe) == pytest.approx(0.25)
    fc1, fc2 = torch.randn(8, 16), torch.randn(16, 8)
    upcycle_dense_ffn(moe, fc1, fc2, match_dense_output=False)
    x = torch.randn(5, 8)
    out, _, _ = moe.eval()(x)
    torch.testing.assert_close(out, 0.25 * (torch.nn.functional.gelu(x @ fc1) @ fc2), rtol=1e-5, atol=1e-5)


def test_errors_name_the_mismatch():
    dense = dense_lm()
    with pytest.raises(ValueError, match="d_model: dense 32 vs moe 64"):
        upcycle_lm(dense, dense.args.replace(d_model=64, num_experts=4))
    with pytest.raises(ValueError, match="expert_ffn_hidden_size"):
        upcycle_lm(dense, dense.args.replace(num_experts=4, expert_ffn_hidden_size=32))
    with pytest.raises(ValueError, match="starts from a dense model"):
        upcycle_lm(upcycle_lm(dense, dense.args.replace(num_experts=4)), dense.args.replace(num_experts=4))
    with pytest.raises(ValueError, match="num_experts must be >= 1"):
        upcycle_lm(dense, dense.args)
    moe = MoE(8, num_experts=4, k=2, ffn_hidden_size=16, dropless=True, use_rts=False)
    with pytest.raises(ValueError, match=r"dense w1 has shape \(8, 32\)"):
        upcycle_dense_ffn(moe, torch.randn(8, 32), torch.randn(32, 8))
    with pytest.raises(ValueError, match="w3 must be given exactly for swiglu"):
        upcycle_dense_ffn(moe, torch.randn(8, 16), torch.randn(16, 8), torch.randn(8, 16))
    with pytest.raises(ValueError, match="noise_std must be >= 0"):
        upcycle_dense_ffn(moe, torch.randn(8, 16), torch.randn(16, 8), noise_std=-1.0)


def test_upcycle_hf_dense_mlp_into_mixtral_block():
    pytest.importorskip("transformers")
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    from moe_proto.hf import moe_block_from_hf

    torch.manual_seed(0)
    config = MixtralConfig(hidden_size=16, intermediate_size=24, num_local_experts=4, num_experts_per_tok=2)
    hf = MixtralSparseMoeBlock(config)
    for p in hf.parameters():  # a standalone HF block is left uninitialised (torch.empty)
        torch.nn.init.normal_(p, std=0.1)
    block = moe_block_from_hf(hf)
    gate, up, down = torch.nn.Linear(16, 24, bias=False), torch.nn.Linear(16, 24, bias=False), \
        torch.nn.Linear(24, 16, bias=False)  # a Llama/Mistral-style dense MLP
    upcycle_dense_ffn(block.moe, gate.weight.t(), down.weight.t(), up.weight.t())
    x = torch.randn(2, 5, 16)
    dense = down(torch.nn.functional.silu(gate(x)) * up(x))
    torch.testing.assert_close(block.eval()(x), dense, rtol=1e-5, atol=1e-5)
