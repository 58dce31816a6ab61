"""The optimizer's parameter groups for a model with MoE layers: experts apart, as DeepSpeed's ZeRO 1/2 require.

Example::

    groups = moe_param_groups(model)   # [{"name": "parameters", "params": [...]}, {"moe": True, ...}, ...]
    deepspeed.initialize(model=model, model_parameters=groups, config=ds)
"""
from __future__ import annotations

from typing import Any, Iterable, List, Optional

from torch import nn

from .layer import MoEBase


def has_moe_layers(model: nn.Module) -> bool:
    """Whether DeepSpeed sees MoE layers in ``model`` (expert groups, expert param groups, MoE checkpoints).

    A :class:`moe_proto.replicated.ReplicatedMoE` holds its layer outside its children, so it does not count.
    """
    return any(isinstance(m, MoEBase) for m in model.modules())


def moe_param_groups(model: nn.Module, params: Optional[Iterable[Any]] = None) -> List[Any]:
    """``params`` (default: every parameter of ``model``) with the experts split into their own ``moe`` groups.

    ``params`` may be parameters or DeepSpeed-style group dicts; groups already split are kept.
    Without MoE layers in ``model`` it is the plain list.
    """
    given = list(model.parameters() if params is None else params)
    if not has_moe_layers(model):
        return given
    if any(isinstance(g, dict) and g.get("moe") for g in given):
        return given  # the user split them already
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    # copies with a name each: DeepSpeed's splitter keys groups by name and rewrites their "params"
    groups = [{**g, "params": list(g["params"]), "name": g.get("name", f"group{i}")}
              for i, g in enumerate(x for x in given if isinstance(x, dict))]
    loose = [p for p in given if not isinstance(p, dict)]
    if loose:
        groups.append({"params": loose, "name": "parameters"})
    return split_params_into_different_moe_groups_for_optimizer(groups)
