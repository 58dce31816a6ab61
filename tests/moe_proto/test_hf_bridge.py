"""moe_proto.hf: Mixtral-style HF blocks on moe_proto.MoE, the weight converter, and Trainer + DeepSpeed.

Models are tiny ``MixtralForCausalLM`` built from a local ``MixtralConfig`` (random init, no
download). Checked: HF block -> moe_proto -> HF round trip and the converted block against the
HF block it came from (outputs, router logits, HF's aux loss, gradients), the converter's
errors, and a few ``transformers.Trainer`` steps with a DeepSpeed JSON (ZeRO 0-2, gloo, 1 and
2 real processes) whose loss - including ``router_aux_loss_coef * aux_loss`` - goes down.
"""
import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from transformers import MixtralConfig, MixtralForCausalLM  # noqa: E402
from transformers.models.mixtral.modeling_mixtral import MixtralExperts, MixtralSparseMoeBlock  # noqa: E402

from moe_proto import GroupedExperts  # noqa: E402
from moe_proto.hf import (MoEProtoSparseMoeBlock, copy_grouped_experts_to_hf, grouped_experts_from_hf,  # noqa: E402
                          hf_block_from_moe, moe_block_from_hf, replace_moe_blocks, restore_hf_blocks)
from sparse_scale.multiproc import run_distributed  # noqa: E402

VOCAB = 64


def tiny_config(**overrides):
    kw = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, vocab_size=VOCAB,
              max_position_embeddings=64, router_jitter_noise=0.0, router_aux_loss_coef=0.02)
    kw.update(overrides)
    return MixtralConfig(**kw)


def tiny_model(seed=0, **overrides):
    torch.manual_seed(seed)
    return MixtralForCausalLM(tiny_config(**overrides))


def tokens(seed=1, batch=2, seq=12):
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("top_k", [1, 2, 3])
def test_block_matches_hf_block_outputs_and_gradients(top_k):
    torch.manual_seed(0)
    hf = MixtralSparseMoeBlock(tiny_config(num_experts_per_tok=top_k))
    torch.nn.init.normal_(hf.gate.weight, std=0.5)  # decisive routing, as after training
    torch.nn.init.normal_(hf.experts.gate_up_proj, std=0.2)
    torch.nn.init.normal_(hf.experts.down_proj, std=0.2)
    ours = moe_block_from_hf(hf)
    x = torch.randn(3, 7, 32)
    x_hf, x_ours = x.clone().requires_grad_(), x.clone().requires_grad_()
    ref, out = hf(x_hf), ours(x_ours)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    ref.square().sum().backward()
    out.square().sum().backward()
    torch.testing.assert_close(x_ours.grad, x_hf.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(ours.moe.gate.weight.grad, hf.gate.weight.grad, rtol=1e-4, atol=1e-5)
    gate_grad = hf.experts.gate_up_proj.grad
    ffn = 48
    torch.testing.assert_close(ours.moe.experts.w1.grad, gate_grad[:, :ffn].transpose(1, 2), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(ours.moe.experts.w3.grad, gate_grad[:, ffn:].transpose(1, 2), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(ours.moe.experts.w2.grad, hf.experts.down_proj.grad.transpose(1, 2),
                               rtol=1e-4, atol=1e-5)


def test_round_trip_hf_moe_proto_hf_keeps_weights_and_outputs():
    torch.manual_seed(0)
    config = tiny_config()
    hf = MixtralSparseMoeBlock(config)
    for p in hf.parameters():
        torch.nn.init.normal_(p, std=0.3)
    back = hf_block_from_moe(moe_block_from_hf(hf), config)
    assert type(back) is MixtralSparseMoeBlock
    for (name, a), (_, b) in zip(hf.named_parameters(), back.named_parameters()):
        assert torch.equal(a, b), name
    x = torch.randn(2, 5, 32)
    torch.testing.assert_close(back(x.clone()), hf(x.clone()), rtol=0, atol=0)


def test_experts_converter_both_ways_and_transposed_layout():
    torch.manual_seed(0)
    hf = MixtralExperts(tiny_config())
    torch.nn.init.normal_(hf.gate_up_proj)
    torch.nn.init.normal_(hf.down_proj)
    ours = grouped_experts_from_hf(hf, expert_group_name="ep_size_1")
    assert ours.activation == "swiglu" and ours.w1.group_name == "ep_size_1"
    x = torch.randn(6, 32)
    counts = torch.tensor([2, 0, 3, 1])
    rows = [x[:2], x[2:2], x[2:5], x[5:]]
    for e, r in enumerate(rows):  # expert e on its rows, through HF's own per-expert maths
        gate, up = torch.nn.functional.linear(r, hf.gate_up_proj[e]).chunk(2, dim=-1)
        want = torch.nn.functional.linear(hf.act_fn(gate) * up, hf.down_proj[e])
        start = int(counts[:e].sum())
        torch.testing.assert_close(ours(x, counts)[start:start + len(r)], want, rtol=1e-4, atol=1e-4)
    other = MixtralExperts(tiny_config())
    copy_grouped_experts_to_hf(ours, other)
    assert torch.equal(other.gate_up_proj, hf.gate_up_proj) and torch.equal(other.down_proj, hf.down_proj)
    # A transposed module ([E, d, 2I], [E, I, d]) holding the same experts converts to the same weights.
    transposed = copy.deepcopy(hf)
    transposed.is_transposed = True
    transposed.gate_up_proj = torch.nn.Parameter(hf.gate_up_proj.detach().transpose(1, 2).contiguous())
    transposed.down_proj = torch.nn.Parameter(hf.down_proj.detach().transpose(1, 2).contiguous())
    again = grouped_experts_from_hf(transposed)
    for name in ("w1", "w2", "w3"):
        assert torch.equal(getattr(again, name), getattr(ours, name)), name


def test_converter_errors_name_the_problem():
    config = tiny_config()
    gelu = MixtralExperts(tiny_config(hidden_act="gelu"))
    with pytest.raises(ValueError, match="not SiLU"):
        grouped_experts_from_hf(gelu)
    with pytest.raises(ValueError, match="activation='swiglu'"):
        copy_grouped_experts_to_hf(GroupedExperts(4, 32, 48, activation="gelu"), MixtralExperts(config))
    with pytest.raises(ValueError, match=r"\(experts, hidden, ffn\)=\(4, 32, 40\)"):
        copy_grouped_experts_to_hf(GroupedExperts(4, 32, 40, activation="swiglu"), MixtralExperts(config))
    with pytest.raises(ValueError, match="come from the HF block"):
        moe_block_from_hf(MixtralSparseMoeBlock(config), num_experts=8)
    with pytest.raises(ValueError, match="ep_size=2"):
        moe_block_from_hf(MixtralSparseMoeBlock(config), ep_size=2)
    with pytest.raises(ValueError, match="has no 'gate_up_proj'"):
        grouped_experts_from_hf(torch.nn.Linear(2, 2))


def test_equivalence_probe_rejects_routing_it_does_not_reproduce():
    torch.manual_seed(0)
    hf = MixtralSparseMoeBlock(tiny_config())
    torch.nn.init.normal_(hf.gate.weight, std=0.5)
    hf.gate.forward = lambda h: _unnormalised_router(hf.gate, h)  # top-k probabilities not renormalised
    with pytest.raises(ValueError, match="disagree on a probe batch"):
        moe_block_from_hf(hf)
    moe_block_from_hf(hf, check=False)  # the caller's decision: no probe


def _unnormalised_router(router, hidden):
    logits = torch.nn.functional.linear(hidden.reshape(-1, router.hidden_dim), router.weight)
    values, indices = logits.softmax(-1).topk(router.top_k, dim=-1)
    return logits, values, indices


def test_model_replace_and_restore_keep_loss_logits_and_aux_loss():
    model = tiny_model().eval()
    ids = tokens()
    ref = model(ids, labels=ids, output_router_logits=True)  # installs HF's recording hooks first
    assert replace_moe_blocks(model) == 2
    assert all(isinstance(layer.mlp, MoEProtoSparseMoeBlock) for layer in model.model.layers)
    out = model(ids, labels=ids, output_router_logits=True)
    torch.testing.assert_close(out.logits, ref.logits, rtol=1e-5, atol=1e-5)
    assert len(out.router_logits) == 2
    torch.testing.assert_close(out.router_logits[1], ref.router_logits[1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.aux_loss, ref.aux_loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.loss, ref.loss, rtol=1e-5, atol=1e-6)
    assert out.aux_loss > 0 and model.model.layers[0].mlp.last_aux_loss > 0
    assert model(ids, labels=ids).aux_loss is None  # output_router_logits off: HF adds nothing
    assert replace_moe_blocks(model) == 0  # already converted
    assert restore_hf_blocks(model) == 2
    back = model(ids, labels=ids, output_router_logits=True)
    assert len(back.router_logits) == 2  # the restored routers are hooked too
    torch.testing.assert_close(back.logits, ref.logits, rtol=1e-5, atol=1e-5)


def test_replace_before_any_recording_and_jitter_in_training():
    model = tiny_model(router_jitter_noise=0.1)
    replace_moe_blocks(model)  # jitter is off in eval mode, so the probe still compares exactly
    assert model.model.layers[0].mlp.jitter_noise == 0.1
    ids = tokens()
    out = model(ids, labels=ids, output_router_logits=True)
    assert len(out.router_logits) == 2 and out.router_logits[0].shape == (ids.numel(), 4)
    torch.manual_seed(5)
    a = model(ids).logits
    torch.manual_seed(6)
    b = model(ids).logits
    assert not torch.allclose(a, b)  # training-mode jitter draws differ
    model.eval()
    torch.testing.assert_close(model(ids).logits, model(ids).logits, rtol=0, atol=0)


DS_STEPS = 8


def _train_with_trainer(rank, world_size, stage, out_dir):
    import os

    from torch.utils.data import Dataset
    from transformers import Trainer, TrainingArguments

    class Repeat(Dataset):  # one fixed batch of token ids, so the loss must fall as the model fits it
        def __init__(self):
            self.ids = tokens(seed=3, batch=8, seq=16)

        def __len__(self):
            return 64

        def __getitem__(self, i):
            ids = self.ids[i % len(self.ids)]
            return {"input_ids": ids, "labels": ids}

    model = tiny_model(seed=0, output_router_logits=True, router_aux_loss_coef=0.05)
    replace_moe_blocks(model)
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    ds = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
          "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": 0.0, "torch_adam": True}},
          "zero_optimization": {"stage": stage}, "gradient_clipping": 1.0, "steps_per_print": 10 ** 6}
    args = TrainingArguments(output_dir=os.path.join(out_dir, f"r{rank}"), deepspeed=ds, use_cpu=True,
                             per_device_train_batch_size=4, max_steps=DS_STEPS, learning_rate=3e-3,
                             lr_scheduler_type="constant", logging_steps=1, report_to=[], save_strategy="no",
                             dataloader_num_workers=0, seed=0, disable_tqdm=True)
    trainer = Trainer(model=model, args=args, train_dataset=Repeat())
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    engine = trainer.model_wrapped
    changed = {k: not torch.equal(before[k], v.detach()) for k, v in trainer.model.named_parameters()}
    ids = tokens(seed=3, batch=8, seq=16)
    with torch.no_grad():
        out = trainer.model.eval()(ids, labels=ids)
    return {"losses": losses, "changed": changed, "aux": float(out.aux_loss), "engine": type(engine).__name__,
            "world": trainer.args.world_size, "zero_stage": engine.zero_optimization_stage(),
            "checksum": sum(float(p.detach().double().sum()) for p in trainer.model.parameters()),
            "moe_layers": bool(getattr(engine, "has_moe_layers", False))}


@pytest.mark.slow
@pytest.mark.parametrize("stage,world_size", [(0, 1), (2, 1), (1, 2)])
def test_trainer_with_deepspeed_json_trains_moe_proto_blocks(tmp_path, stage, world_size):
    results = run_distributed(_train_with_trainer, world_size=world_size, args=(stage, str(tmp_path)),
                              timeout_s=55)
    for res in results:
        assert res["engine"] == "DeepSpeedEngine" and res["moe_layers"]
        assert (res["world"], res["zero_stage"]) == (world_size, stage)
        losses = res["losses"]
        assert len(losses) == DS_STEPS
        assert losses[-1] < losses[0] * 0.9, losses
        assert res["aux"] > 0
        changed = res["changed"]
        assert changed["model.layers.0.mlp.moe.gate.weight"] and changed["model.layers.1.mlp.moe.experts.w1"]
        assert all(changed.values()), [k for k, v in changed.items() if not v]
    if world_size == 2:  # data parallel: both ranks end with the same weights
        assert results[0]["checksum"] == pytest.approx(results[1]["checksum"], rel=1e-6)
