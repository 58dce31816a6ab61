"""Aux-loss-free load balancing: the expert bias, its update and its accumulation over micro-batches and ranks."""
import pytest
import torch
from torch import nn

from moe_proto import MoE, reset_expert_loads, route, update_expert_biases
from moe_proto.balance import ExpertBalance
from sparse_scale.multiproc import run_distributed

D, E, P, RATE = 8, 4, 2, 0.25


def _layer(rate=RATE, ep_size=1, **kw):
    return MoE(D, None, num_experts=E, ep_size=ep_size, num_prototypes=P, ffn_hidden_size=D, capacity_factor=1.0,
               min_capacity=0, use_rts=False, expert_bias_update_rate=rate, **kw)


def test_apply_load_moves_each_prototype_towards_its_own_mean():
    balance = ExpertBalance(4, 2, update_rate=0.5)
    balance.apply_load(torch.tensor([5, 1, 2, 2]))  # means 3 and 2: expert 0 over, 1 under, 2 and 3 even
    assert balance.bias.tolist() == [-0.5, 0.5, 0.0, 0.0]
    balance.apply_load(torch.tensor([0, 6, 3, 1]))
    assert balance.bias.tolist() == [0.0, 0.0, -0.5, 0.5]


def test_bias_changes_the_choice_but_not_the_gate():
    logits = torch.tensor([[2.0, 1.0, 0.0, 0.5], [0.0, 0.1, 3.0, 0.0]])
    plain = route(logits, num_prototypes=2, capacity_factor=None)
    bias = torch.tensor([0.0, 0.5, 0.0, 0.0])  # softmax [2, 1] -> [0.731, 0.269]: +0.5 makes expert 1 win
    biased = route(logits, num_prototypes=2, capacity_factor=None, expert_bias=bias)
    assert plain.expert_index.tolist() == [[0, 3], [1, 2]]
    assert biased.expert_index.tolist() == [[1, 3], [1, 2]]
    p01 = torch.softmax(logits[0, :2], 0)
    p23 = torch.softmax(logits[0, 2:], 0)
    torch.testing.assert_close(biased.gate[0], torch.stack([p01[1], p23[1]]))  # unbiased probability of expert 1
    torch.testing.assert_close(biased.gate[1], plain.gate[1])
    # The aux loss counts the biased choice (f) against unbiased probabilities (p).
    f = torch.tensor([[0.0, 1.0], [0.5, 0.5]])
    p = torch.softmax(logits.view(2, 2, 2), -1).mean(0)
    torch.testing.assert_close(biased.aux_loss, (2 * (f * p).sum(-1)).mean())


def test_bias_with_noise_or_wrong_shape_is_an_error():
    logits = torch.randn(4, 4)
    with pytest.raises(ValueError, match="expert_bias must be"):
        route(logits, expert_bias=torch.zeros(3))
    with pytest.raises(ValueError, match="selection_noise"):
        route(logits, top_k=2, expert_bias=torch.zeros(4), selection_noise=torch.zeros(4, 4))
    with pytest.raises(ValueError, match="noisy choice"):
        MoE(D, None, num_experts=4, k=2, ffn_hidden_size=D, use_rts=False, expert_bias_update_rate=0.1)
    with pytest.raises(ValueError, match="expert_bias_update_rate"):
        _layer(rate=-1.0)
    with pytest.raises(ValueError, match="deepspeed_compat"):
        MoE(D, None, num_experts=4, ffn_hidden_size=D, use_rts=False, deepspeed_compat=True,
            expert_bias_update_rate=0.1)


def test_layer_accumulates_training_loads_over_micro_batches_and_updates_once():
    torch.manual_seed(0)
    layer = _layer()
    batches = [torch.randn(3, 5, D) for _ in range(3)]
    expected = torch.zeros(E, dtype=torch.long)
    for x in batches:
        _, _, counts = layer(x)
        expected += counts
    layer.eval()
    layer(torch.randn(2, 5, D))  # eval forwards do not count
    layer.train()
    assert torch.equal(layer.balance.step_load, expected)
    assert update_expert_biases(nn.Sequential(layer)) == 1
    load = expected.double().view(P, -1)
    want = RATE * torch.sign(load.mean(1, keepdim=True) - load).reshape(-1)
    torch.testing.assert_close(layer.balance.bias, want.float())
    assert int(layer.balance.step_load.sum()) == 0
    # The next step routes with the bias: selection of score + bias, exactly as route() does.
    x = torch.randn(4, D)
    logits = layer.gate(x).float()
    rec = route(logits, num_prototypes=P, capacity_factor=1.0, min_capacity=0, expert_bias=layer.balance.bias)
    _, _, counts = layer(x)
    assert torch.equal(counts, rec.routed_per_expert)


def test_bias_is_a_saved_buffer_and_off_means_no_state():
    layer = _layer()
    state = layer.state_dict()  # the router (registered as gate) holds the balance state
    assert "gate.balance.bias" in state and "gate.balance.step_load" not in state
    layer.gate.balance.bias.fill_(0.5)
    fresh = _layer()
    fresh.load_state_dict({k.replace("gate.balance.", "balance."): v for k, v in state.items()})  # keys of before
    torch.testing.assert_close(fresh.balance.bias, torch.full_like(fresh.balance.bias, 0.5))
    off = _layer(rate=0.0)
    assert off.balance is None and not list(off.buffers())
    assert update_expert_biases(off) == 0


def test_reset_drops_the_step_without_moving_the_bias():
    layer = _layer()
    layer(torch.randn(2, 4, D))
    reset_expert_loads(layer)
    assert int(layer.balance.step_load.sum()) == 0 and float(layer.balance.bias.abs().sum()) == 0


# --- 2 ranks, expert parallel, DeepSpeed with gradient accumulation 2: loads summed over ranks and micro-batches.
WORLD, GA, B, S = 2, 2, 2, 6


class _Net(nn.Module):
    def __init__(self, ep_size):
        super().__init__()
        self.moe = _layer(ep_size=ep_size)

    def forward(self, x):
        return self.moe(x)[0].square().mean()


def _data(rank, micro):
    return torch.randn(B, S, D, generator=torch.Generator().manual_seed(100 * rank + micro))


def _engine(ep_size):
    import deepspeed
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    from moe_proto.checkpoint import load_full_state_dict

    torch.manual_seed(0)
    full = _Net(1)
    model = _Net(ep_size)
    if ep_size > 1:
        model.moe.set_deepspeed_parallelism()
    load_full_state_dict(model, full.state_dict())
    params = split_params_into_different_moe_groups_for_optimizer({"params": list(model.parameters()),
                                                                   "name": "params"})
    cfg = {"train_micro_batch_size_per_gpu": B, "gradient_accumulation_steps": GA, "steps_per_print": 10**6,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=params, config=cfg)
    return engine


def _ranks(rank, world, ckpt_dir):
    import deepspeed

    from moe_proto.checkpoint import load_checkpoint, save_checkpoint

    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")
    engine = _engine(ep_size=2)
    applied = []
    for micro in range(GA):
        engine.backward(engine(_data(rank, micro)))
        engine.step()
        applied.append(engine.was_step_applied())
    updated = update_expert_biases(engine.module)
    bias = engine.module.moe.balance.bias.clone()
    save_checkpoint(engine, ckpt_dir, "t")
    other = _engine(ep_size=1)  # reload at another ep_size: the bias is replicated, not sharded
    load_checkpoint(other, ckpt_dir, "t")
    torch.manual_seed(0)
    scoped = _layer(rate=0.0, aux_loss_scope="global_batch")  # counts all-reduced over the world in each forward
    aux = [float(scoped(_data(rank, micro))[1]) for micro in range(GA)]
    return {"applied": applied, "updated": updated, "bias": bias, "reloaded": other.module.moe.balance.bias.clone(),
            "global_aux": aux}


def test_two_ranks_sum_loads_over_ranks_and_micro_batches(tmp_path):
    results = run_distributed(_ranks, world_size=WORLD, args=(str(tmp_path), ), timeout_s=50)
    torch.manual_seed(0)
    reference = _Net(1).moe  # same init; the first step routes without bias, so the loads are those of one process
    load = torch.zeros(E, dtype=torch.long)
    for rank in range(WORLD):
        for micro in range(GA):
            load += reference(_data(rank, micro))[2]
    grouped = load.double().view(P, -1)
    want = (RATE * torch.sign(grouped.mean(1, keepdim=True) - grouped)).reshape(-1).float()
    assert float(want.abs().sum()) > 0  # the data is unbalanced enough for the test to mean something
    torch.manual_seed(0)
    scoped = _layer(rate=0.0)
    counts = {(rank, micro): scoped(_data(rank, micro))[2] for rank in range(WORLD) for micro in range(GA)}
    for rank, r in enumerate(results):
        for micro in range(GA):  # f: every rank's micro-batches up to this one; p: this rank's own tokens
            f = sum(counts[(q, m)] for q in range(WORLD) for m in range(micro + 1)).double().view(P, -1)
            f = f / (WORLD * (micro + 1) * B * S)
            logits = scoped.gate(_data(rank, micro).reshape(-1, D)).detach().double()
            p = torch.softmax(logits.view(-1, P, E // P), -1).mean(0)
            assert r["global_aux"][micro] == pytest.approx(float((E // P * (f * p).sum(-1)).mean()), rel=1e-5)
    for r in results:
        assert r["applied"] == [False, True] and r["updated"] == 1
        torch.testing.assert_close(r["bias"], want)
        torch.testing.assert_close(r["reloaded"], want)


def test_engine_step_moves_the_bias_or_drops_a_skipped_step():
    from types import SimpleNamespace

    from moe_proto.config import MoEProtoConfig
    from sparse_scale.engine import SparseEngine
    from sparse_scale.rec.moe_tower import MoETower

    def engine(applied: bool) -> SparseEngine:  # DeepSpeed's engine at a boundary, its step applied or skipped
        inner = SimpleNamespace(module=tower, is_gradient_accumulation_boundary=lambda: True, step=lambda: None,
                                was_step_applied=lambda: applied)
        return SparseEngine(inner, gba=False, sparse_lr=None)

    torch.manual_seed(0)
    tower = MoETower(16, (8, 8), MoEProtoConfig(num_experts=4, num_prototypes=2, expert_bias_update_rate=0.5))
    balance = tower.moe["1"].balance
    tower(torch.randn(32, 16))
    engine(applied=False).step()  # fp16 overflow: nothing moves, the loads go
    assert float(balance.bias.abs().sum()) == 0 and int(balance.step_load.sum()) == 0
    tower(torch.randn(32, 16))
    load = balance.step_load.clone().double().view(2, 2)
    engine(applied=True).step()
    torch.testing.assert_close(balance.bias, (0.5 * torch.sign(load.mean(1, keepdim=True) - load)).reshape(-1).float())
    with pytest.raises(ValueError, match="no sequence dim"):
        MoETower(16, (8, 8), MoEProtoConfig(num_experts=4, aux_loss_scope="sequence"))


def test_lm_job_updates_and_checkpoints_the_biases(tmp_path):
    from tests.e2e.test_train_moe_lm import _config, _data, _job, _run_job

    steps, rate = 3, 0.01
    cfg = _config(tmp_path, expert_bias_update_rate=rate, score_function="sigmoid", normalize_routes=True,
                  num_shared_experts=1)
    (out, ) = run_distributed(_run_job, 1, args=(_job(cfg, _data(tmp_path), tmp_path / "a", steps), ), timeout_s=50,
                              init_process_group=False)
    saved = torch.load(f"{out['checkpoint']}/moe_proto/dense.pt", weights_only=False)["buffers"]
    assert sorted(saved) == ["blocks.0.ffn.gate.balance.bias", "blocks.1.ffn.gate.balance.bias"]
    for bias in saved.values():
        steps_taken = bias / rate  # every update moves each bias by -rate, 0 or +rate
        torch.testing.assert_close(steps_taken, steps_taken.round())
        assert float(steps_taken.abs().max()) <= steps and float(bias.abs().sum()) > 0
