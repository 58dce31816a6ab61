"""The config's optimizer, run on the parameter servers: torch's for the dense shard, lazy row-wise for tables.

:class:`OptimizerSpec` reads DeepSpeed's ``"optimizer"`` block the way DeepSpeed 0.19.8
does on its ``torch_adam`` path (``_configure_basic_optimizer``): ``Adam`` means AdamW
unless ``"adam_w_mode": false``, ``AdamW`` is AdamW, ``SGD``/``Adagrad`` are torch's, and
the hyperparameters go to the torch class unchanged (so torch's defaults apply, e.g.
AdamW's ``weight_decay=0.01`` when the block gives none, exactly as under DeepSpeed).

Dense shards use the torch optimizer itself: the supported optimizers are element-wise,
so a shard's update equals the same slice of the full update.

Embedding shards use a lazy variant that reads and writes only the rows present in the
global batch (``index`` gather, update, scatter: no per-id Python loop). The formulas are
members of picasso_ops' one family of row optimizers
(:mod:`picasso_ops.embedding.sparse_optim`: ``TorchRowAdam``, ``TorchRowSGD``,
``TorchRowAdagrad``), held with their table and state by :class:`RowOptimizer`, the one holder
of the servers' tables and the workers' copies (``gba_engine.worker_tables``):

* Adam/AdamW: torch's Adam formula on those rows, with per-row moments and one step
  count per table (= updates applied). That is TF's LazyAdam; it equals dense torch Adam
  exactly for rows present in every batch, and an absent row keeps its value and moments
  (dense Adam would keep moving it on momentum).
* SGD: plain, momentum (per-row buffers, started like torch's on a row's first update),
  weight decay and Nesterov, on present rows only.
* Adagrad: per-row accumulators, torch's formula with the table's step count for ``lr_decay``.

A table may carry its own optimizer instead (:class:`TableOptimizerSpec`, set on its
``ServerTableSpec``): picasso_ops' sparse optimizers (``sgd``, ``rowwise_adagrad``, lazy
``adam``), run on the servers by picasso_ops' own update code (the same :class:`RowOptimizer`), so
a packed table trained through the servers follows the picasso block's formulas exactly.

Example::

    spec = OptimizerSpec.from_deepspeed({"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}})
    dense_opt = spec.build_dense([shard_param])          # torch.optim.AdamW
    rows = spec.build_rows(initial_table_shard)          # LazyTorchAdam owning the table
    rows.step(local_ids, row_grads)
    own = TableOptimizerSpec.of("rowwise_adagrad", lr=0.05).build_rows(initial_table_shard)   # picasso's formula
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping, Sequence

import torch
from torch import Tensor

from picasso_ops.embedding.sparse_optim import OPTIMIZERS as SPARSE_OPTIMIZERS
from picasso_ops.embedding.sparse_optim import (TORCH_ROW_OPTIMIZERS, RowUpdate, SparseOptimizer, TorchRowAdagrad,
                                                TorchRowAdam, TorchRowSGD, create_optimizer, resolve_hyperparams)

SUPPORTED = ("adam", "adamw", "sgd", "adagrad")
_DEEPSPEED_ONLY = ("torch_adam", "adam_w_mode", "fp32_optimizer_states")  # consumed by DeepSpeed, not torch
_IMPLEMENTATION_ONLY = ("foreach", "fused", "capturable", "differentiable")  # speed knobs: same maths


@dataclasses.dataclass(frozen=True)
class OptimizerSpec:
    """An optimizer type (``adam``, ``adamw``, ``sgd``, ``adagrad``) and its torch keyword arguments."""

    type: str
    params: tuple[tuple[str, Any], ...] = ()

    def __post_init__(self) -> None:
        if self.type not in SUPPORTED:
            raise ValueError(f"parameter-server optimizer must be one of {SUPPORTED}, got {self.type!r}")
        try:  # fail at construction, with the type named, rather than on the first server step
            self.build_dense([torch.nn.Parameter(torch.zeros(1))])
            self.build_rows(torch.zeros(1, 1))
        except (TypeError, ValueError) as exc:
            raise ValueError(f"optimizer {self.type!r} with params {dict(self.params)}: {exc}") from exc

    @classmethod
    def of(cls, type: str, **params: Any) -> "OptimizerSpec":
        """Direct construction: ``OptimizerSpec.of("adam", lr=1e-3, betas=(0.9, 0.99))``."""
        return cls(type=type.lower(), params=tuple(sorted(params.items())))

    @classmethod
    def from_deepspeed(cls, block: Mapping[str, Any]) -> "OptimizerSpec":
        """From a DeepSpeed ``"optimizer"`` block (``{"type": ..., "params": {...}}``).

        Example::

            OptimizerSpec.from_deepspeed({"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}})
        """
        if "type" not in block:
            raise ValueError(f"optimizer block needs a 'type', got keys {sorted(block)}")
        name = str(block["type"]).lower()
        params = dict(block.get("params") or {})
        if name in ("adam", "adamw"):
            adam_w_mode = bool(params.get("adam_w_mode", True))
            name = "adamw" if (name == "adamw" or adam_w_mode) else "adam"
        elif name not in SUPPORTED:
            raise ValueError(
                f"optimizer type {block['type']!r} cannot run on the parameter servers; supported: "
                "Adam, AdamW, SGD, Adagrad (element-wise optimizers shard exactly)"
            )
        kept = {k: (tuple(v) if isinstance(v, list) else v) for k, v in params.items() if k not in _DEEPSPEED_ONLY}
        return cls(type=name, params=tuple(sorted(kept.items())))

    @property
    def kwargs(self) -> dict[str, Any]:
        """The torch keyword arguments (a fresh dict)."""
        return dict(self.params)

    def build_dense(self, params: Sequence[Tensor]) -> torch.optim.Optimizer:
        """The torch optimizer over a dense shard."""
        cls = {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW, "sgd": torch.optim.SGD,
               "adagrad": torch.optim.Adagrad}[self.type]
        return cls(list(params), **self.kwargs)

    def build_rows(self, weight: Tensor) -> "RowOptimizer":
        """A lazy row-wise optimizer that owns ``weight`` (a [rows, dim] table shard; copied)."""
        kwargs = {k: v for k, v in self.kwargs.items() if k not in _IMPLEMENTATION_ONLY}
        if self.type in ("adam", "adamw"):
            kwargs["decoupled"] = self.type == "adamw"
        return RowOptimizer(weight, TORCH_ROW_OPTIMIZERS[self.type](**kwargs))


class RowOptimizer:
    """A table shard and its optimizer state, updated by one member of picasso_ops' row-optimizer family.

    The one holder of the servers' tables and of the workers' copies of them: ``optimizer`` is a
    :class:`~picasso_ops.embedding.sparse_optim.SparseOptimizer` (torch's formulas for the job's
    optimizer, :data:`~picasso_ops.embedding.sparse_optim.TORCH_ROW_OPTIMIZERS`; picasso's own for a
    table with a :class:`TableOptimizerSpec`); :meth:`step` updates only the given rows, and the
    step count ticks on every update, present rows or not, as dense torch optimizers and picasso's
    packed tables count their steps.

    Example::

        opt = RowOptimizer(torch.zeros(4, 2), TorchRowSGD(lr=0.1))
        opt.step(torch.tensor([1]), torch.ones(1, 2)); opt.weight[1]      # tensor([-0.1000, -0.1000])
    """

    def __init__(self, weight: Tensor, optimizer: SparseOptimizer) -> None:
        if weight.dim() != 2:
            raise ValueError(f"a table shard must be 2-D [rows, dim], got shape {tuple(weight.shape)}")
        self.weight = weight.detach().to(torch.float32).clone()
        self.steps = 0  # updates applied to this table (its bias-correction / lr-decay clock)
        self.sparse = optimizer
        rows, dim = self.weight.shape
        self.state = optimizer.init_state(rows, dim, num_logical_rows=rows)

    @property
    def lr(self) -> float:
        """The learning rate of the next update (the server sets it from the schedule)."""
        return self.sparse.lr

    @lr.setter
    def lr(self, value: float) -> None:
        self.sparse.lr = value

    def step(self, rows: Tensor, grad: Tensor) -> None:
        """Apply one global-batch update: ``rows`` unique local indices, ``grad`` [len(rows), dim]."""
        if grad.shape != (rows.numel(), self.weight.shape[1]):
            raise ValueError(f"row gradient shape {tuple(grad.shape)} != ({rows.numel()}, {self.weight.shape[1]})")
        self.steps += 1  # every update ticks the clock, present rows or not, as dense torch optimizers do
        if rows.numel():
            self.sparse.update(self.weight, self.state, RowUpdate.simple(rows, grad.to(torch.float32), step=self.steps))

    def put(self, rows: Tensor, values: Tensor) -> None:
        """Overwrite row values (initialisation, cache write-back); optimizer state is kept."""
        self.weight[rows] = values.to(torch.float32)

    def state_dict(self) -> dict[str, Tensor | int]:
        """Copies of the shard's weight, every per-row state tensor and the step count (for checkpoints).

        Example::

            table.state_dict().keys()      # dict_keys(['weight', 'exp_avg', 'exp_avg_sq', 'steps'])
        """
        out: dict[str, Tensor | int] = {"weight": self.weight.clone()}
        out.update({k: v.clone() for k, v in self._state_tensors().items()})
        out["steps"] = self.steps
        return out

    def load_state_dict(self, state: dict[str, Tensor | int]) -> None:
        """Install a :meth:`state_dict` of a shard of the same shape and optimizer; a mismatch is a clear error."""
        want = {"weight", "steps", *self._state_tensors()}
        if set(state) != want:
            raise ValueError(f"table state has keys {sorted(state)}, this {self._kind()} needs {sorted(want)}")
        for key, mine in {"weight": self.weight, **self._state_tensors()}.items():
            if state[key].shape != mine.shape:
                raise ValueError(f"table state {key!r} has shape {tuple(state[key].shape)}, this shard "
                                 f"{tuple(mine.shape)}: was it saved with another num_servers or table size?")
            mine.copy_(state[key])
        self.steps = int(state["steps"])

    def _kind(self) -> str:
        return f"{type(self).__name__} ({type(self.sparse).__name__})"

    def _state_tensors(self) -> dict[str, Tensor]:
        """Per-row optimizer state by name (none for plain SGD)."""
        return dict(self.state)


class LazySGD(RowOptimizer):
    """torch.optim.SGD on the present rows (per-row momentum buffers): ``RowOptimizer`` with :class:`TorchRowSGD`."""

    def __init__(self, weight: Tensor, **kwargs: Any) -> None:
        super().__init__(weight, TorchRowSGD(**kwargs))


class LazyTorchAdam(RowOptimizer):
    """torch.optim.Adam / AdamW on the present rows: ``RowOptimizer`` with :class:`TorchRowAdam` (see its formula)."""

    def __init__(self, weight: Tensor, decoupled: bool, **kwargs: Any) -> None:
        super().__init__(weight, TorchRowAdam(decoupled=decoupled, **kwargs))


class LazyAdagrad(RowOptimizer):
    """torch.optim.Adagrad on the present rows (per-row accumulators): ``RowOptimizer`` with :class:`TorchRowAdagrad`."""

    def __init__(self, weight: Tensor, **kwargs: Any) -> None:
        super().__init__(weight, TorchRowAdagrad(**kwargs))


LR_SCHEDULES = ("deepspeed", "constant")


@dataclasses.dataclass(frozen=True)
class TableOptimizerSpec:
    """A server table's own sparse optimizer (picasso_ops' ``sgd``, ``rowwise_adagrad``, ``adam``) and its lr schedule.

    ``params`` are picasso's hyperparameters (``lr``, ``eps``, ``beta1``, ``beta2``; defaults
    filled in). ``lr_schedule`` ``"deepspeed"``: update ``u`` runs at ``lr`` x DeepSpeed's lr of
    optimizer step ``u`` / its schedule's peak (``schedule_peak``, set from the config's
    ``scheduler`` block by ``gba_engine.startup``; no scheduler: ``lr``), as picasso scales
    worker-side tables; ``"constant"``: always ``lr``.

    Example::

        spec = TableOptimizerSpec.of("adam", lr=0.01, lr_schedule="deepspeed")
        spec.scheduled_lr(ds_lr=0.0005)                  # 0.01: no peak known yet, lr throughout
        spec.with_peak(0.001).scheduled_lr(0.0005)       # 0.005
    """

    type: str
    params: tuple[tuple[str, float], ...] = ()
    lr_schedule: str = "constant"
    schedule_peak: float | None = None  # the DeepSpeed schedule's peak lr that "deepspeed" scaling divides by

    def __post_init__(self) -> None:
        if self.type not in SPARSE_OPTIMIZERS:
            raise ValueError(f"a table's sparse optimizer must be one of {tuple(SPARSE_OPTIMIZERS)}, got {self.type!r}")
        if self.lr_schedule not in LR_SCHEDULES:
            raise ValueError(f"a table's lr_schedule must be one of {LR_SCHEDULES}, got {self.lr_schedule!r}")
        if self.schedule_peak is not None and not (self.schedule_peak > 0 and math.isfinite(self.schedule_peak)):
            raise ValueError(f"schedule_peak must be a finite lr > 0, got {self.schedule_peak}")
        object.__setattr__(self, "params", resolve_hyperparams(self.type, dict(self.params)))

    @classmethod
    def of(cls, type: str, lr_schedule: str = "constant", **params: float) -> "TableOptimizerSpec":
        """Direct construction: ``TableOptimizerSpec.of("rowwise_adagrad", lr=0.05, eps=1e-8)``."""
        return cls(type=type, params=tuple(sorted(params.items())), lr_schedule=lr_schedule)

    @property
    def lr(self) -> float:
        """The table's lr (the peak under a "deepspeed" schedule)."""
        return dict(self.params)["lr"]

    def with_peak(self, peak: float | None) -> "TableOptimizerSpec":
        """This spec scaled against a DeepSpeed schedule peaking at ``peak`` (None: no scheduler)."""
        return dataclasses.replace(self, schedule_peak=peak)

    def scheduled_lr(self, ds_lr: float) -> float:
        """The table's lr for an update DeepSpeed runs at ``ds_lr``."""
        if self.lr_schedule != "deepspeed" or self.schedule_peak is None:
            return self.lr
        return self.lr * ds_lr / self.schedule_peak

    def build_rows(self, weight: Tensor) -> "SparseRowOptimizer":
        """picasso's optimizer owning ``weight`` (a [rows, dim] table shard; copied)."""
        return SparseRowOptimizer(weight, create_optimizer(self.type, dict(self.params)))


class SparseRowOptimizer(RowOptimizer):
    """A picasso ``SparseOptimizer`` of the ``picasso`` block's kinds on a server's table shard (its own formula).

    ``rowwise_adagrad`` keeps one accumulator per row (``momentum1 += mean(g**2)``, ``w -= lr *
    g / (sqrt(momentum1) + eps)``); ``adam`` picasso's lazy Adam with the table's update count
    as ``t``; ``sgd`` ``w -= lr * g``. The same holder as every other table (:class:`RowOptimizer`).

    Example::

        opt = TableOptimizerSpec.of("rowwise_adagrad", lr=0.1).build_rows(torch.zeros(4, 2))
        opt.step(torch.tensor([1]), torch.ones(1, 2)); opt.weight[1]      # tensor([-0.1000, -0.1000])
    """
