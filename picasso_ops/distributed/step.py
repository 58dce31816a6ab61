"""The sparse step contract between fused/deferred embedding tables and DeepSpeed's engine.

The packed tables register no parameters, so DeepSpeed's engine never sees
them: their gradients go (already summed per unique row) into the tables'
own deferred buffers during ``loss.backward()``, and their optimizer runs in
:func:`sparse_step`. The contract, on every rank:

* ``engine.backward(loss)`` divides the loss by ``gradient_accumulation_steps``
  (and, under fp16, multiplies it by the loss scale) before autograd runs, so
  the stored row gradients carry the same ``1 / gas`` as the dense ones.
* The tables keep accumulating over the micro-batches of one accumulation
  window (``defer_updates``); nothing is applied before the boundary.
* At the boundary, after ``engine.step()`` has applied the dense step, the
  tables exchange their row gradients across ranks and take exactly one
  optimizer step with ``grad_scale = 1 / loss_scale``; if the engine skipped
  its step (fp16 overflow) the sparse gradients are dropped too.
* Embedding backwards that a ``picasso_ops.interleave.InterleavedForward``
  queued on its sparse thread are waited for before the tables' step.
* DeepSpeed's gradient clipping does not cover the tables (their gradients
  never exist densely), as with torchrec's fused optimizers.
* With ``engine_step(engine, sparse_lr=peak)`` the tables follow DeepSpeed's
  learning-rate schedule: their step at a boundary uses
  ``peak * deepspeed_lr_factor(engine)``, the factor read *before*
  ``engine.step()``, i.e. from the lr DeepSpeed's optimizer uses for that same
  step (``engine.step()`` steps the optimizer, then advances the scheduler).

:func:`engine_step` does all of this in place of ``engine.step()``.

Example::

    >>> from picasso_ops.distributed import engine_step
    >>> for batch in batches:
    ...     engine.backward(loss_fn(engine(batch.dense, batch.values, batch.lengths), batch.labels))
    ...     engine_step(engine)   # instead of engine.step()
    >>> engine_step(engine, sparse_lr=0.05)  # tables at 0.05 x DeepSpeed's lr / its schedule's peak
"""

from __future__ import annotations

import logging
import math
from typing import Any, Iterator, Optional

from torch import nn

from picasso_ops.contracts import SparseBackwardQueue, SparseStepModule

__all__ = ["sparse_modules", "sparse_step", "discard_sparse_gradients", "wait_sparse_backward", "engine_step",
           "schedule_peak_lr", "deepspeed_lr_factor", "set_sparse_lr"]

logger = logging.getLogger(__name__)
_warned: set[str] = set()  # one warning per scheduler type / problem, not one per step


def sparse_modules(module: nn.Module) -> Iterator[SparseStepModule]:
    """Submodules of ``module`` (itself included) that own deferred sparse tables (:class:`SparseStepModule`).

    Example::

        >>> list(sparse_modules(nn.Linear(2, 2)))
        []
    """
    for m in module.modules():
        if isinstance(m, SparseStepModule):
            yield m


def sparse_step(module: nn.Module, grad_scale: float = 1.0) -> int:
    """Apply every sparse table's accumulated gradients in ``module`` (one step each); returns how many.

    A collective when the tables are distributed: call it on every rank, in
    the same place. ``grad_scale`` multiplies the gradients (``1 / loss_scale``).

    Example::

        >>> sparse_step(nn.Linear(2, 2))
        0
    """
    wait_sparse_backward(module)
    n = 0
    for m in sparse_modules(module):
        m.sparse_step(grad_scale=grad_scale)
        n += 1
    return n


def discard_sparse_gradients(module: nn.Module) -> None:
    """Drop every sparse table's accumulated gradients in ``module`` (local)."""
    wait_sparse_backward(module)
    for m in sparse_modules(module):
        m.discard_pending()


def wait_sparse_backward(module: nn.Module) -> None:
    """Let embedding backwards still running on other threads finish (``InterleavedForward`` queues them).

    Example::

        >>> wait_sparse_backward(nn.Linear(2, 2))  # nothing queued: returns at once
    """
    for m in module.modules():
        if isinstance(m, SparseBackwardQueue):
            m.wait_sparse_backward()


def _loss_scale(engine: Any) -> float:
    """The loss scale the last backward used (1 without fp16)."""
    fp16 = getattr(engine, "fp16_enabled", None)
    if not callable(fp16) or not fp16():
        return 1.0
    scale = engine._get_optimizer_loss_scale()  # read before step(): an overflow step lowers it
    return float(scale) if scale is not None else 1.0


def _warn_once(key: str, message: str, *args: Any) -> None:
    if key not in _warned:
        _warned.add(key)
        logger.warning(message, *args)


def _first(values: Any) -> Optional[float]:
    """``float(values[0])`` of a per-param-group list (tensors too), ``None`` when empty or missing."""
    if values is None or len(values) == 0:
        return None
    return float(values[0])


def schedule_peak_lr(scheduler: Any) -> Optional[float]:
    """The lr of param group 0 that ``scheduler``'s shape is relative to (``None``: a scheduler of unknown kind).

    DeepSpeed's WarmupLR / WarmupDecayLR / OneCycle: their peak (``warmup_max_lr``,
    ``cycle_max_lr``); WarmupCosineLR: the optimizer's lr, which its ratio
    multiplies; LRRangeTest: its start (``lr_range_test_min_lr``); torch
    schedulers (``base_lrs``): the optimizer's initial lr.

    Example::

        >>> # ds_configs/demo_cpu.json: WarmupDecayLR with warmup_max_lr 0.003
        >>> schedule_peak_lr(engine.lr_scheduler)  # doctest: +SKIP
        0.003
    """
    for attr in ("max_lrs", "org_lrs", "base_lrs"):
        peak = _first(getattr(scheduler, attr, None))
        if peak is not None:
            return peak
    if type(scheduler).__name__ == "LRRangeTest":  # its lr grows from min_lr: the tables grow from theirs
        return _first(getattr(scheduler, "min_lr", None))
    return None


def deepspeed_lr_factor(engine: Any) -> float:
    """DeepSpeed's lr of param group 0 for its coming optimizer step over its schedule's peak (1: no schedule).

    Read it *before* ``engine.step()``: the optimizer steps with the current
    lr, then the scheduler moves it to the next step's. 1.0 without a
    scheduler, for a scheduler of unknown kind, or a peak of 0 (warned once);
    0.0 is a valid answer: DeepSpeed's warm-ups start at iteration -1
    (``warmup_min_lr``) and go to iteration 0 after the first step, so with
    ``warmup_min_lr = 0`` the first two dense steps run at lr 0. Reads the engine only.

    Example::

        >>> # demo_cpu.json's WarmupDecayLR (0 to 0.003 over 100 linear steps) at scheduler iteration 10:
        >>> deepspeed_lr_factor(engine)  # doctest: +SKIP
        0.1
    """
    scheduler = getattr(engine, "lr_scheduler", None)
    if scheduler is None:
        return 1.0
    peak = schedule_peak_lr(scheduler)
    name = type(scheduler).__name__
    if peak is None:
        _warn_once(f"unknown:{name}", "sparse lr schedule: no peak lr known for scheduler %s; the tables keep their "
                   "lr (factor 1)", name)
        return 1.0
    if not (peak > 0.0 and math.isfinite(peak)):
        _warn_once(f"peak:{name}", "sparse lr schedule: scheduler %s's peak lr is %s; the tables keep their lr "
                   "(factor 1)", name, peak)
        return 1.0
    get_lr = getattr(engine, "get_lr", None)
    lr = _first(get_lr()) if callable(get_lr) else _first([g["lr"] for g in engine.optimizer.param_groups])
    if lr is None:
        _warn_once("no-lr", "sparse lr schedule: the engine reports no lr; the tables keep their lr (factor 1)")
        return 1.0
    return lr / peak


def set_sparse_lr(module: nn.Module, lr: float) -> int:
    """Set the learning rate of every sparse table in ``module`` (local); returns how many modules.

    Example::

        >>> set_sparse_lr(nn.Linear(2, 2), 0.01)
        0
    """
    n = 0
    for m in sparse_modules(module):
        if isinstance(getattr(type(m), "lr", None), property):  # packed and row-sharded collections: every pack
            m.lr = lr
        elif hasattr(getattr(getattr(m, "cache", None), "optimizer", None), "lr"):
            m.cache.optimizer.lr = lr  # CachedFieldEmbeddings: one optimizer for cached and stored rows
        else:
            raise TypeError(f"{type(m).__name__} has sparse tables but no lr to schedule; "
                            'use picasso.optimizer.lr_schedule = "constant"')
        n += 1
    return n


def engine_step(engine: Any, sparse_lr: Optional[float] = None) -> bool:
    """``engine.step()`` plus the sparse tables' step at the gradient-accumulation boundary.

    Call it in place of ``engine.step()`` after every ``engine.backward``.
    Returns ``True`` when this call was an accumulation boundary.
    ``sparse_lr``: the tables' peak lr, scaled at each boundary by
    :func:`deepspeed_lr_factor` (the lr DeepSpeed's optimizer uses for the same
    step over its schedule's peak); ``None`` leaves the tables' lr alone.

    Example::

        >>> engine.backward(loss); engine_step(engine)  # doctest: +SKIP
        >>> engine.backward(loss); engine_step(engine, sparse_lr=0.05)  # doctest: +SKIP
    """
    managed = getattr(engine, "managed_gradient_accumulation", None)
    boundary = engine.is_gradient_accumulation_boundary() or (callable(managed) and not managed())
    scale = _loss_scale(engine) if boundary else 1.0
    # before engine.step(): it steps the optimizer at this lr, then the scheduler moves to the next step's
    factor = deepspeed_lr_factor(engine) if boundary and sparse_lr is not None else 1.0
    engine.step()
    if not boundary:
        return False
    applied = getattr(engine, "was_step_applied", None)
    if callable(applied) and not applied():
        logger.warning("the engine skipped its step (overflow): dropping the sparse gradients of this step too")
        discard_sparse_gradients(engine.module)
    else:
        if sparse_lr is not None:
            set_sparse_lr(engine.module, sparse_lr * factor)
        sparse_step(engine.module, grad_scale=1.0 / scale)
    return True
