"""The building blocks the reference CTR models share: the ReLU MLP tower and the FM pairwise term.

    >>> tower = mlp_tower(8, (4,), dropout=0.1)       # Linear -> ReLU -> Dropout -> Linear
    >>> fm_interaction(torch.ones(2, 3, 4))            # sum over field pairs of <e_i, e_j>
    tensor([12., 12.])

Every model of ``picasso_ops.models`` builds its MLPs with :func:`mlp_tower`, so a tower's
dropout means the same in each, and the FM models (wide-and-deep, DeepFM) call one
:func:`fm_interaction`.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

__all__ = ["TowerFactory", "check_dropout", "fm_interaction", "mlp_tower"]

TowerFactory = Callable[[int], nn.Module]
"""Builds a model's MLP from its input width: a module mapping ``[B, width]`` rows to ``[B, 1]`` logits."""


def check_dropout(p: float, where: str = "dropout") -> float:
    """``p`` as a float when it is a probability in ``[0, 1)``; else a ValueError naming ``where``.

    Example::

        >>> check_dropout(0.2)
        0.2
    """
    if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 <= float(p) < 1.0:
        raise ValueError(f"{where} {p!r}: must be a probability in [0, 1) (0: no dropout)")
    return float(p)


def mlp_tower(width: int, hidden: tuple[int, ...], out: int = 1, last_relu: bool = False,
              dropout: float = 0.0) -> nn.Sequential:
    """``Linear -> ReLU`` (``-> Dropout(dropout)`` when ``dropout > 0``) per hidden width, then ``Linear(.., out)``.

    A ReLU follows the last Linear with ``last_relu``. ``dropout`` 0 adds no module, so the
    state_dict keys (``0.weight``, ``2.weight``, ...) are those of a tower built without the
    argument; ``model.eval()`` turns the dropout off.

    Example::

        >>> mlp_tower(8, (4,))
        Sequential(
          (0): Linear(in_features=8, out_features=4, bias=True)
          (1): ReLU()
          (2): Linear(in_features=4, out_features=1, bias=True)
        )
    """
    p = check_dropout(dropout)
    layers: list[nn.Module] = []
    for h in hidden:
        layers += [nn.Linear(width, h), nn.ReLU()]
        if p > 0.0:
            layers.append(nn.Dropout(p))
        width = h
    layers.append(nn.Linear(width, out))
    if last_relu:
        layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def fm_interaction(fields: torch.Tensor) -> torch.Tensor:
    """The factorisation machine's second-order term ``sum_{i<j} <e_i, e_j>`` per sample, ``[B, F, D] -> [B]``.

    Computed as ``((sum_i e_i)^2 - sum_i e_i^2) / 2`` summed over the ``D`` dims: ``O(F D)``, not ``O(F^2 D)``.

    Example::

        >>> fm_interaction(torch.tensor([[[1.0, 2.0], [3.0, 4.0]]]))  # 1*3 + 2*4
        tensor([11.])
    """
    if fields.dim() != 3:
        raise ValueError(f"fm_interaction: expected field embeddings [B, F, D], got shape {tuple(fields.shape)}")
    return 0.5 * (fields.sum(1).pow(2) - fields.pow(2).sum(1)).sum(-1)
