"""Sparse optimizers applied in place to the touched rows of an embedding buffer.

The packed lookup's backward hands each optimizer a :class:`RowUpdate`: the
unique rows touched by the batch and their summed gradient. Only those rows
and their optimizer state are read and written; untouched rows never change
(state of rows absent from a batch does not decay: "lazy" state).

Definitions (``g`` is a row's gradient summed over the batch, ``D`` the table's
embedding dim, ``t`` the optimizer step, 1-based):

* ``sgd``: ``w -= lr * g``. Same as ``torch.optim.SGD`` on a sparse gradient.
* ``rowwise_adagrad``: FBGEMM's ``EXACT_ROWWISE_ADAGRAD``:
  one state scalar per row, ``momentum1 += sum(g**2) / D`` (the mean of the
  squared gradient over the row), then ``w -= lr * g / (sqrt(momentum1) + eps)``.
* ``adam``: lazy Adam, FBGEMM's ``ADAM`` formula without weight decay:
  ``m = b1*m + (1-b1)*g``, ``v = b2*v + (1-b2)*g**2`` for touched rows only,
  ``w -= lr * (m / (1 - b1**t)) / (sqrt(v / (1 - b2**t)) + eps)``. ``t`` is the
  global step (the number of optimizer steps the table has taken, touched or
  not), as in FBGEMM and ``torch.optim.SparseAdam``, not a per-row count. Note
  SparseAdam puts ``eps`` after folding the bias correction into the step size,
  so it differs from this formula by ``eps * sqrt(1 - b2**t)``.

The same family holds torch's own formulas on the touched rows (:class:`TorchRowSGD`,
:class:`TorchRowAdam`, :class:`TorchRowAdagrad`; :data:`TORCH_ROW_OPTIMIZERS`): what
``gba_engine``'s parameter servers (and the workers' copies of their tables) run for DeepSpeed's
``"optimizer"`` block, as DeepSpeed's ``torch_adam`` path would. They are not choices of the
``picasso`` block, and the fused C++ kernels do not run them.

Every optimizer of the ``picasso`` block also takes ``weight_decay`` (default 0: off), decoupled weight
decay of the touched rows in AdamW's form: ``w *= 1 - lr * weight_decay``
before the step above, on the rows of the update only (lazy, like the state).
For ``sgd`` this is ``torch.optim.SGD(weight_decay=...)``; for ``adam`` with
every row touched it is ``torch.optim.AdamW``. FBGEMM calls this
``WeightDecayMode.DECOUPLE``.

Example::

    >>> import torch
    >>> from picasso_ops.embedding.sparse_optim import RowUpdate, create_optimizer
    >>> opt = create_optimizer("rowwise_adagrad", {"lr": 0.1})
    >>> w = torch.zeros(4, 2); state = opt.init_state(4, 2, num_logical_rows=4)
    >>> opt.update(w, state, RowUpdate.simple(torch.tensor([1]), torch.ones(1, 2), step=1))
    >>> w[1].tolist()  # -0.1 * 1 / (sqrt(1) + 1e-8)
    [-0.10000000149011612, -0.10000000149011612]
"""

from __future__ import annotations

import difflib
import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar, Literal, Mapping, Optional, Union

import torch
from torch import Tensor

__all__ = [
    "RowUpdate",
    "SparseOptimizer",
    "SparseSGD",
    "RowWiseAdagrad",
    "LazyAdam",
    "OPTIMIZERS",
    "TORCH_ROW_OPTIMIZERS",
    "TorchRowAdagrad",
    "TorchRowAdam",
    "TorchRowSGD",
    "create_optimizer",
    "resolve_hyperparams",
]

StateKind = Literal["row", "element"]


@dataclass(frozen=True)
class RowUpdate:
    """One step's gradient for one weight buffer, on its unique touched rows.

    A buffer row ("storage row") is either a whole table row or, when tables of
    different dims share a buffer, one of ``D / width`` consecutive slices of a
    table row. Row-wise state lives per table row ("logical row").

    Attributes:
        rows: ``[U]`` unique storage rows, ascending.
        grad: ``[U, width]`` their summed gradient.
        logical_rows: ``[UL]`` unique logical rows (state index of row-wise optimizers).
        segment: ``[U]`` position in ``logical_rows`` of each storage row, or
            ``None`` when storage rows are logical rows.
        row_dim: the full embedding dim of each storage row's table, ``[U]`` or one number.
        step: the optimizer step (1-based) of each storage row's table, ``[U]`` or one number.
    """

    rows: Tensor
    grad: Tensor
    logical_rows: Tensor
    segment: Optional[Tensor]
    row_dim: Union[Tensor, int]
    step: Union[Tensor, int]

    @classmethod
    def simple(cls, rows: Tensor, grad: Tensor, step: int) -> "RowUpdate":
        """Update for a buffer whose storage rows are table rows of dim ``grad.shape[1]``.

        Example::

            >>> RowUpdate.simple(torch.tensor([0, 3]), torch.ones(2, 8), step=1).row_dim
            8
        """
        return cls(rows=rows, grad=grad, logical_rows=rows, segment=None, row_dim=grad.shape[1], step=step)


class SparseOptimizer(ABC):
    """An optimizer that updates only the rows in a :class:`RowUpdate`, in place.

    Subclasses declare ``name``, ``defaults`` (every hyperparameter with its
    default) and ``state_kinds`` (``"row"``: one fp32 scalar per logical row;
    ``"element"``: fp32 ``[storage rows, width]`` like the weight).

    Attributes:
        hyperparams: resolved hyperparameters; ``lr`` may be changed between steps.
    """

    name: ClassVar[str]
    defaults: ClassVar[Mapping[str, float]]
    state_kinds: ClassVar[Mapping[str, StateKind]]
    uses_step: ClassVar[bool] = False
    decoupled_decay_only: ClassVar[bool] = True  # lr x weight_decay < 1 is checked (torch's formulas: not)

    def __init__(self, **hyperparams: float) -> None:
        self.hyperparams: dict[str, float] = dict(resolve_hyperparams(self.name, hyperparams))
        _check_decay(self.name, self.hyperparams["lr"], self.hyperparams["weight_decay"])

    @property
    def lr(self) -> float:
        """The learning rate; the training loop may set it between steps (schedules)."""
        return self.hyperparams["lr"]

    @lr.setter
    def lr(self, value: float) -> None:
        if not value >= 0.0:
            raise ValueError(f"learning rate must be >= 0, got {value}")
        if self.decoupled_decay_only:
            _check_decay(self.name, float(value), self.hyperparams["weight_decay"])
        self.hyperparams["lr"] = float(value)

    def decay_rows(self, weight: Tensor, rows: Tensor) -> None:
        """Decoupled weight decay of ``weight[rows]`` (unique rows) before a step: ``w *= 1 - lr * weight_decay``.

        Example::

            >>> opt = SparseSGD(lr=0.5, weight_decay=0.2); w = torch.ones(3, 2)
            >>> opt.decay_rows(w, torch.tensor([1])); w[:, 0].tolist()
            [1.0, 0.8999999761581421, 1.0]
        """
        wd = self.hyperparams["weight_decay"]
        if wd == 0.0 or rows.numel() == 0:
            return
        kept = weight.index_select(0, rows).mul_(1.0 - self.lr * wd)
        weight.index_copy_(0, rows, kept)

    def init_state(
        self,
        num_storage_rows: int,
        width: int,
        *,
        num_logical_rows: int,
        device: Optional[torch.device] = None,
    ) -> dict[str, Tensor]:
        """Zero-initialised state tensors, fp32, keyed by state name.

        Example::

            >>> {k: tuple(v.shape) for k, v in LazyAdam().init_state(10, 4, num_logical_rows=10).items()}
            {'momentum1': (10, 4), 'momentum2': (10, 4)}
        """
        state = {}
        for key, kind in self.state_kinds.items():
            shape = (num_logical_rows,) if kind == "row" else (num_storage_rows, width)
            state[key] = torch.zeros(shape, dtype=torch.float32, device=device)
        return state

    @abstractmethod
    def update(self, weight: Tensor, state: Mapping[str, Tensor], upd: RowUpdate) -> None:
        """Apply one step to ``weight[upd.rows]`` and the matching state, in place."""

    def __repr__(self) -> str:
        params = ", ".join(f"{k}={v:g}" for k, v in self.hyperparams.items())
        return f"{type(self).__name__}({params})"


def _add_rows(weight: Tensor, rows: Tensor, delta: Tensor) -> None:
    """``weight[rows] += delta`` for unique ``rows`` (index_put_ beats index_add_ with alpha on CPU)."""
    weight.index_put_((rows,), delta.to(weight.dtype), accumulate=True)


class SparseSGD(SparseOptimizer):
    """Plain SGD on the touched rows: ``w -= lr * g``."""

    name = "sgd"
    defaults = {"lr": 0.01, "weight_decay": 0.0}
    state_kinds: ClassVar[Mapping[str, StateKind]] = {}

    def update(self, weight: Tensor, state: Mapping[str, Tensor], upd: RowUpdate) -> None:
        self.decay_rows(weight, upd.rows)
        _add_rows(weight, upd.rows, upd.grad.float() * -self.lr)


class RowWiseAdagrad(SparseOptimizer):
    """FBGEMM's exact row-wise Adagrad: one accumulator per row, the mean squared gradient."""

    name = "rowwise_adagrad"
    defaults = {"lr": 0.01, "eps": 1e-8, "weight_decay": 0.0}
    state_kinds: ClassVar[Mapping[str, StateKind]] = {"momentum1": "row"}

    def update(self, weight: Tensor, state: Mapping[str, Tensor], upd: RowUpdate) -> None:
        grad = upd.grad.float()
        mean_sq = grad.square().sum(1) / upd.row_dim
        if upd.segment is not None:  # slices of one table row add up to that row's mean
            mean_sq = torch.zeros(upd.logical_rows.numel(), device=grad.device).index_add_(0, upd.segment, mean_sq)
        acc = state["momentum1"]
        new_acc = acc.index_select(0, upd.logical_rows) + mean_sq
        acc.index_copy_(0, upd.logical_rows, new_acc)
        multiplier = new_acc.sqrt_().add_(self.hyperparams["eps"]).reciprocal_().mul_(-self.lr)
        if upd.segment is not None:
            multiplier = multiplier.index_select(0, upd.segment)
        self.decay_rows(weight, upd.rows)
        _add_rows(weight, upd.rows, grad * multiplier.unsqueeze(1))


class LazyAdam(SparseOptimizer):
    """Lazy Adam on the touched rows of a buffer, global-step bias correction, ``eps`` outside the square root.

    For each touched row (``g`` its gradient summed over the batch, ``t`` the
    table's optimizer step, 1-based, counted over all steps whether the row was
    touched or not):

    * ``m = beta1 * m + (1 - beta1) * g``
    * ``v = beta2 * v + (1 - beta2) * g**2``  (elementwise, ``[width]`` per row)
    * ``w -= lr * (m / (1 - beta1**t)) / (sqrt(v / (1 - beta2**t)) + eps)``

    Untouched rows keep ``w``, ``m`` and ``v`` unchanged (no decay of their
    moments). With ``weight_decay`` the touched rows are first scaled by
    ``1 - lr * weight_decay`` (decoupled, as AdamW). Otherwise this is FBGEMM's ``ADAM``;
    ``torch.optim.SparseAdam`` differs by ``eps * sqrt(1 - beta2**t)`` (it folds
    the bias corrections into the step size). gba_engine's server-side Adam is
    a different formula under a different name.

    Example::

        >>> opt = LazyAdam(lr=0.1)
        >>> w = torch.zeros(3, 2); st = opt.init_state(3, 2, num_logical_rows=3)
        >>> opt.update(w, st, RowUpdate.simple(torch.tensor([2]), torch.ones(1, 2), step=1))
        >>> round(w[2, 0].item(), 4), w[0].tolist()   # -lr * 1 / (1 + eps); row 0 untouched
        (-0.1, [0.0, 0.0])
    """

    name = "adam"
    defaults = {"lr": 0.001, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.0}
    state_kinds: ClassVar[Mapping[str, StateKind]] = {"momentum1": "element", "momentum2": "element"}
    uses_step = True

    def update(self, weight: Tensor, state: Mapping[str, Tensor], upd: RowUpdate) -> None:
        beta1, beta2, eps = self.hyperparams["beta1"], self.hyperparams["beta2"], self.hyperparams["eps"]
        grad = upd.grad.float()
        m1 = state["momentum1"].index_select(0, upd.rows).mul_(beta1).add_(grad, alpha=1.0 - beta1)
        m2 = state["momentum2"].index_select(0, upd.rows).mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
        state["momentum1"].index_copy_(0, upd.rows, m1)
        state["momentum2"].index_copy_(0, upd.rows, m2)
        if isinstance(upd.step, Tensor):
            step = upd.step.to(torch.float64).unsqueeze(1)
            bc1 = (1.0 - torch.pow(beta1, step)).float()
            bc2 = (1.0 - torch.pow(beta2, step)).float()
        else:
            bc1, bc2 = 1.0 - beta1**upd.step, 1.0 - beta2**upd.step
        denom = (m2 / bc2).sqrt_().add_(eps)
        self.decay_rows(weight, upd.rows)
        _add_rows(weight, upd.rows, (m1 / bc1).div_(denom).mul_(-self.lr))


OPTIMIZERS: dict[str, type[SparseOptimizer]] = {
    cls.name: cls for cls in (SparseSGD, RowWiseAdagrad, LazyAdam)
}


class _TorchFormula(SparseOptimizer):
    """A member of the family that runs one of torch.optim's formulas on the touched rows.

    Its hyperparameters are torch's keyword arguments (booleans included), checked by the
    subclass's constructor; ``weight_decay`` is torch's (L2 into the gradient, or AdamW's
    decoupled form), so ``lr x weight_decay`` is not limited. The update reads the table's step
    count from ``RowUpdate.step`` (one number: these run on whole table rows).
    """

    decoupled_decay_only = False
    defaults: ClassVar[Mapping[str, float]] = {}

    def __init__(self, **hyperparams: float) -> None:  # noqa: D107 - the subclasses check their own
        self.hyperparams = dict(hyperparams)

    def _l2_grad(self, grad: Tensor, rows_value: Tensor) -> Tensor:
        """torch's gradient of these rows: negated with ``maximize``, plus ``weight_decay`` x value (L2)."""
        h = self.hyperparams
        g = -grad if h["maximize"] else grad
        return g.add(rows_value, alpha=h["weight_decay"]) if h["weight_decay"] else g


class TorchRowSGD(_TorchFormula):
    """torch.optim.SGD on the touched rows: per-row momentum buffers, started like torch's on a row's first update.

    State (with ``momentum`` only): ``momentum_buffer`` ``[rows, dim]`` and ``started`` (bool per row).

    Example::

        >>> opt = TorchRowSGD(lr=0.1, momentum=0.9); w = torch.zeros(3, 2)
        >>> st = opt.init_state(3, 2, num_logical_rows=3)
        >>> opt.update(w, st, RowUpdate.simple(torch.tensor([1]), torch.ones(1, 2), step=1)); w[1].tolist()
        [-0.10000000149011612, -0.10000000149011612]
    """

    name = "torch_sgd"
    state_kinds: ClassVar[Mapping[str, StateKind]] = {}

    def __init__(self, lr: float = 1e-3, momentum: float = 0.0, dampening: float = 0.0, weight_decay: float = 0.0,
                 nesterov: bool = False, maximize: bool = False) -> None:
        if lr < 0 or momentum < 0 or weight_decay < 0:
            raise ValueError(f"invalid SGD hyperparameters lr={lr} momentum={momentum} weight_decay={weight_decay}")
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("Nesterov momentum requires a momentum and zero dampening")
        super().__init__(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                         nesterov=nesterov, maximize=maximize)

    def init_state(self, num_storage_rows: int, width: int, *, num_logical_rows: int,
                   device: Optional[torch.device] = None) -> dict[str, Tensor]:
        if not self.hyperparams["momentum"]:
            return {}
        return {"momentum_buffer": torch.zeros(num_storage_rows, width, dtype=torch.float32, device=device),
                "started": torch.zeros(num_logical_rows, dtype=torch.bool, device=device)}

    def update(self, weight: Tensor, state: Mapping[str, Tensor], upd: RowUpdate) -> None:
        h, rows = self.hyperparams, upd.rows
        p = weight[rows]
        d_p = self._l2_grad(upd.grad, p)
        if h["momentum"]:
            old = state["momentum_buffer"][rows]
            started = state["started"][rows].unsqueeze(1)
            # torch starts a buffer at the first gradient (no dampening); later steps blend
            buf = torch.where(started, old * h["momentum"] + d_p * (1 - h["dampening"]), d_p)
            state["momentum_buffer"][rows] = buf
            state["started"][rows] = True
            d_p = d_p.add(buf, alpha=h["momentum"]) if h["nesterov"] else buf
        weight[rows] = p.add(d_p, alpha=-self.lr)


class TorchRowAdam(_TorchFormula):
    """torch.optim.Adam / AdamW on the touched rows: per-row moments, the table's step count for the bias correction.

    The update is torch's own, term by term (``lerp`` of the first moment, ``sqrt(v) /
    sqrt(1 - beta2**t) + eps``, step ``lr / (1 - beta1**t)``), plus torch's weight decay: L2 into
    the gradient (Adam) or decoupled ``p *= 1 - lr * wd`` (AdamW, default wd 0.01), and
    ``maximize``. :class:`LazyAdam` (the ``picasso`` block's ``adam``) has the same Adam core and
    bias correction, but rounds differently (its moments by ``mul``/``add`` and ``sqrt(v / (1 -
    beta2**t))``) and decays only in AdamW's form: equal in exact arithmetic when wd = 0.

    State: ``exp_avg`` and ``exp_avg_sq`` ``[rows, dim]`` (torch's names).

    Example::

        >>> opt = TorchRowAdam(decoupled=True, lr=0.1, weight_decay=0.0); w = torch.zeros(2, 2)
        >>> st = opt.init_state(2, 2, num_logical_rows=2)
        >>> opt.update(w, st, RowUpdate.simple(torch.tensor([0]), torch.ones(1, 2), step=1)); round(w[0, 0].item(), 4)
        -0.1
    """

    name = "torch_adam"
    state_kinds: ClassVar[Mapping[str, StateKind]] = {"exp_avg": "element", "exp_avg_sq": "element"}
    uses_step = True

    def __init__(self, decoupled: bool, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: Optional[float] = None, amsgrad: bool = False,
                 maximize: bool = False) -> None:
        if amsgrad:
            raise ValueError("amsgrad is not supported for embedding rows on the parameter servers")
        if weight_decay is None:
            weight_decay = 1e-2 if decoupled else 0.0  # torch's AdamW / Adam defaults
        b1, b2 = betas
        if lr < 0 or eps < 0 or weight_decay < 0 or not (0 <= b1 < 1 and 0 <= b2 < 1):
            raise ValueError(f"invalid Adam hyperparameters lr={lr} betas={betas} eps={eps} wd={weight_decay}")
        super().__init__(lr=lr, beta1=b1, beta2=b2, eps=eps, weight_decay=weight_decay, decoupled=decoupled,
                         maximize=maximize)

    def update(self, weight: Tensor, state: Mapping[str, Tensor], upd: RowUpdate) -> None:
        h, rows, steps = self.hyperparams, upd.rows, int(upd.step)
        lr, beta1, beta2 = self.lr, h["beta1"], h["beta2"]
        p = weight[rows]
        g = -upd.grad if h["maximize"] else upd.grad
        if h["weight_decay"]:
            if h["decoupled"]:
                p = p * (1 - lr * h["weight_decay"])
            else:
                g = g.add(p, alpha=h["weight_decay"])
        m = state["exp_avg"][rows].lerp(g, 1 - beta1)
        v = state["exp_avg_sq"][rows].mul(beta2).addcmul(g, g, value=1 - beta2)
        bias1 = 1 - beta1 ** steps
        bias2_sqrt = math.sqrt(1 - beta2 ** steps)
        denom = (v.sqrt() / bias2_sqrt).add_(h["eps"])
        state["exp_avg"][rows] = m
        state["exp_avg_sq"][rows] = v
        weight[rows] = p.addcdiv(m, denom, value=-lr / bias1)


class TorchRowAdagrad(_TorchFormula):
    """torch.optim.Adagrad on the touched rows: per-element accumulators, the table's step count for ``lr_decay``.

    State: ``sum`` ``[rows, dim]`` (torch's name), started at ``initial_accumulator_value``.

    Example::

        >>> opt = TorchRowAdagrad(lr=0.1); w = torch.zeros(2, 1); st = opt.init_state(2, 1, num_logical_rows=2)
        >>> opt.update(w, st, RowUpdate.simple(torch.tensor([1]), torch.ones(1, 1), step=1)); round(w[1, 0].item(), 4)
        -0.1
    """

    name = "torch_adagrad"
    state_kinds: ClassVar[Mapping[str, StateKind]] = {"sum": "element"}
    uses_step = True

    def __init__(self, lr: float = 1e-2, lr_decay: float = 0.0, weight_decay: float = 0.0,
                 initial_accumulator_value: float = 0.0, eps: float = 1e-10, maximize: bool = False) -> None:
        if lr < 0 or lr_decay < 0 or weight_decay < 0 or initial_accumulator_value < 0 or eps < 0:
            raise ValueError(f"invalid Adagrad hyperparameters lr={lr} lr_decay={lr_decay} wd={weight_decay}")
        super().__init__(lr=lr, lr_decay=lr_decay, weight_decay=weight_decay,
                         initial_accumulator_value=initial_accumulator_value, eps=eps, maximize=maximize)

    def init_state(self, num_storage_rows: int, width: int, *, num_logical_rows: int,
                   device: Optional[torch.device] = None) -> dict[str, Tensor]:
        return {"sum": torch.full((num_storage_rows, width), float(self.hyperparams["initial_accumulator_value"]),
                                  dtype=torch.float32, device=device)}

    def update(self, weight: Tensor, state: Mapping[str, Tensor], upd: RowUpdate) -> None:
        h, rows = self.hyperparams, upd.rows
        p = weight[rows]
        g = self._l2_grad(upd.grad, p)
        clr = self.lr / (1 + (int(upd.step) - 1) * h["lr_decay"])
        s = state["sum"][rows].addcmul(g, g, value=1)
        state["sum"][rows] = s
        weight[rows] = p.addcdiv(g, s.sqrt().add_(h["eps"]), value=-clr)


# torch's formulas by the name of DeepSpeed's optimizer type (the parameter servers' rows); not picasso block choices
TORCH_ROW_OPTIMIZERS: dict[str, type[SparseOptimizer]] = {
    "adam": TorchRowAdam, "adamw": TorchRowAdam, "sgd": TorchRowSGD, "adagrad": TorchRowAdagrad,
}


def resolve_hyperparams(optimizer: str, params: Mapping[str, float]) -> tuple[tuple[str, float], ...]:
    """Check an optimizer's hyperparameters and fill in defaults; sorted ``(key, value)`` pairs.

    Raises ``ValueError`` naming an unknown optimizer or key (with the nearest
    valid one) and bad values.

    Example::

        >>> resolve_hyperparams("adam", {"lr": 0.01})
        (('beta1', 0.9), ('beta2', 0.999), ('eps', 1e-08), ('lr', 0.01), ('weight_decay', 0.0))
    """
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"unknown sparse optimizer {optimizer!r}{_did_you_mean(optimizer, OPTIMIZERS)}")
    defaults = OPTIMIZERS[optimizer].defaults
    resolved = dict(defaults)
    for key, value in params.items():
        if key not in defaults:
            raise ValueError(
                f"unknown hyperparameter {key!r} for optimizer {optimizer!r}{_did_you_mean(key, defaults)}; "
                f"valid: {sorted(defaults)}"
            )
        value = float(value)
        if not (value >= 0.0 and math.isfinite(value)) or (key in ("beta1", "beta2") and not value < 1.0):
            raise ValueError(f"bad value {value} for {optimizer!r} hyperparameter {key!r}")
        resolved[key] = value
    return tuple(sorted(resolved.items()))


def create_optimizer(optimizer: str, params: Mapping[str, float]) -> SparseOptimizer:
    """Instantiate a sparse optimizer by name.

    Example::

        >>> create_optimizer("sgd", {"lr": 0.5}).lr
        0.5
    """
    return OPTIMIZERS[optimizer](**dict(resolve_hyperparams(optimizer, params)))


def _check_decay(name: str, lr: float, weight_decay: float) -> None:
    """Refuse a decay that would flip or zero the rows' sign: ``lr * weight_decay`` must stay below 1."""
    if weight_decay > 0.0 and not lr * weight_decay < 1.0:
        raise ValueError(f"{name!r}: lr {lr:g} x weight_decay {weight_decay:g} = {lr * weight_decay:g} must be < 1 "
                         "(each touched row is scaled by 1 - lr x weight_decay)")


def _did_you_mean(word: str, choices: Mapping[str, object]) -> str:
    close = difflib.get_close_matches(word, list(choices), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""
