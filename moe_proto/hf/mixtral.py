"""Run a Hugging Face Mixtral-style model's sparse MoE blocks on :class:`moe_proto.MoE`.

transformers 5.x's ``MixtralSparseMoeBlock.forward(hidden_states [B, S, d]) -> [B, S, d]``
returns the output only. The router logits reach ``MoeCausalLMOutputWithPast.router_logits``
through a forward hook on every ``MixtralTopKRouter`` (``OutputRecorder(..., index=0)``),
and ``MixtralForCausalLM`` turns them into ``aux_loss`` (``load_balancing_loss_func``, with the
attention mask) and adds ``router_aux_loss_coef * aux_loss`` to the loss when
``output_router_logits`` is on. :class:`MoEProtoSparseMoeBlock` keeps that contract: same
forward, same input jitter (``router_jitter_noise``, training only), and its router logits
go through a hooked :class:`RouterLogitsTap`, so the HF aux-loss path works unchanged.
moe_proto's own ``l_aux`` (plus ``z_loss_coef * z_loss``) is kept in ``last_aux_loss``.

Routing equivalence: HF Mixtral is dropless top-k over a softmax of all experts, the k
probabilities renormalised to sum to 1. moe_proto reproduces it with ``k=top_k,
dropless=True, score_function="softmax", normalize_routes=True`` and no routing noise
(``use_rts=False, top2_2nd_expert_sampling=False``); the experts are ``activation="swiglu"``
:class:`~moe_proto.GroupedExperts` (weights: :mod:`moe_proto.hf.convert`).

Example::

    from transformers import MixtralConfig, MixtralForCausalLM
    model = MixtralForCausalLM(MixtralConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                             num_attention_heads=4, num_key_value_heads=2,
                                             num_local_experts=4, vocab_size=100))
    replace_moe_blocks(model)        # 2: every layer's block now runs on moe_proto.MoE
    restore_hf_blocks(model)         # 2: back to MixtralSparseMoeBlock, same weights
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Dict, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..layer import MoE
from .convert import copy_grouped_experts_to_hf, hf_expert_shapes, load_hf_expert_weights

logger = logging.getLogger(__name__)

# Arguments that come from the HF block and cannot be overridden.
_FROM_HF = ("hidden_size", "expert", "num_experts", "ffn_hidden_size", "activation")
# Arguments that do not change the layer's output, so the equivalence probe still applies.
_OUTPUT_NEUTRAL = ("z_loss_coef", "aux_loss_scope")
_PROBE_TOKENS = 16


class RouterLogitsTap(nn.Module):
    """Identity on the router logits ``[tokens, experts]``; it exists to carry the output-recording hook."""

    def forward(self, router_logits: Tensor) -> Tensor:
        return router_logits


class MoEProtoSparseMoeBlock(nn.Module):
    """A drop-in for ``MixtralSparseMoeBlock`` that computes with :class:`moe_proto.MoE`.

    ``hf_block_class`` (the replaced class) is kept so :func:`restore_hf_blocks` can build it back.

    Example::

        block = MoEProtoSparseMoeBlock(MoE(32, num_experts=4, k=2, dropless=True, normalize_routes=True,
                                           use_rts=False, top2_2nd_expert_sampling=False,
                                           ffn_hidden_size=64, activation="swiglu"))
        out = block(torch.randn(2, 5, 32))   # [2, 5, 32]
    """

    def __init__(self, moe: MoE, jitter_noise: float = 0.0, hf_block_class: Optional[type] = None) -> None:
        super().__init__()
        if jitter_noise < 0:
            raise ValueError(f"jitter_noise must be >= 0, got {jitter_noise}")
        self.moe = moe
        self.top_k = moe.args.k
        self.jitter_noise = jitter_noise
        self.router_logits = RouterLogitsTap()
        self.hf_block_class = hf_block_class
        self.last_aux_loss: Optional[Tensor] = None

    def forward(self, hidden_states: Tensor) -> Tensor:
        """``[B, S, d]`` -> ``[B, S, d]``, like the HF block; router logits go to the tap."""
        if self.training and self.jitter_noise > 0:
            # HF scales the block input (router and experts alike); out of place here, same draws.
            noise = torch.empty_like(hidden_states).uniform_(1.0 - self.jitter_noise, 1.0 + self.jitter_noise)
            hidden_states = hidden_states * noise
        flat = hidden_states.reshape(-1, hidden_states.shape[-1])
        # The same logits moe_proto routes on, in the model dtype as HF's router returns them.
        self.router_logits(F.linear(flat, self.moe.gate.weight.to(flat.dtype)))
        output, l_aux, _ = self.moe(hidden_states)
        self.last_aux_loss = l_aux
        return output


def hf_equivalent_moe_kwargs(block: nn.Module) -> Dict[str, Any]:
    """The :class:`moe_proto.MoE` arguments that reproduce a Mixtral-style block's routing and experts.

    Example::

        hf_equivalent_moe_kwargs(model.model.layers[0].mlp)["k"]   # config.num_experts_per_tok
    """
    router, experts = _router_and_experts(block)
    num_experts, hidden, ffn = hf_expert_shapes(experts)
    top_k = getattr(router, "top_k", getattr(block, "top_k", None))
    if not isinstance(top_k, int) or top_k < 1:
        raise ValueError(f"{type(block).__name__}: cannot read top_k from its router or block")
    # Mixtral always renormalises; Qwen-MoE style routers say so with norm_topk_prob.
    normalize = bool(getattr(router, "norm_topk_prob", True))
    return dict(hidden_size=hidden, num_experts=num_experts, k=top_k, ffn_hidden_size=ffn, activation="swiglu",
                dropless=True, score_function="softmax", normalize_routes=normalize, use_rts=False,
                top2_2nd_expert_sampling=False, noisy_gate_policy=None)


def moe_block_from_hf(block: nn.Module, check: bool = True, **moe_kwargs: Any) -> MoEProtoSparseMoeBlock:
    """Build a :class:`MoEProtoSparseMoeBlock` with a copy of ``block``'s router and expert weights.

    ``moe_kwargs`` override :func:`hf_equivalent_moe_kwargs` (e.g. ``dropless=False,
    capacity_factor=1.25`` or ``z_loss_coef``). With ``check`` and no output-changing
    override, an fp32 block's output is compared with the new block's on a probe batch
    (eval mode) and a mismatch raises.

    Example::

        new = moe_block_from_hf(model.model.layers[0].mlp)
    """
    fixed = sorted(set(moe_kwargs) & set(_FROM_HF))
    if fixed:
        raise ValueError(f"moe_kwargs {fixed} come from the HF block ({type(block).__name__}) and cannot be set")
    if moe_kwargs.get("ep_size", 1) != 1:
        raise ValueError(f"ep_size={moe_kwargs['ep_size']}: convert with ep_size=1 (every rank holds every expert); "
                         "expert-parallel HF models are not supported by the converter")
    router, experts = _router_and_experts(block)
    kwargs = hf_equivalent_moe_kwargs(block)
    kwargs.update(moe_kwargs)
    weight = router.weight
    moe = MoE(kwargs.pop("hidden_size"), **kwargs).to(device=weight.device, dtype=weight.dtype)
    with torch.no_grad():
        moe.gate.weight.copy_(weight)
    load_hf_expert_weights(moe.experts, experts)
    new = MoEProtoSparseMoeBlock(moe, float(getattr(block, "jitter_noise", 0.0) or 0.0), type(block))
    new.train(block.training)
    if check and all(k in _OUTPUT_NEUTRAL for k in moe_kwargs):
        check_same_output(block, new)
    return new


def hf_block_from_moe(block: MoEProtoSparseMoeBlock, config: Any,
                      hf_block_class: Optional[Callable[[Any], nn.Module]] = None) -> nn.Module:
    """Build the HF block (``hf_block_class(config)``, default the class it replaced) with ``block``'s weights.

    Example::

        hf = hf_block_from_moe(model.model.layers[0].mlp, model.config)   # a MixtralSparseMoeBlock
    """
    cls = hf_block_class or block.hf_block_class
    if cls is None:
        raise ValueError("the block does not record the HF class it replaced: pass hf_block_class")
    moe = block.moe
    if moe.ep_size != 1 or moe.args.use_residual or moe.args.num_shared_experts:
        raise ValueError("only ep_size=1 MoE layers without residual/shared experts map onto an HF Mixtral block")
    weight = moe.gate.weight
    with torch.device(weight.device):
        hf = cls(config).to(dtype=weight.dtype)
    router, experts = _router_and_experts(hf)
    if tuple(router.weight.shape) != tuple(weight.shape):
        raise ValueError(f"{cls.__name__}(config) has a router of shape {tuple(router.weight.shape)}, the MoE "
                         f"layer's is {tuple(weight.shape)}: the config does not match")
    with torch.no_grad():
        router.weight.copy_(weight)
    copy_grouped_experts_to_hf(moe.experts, experts)
    hf.train(block.training)
    return hf


def replace_moe_blocks(model: nn.Module, check: bool = True, **moe_kwargs: Any) -> int:
    """Replace every Mixtral-style sparse MoE block of ``model`` in place; returns how many.

    A block is any module with a ``gate`` router (``weight [E, d]``, ``top_k``) and fused
    ``experts`` (``gate_up_proj``/``down_proj``) and nothing else. See
    :func:`moe_block_from_hf` for ``check`` and ``moe_kwargs``. Call it before handing the
    model to ``Trainer`` / ``deepspeed.initialize`` (the optimizer must see the new parameters).

    Example::

        n = replace_moe_blocks(model, z_loss_coef=1e-3)
    """
    replaced = 0
    for parent, name, child in list(_named_children_deep(model)):
        if isinstance(child, MoEProtoSparseMoeBlock) or not _is_sparse_moe_block(child):
            continue
        new = moe_block_from_hf(child, check=check, **moe_kwargs)
        setattr(parent, name, new)
        _hook_router_logits(model, new.router_logits)
        replaced += 1
    logger.info("replaced %d sparse MoE block(s) of %s with moe_proto.MoE", replaced, type(model).__name__)
    return replaced


def restore_hf_blocks(model: nn.Module) -> int:
    """Turn every :class:`MoEProtoSparseMoeBlock` of ``model`` back into its HF block (same weights); returns how many.

    Example::

        restore_hf_blocks(model); model.save_pretrained("out")   # HF's own checkpoint layout
    """
    config = getattr(model, "config", None)
    if config is None:
        raise ValueError(f"{type(model).__name__} has no .config to build the HF blocks from")
    restored = 0
    for parent, name, child in list(_named_children_deep(model)):
        if isinstance(child, MoEProtoSparseMoeBlock):
            hf = hf_block_from_moe(child, config)
            setattr(parent, name, hf)
            _hook_recorded_modules(model, hf)
            restored += 1
    return restored


def check_same_output(hf_block: nn.Module, block: MoEProtoSparseMoeBlock, atol: float = 1e-5) -> None:
    """Raise if the two blocks disagree on a probe batch (eval mode, own RNG); fp32/fp64 weights only.

    Example::

        check_same_output(model.model.layers[0].mlp, moe_block_from_hf(model.model.layers[0].mlp, check=False))
    """
    weight = block.moe.gate.weight
    if weight.dtype not in (torch.float32, torch.float64):
        logger.info("skipping the HF equivalence probe for %s weights (top-k ties differ by rounding)", weight.dtype)
        return
    generator = torch.Generator(device=weight.device).manual_seed(0)
    probe = torch.randn(1, _PROBE_TOKENS, block.moe.args.hidden_size, generator=generator, device=weight.device,
                        dtype=weight.dtype)
    modes = hf_block.training, block.training
    hf_block.eval()
    block.eval()
    try:
        with torch.no_grad():
            ref, ours = hf_block(probe.clone()), block(probe.clone())  # HF's jitter works in place: own copies
    finally:
        hf_block.train(modes[0])
        block.train(modes[1])
    ref = ref[0] if isinstance(ref, tuple) else ref
    if ref.shape != ours.shape or not torch.allclose(ref, ours, rtol=1e-4, atol=atol):
        diff = (ref - ours).abs().max().item() if ref.shape == ours.shape else float("nan")
        raise ValueError(f"{type(hf_block).__name__} and its moe_proto conversion disagree on a probe batch "
                         f"(max abs diff {diff:.3g}): its router is not softmax top-k (renormalised) over "
                         "SwiGLU experts; pass check=False and routing arguments that match it")


def _router_and_experts(block: nn.Module) -> tuple:
    router, experts = getattr(block, "gate", None), getattr(block, "experts", None)
    if router is None or experts is None or not isinstance(getattr(router, "weight", None), Tensor):
        raise ValueError(f"{type(block).__name__} is not a Mixtral-style sparse MoE block (needs .gate with a "
                         ".weight and .experts)")
    return router, experts


def _is_sparse_moe_block(module: nn.Module) -> bool:
    """Mixtral-style: exactly a ``gate`` router and fused ``experts`` (shared experts etc. are not converted)."""
    names = {name for name, _ in module.named_children()}
    if names != {"gate", "experts"}:
        return False
    return (isinstance(getattr(module.gate, "weight", None), Tensor)
            and isinstance(getattr(module.experts, "gate_up_proj", None), Tensor))


def _named_children_deep(model: nn.Module):
    """``(parent, name, child)`` for every module below ``model`` (callers list it before replacing any)."""
    for parent in model.modules():
        for name, child in parent.named_children():
            yield parent, name, child


def _recording_specs(model: nn.Module) -> list:
    """``(submodel, key, OutputRecorder)`` of every HF submodel that records outputs (``_can_record_outputs``)."""
    from transformers.utils.output_capturing import OutputRecorder

    specs = []
    for sub in model.modules():
        table = getattr(type(sub), "_can_record_outputs", None) or {}
        for key, entries in table.items():
            for entry in entries if isinstance(entries, list) else [entries]:
                if isinstance(entry, OutputRecorder):
                    specs.append((sub, key, entry))
    return specs


def _install_hook(module: nn.Module, key: str, index: int) -> None:
    try:  # the name (sic) is transformers 5.x's; our tap has no class for OutputRecorder to match
        from transformers.utils.output_capturing import install_output_capuring_hook as install
    except ImportError as exc:  # pragma: no cover - depends on the installed transformers
        raise ImportError("moe_proto.hf needs transformers 5.x's output_capturing hooks (pinned in "
                          "constraints.txt)") from exc
    install(module, key, index)


def _hook_router_logits(model: nn.Module, tap: RouterLogitsTap) -> None:
    """Record the tap's output as ``router_logits``, once, if the model records router logits at all."""
    if getattr(tap, "_moe_proto_hooked", False):
        return
    if any(key == "router_logits" for _, key, _ in _recording_specs(model)):
        _install_hook(tap, "router_logits", 0)
        tap._moe_proto_hooked = True


def _hook_recorded_modules(model: nn.Module, new: nn.Module) -> None:
    """Hook a restored HF block's modules if the model already installed its hooks (it installs them once)."""
    for sub, key, spec in _recording_specs(model):
        if not getattr(sub, "_output_capturing_hooks_installed", False) or spec.target_class is None:
            continue
        for module in new.modules():
            if isinstance(module, spec.target_class):
                _install_hook(module, key, spec.index)


__all__ = ["MoEProtoSparseMoeBlock", "RouterLogitsTap", "hf_equivalent_moe_kwargs", "moe_block_from_hf",
           "hf_block_from_moe", "replace_moe_blocks", "restore_hf_blocks", "check_same_output"]
