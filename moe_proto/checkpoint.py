"""Checkpoints that load at any expert-parallel size: parameters and Adam state per global expert.

DeepSpeed's own ``engine.save_checkpoint`` works for :class:`moe_proto.MoE` under ZeRO 0-2
(the layer writes DeepSpeed's per-expert keys, :mod:`moe_proto.ds_layout`), but its ZeRO
optimizer files are flat partitions tied to the data-parallel size, so an ep_size change
cannot reload them (DeepSpeed #6589), and it does not save the ZeRO-3 layer.

This module writes its own topology-free checkpoint instead, one directory per tag::

    <save_dir>/<tag>/moe_proto/dense.pt            rank 0: non-expert params + optimizer moments, metadata
    <save_dir>/<tag>/moe_proto/experts_<a>-<b>.pt  per EP rank (expert-data-parallel rank 0): the
                                                   rows [a, b) of every stacked expert tensor + moments
                                                   (per-expert modules: expert g's tensors are row g of
                                                   ``<layer>.experts.deepspeed_experts.*.<key>``), and
                                                   the rows of the per-expert buffers (e.g. a BatchNorm's
                                                   running stats inside an expert module)

A model whose MoE layers differ in ``(num_experts, ep_size)`` (a PR-MoE pyramid) writes one file
per writer rank per distinct shape instead, ``experts_e<E>-ep<ep>_<a>-<b>.pt``: each holds the rows
[a, b) of the layers with ``num_experts == E`` saved at ``ep_size == ep``, written by those layers'
own expert-data-parallel rank 0. Loading reads each layer's rows from the files of its saved shape,
at any ep_size per layer; checkpoints with the single-range names load as before.

Every tensor is the full fp32 value (under ZeRO 1/2 assembled from each rank's flat
partition through the parameter's ``_hp_mapping`` addresses by
:mod:`sparse_core.zero_state`, like DeepSpeed's ``safe_get_full_*`` API but reading
the optimizer state directly; under ZeRO 3 gathered over the parameter's partition group
(the expert-data-parallel group for experts) with ``safe_get_full_fp32_param`` /
``safe_get_full_optimizer_state`` and written back per partition; without ZeRO from the
optimizer), so loading at another ``ep_size`` (or ZeRO stage 0-3, or world size) just
slices the rows of the experts a rank holds. Supported optimizers: Adam/AdamW (``exp_avg``,
``exp_avg_sq``, ``step`` per param group).
The param groups' scheduled hyperparameters (``lr``, ``betas``, ``momentum``) are saved too:
DeepSpeed's schedulers (e.g. ``WarmupLR``) restore only their iteration counter and would
leave the first resumed step at the initial lr.

Example::

    save_checkpoint(engine, "ckpt", tag="step100")        # on every rank (collective)
    # ... later, any ep_size / ZeRO stage 0-3:
    load_checkpoint(engine, "ckpt", tag="step100")        # on every rank
"""
from __future__ import annotations

import json
import logging
import os
import re
from typing import Any, Dict, Iterator, List, NamedTuple, Optional, Tuple

import torch
import torch.distributed as dist
from torch import Tensor, nn

from sparse_core.zero_state import (base_optimizer, is_partitioned, read_full_param,
                                         relink_zero_optimizer_states, write_param_fragment, zero_stage)

from .ds_layout import stacked_layout
from .experts import GroupedExperts
from .layer import MoEBase
from sparse_core.zero3_state import (flat_groups, gathered_value, is_zero3_param, read_full_state,
                                           write_full_state)

logger = logging.getLogger(__name__)

OPTIM_KEYS: Tuple[str, ...] = ("exp_avg", "exp_avg_sq")
# Param-group entries that LR/momentum schedulers write; restored on load, other settings come from the config.
SCHEDULED_KEYS: Tuple[str, ...] = ("lr", "betas", "momentum")
_SUBDIR = "moe_proto"
_EXPERT_FILE = re.compile(r"experts_(\d+)-(\d+)\.pt$")
_SHAPED_EXPERT_FILE = re.compile(r"experts_e(\d+)-ep(\d+)_(\d+)-(\d+)\.pt$")
Shape = Tuple[int, int]  # (num_experts, ep_size) of an MoE layer
_SINGLE, _PER_SHAPE = "single_range", "per_shape"  # meta["expert_layout"]: which expert file names


def expert_params(model: nn.Module) -> Dict[str, MoEBase]:
    """Map every expert parameter name (as in ``model.named_parameters()``) to its MoE layer.

    Stacked layers hold one tensor per projection (``experts.w1 [E_local, d, ffn]``); layers with
    per-expert modules one tensor per local expert and key (``experts.deepspeed_experts.{i}.<key>``).

    Example::

        expert_params(model)   # {"blocks.0.moe.experts.w1": <MoE>, ...}
    """
    owners: Dict[str, MoEBase] = {}
    for prefix, module in model.named_modules():
        if isinstance(module, MoEBase):
            for name, _ in module.experts.named_parameters():
                owners[f"{prefix}.experts.{name}" if prefix else f"experts.{name}"] = module
    return owners


def expert_buffers(model: nn.Module) -> Dict[str, MoEBase]:
    """Map every persistent buffer of an MoE layer's experts (as in ``model.state_dict()``) to its layer.

    These differ per expert (e.g. the running stats of a ``BatchNorm`` inside a per-expert module:
    local expert ``i``'s ``<key>`` is row ``i`` of ``<layer>.experts.deepspeed_experts.*.<key>``, as
    for parameters), so checkpoints save them per global expert, not from rank 0. Non-persistent
    buffers are not state and are left out, as ``state_dict`` does.

    Example::

        expert_buffers(model)   # {"moe.experts.deepspeed_experts.0.1.running_mean": <MoE>, ...}
    """
    owners: Dict[str, MoEBase] = {}
    for prefix, module in model.named_modules():
        if isinstance(module, MoEBase):
            params = {name for name, _ in module.experts.named_parameters()}
            for name in module.experts.state_dict():
                if name not in params:
                    owners[f"{prefix}.experts.{name}" if prefix else f"experts.{name}"] = module
    return owners


_PER_EXPERT = re.compile(r"^(?P<head>(?:.*\.)?experts\.deepspeed_experts\.)(?P<index>\d+)\.(?P<key>.+)$")


def expert_slot(name: str, layer: MoEBase) -> Tuple[str, Optional[int]]:
    """Where an expert parameter's (or per-expert buffer's) values go in a checkpoint: ``(stack name, local index)``.

    A stacked parameter is its own stack (index None). Local expert ``i``'s ``<key>`` of a per-expert
    layer is row ``i`` of the stack ``<prefix>.experts.deepspeed_experts.*.<key>``, so both kinds are
    written as rows of global experts and load at any ep size.

    Example::

        expert_slot("moe.experts.deepspeed_experts.1.norm.weight", layer)
        # ("moe.experts.deepspeed_experts.*.norm.weight", 1)
    """
    if isinstance(layer.experts, GroupedExperts):
        return name, None
    match = _PER_EXPERT.match(name)
    if match is None:  # ModuleExperts holds its copies in deepspeed_experts: nothing else is an expert parameter
        raise ValueError(f"{name}: not a per-expert parameter (experts.deepspeed_experts.<i>.<key>)")
    return f"{match['head']}*.{match['key']}", int(match["index"])


def global_expert_name(stack_name: str, global_id: int) -> str:
    """The per-expert name of global expert ``global_id`` in a stack named by :func:`expert_slot`."""
    return stack_name.replace("deepspeed_experts.*.", f"deepspeed_experts.{global_id}.", 1)


def load_full_state_dict(model: nn.Module, full_state: Dict[str, Tensor]) -> None:
    """Copy an ep_size-independent state (expert stacks over all E experts) into ``model``.

    Expert tensors are sliced to the rows ``model``'s layers hold (their ``expert_range``),
    everything else is copied as is; per-expert buffers (:func:`expert_buffers`) are taken from
    their global experts' keys like parameters. Used to start every ep_size from one full init,
    and by :func:`load_checkpoint`.

    Example::

        torch.manual_seed(0); full = build(ep_size=1)
        model = build(ep_size=2); model.set_deepspeed_parallelism()...
        load_full_state_dict(model, full.state_dict())
    """
    owners = expert_params(model)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if is_zero3_param(param):
                raise ValueError(f"load_full_state_dict: {name} is already partitioned by ZeRO-3; call it before "
                                 "deepspeed.initialize, or use load_checkpoint on the engine")
            param.copy_(_full_value(name, owners.get(name), full_state, "parameter"))
        buffers = dict(model.named_buffers())
        for name, layer in expert_buffers(model).items():
            buffers[name].copy_(_full_value(name, layer, full_state, "buffer"))


def _full_value(name: str, layer: Optional[MoEBase], full_state: Dict[str, Tensor], what: str) -> Tensor:
    """The value of ``name`` (a parameter or per-expert buffer of ``layer``) on this rank, from a full state."""
    stack, index = expert_slot(name, layer) if layer is not None else (name, None)
    key = name if index is None else global_expert_name(stack, layer.expert_range[0] + index)
    if key not in full_state:
        hint = (": the state is in DeepSpeed's layout; take it as `with "
                "moe_proto.ds_layout.stacked_layout(full): full.state_dict()`"
                if index is None and any(".deepspeed_experts." in k for k in full_state) else "")
        raise KeyError(f"{what} {key} is missing from the full state dict{hint}")
    return full_state[key] if index is not None else _local_rows(full_state[key], layer)


def full_state_dict(model: nn.Module) -> Dict[str, Tensor]:
    """All parameters, and the per-expert buffers, with expert stacks gathered over each layer's EP group.

    Collective over the EP groups (and under ZeRO-3 over each parameter's partition group:
    every rank must call it). Per-expert modules' tensors are keyed per global expert
    (``...deepspeed_experts.{g}...``). Example::

        state = full_state_dict(engine.module)     # state["moe.experts.w1"].shape[0] == num_experts
    """
    owners = expert_params(model)
    out: Dict[str, Tensor] = {}
    for name, param in model.named_parameters():
        _gather_into(out, name, gathered_value(param), owners.get(name))  # gathered_value: a copy
    buffers = dict(model.named_buffers())
    for name, layer in expert_buffers(model).items():  # the same order on every rank
        _gather_into(out, name, buffers[name].detach().clone(), layer)
    return out


def _gather_into(out: Dict[str, Tensor], name: str, value: Tensor, layer: Optional[MoEBase]) -> None:
    """Put ``value`` (this rank's) into ``out`` with every EP rank's rows (collective over ``layer``'s EP group)."""
    parts = [value]
    if layer is not None and layer.ep_size > 1:
        parts = [torch.empty_like(value) for _ in range(layer.ep_size)]
        dist.all_gather(parts, value.contiguous(), group=layer.ep_group)
    stack, index = expert_slot(name, layer) if layer is not None else (name, None)
    if index is None:
        out[name] = torch.cat(parts) if len(parts) > 1 else value
    else:  # per-expert modules: one key per global expert
        for ep_rank, part in enumerate(parts):
            out[global_expert_name(stack, ep_rank * layer.num_local_experts + index)] = part


def save_checkpoint(engine: Any, save_dir: str, tag: str) -> str:
    """Write parameters and Adam state, experts split per global expert rows (collective).

    Every MoE layer's expert rows (parameters, moments, per-expert buffers) are written by its
    own expert-data-parallel rank 0 for its own ``(num_experts, ep_size)``, so layers of
    different shapes (a PR-MoE pyramid) save too. Also re-links ZeRO's optimizer-state views
    (:func:`relink_zero_optimizer_states`). Returns the checkpoint directory. Example::

        path = save_checkpoint(engine, "ckpt", "step3")
    """
    model = engine.module
    owners, buffer_owners = expert_params(model), expert_buffers(model)
    # Decided from the model alone, the same on every rank (nothing here can fail on one rank only).
    shapes = {expert_slot(n, l)[0]: _shape(l) for n, l in {**owners, **buffer_owners}.items()}
    single = len(set(shapes.values())) <= 1  # one expert range per rank: the single-range file names
    relink_zero_optimizer_states(engine)
    path = os.path.join(save_dir, tag, _SUBDIR)
    rank = dist.get_rank()
    if rank == 0:
        os.makedirs(path, exist_ok=True)
    dist.barrier()
    dense: Dict[str, Dict[str, Tensor]] = {}
    experts: Dict[Shape, Dict[str, Dict[str, Tensor]]] = {}
    # Every rank walks the parameters in the same order: the full-state reads are collectives.
    rows: Dict[str, Dict[int, Dict[str, Tensor]]] = {}
    for name, param in model.named_parameters():
        entry = _read_param_state(engine, param)
        layer = owners.get(name)
        if layer is None:
            dense[name] = entry
            continue
        stack, index = expert_slot(name, layer)
        if index is None:
            experts.setdefault(shapes[stack], {})[stack] = entry
        else:
            rows.setdefault(stack, {})[index] = entry
    for stack, by_index in rows.items():  # per-expert modules: local expert i is row i, as in a stack
        experts.setdefault(shapes[stack], {})[stack] = {
            k: torch.stack([by_index[i][k] for i in range(len(by_index))]) for k in by_index[0]}
    buffer_rows = _expert_buffer_rows(model, buffer_owners, shapes)
    if rank == 0:
        groups = _param_group_states(engine)
        meta = {"step": max((g["step"] for g in groups), default=0.0),
                "global_steps": int(getattr(engine, "global_steps", 0)),
                "global_samples": int(getattr(engine, "global_samples", 0)),
                "param_groups": groups,
                "lr_scheduler": engine.lr_scheduler.state_dict() if getattr(engine, "lr_scheduler", None) else None,
                "experts": _shape_meta(owners),
                "expert_buffers": _shape_meta(buffer_owners),
                "expert_layout": _SINGLE if single else _PER_SHAPE}
        torch.save({"params": dense, "buffers": _persistent_buffers(model), "meta": meta},
                   os.path.join(path, "dense.pt"))
        with open(os.path.join(path, "meta.json"), "w") as f:
            # default=float: a tensor-valued lr stays readable.
            json.dump({k: v for k, v in meta.items() if k != "lr_scheduler"}, f, indent=1, default=float)
    layer_of_shape = {_shape(layer): layer for layer in {**owners, **buffer_owners}.values()}
    for shape, layer in sorted(layer_of_shape.items()):
        if _is_expert_writer(layer):
            first, last = layer.expert_range
            torch.save({"first": first, "last": last, "num_experts": shape[0], "ep_size": shape[1],
                        "params": experts.get(shape, {}), "buffers": buffer_rows.get(shape, {})},
                       os.path.join(path, _expert_file_name(shape, first, last, single)))
    dist.barrier()
    logger.info("saved moe_proto checkpoint to %s", path)
    return path


def load_checkpoint(engine: Any, load_dir: str, tag: str) -> Dict[str, Any]:
    """Load a :func:`save_checkpoint` directory into ``engine`` at any ep_size (collective).

    Sets parameters (model and ZeRO fp32 master copies), Adam moments and each param
    group's step, the per-expert buffers (each layer's rows, at its own ep_size),
    ``engine.global_steps``, the LR scheduler and the param groups' ``lr`` / ``betas`` /
    ``momentum``, then re-links ZeRO's optimizer-state views. Returns the checkpoint metadata.
    Example::

        meta = load_checkpoint(engine, "ckpt", "step3")
    """
    path = os.path.join(load_dir, tag, _SUBDIR)
    dense_file = os.path.join(path, "dense.pt")
    if not os.path.exists(dense_file):
        raise FileNotFoundError(f"no moe_proto checkpoint at {path} (dense.pt missing)")
    saved = torch.load(dense_file, map_location="cpu", weights_only=False)
    meta = saved["meta"]
    model = engine.module
    owners, buffer_owners = expert_params(model), expert_buffers(model)
    # Before any rank reads an expert file or touches its optimizer: from the model, dense.pt and the file
    # names only, so every rank decides the same and none waits in a collective while another raises.
    missing = [name for name in dict(model.named_parameters()) if name not in owners and name not in saved["params"]]
    if missing:
        raise KeyError(f"parameters {missing} are missing from the checkpoint at {path}")
    single = meta.get("expert_layout", _SINGLE) == _SINGLE  # checkpoints before pyramids: single-range names
    files = {f.name for f in expert_files(path)}
    plan = {**_read_plan(owners, meta["experts"], files, single, "params", path),
            **_read_plan(buffer_owners, meta.get("expert_buffers", {}), files, single, "buffers", path)}
    values = _read_expert_rows(path, plan)
    _materialize_optimizer_state(engine, _saved_group_steps(engine, meta))
    for name, param in model.named_parameters():
        if name in owners:
            stack, index = expert_slot(name, owners[name])
            entry = values[("params", stack)]
            if index is not None:
                entry = {k: v[index] for k, v in entry.items()}
        else:
            entry = saved["params"][name]
        _write_param_state(engine, param, entry)
    _load_buffers(model, saved.get("buffers", {}), path)
    _load_expert_buffers(model, buffer_owners, values, path)
    engine.global_steps = meta["global_steps"]
    engine.global_samples = meta["global_samples"]
    if meta.get("lr_scheduler") is not None and getattr(engine, "lr_scheduler", None) is not None:
        engine.lr_scheduler.load_state_dict(meta["lr_scheduler"])
    # After the scheduler: its load_state_dict leaves the groups' lr at the initial value.
    _restore_group_hyperparameters(engine, meta, path)
    relink_zero_optimizer_states(engine)
    dist.barrier()
    logger.info("loaded moe_proto checkpoint %s (saved at ep sizes %s)", path,
                sorted({v["ep_size"] for v in meta["experts"].values()}))
    return meta


def _shape(layer: MoEBase) -> Shape:
    return int(layer.num_experts), int(layer.ep_size)


def _shape_meta(owners: Dict[str, MoEBase]) -> Dict[str, Dict[str, int]]:
    """Per stack name: the saving layer's ``num_experts`` and ``ep_size`` (which expert files hold its rows)."""
    return {expert_slot(n, l)[0]: {"num_experts": l.num_experts, "ep_size": l.ep_size} for n, l in owners.items()}


def _expert_buffer_rows(model: nn.Module, buffer_owners: Dict[str, MoEBase],
                        shapes: Dict[str, Shape]) -> Dict[Shape, Dict[str, Tensor]]:
    """This rank's per-expert buffers as rows of their stacks (local expert i: row i), per layer shape."""
    buffers = dict(model.named_buffers())
    stacked: Dict[str, Tensor] = {}
    rows: Dict[str, Dict[int, Tensor]] = {}
    for name, layer in buffer_owners.items():
        stack, index = expert_slot(name, layer)
        value = buffers[name].detach().cpu().clone()
        if index is None:
            stacked[stack] = value
        else:
            rows.setdefault(stack, {})[index] = value
    for stack, by_index in rows.items():
        stacked[stack] = torch.stack([by_index[i] for i in range(len(by_index))])
    out: Dict[Shape, Dict[str, Tensor]] = {}
    for stack, value in stacked.items():
        out.setdefault(shapes[stack], {})[stack] = value
    return out


def _load_expert_buffers(model: nn.Module, buffer_owners: Dict[str, MoEBase],
                         values: Dict[Tuple[str, str], Any], path: str) -> None:
    buffers = dict(model.named_buffers())
    with torch.no_grad():
        for name, layer in buffer_owners.items():
            stack, index = expert_slot(name, layer)
            value = values[("buffers", stack)]
            value = value[index] if index is not None else value
            if tuple(value.shape) != tuple(buffers[name].shape):
                raise ValueError(f"{name}: checkpoint buffer has shape {tuple(value.shape)}, the model's "
                                 f"{tuple(buffers[name].shape)} ({path})")
            buffers[name].copy_(value)


def _persistent_buffers(model: nn.Module) -> Dict[str, Tensor]:
    """The MoE layers' replicated persistent buffers (the expert biases: full [E], the same on every rank; rank 0's
    saved); per-expert buffers (:func:`expert_buffers`) are not among them."""
    out: Dict[str, Tensor] = {}
    per_expert = expert_buffers(model)  # saved per global expert with the expert rows
    for prefix, module in model.named_modules():
        if isinstance(module, MoEBase):
            params = {name for name, _ in module.named_parameters()}
            with stacked_layout(module):
                state = module.state_dict()
            for name, value in state.items():
                full = f"{prefix}.{name}" if prefix else name
                if name not in params and full not in per_expert:
                    out[full] = value.detach().cpu().clone()
    return out


def _buffer_name_of_before(name: str) -> str:
    """The name a checkpoint saved before the router held the balance state gives a buffer (``<layer>.balance.*``)."""
    head, sep, tail = name.rpartition("balance.") if name.startswith("balance.") or ".balance." in name else ("", "", "")
    if not sep or head.endswith("gate."):
        return name
    return f"{head}gate.balance.{tail}"


def _load_buffers(model: nn.Module, saved: Dict[str, Tensor], path: str) -> None:
    wanted = _persistent_buffers(model)
    saved = {**{_buffer_name_of_before(k): v for k, v in saved.items()}, **saved}
    missing = sorted(set(wanted) - set(saved))
    if missing:
        raise KeyError(f"buffers {missing} are missing from the checkpoint at {path}")
    state = dict(model.named_buffers())
    with torch.no_grad():
        for name in wanted:
            if tuple(saved[name].shape) != tuple(state[name].shape):
                raise ValueError(f"{name}: checkpoint buffer has shape {tuple(saved[name].shape)}, the model's "
                                 f"{tuple(state[name].shape)} ({path})")
            state[name].copy_(saved[name])


def _local_rows(value: Tensor, layer: Optional[MoEBase]) -> Tensor:
    if layer is None:
        return value
    if value.shape[0] != layer.num_experts:
        raise ValueError(f"expert tensor has {value.shape[0]} rows, the layer has {layer.num_experts} experts")
    first, last = layer.expert_range
    return value[first:last]


def _is_expert_writer(layer: MoEBase) -> bool:
    """Whether this rank writes ``layer``'s expert rows: rank 0 of its expert-data-parallel group."""
    from deepspeed.utils import groups

    return groups._get_expert_data_parallel_rank(layer.expert_group_name) == 0


def _inner_optimizer(engine: Any) -> torch.optim.Optimizer:
    """The torch optimizer holding the param groups and state (inside ZeRO 1/2/3's wrapper)."""
    return engine.optimizer.optimizer if zero_stage(engine) == 3 else base_optimizer(engine)


def _state_keys(engine: Any) -> List[List[Tensor]]:
    """Per param group of the inner optimizer, the tensors its state is keyed by.

    ZeRO-3 empties the groups' ``params`` between steps; its flat partitions are the keys.
    """
    if zero_stage(engine) == 3:
        return flat_groups(engine)
    return [list(group["params"]) for group in base_optimizer(engine).param_groups]


def _param_group_states(engine: Any) -> List[Dict[str, Any]]:
    """Per param group of the (inner) optimizer: its Adam ``step`` and the :data:`SCHEDULED_KEYS` it has."""
    base = _inner_optimizer(engine)
    out: List[Dict[str, Any]] = []
    for group, keys in zip(base.param_groups, _state_keys(engine)):
        steps = [base.state[p]["step"] for p in keys if "step" in base.state.get(p, {})]
        entry: Dict[str, Any] = {"step": float(steps[0]) if steps else 0.0}
        entry.update({k: group[k] for k in SCHEDULED_KEYS if k in group})
        out.append(entry)
    return out


def _saved_group_steps(engine: Any, meta: Dict[str, Any]) -> List[float]:
    """The Adam step for each of ``engine``'s param groups (one shared step if the group count changed)."""
    count = len(_inner_optimizer(engine).param_groups)
    saved = meta.get("param_groups")
    if saved is not None and len(saved) == count:
        return [float(g["step"]) for g in saved]
    return [float(meta["step"])] * count


def _restore_group_hyperparameters(engine: Any, meta: Dict[str, Any], path: str) -> None:
    """Set the param groups' :data:`SCHEDULED_KEYS` to the saved values (by group index)."""
    groups = _inner_optimizer(engine).param_groups
    saved = meta.get("param_groups")
    if saved is None:
        logger.warning("%s predates saved param-group hyperparameters: the lr stays at its initial value "
                       "until the scheduler's next step", path)
        return
    if len(saved) != len(groups):
        values = {repr({k: g[k] for k in SCHEDULED_KEYS if k in g}) for g in saved}
        if len(values) != 1:
            raise ValueError(f"{path}: saved with {len(saved)} param groups of different hyperparameters, "
                             f"the optimizer has {len(groups)}: cannot tell which is which")
        saved = [saved[0]] * len(groups)
    for group, entry in zip(groups, saved):
        for key in SCHEDULED_KEYS:
            if key in group and key in entry:
                group[key] = entry[key]


def _read_param_state(engine: Any, param: nn.Parameter) -> Dict[str, Tensor]:
    if zero_stage(engine) == 3:
        return {"param": read_full_state(engine, param), **{k: read_full_state(engine, param, k) for k in OPTIM_KEYS}}
    if is_partitioned(engine):
        entry = {"param": read_full_param(engine, param)}
        for key in OPTIM_KEYS:
            entry[key] = read_full_param(engine, param, key)
        return entry
    state = base_optimizer(engine).state.get(param, {})
    entry = {"param": param.detach().float().cpu().clone()}
    for key in OPTIM_KEYS:
        entry[key] = state[key].detach().cpu().clone() if key in state else torch.zeros_like(entry["param"])
    return entry


def _materialize_optimizer_state(engine: Any, group_steps: List[float]) -> None:
    """Create Adam state (zeros) where the optimizer has none yet and set each group's saved step.

    Under ZeRO 1/2 the inner optimizer's group ``i`` holds exactly the flat fp32 partition ``i``;
    under ZeRO 3 its flat partitions are listed by :func:`sparse_core.zero3_state.flat_groups`.
    """
    base = _inner_optimizer(engine)
    for group, keys, step in zip(base.param_groups, _state_keys(engine), group_steps):
        # torch's Adam keeps ``step`` on the CPU unless capturable/fused.
        on_param = bool(group.get("capturable") or group.get("fused"))
        for p in keys:
            state = base.state[p]
            for key in OPTIM_KEYS:
                if key not in state:
                    state[key] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["step"] = torch.tensor(float(step), dtype=torch.float32, device=p.device if on_param else "cpu")


def _write_param_state(engine: Any, param: nn.Parameter, entry: Dict[str, Tensor]) -> None:
    if zero_stage(engine) == 3:
        write_full_state(engine, param, entry["param"].float())
        for key in OPTIM_KEYS:
            write_full_state(engine, param, entry[key].float(), key)
        return
    value = entry["param"].to(param.device)
    if tuple(value.shape) != tuple(param.shape):
        raise ValueError(f"checkpoint tensor of shape {tuple(value.shape)} for a parameter of shape "
                         f"{tuple(param.shape)}")
    with torch.no_grad():
        param.copy_(value.to(param.dtype))
    if is_partitioned(engine):
        write_param_fragment(engine, param, value.float())
        for key in OPTIM_KEYS:
            write_param_fragment(engine, param, entry[key].float(), key)
        return
    state = base_optimizer(engine).state[param]
    for key in OPTIM_KEYS:
        state[key].copy_(entry[key].to(state[key].device))


class ExpertFile(NamedTuple):
    """One expert file of a checkpoint: rows ``[first, last)``; ``shape`` is ``(num_experts, ep_size)`` of the
    layers it holds, None for the single-range layout (every layer of one shape, ``experts_<a>-<b>.pt``)."""
    shape: Optional[Shape]
    first: int
    last: int
    name: str


def _expert_file_name(shape: Shape, first: int, last: int, single: bool) -> str:
    if single:
        return f"experts_{first:06d}-{last:06d}.pt"
    return f"experts_e{shape[0]}-ep{shape[1]}_{first:06d}-{last:06d}.pt"


def expert_files(path: str) -> List[ExpertFile]:
    """The expert files of a checkpoint directory (``<save_dir>/<tag>/moe_proto``), by shape then first row.

    Example::

        [(f.shape, f.first, f.last) for f in expert_files("ckpt/step3/moe_proto")]
        # [((4, 2), 0, 2), ((4, 2), 2, 4), ((8, 4), 0, 2), ...]  (a pyramid; (None, a, b) for one shape)
    """
    out: List[ExpertFile] = []
    for f in os.listdir(path):
        m = _EXPERT_FILE.match(f)
        if m:
            out.append(ExpertFile(None, int(m.group(1)), int(m.group(2)), f))
            continue
        m = _SHAPED_EXPERT_FILE.match(f)
        if m:
            out.append(ExpertFile((int(m.group(1)), int(m.group(2))), int(m.group(3)), int(m.group(4)), f))
    return sorted(out, key=lambda e: (e.shape or (0, 0), e.first, e.last, e.name))


def iter_expert_files(path: str) -> Iterator[Tuple[int, int, str]]:
    """``(first, last, filename)`` of each expert file of a checkpoint directory, in expert order.

    One run of ranges per layer shape in a pyramid's checkpoint (:func:`expert_files` says which).
    """
    for f in expert_files(path):
        yield f.first, f.last, f.name


ReadPlan = Dict[Tuple[str, str], Tuple[Tuple[int, int], List[ExpertFile]]]


def _read_plan(owners: Dict[str, MoEBase], saved_meta: Dict[str, Dict[str, int]], files: set, single: bool,
               section: str, path: str) -> ReadPlan:
    """Per ``(section, stack)`` of the model: the rows this rank needs and the files of the stack's saved shape.

    The files are the ones the saving ranks wrote for the stack's saved ``(num_experts, ep_size)`` (one per
    expert-parallel rank), named from the metadata, so stale files of another save in the directory are never
    read. Raises (the same on every rank: model, metadata and file names only) when the checkpoint lacks a
    stack, has another number of experts, or lacks one of those files.
    """
    what = "expert parameter" if section == "params" else "per-expert buffer"
    plan: ReadPlan = {}
    for name, layer in owners.items():
        stack = expert_slot(name, layer)[0]
        if (section, stack) in plan:
            continue
        saved = saved_meta.get(stack)
        if saved is None:
            raise ValueError(f"{what} {stack}: not in the checkpoint at {path} (saved {what}s: "
                             f"{sorted(saved_meta) or 'none'})")
        if saved["num_experts"] != layer.num_experts:
            raise ValueError(f"{stack}: checkpoint has {saved} experts, the model has {layer.num_experts}")
        shape = (int(saved["num_experts"]), int(saved["ep_size"]))
        local = shape[0] // shape[1]
        written = [ExpertFile(None if single else shape, r * local, (r + 1) * local,
                              _expert_file_name(shape, r * local, (r + 1) * local, single)) for r in range(shape[1])]
        lost = [f.name for f in written if f.name not in files]
        if lost:
            raise FileNotFoundError(f"{stack}: expert files {lost} are missing from {path} (its {shape[0]} experts "
                                    f"were saved at ep_size {shape[1]}, one file per expert-parallel rank)")
        plan[(section, stack)] = (layer.expert_range, written)
    return plan


def _read_expert_rows(path: str, plan: ReadPlan) -> Dict[Tuple[str, str], Any]:
    """Assemble, per planned stack, rows [first, last) of its tensors (a dict of them for parameters)."""
    wanted_by_file: Dict[str, List[Tuple[Tuple[str, str], int, int, ExpertFile]]] = {}
    for item, ((a, b), files) in plan.items():
        for f in files:
            if f.first < b and a < f.last:
                wanted_by_file.setdefault(f.name, []).append((item, max(a, f.first), min(b, f.last), f))
    parts: Dict[Tuple[str, str], List[Tuple[int, Any]]] = {item: [] for item in plan}
    for fname, wanted in sorted(wanted_by_file.items()):
        # mmap: only the rows sliced below are read from disk.
        blob = torch.load(os.path.join(path, fname), map_location="cpu", mmap=True, weights_only=False)
        for (section, stack), lo, hi, f in wanted:
            value = blob.get(section, {}).get(stack)
            if value is None:
                raise KeyError(f"{stack}: missing from {os.path.join(path, fname)} ({section})")
            rows = slice(lo - f.first, hi - f.first)
            part = ({k: t[rows].clone() for k, t in value.items()} if isinstance(value, dict)
                    else value[rows].clone())
            parts[(section, stack)].append((lo, part))
    out: Dict[Tuple[str, str], Any] = {}
    for item, pieces in parts.items():
        pieces = [p for _, p in sorted(pieces, key=lambda x: x[0])]
        if isinstance(pieces[0], dict):
            out[item] = {k: torch.cat([p[k] for p in pieces]) for k in pieces[0]}
        else:
            out[item] = torch.cat(pieces)
    return out
