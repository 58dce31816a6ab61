"""Routing options: sigmoid scores, route normalisation, aux loss scopes, shared experts, config pass-through."""
import pytest
import torch

from moe_proto import MoE, MoETransformerArgs, MoETransformerLM, route, update_expert_biases
from moe_proto.config import MoEProtoConfig
from moe_proto.models import MoEModelConfig

D = 8


def _hand_aux(probs_g, index, top_k):
    """E_g * sum f p per prototype, averaged; f from the chosen experts, p the mean probabilities."""
    s, num_p, group = probs_g.shape
    f = torch.zeros(num_p, group)
    for t in range(s):
        for e in index[t].tolist():
            f[e // group, e % group] += 1.0 / (top_k * s)
    return (group * (f * probs_g.mean(0)).sum(-1)).mean()


def test_sigmoid_scores_gates_and_aux_loss_by_hand():
    logits = torch.tensor([[1.0, -1.0, 0.0, 2.0], [0.5, 0.0, -2.0, -1.0], [-1.0, 3.0, 1.0, 0.0]])
    rec = route(logits, top_k=2, capacity_factor=None, score_function="sigmoid", normalize_routes=False)
    scores = torch.sigmoid(logits)
    assert rec.expert_index.tolist() == [[3, 0], [0, 1], [1, 2]]
    torch.testing.assert_close(rec.gate, scores.gather(1, rec.expert_index))
    normalised = scores / scores.sum(-1, keepdim=True)
    torch.testing.assert_close(rec.aux_loss, _hand_aux(normalised.view(3, 1, 4), rec.expert_index, 2))
    norm = route(logits, top_k=2, capacity_factor=None, score_function="sigmoid", normalize_routes=True)
    picked = scores.gather(1, norm.expert_index)
    torch.testing.assert_close(norm.gate, picked / picked.sum(-1, keepdim=True))


def test_normalize_routes_within_each_prototype():
    torch.manual_seed(1)
    logits = torch.randn(6, 8)
    rec = route(logits, top_k=2, num_prototypes=2, capacity_factor=None, normalize_routes=True)
    torch.testing.assert_close(rec.gate.view(6, 2, 2).sum(-1), torch.ones(6, 2))
    one = route(logits, top_k=1, num_prototypes=2, capacity_factor=None, normalize_routes=True)
    torch.testing.assert_close(one.gate, torch.ones(6, 2))  # top_k=1 softmax: every weight becomes 1
    raw = route(logits, top_k=2, num_prototypes=2, capacity_factor=None, normalize_routes=False)
    probs = torch.softmax(logits.view(6, 2, 4), -1).view(6, 8)
    torch.testing.assert_close(raw.gate, probs.gather(1, raw.expert_index))


def test_sequence_scope_is_the_mean_of_per_sequence_losses():
    torch.manual_seed(2)
    logits = torch.randn(12, 4)  # 3 sequences of 4 tokens, P=2
    rec = route(logits, num_prototypes=2, capacity_factor=None, aux_loss_scope="sequence", sequence_length=4)
    want = torch.stack([route(logits[i:i + 4], num_prototypes=2, capacity_factor=None).aux_loss
                        for i in (0, 4, 8)]).mean()
    torch.testing.assert_close(rec.aux_loss, want)
    probs = torch.softmax(logits.view(12, 2, 2), -1)
    hand = torch.stack([_hand_aux(probs[i:i + 4], rec.expert_index[i:i + 4], 1) for i in (0, 4, 8)]).mean()
    torch.testing.assert_close(rec.aux_loss, hand)
    # Masked tokens leave their sequence's counts and means; a fully masked sequence leaves the average.
    used = torch.tensor([1, 1, 0, 1] + [0] * 4 + [1, 1, 1, 1])
    masked = route(logits, num_prototypes=2, capacity_factor=None, aux_loss_scope="sequence", sequence_length=4,
                   used_token=used)
    keep = [0, 1, 3]
    first = _hand_aux(probs[keep], rec.expert_index[keep], 1)
    last = _hand_aux(probs[8:], rec.expert_index[8:], 1)
    torch.testing.assert_close(masked.aux_loss, (first + last) / 2)
    with pytest.raises(ValueError, match="sequence_length"):
        route(logits, aux_loss_scope="sequence", sequence_length=5)


def test_global_batch_scope_uses_the_given_counts():
    torch.manual_seed(3)
    logits = torch.randn(5, 4)
    seen = {}

    def global_load(routed, used):
        seen["routed"], seen["used"] = routed.clone(), int(used)
        return routed + torch.tensor([10, 0, 0, 2]), used + 12  # earlier micro-batches/ranks: 12 tokens

    rec = route(logits, top_k=2, capacity_factor=None, aux_loss_scope="global_batch", global_load_fn=global_load)
    assert seen["used"] == 5 and torch.equal(seen["routed"], rec.routed_per_expert)
    f = (rec.routed_per_expert + torch.tensor([10, 0, 0, 2])).float() / (2 * 17)
    p = torch.softmax(logits, -1).mean(0)
    torch.testing.assert_close(rec.aux_loss, 4 * (f * p).sum())
    plain = route(logits, top_k=2, capacity_factor=None, aux_loss_scope="global_batch")
    torch.testing.assert_close(plain.aux_loss, route(logits, top_k=2, capacity_factor=None).aux_loss)


def test_layer_global_batch_accumulates_micro_batches_until_the_step_ends():
    torch.manual_seed(4)
    layer = MoE(D, None, num_experts=4, num_prototypes=2, ffn_hidden_size=D, use_rts=False, capacity_factor=2.0,
                aux_loss_scope="global_batch")
    xs = [torch.randn(2, 3, D) for _ in range(2)]
    _, _, c0 = layer(xs[0])
    _, l1, c1 = layer(xs[1])
    probs = torch.softmax(layer.gate(xs[1].reshape(-1, D)).view(6, 2, 2), -1).mean(0)
    f = (c0 + c1).float().view(2, 2) / 12
    torch.testing.assert_close(l1, (2 * (f * probs).sum(-1)).mean())
    assert update_expert_biases(layer) == 0  # no bias, but the global batch starts again
    _, l2, _ = layer(xs[1])  # a new step: this micro-batch's counts only
    torch.testing.assert_close(l2, route(layer.gate(xs[1].reshape(-1, D)).float(), num_prototypes=2,
                                         capacity_factor=2.0, min_capacity=4).aux_loss)


def test_layer_sequence_scope_needs_a_sequence_dim():
    layer = MoE(D, None, num_experts=4, ffn_hidden_size=D, use_rts=False, aux_loss_scope="sequence")
    x = torch.randn(3, 4, D)
    _, l_aux, _ = layer(x)
    logits = layer.gate(x.reshape(-1, D)).float()
    torch.testing.assert_close(l_aux, route(logits, capacity_factor=1.0, min_capacity=4, aux_loss_scope="sequence",
                                            sequence_length=4).aux_loss)
    with pytest.raises(ValueError, match="batch, seq, hidden"):
        layer(torch.randn(12, D))


def test_shared_experts_add_a_dense_ffn_to_the_routed_output():
    torch.manual_seed(5)
    layer = MoE(D, None, num_experts=4, ffn_hidden_size=6, use_rts=False, num_shared_experts=2,
                shared_expert_ffn_hidden_size=3, activation="relu")
    shared = layer.shared_experts
    assert (shared.num_experts, shared.ffn_hidden_size) == (1, 6)  # 2 shared experts of width 3 = one of 6
    assert all(getattr(p, "allreduce", True) for p in shared.parameters())  # replicated: reduced over DP
    x = torch.randn(2, 5, D)
    out, _, _ = layer(x)
    plain = MoE(D, None, num_experts=4, ffn_hidden_size=6, use_rts=False, activation="relu")
    plain.load_state_dict({k: v for k, v in layer.state_dict().items() if not k.startswith("shared_experts")})
    flat = x.reshape(-1, D)
    dense = torch.relu(flat @ shared.w1[0]) @ shared.w2[0]  # w1 [1, D, 6], w2 [1, 6, D]
    torch.testing.assert_close(out, plain(x)[0] + dense.view_as(x))
    with pytest.raises(ValueError, match="use_residual"):
        MoE(D, None, num_experts=4, ffn_hidden_size=6, use_rts=False, num_shared_experts=1, use_residual=True)


def test_defaults_build_nothing_new():
    layer = MoE(D, None, num_experts=4, num_prototypes=2, ffn_hidden_size=D, use_rts=False)
    assert layer.balance is None and not hasattr(layer, "shared_experts") and layer.args.default_routing
    assert sorted(layer.state_dict()) == ["experts.w1", "experts.w2", "gate.weight"]


def test_config_block_reaches_every_lm_layer():
    block = MoEProtoConfig.model_validate({"num_experts": 8, "num_prototypes": 2, "top_k": 2,
                                           "expert_bias_update_rate": 0.01, "score_function": "sigmoid",
                                           "normalize_routes": True, "aux_loss_scope": "sequence",
                                           "num_shared_experts": 1, "shared_expert_ffn_hidden_size": 16})
    shape = MoEModelConfig.model_validate({"num_layers": 2, "d_model": 16, "num_heads": 2, "ffn_hidden_size": 32,
                                           "seq_len": 8})
    model = MoETransformerLM(MoETransformerArgs.from_configs(shape, block))
    (layer, ) = model.moe_layers()
    args = layer.args
    assert (args.expert_bias_update_rate, args.score_function, args.normalize_routes, args.aux_loss_scope,
            args.num_shared_experts, args.shared_expert_ffn_hidden_size) == (0.01, "sigmoid", True, "sequence", 1, 16)
    out = model(torch.randint(0, 256, (2, 8)), torch.randint(0, 256, (2, 8)))
    out.loss.backward()
    load = layer.balance.step_load.double().view(2, 4)
    assert int(load.sum()) == 2 * 8 * 2 * 2  # 16 tokens x 2 prototypes x top-2
    assert update_expert_biases(model) == 1
    want = 0.01 * torch.sign(load.mean(1, keepdim=True) - load).reshape(-1)
    torch.testing.assert_close(layer.balance.bias, want.float())
    with pytest.raises(ValueError, match="num_shared_experts"):
        MoEProtoConfig.model_validate({"num_experts": 4, "shared_expert_ffn_hidden_size": 8})
    with pytest.raises(ValueError, match="score_function"):
        MoEProtoConfig.model_validate({"num_experts": 4, "score_function": "tanh"})
