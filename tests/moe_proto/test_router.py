"""One layer class tree and one declaration of the routing options (moe_proto.layer, moe_proto.router)."""
from __future__ import annotations

import dataclasses
import inspect
import pydoc

import pytest
import torch
from torch import nn

from moe_proto import MoE, MoEBase, Router, RouterConfig, ZeRO3MoE, routing
from moe_proto.args import MoEArgs
from moe_proto.config import MoEProtoConfig
from moe_proto.from_block import layer_kwargs, moe_layer
from moe_proto.router import BLOCK_FIXED, BLOCK_KEYS, ROUTER_FIELDS, router_config_of_block

D, E, FFN = 8, 4, 16
LAYER_ONLY = {"expert", "ep_fixed_splits", "zero_stage"}  # constructor arguments that are not MoEArgs fields


def test_the_signature_shows_every_argument_typed_with_its_default():
    params = inspect.signature(MoE).parameters
    names = list(params)
    assert names[:15] == ["hidden_size", "expert", "num_experts", "ep_size", "k", "capacity_factor",
                          "eval_capacity_factor", "min_capacity", "use_residual", "noisy_gate_policy", "drop_tokens",
                          "use_rts", "use_tutel", "enable_expert_tensor_parallelism", "top2_2nd_expert_sampling"]
    assert all(p.kind is not p.VAR_POSITIONAL and p.kind is not p.VAR_KEYWORD for p in params.values())
    assert all(p.annotation is not p.empty for p in params.values())
    assert all(p.default is not p.empty for name, p in params.items() if name != "hidden_size")
    # DeepSpeed's positional arguments keep DeepSpeed's defaults.
    from deepspeed.moe.layer import MoE as DeepSpeedMoE
    for name, p in inspect.signature(DeepSpeedMoE).parameters.items():
        if name in params and p.default is not p.empty:
            assert params[name].default == p.default, name
    assert inspect.signature(ZeRO3MoE) == inspect.signature(MoE)
    text = pydoc.render_doc(MoE, renderer=pydoc.plaintext)
    assert "num_prototypes: 'int' = 1" in text and "zero_stage" in text


def test_the_constructor_and_the_declaration_list_the_same_options():
    params = inspect.signature(MoE).parameters
    for field in dataclasses.fields(MoEArgs):
        assert field.name in params, f"MoEArgs.{field.name} is not an argument of MoE"
        if field.default is not dataclasses.MISSING:
            assert params[field.name].default == field.default, field.name
    assert set(params) - {f.name for f in dataclasses.fields(MoEArgs)} == LAYER_ONLY
    layer = MoE(D, None, num_experts=E, k=2, ffn_hidden_size=FFN, score_function="sigmoid", use_rts=False)
    assert layer.router is layer.gate and layer.gate.config is layer.args
    assert isinstance(layer.args, RouterConfig) and layer.args.router_config() == RouterConfig(
        **{name: getattr(layer.args, name) for name in ROUTER_FIELDS})


def test_a_routing_option_is_validated_once_where_it_is_declared():
    with pytest.raises(ValueError, match="score_function='cosine'"):
        RouterConfig(score_function="cosine")
    with pytest.raises(ValueError, match="score_function='cosine'"):
        MoE(D, None, num_experts=E, ffn_hidden_size=FFN, score_function="cosine")
    with pytest.raises(ValueError, match="moe_proto: .*score_function='cosine'|score_function"):
        MoEProtoConfig(num_experts=E, score_function="cosine")
    with pytest.raises(ValueError, match="use_rts must be True or False"):
        RouterConfig(use_rts="yes")
    with pytest.raises(ValueError, match="k=3 exceeds the 2 experts of each prototype"):
        MoEProtoConfig(num_experts=4, num_prototypes=2, top_k=3)


def test_a_block_the_layer_and_the_router_share_the_declaration():
    block = MoEProtoConfig(num_experts=8, num_prototypes=2, top_k=2, dropless=True, z_loss_coef=0.1,
                           score_function="sigmoid", normalize_routes=True)
    config = router_config_of_block(block)
    assert config.k == 2 and config.is_dropless and config.drop_policy is None and config.z_loss_coef == 0.1
    assert {name: getattr(config, name) for name in BLOCK_FIXED} == BLOCK_FIXED
    for name in ROUTER_FIELDS:  # every field the block has is read from it (k from top_k)
        key = BLOCK_KEYS.get(name, name)
        if name not in BLOCK_FIXED and key in MoEProtoConfig.model_fields and name != "drop_policy":
            assert getattr(config, name) == getattr(block, key), name
    layer = moe_layer(block, hidden_size=D, ffn_hidden_size=FFN)
    assert layer.gate.config.router_config() == config
    assert set(layer_kwargs(block)) <= set(inspect.signature(MoE).parameters)


def test_the_router_routes_as_the_pure_routing_functions_do():
    torch.manual_seed(0)
    config = RouterConfig(num_experts=E, k=2, capacity_factor=1.0, min_capacity=0, use_rts=True)
    router = Router(D, config)
    x = torch.randn(32, D)
    torch.manual_seed(1)
    out = router.route(x)
    logits = x @ router.weight.detach().t()
    torch.manual_seed(1)  # the same draws: second-expert Gumbel noise, then the RTS priorities
    noise = routing.gumbel_noise(logits.shape, logits.device)
    rts = torch.rand(32, 2)
    want = routing.route(logits, top_k=2, capacity_factor=1.0, min_capacity=0, rts_priority=rts,
                         selection_noise=noise, noise_from_choice=1)
    assert torch.equal(out.record.expert_index, want.expert_index) and torch.equal(out.record.slot, want.slot)
    torch.testing.assert_close(out.record.gate, want.gate)
    router.eval()  # eval: no noise, no RTS, the eval capacity factor
    torch.testing.assert_close(router.route(x).record.gate,
                               routing.route(logits, top_k=2, capacity_factor=1.0, min_capacity=0).gate)
    torch.testing.assert_close(router(x), logits)  # forward gives the logits, as the nn.Linear gate did
    with pytest.raises(TypeError, match="RouterConfig"):
        Router(D, {"num_experts": E})


def test_the_gate_weight_keeps_its_key_and_its_initialisation():
    torch.manual_seed(3)
    layer = MoE(D, None, num_experts=E, ffn_hidden_size=FFN)
    torch.manual_seed(3)
    linear = nn.Linear(D, E, bias=False)
    assert torch.equal(layer.state_dict()["gate.weight"], linear.weight.detach())


class _Scaled(MoE):
    """A subclass overriding a stage and calling super(): what the old member copying could not do."""

    def combine(self, expert_output, plan, num_tokens):
        return 2.0 * super().combine(expert_output, plan, num_tokens)


def test_subclasses_override_stages_with_super():
    torch.manual_seed(0)
    plain = MoE(D, None, num_experts=E, ffn_hidden_size=FFN, use_rts=False)
    torch.manual_seed(0)
    scaled = _Scaled(D, None, num_experts=E, ffn_hidden_size=FFN, use_rts=False)
    x = torch.randn(2, 5, D)
    torch.testing.assert_close(scaled(x)[0], 2.0 * plain(x)[0])
    assert isinstance(scaled, MoEBase)
    with pytest.raises(TypeError, match="MoEBase holds the shared stages"):
        MoEBase(D, None, num_experts=E, ffn_hidden_size=FFN)


def test_the_docs_class_layout_example_runs():
    """docs/moe.md, "The class layout": the snippet as shown."""
    config = RouterConfig(num_experts=8, k=2, use_rts=False)
    router = Router(64, config)  # a layer's gate, on its own
    layer = MoE(64, None, num_experts=8, k=2, use_rts=False, ffn_hidden_size=128)
    assert layer.gate.config.router_config() == config  # the layer's router, from the same declaration
    assert router.weight.shape == layer.gate.weight.shape == (8, 64)
