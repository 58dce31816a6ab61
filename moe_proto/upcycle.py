"""Sparse upcycling: start an MoE model from a dense checkpoint of the same shape.

Every expert of an MoE layer becomes a copy of the dense FFN it replaces (Komatsuzaki et
al., "Sparse Upcycling"), optionally plus Gaussian noise (own seed) so experts can
diverge; the router starts at zero (``router_std=0``) or small random weights. With a
zero router every expert scores the same, so a token's output is ``gate_sum * dense(x)``
where ``gate_sum`` is the total gate weight at uniform scores (1 for softmax top-k>1
renormalised; ``k/E`` for top-1 without renormalisation, times the number of prototypes).
``match_dense_output=True`` divides the copied down projections (``w2``) by that sum, so
a zero-router, noise-free, dropless upcycled model computes exactly the dense model.
With capacity limits a zero router sends every token to the same experts (ties pick the
lowest ids): train with ``router_std > 0`` or dropless.

Example::

    dense = MoETransformerLM(MoETransformerArgs(num_layers=2, d_model=32, num_heads=4, ffn_hidden_size=64))
    moe = upcycle_lm(dense, dense.args.replace(num_experts=4, top_k=2, moe_every=1, dropless=True))
"""
from __future__ import annotations

import logging
from typing import Optional

import torch
from torch import Tensor

from .experts import GroupedExperts
from .layer import MoEBase
from .models import MoETransformerArgs, MoETransformerLM

logger = logging.getLogger(__name__)

# Fields an upcycled model must share with its dense source (everything but the MoE settings).
_SHAPE_FIELDS = ("num_layers", "d_model", "num_heads", "ffn_hidden_size", "vocab_size", "max_seq_len", "positions",
                 "activation", "norm_eps")


def upcycle_experts(experts: GroupedExperts, w1: Tensor, w2: Tensor, w3: Optional[Tensor] = None,
                    noise_std: float = 0.0, seed: int = 0, scale: float = 1.0) -> None:
    """Fill every expert with the dense FFN ``(w1 [d, ffn], w2 [ffn, d], w3 [d, ffn] for swiglu)`` (in place).

    ``noise_std > 0`` adds ``N(0, noise_std^2)`` (relative to each weight's std) per expert
    from ``torch.Generator().manual_seed(seed)``; ``w2`` is multiplied by ``scale``.

    Example::

        upcycle_experts(moe.experts, fc1.weight.t(), fc2.weight.t(), noise_std=0.01, seed=1)
    """
    if noise_std < 0:
        raise ValueError(f"noise_std must be >= 0, got {noise_std}")
    if (w3 is None) != (experts.w3 is None):
        raise ValueError(f"experts use activation={experts.activation!r}: w3 must be given exactly for swiglu")
    if experts.b1 is not None:
        raise ValueError("upcycling fills bias-free experts only (the dense FFNs have no biases)")
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, dense, factor in (("w1", w1, 1.0), ("w2", w2, scale), ("w3", w3, 1.0)):
            if dense is None:
                continue
            target = getattr(experts, name)
            if tuple(dense.shape) != tuple(target.shape[1:]):
                raise ValueError(f"dense {name} has shape {tuple(dense.shape)}, the experts' is "
                                 f"{tuple(target.shape[1:])}")
            target.copy_((dense.detach() * factor).to(target.dtype).expand_as(target))
            if noise_std > 0:
                std = float(dense.detach().float().std()) * abs(factor)
                noise = torch.randn(target.shape, generator=generator) * (noise_std * std)
                target.add_(noise.to(device=target.device, dtype=target.dtype))


def zero_router_gate_sum(moe: MoEBase) -> float:
    """Total gate weight a token gets when every expert scores the same (a zero router, no expert bias).

    Example::

        zero_router_gate_sum(MoE(8, num_experts=4, k=2, ffn_hidden_size=16, dropless=True))   # 1.0
    """
    gate = moe.gate.weight
    saved, mode = gate.detach().clone(), moe.training
    moe.eval()
    try:
        with torch.no_grad():
            gate.zero_()
            record = moe.route(torch.zeros(1, moe.args.hidden_size, device=gate.device), sequence_length=1)
    finally:
        with torch.no_grad():
            gate.copy_(saved)
        moe.train(mode)
    return float(record.gate.sum())


def upcycle_dense_ffn(moe: MoEBase, w1: Tensor, w2: Tensor, w3: Optional[Tensor] = None, noise_std: float = 0.0,
                      seed: int = 0, router_std: float = 0.0, match_dense_output: bool = True) -> None:
    """Initialise ``moe`` (experts and router) from one dense FFN's weights, in ``x @ W`` orientation (in place).

    Works for any :class:`moe_proto.MoE`, including the HF bridge's blocks (``block.moe``).

    Example::

        upcycle_dense_ffn(moe, mlp.gate_proj.weight.t(), mlp.down_proj.weight.t(), mlp.up_proj.weight.t())
    """
    if router_std < 0:
        raise ValueError(f"router_std must be >= 0, got {router_std}")
    if moe.args.use_residual or moe.args.num_shared_experts:
        raise ValueError("upcycling copies the dense FFN into the routed experts; a layer with use_residual or "
                         "shared experts would add a second FFN: build it without them")
    with torch.no_grad():
        if router_std > 0:
            generator = torch.Generator().manual_seed(seed + 1)
            moe.gate.weight.copy_(torch.randn(moe.gate.weight.shape, generator=generator) * router_std)
        else:
            moe.gate.weight.zero_()
    scale = 1.0
    if match_dense_output:
        gate_sum = zero_router_gate_sum(moe)
        scale = 1.0 / gate_sum
        if abs(gate_sum - 1.0) > 1e-6:
            logger.info("upcycling: gates sum to %.4g at a zero router; expert down projections scaled by %.4g",
                        gate_sum, scale)
    upcycle_experts(moe.experts, w1, w2, w3, noise_std=noise_std, seed=seed, scale=scale)


def upcycle_lm(dense: MoETransformerLM, moe_args: MoETransformerArgs, noise_std: float = 0.0, seed: int = 0,
               router_std: float = 0.0, match_dense_output: bool = True) -> MoETransformerLM:
    """A new MoE :class:`MoETransformerLM` (``moe_args``) initialised from a dense one (``num_experts=0``).

    Every non-FFN weight and every dense FFN is copied; each MoE layer's experts copy the
    dense FFN of the same layer (see :func:`upcycle_dense_ffn`; layer ``i``'s noise seed is
    ``seed + layer``). ``moe_args`` must have the dense model's shape and
    ``expert_ffn_hidden_size`` equal to its ``ffn_hidden_size`` (or None), and ``ep_size=1``.

    Example::

        moe = upcycle_lm(dense, dense.args.replace(num_experts=8, top_k=2, dropless=True), noise_std=0.01)
    """
    src = dense.args
    if src.num_experts:
        raise ValueError(f"the source model has num_experts={src.num_experts}: upcycling starts from a dense model")
    diff = [f"{f}: dense {getattr(src, f)!r} vs moe {getattr(moe_args, f)!r}" for f in _SHAPE_FIELDS
            if getattr(src, f) != getattr(moe_args, f)]
    if moe_args.expert_ffn != src.ffn_hidden_size:
        diff.append(f"expert_ffn_hidden_size: moe {moe_args.expert_ffn} vs dense ffn_hidden_size "
                    f"{src.ffn_hidden_size}")
    if diff:
        raise ValueError("upcycle_lm: the MoE model must have the dense model's shape; differs in " + "; ".join(diff))
    if moe_args.ep_size != 1:
        raise ValueError(f"upcycle_lm builds the full model: use ep_size=1 (got {moe_args.ep_size}) and shard after")
    if moe_args.num_experts < 1:
        raise ValueError("upcycle_lm: moe_args.num_experts must be >= 1")
    param = next(dense.parameters())
    with torch.device(param.device):
        model = MoETransformerLM(moe_args).to(dtype=param.dtype)
    dense_state = dense.state_dict()
    target = model.state_dict()
    copied = {k: v for k, v in dense_state.items() if k in target and target[k].shape == v.shape}
    model.load_state_dict(copied, strict=False)
    for index, block in enumerate(model.blocks):
        if not block.is_moe:
            continue
        ffn = dense.blocks[index].ffn
        upcycle_dense_ffn(block.ffn, ffn.fc1.weight.t(), ffn.fc2.weight.t(),
                          None if ffn.fc3 is None else ffn.fc3.weight.t(), noise_std=noise_std, seed=seed + index,
                          router_std=router_std, match_dense_output=match_dense_output)
    missing = [k for k in target if k not in copied and not _is_moe_key(model, k)]
    if missing:
        raise ValueError(f"upcycle_lm: no dense weight for {missing}")
    logger.info("upcycled a dense %d-layer model into %d MoE layer(s) of %d experts", src.num_layers,
                moe_args.num_moe_layers, moe_args.num_experts)
    return model


def _is_moe_key(model: MoETransformerLM, key: str) -> bool:
    parts = key.split(".")
    return len(parts) > 3 and parts[0] == "blocks" and parts[2] == "ffn" and model.blocks[int(parts[1])].is_moe


__all__ = ["upcycle_experts", "upcycle_dense_ffn", "upcycle_lm", "zero_router_gate_sum"]
