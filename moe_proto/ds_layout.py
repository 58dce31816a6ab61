"""DeepSpeed's state-dict layout for :class:`moe_proto.MoE`: the key mapping, both ways.

``deepspeed.moe.layer.MoE`` keys its weights ``deepspeed_moe.gate.wg.weight`` and
``deepspeed_moe.experts.deepspeed_experts.{i}.<the expert module's own keys>``, one set per
local expert; DeepSpeed's ``engine.save_checkpoint`` (``_save_moe_checkpoint``) writes one file per
global expert by matching those keys, and its ``load_checkpoint`` hands them back with local ids.
A layer whose ``state_dict_layout`` is ``"deepspeed"`` writes its state dict in that layout
(stacked experts sliced per expert, ``nn.Linear`` orientation); every layer loads both layouts.

The per-expert keys of stacked experts are the names of the expert module the layer copied
(``GroupedExperts.expert_keys``: ``{"w1": "0.weight", ...}`` for ``Sequential(Linear, act, Linear)``);
a layer that built its own experts names them ``fc1`` (``fc3``: the gated input) and ``fc2``.
Shared experts are written as ``shared_mlp.*``: DeepSpeed's save takes every key containing
``expert`` for a routed expert's.

Example::

    layer.state_dict_layout = "deepspeed"
    sorted(layer.state_dict())[:2]   # ['deepspeed_moe.experts.deepspeed_experts.0.0.bias', ...]
    with stacked_layout(model):
        model.state_dict()           # 'moe.experts.w1' [E_local, d, ffn], 'moe.gate.weight'
"""
from __future__ import annotations

import contextlib
from typing import Any, Dict, Iterator, List

import torch
from torch import Tensor, nn

GATE_KEY = "deepspeed_moe.gate.wg.weight"
EXPERTS_PREFIX = "deepspeed_moe.experts.deepspeed_experts."
SHARED_PREFIX = "shared_mlp."
LAYOUTS = ("deepspeed", "stacked")
_OWN_EXPERTS = "experts."


def check_layout(layout: str) -> str:
    if layout not in LAYOUTS:
        raise ValueError(f"state_dict_layout={layout!r} is not one of {LAYOUTS}")
    return layout


def _is_stacked(experts: nn.Module) -> bool:
    return hasattr(experts, "expert_keys")


def _rename_prefix(state: Dict[str, Any], old: str, new: str) -> None:
    for key in [k for k in state if k.startswith(old)]:
        state[new + key[len(old):]] = state.pop(key)


def to_deepspeed_keys(layer: nn.Module, state: Dict[str, Any], prefix: str, local_metadata: Any) -> None:
    """State-dict hook of the layer: rewrite its own keys into DeepSpeed's layout (when the layer uses it)."""
    if layer.state_dict_layout != "deepspeed":
        return
    if prefix + "gate.weight" in state:
        state[prefix + GATE_KEY] = state.pop(prefix + "gate.weight")
    _rename_prefix(state, prefix + "shared_experts.", prefix + SHARED_PREFIX)
    experts = layer.experts
    if not _is_stacked(experts):  # per-expert modules: experts.deepspeed_experts.{i}.* already
        _rename_prefix(state, prefix + _OWN_EXPERTS, prefix + "deepspeed_moe.experts.")
        return
    for name, expert_key in experts.expert_keys.items():
        value = state.pop(prefix + _OWN_EXPERTS + name, None)
        if value is None:
            continue
        for i in range(value.shape[0]):
            row = value[i].detach()
            state[f"{prefix}{EXPERTS_PREFIX}{i}.{expert_key}"] = (row.t() if row.dim() == 2 else row).contiguous()


def from_deepspeed_keys(layer: nn.Module, state: Dict[str, Any], prefix: str, local_metadata: Any, strict: bool,
                        missing_keys: List[str], unexpected_keys: List[str], error_msgs: List[str]) -> None:
    """Load pre-hook of the layer: DeepSpeed-layout keys become the layer's own (stacked keys pass through)."""
    if prefix + GATE_KEY in state:
        state[prefix + "gate.weight"] = state.pop(prefix + GATE_KEY)
    _rename_prefix(state, prefix + SHARED_PREFIX, prefix + "shared_experts.")
    experts = layer.experts
    ds_prefix = prefix + EXPERTS_PREFIX
    if not any(k.startswith(ds_prefix) for k in state):
        return
    if not _is_stacked(experts):
        _rename_prefix(state, prefix + "deepspeed_moe.experts.", prefix + _OWN_EXPERTS)
        return
    for name, expert_key in experts.expert_keys.items():
        keys = [f"{ds_prefix}{i}.{expert_key}" for i in range(experts.num_experts)]
        absent = [k for k in keys if k not in state]
        if len(absent) == len(keys):
            continue  # torch reports experts.<name> as missing
        if absent:
            error_msgs.append(f"{prefix}experts.{name}: the DeepSpeed-layout state has no {absent[0]} ({len(absent)} "
                              f"of the layer's {experts.num_experts} local experts missing): it was saved with "
                              "fewer experts per rank or another expert module")
            continue
        rows = [state.pop(k) for k in keys]
        state[prefix + _OWN_EXPERTS + name] = torch.stack([r.t() if r.dim() == 2 else r for r in rows])


@contextlib.contextmanager
def stacked_layout(model: nn.Module) -> Iterator[None]:
    """Within the block every MoE layer of ``model`` writes its state dict with its own (stacked) keys.

    Example::

        with stacked_layout(model):
            buffers = {k: v for k, v in model.state_dict().items() if k not in params}
    """
    layers = [m for m in model.modules() if getattr(m, "state_dict_layout", None) in LAYOUTS]
    saved = [m.state_dict_layout for m in layers]
    try:
        for m in layers:
            m.state_dict_layout = "stacked"
        yield
    finally:
        for m, layout in zip(layers, saved):
            m.state_dict_layout = layout


def expert_state(layer: nn.Module, index: int) -> Dict[str, Tensor]:
    """Local expert ``index`` of ``layer`` as DeepSpeed's expert module would hold it (its own keys).

    Example: ``expert_state(layer, 0)`` is ``{"0.weight": ..., "0.bias": ..., "2.weight": ..., "2.bias": ...}``.
    """
    out: Dict[str, Tensor] = {}
    experts = layer.experts
    if not _is_stacked(experts):
        return {k: v.detach() for k, v in experts.deepspeed_experts[index].state_dict().items()}
    for name, expert_key in experts.expert_keys.items():
        value = getattr(experts, name)
        if value is not None:
            row = value[index].detach()
            out[expert_key] = row.t() if row.dim() == 2 else row
    return out
