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

:func:`engine_step` does all of this in place of ``engine.step()``.

Example::

    >>> from picasso_ops.distributed import engine_step
    >>> for batch in batches:
    ...     engine.backward(loss_fn(engine(batch.dense, batch.values, batch.lengths), batch.labels))
    ...     engine_step(engine)   # instead of engine.step()
"""

from __future__ import annotations

import logging
from typing import Any, Iterator

from torch import nn

__all__ = ["sparse_modules", "sparse_step", "discard_sparse_gradients", "wait_sparse_backward", "engine_step"]

logger = logging.getLogger(__name__)


def sparse_modules(module: nn.Module) -> Iterator[nn.Module]:
    """Submodules of ``module`` (itself included) that own deferred sparse tables (have ``sparse_step``).

    Example::

        >>> list(sparse_modules(nn.Linear(2, 2)))
        []
    """
    for m in module.modules():
        if callable(getattr(m, "sparse_step", None)) and callable(getattr(m, "discard_pending", None)):
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
        wait = getattr(m, "wait_sparse_backward", None)
        if callable(wait):
            wait()


def _loss_scale(engine: Any) -> float:
    """The loss scale the last backward used (1 without fp16)."""
    fp16 = getattr(engine, "fp16_enabled", None)
    if not callable(fp16) or not fp16():
        return 1.0
    scale = engine._get_optimizer_loss_scale()  # read before step(): an overflow step lowers it
    return float(scale) if scale is not None else 1.0


def engine_step(engine: Any) -> bool:
    """``engine.step()`` plus the sparse tables' step at the gradient-accumulation boundary.

    Call it in place of ``engine.step()`` after every ``engine.backward``.
    Returns ``True`` when this call was an accumulation boundary.

    Example::

        >>> engine.backward(loss); engine_step(engine)  # doctest: +SKIP
    """
    managed = getattr(engine, "managed_gradient_accumulation", None)
    boundary = engine.is_gradient_accumulation_boundary() or (callable(managed) and not managed())
    scale = _loss_scale(engine) if boundary else 1.0
    engine.step()
    if not boundary:
        return False
    applied = getattr(engine, "was_step_applied", None)
    if callable(applied) and not applied():
        logger.warning("the engine skipped its step (overflow): dropping the sparse gradients of this step too")
        discard_sparse_gradients(engine.module)
    else:
        sparse_step(engine.module, grad_scale=1.0 / scale)
    return True
