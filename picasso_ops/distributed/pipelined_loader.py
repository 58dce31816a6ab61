"""A user's own batches through the sparse-dist pipeline: ``for batch in engine.pipeline(loader)``.

:class:`~picasso_ops.distributed.pipeline.SparseDistPipeline` needs a stream it can read ahead
(``peek``) and a loop that tells it when a step is done. :class:`PipelinedLoader` gives it both
around any iterable of batches: a one-item lookahead the pipeline's thread fills (so the data is
read off the step's critical path too), and a ``step_done`` hook that ``SparseEngine.step()``
calls. The loop the user writes stays DeepSpeed's::

    for dense, kjt, labels in engine.pipeline(loader):        # batch i+1 read and exchanged meanwhile
        loss = loss_fn(engine(dense, kjt), labels)
        engine.backward(loss)
        engine.step()                                          # the tables' step, then batch i+1's rows

The ids of a batch (``ids(batch)``: field-major ``(values, lengths[F, B])``, optionally per-sample
weights) must be the ones the model's field-embedding module is called with; a batch holding one
torchrec ``KeyedJaggedTensor`` needs no ``ids``. A prepared lookup that does not match the
forward's batch raises instead of training on other rows.
"""
from __future__ import annotations

import logging
import threading
from typing import Any, Callable, Iterable, Iterator, Optional

from torch import Tensor, nn

from picasso_ops.distributed.pipeline import SparseDistPipeline, pipelined_tables

__all__ = ["PipelinedLoader", "kjt_ids", "unpipelined_reason"]

logger = logging.getLogger(__name__)

IdsFn = Callable[[Any], tuple[Tensor, ...]]


def unpipelined_reason(mode: str, model: nn.Module, *, micro_batches: int = 1, cache: bool = False) -> Optional[str]:
    """Why ``picasso.pipeline`` = ``mode`` cannot pipeline ``model`` (``None``: it can).

    Example::

        >>> unpipelined_reason("off", nn.Linear(2, 2))
        'picasso.pipeline is "off"'
    """
    if mode == "off":
        return 'picasso.pipeline is "off"'
    if micro_batches > 1:
        return "interleave.micro_batches > 1 splits each batch"
    if cache:
        return "a cache serves the tables"
    data_parallel = mode == "all"
    if not pipelined_tables(model, data_parallel):
        return "the model has no packed " + ("data-parallel or row-wise" if data_parallel else "row-wise") + " tables"
    return None


def kjt_ids(batch: Any) -> tuple[Tensor, Tensor]:
    """``(values, lengths [F, B])`` of the one torchrec ``KeyedJaggedTensor`` in ``batch`` (itself, or in a tuple,
    list or dict), as a model passes ``kjt.values(), kjt.lengths().view(F, -1)`` to its tables.

    Example::

        >>> values, lengths = kjt_ids((dense, kjt, labels))  # doctest: +SKIP
    """
    items = batch.values() if isinstance(batch, dict) else batch if isinstance(batch, (tuple, list)) else (batch,)
    found = [x for x in items if type(x).__name__ == "KeyedJaggedTensor" and hasattr(x, "lengths")]
    if len(found) != 1:
        raise TypeError(f"engine.pipeline: a batch of {type(batch).__name__} holds {len(found)} KeyedJaggedTensors; "
                        "pass ids=lambda batch: (values, lengths) with the field-major ids the model's tables get")
    kjt = found[0]
    return kjt.values(), kjt.lengths().view(len(kjt.keys()), -1)


class _Lookahead:
    """An iterator read one item ahead by ``peek`` (the pipeline's thread) and consumed by ``take`` (the loop)."""

    def __init__(self, batches: Iterable[Any]) -> None:
        self._it: Iterator[Any] = iter(batches)
        self._lock = threading.Lock()
        self._next: list[Any] = []
        self._ended = False

    def _fill(self) -> None:
        if not self._next and not self._ended:
            try:
                self._next.append(next(self._it))
            except StopIteration:
                self._ended = True

    def peek(self) -> Any:
        with self._lock:
            self._fill()
            return self._next[0] if self._next else None

    def take(self) -> Any:
        with self._lock:
            self._fill()
            return self._next.pop() if self._next else None


class PipelinedLoader:
    """One pass over ``batches`` with each next batch's lookups prepared on a thread while this one trains.

    Every rank iterates it in step (its thread's exchanges are collectives over a gloo group of its
    own, created here: a collective). After each batch the loop calls ``engine.step()`` (which calls
    :meth:`step_done`); a batch without a step is released when the next one is taken. The pass
    closes itself at the end of ``batches``; :meth:`close` (or ``with``) ends it early on every rank.

    Args:
        model: the module whose packed tables are prepared (the engine's ``module``).
        batches: any iterable of the user's batches.
        ids: a batch's field-major ``(values, lengths)`` or ``(values, lengths, weights)``
            (default: :func:`kjt_ids`).
        data_parallel: also prepare data-parallel tables (``picasso.pipeline`` ``"all"``).
        timeout_s: deadline of every wait and of the pipeline group's collectives.

    Example::

        >>> loader = PipelinedLoader(engine.module, batches, ids=lambda b: (b.values, b.lengths))  # doctest: +SKIP
    """

    def __init__(self, model: nn.Module, batches: Iterable[Any], ids: Optional[IdsFn] = None, *,
                 data_parallel: bool = False, timeout_s: float = 300.0) -> None:
        self._source = _Lookahead(batches)
        self._pipe: Optional[SparseDistPipeline] = SparseDistPipeline(
            model, peek=self._source.peek, to_batch=ids or kjt_ids, timeout_s=timeout_s,
            data_parallel=data_parallel)
        self._unreleased = False  # the batch handed out last has not had its step yet
        self.stats: dict[str, int] = self._pipe.stats  # rounds read ahead, void rounds, batches trained unprepared

    def __iter__(self) -> "PipelinedLoader":
        return self

    def __next__(self) -> Any:
        if self._pipe is None:
            raise StopIteration
        self.step_done()
        try:
            item = self._pipe.next_item(self._source.take)
            if item is not None:
                self._pipe.submit()  # the next batch is read and exchanged while this one trains
                self._pipe.arm()  # this batch's lookups, prepared while the last one trained
        except BaseException:
            self.close(quiet=True)
            raise
        if item is None:  # the end of the batches (on every rank: that round was void everywhere)
            self.close()
            raise StopIteration
        self._unreleased = True
        return item

    def step_done(self) -> None:
        """The step of the batch handed out last is done: the next batch's rows may be fetched (idempotent)."""
        if self._unreleased and self._pipe is not None:
            self._unreleased = False
            self._pipe.release()

    @property
    def closed(self) -> bool:
        return self._pipe is None

    def close(self, quiet: bool = False) -> None:
        """End the pass: stop the thread (raises its pending error unless ``quiet``); idempotent."""
        pipe, self._pipe = self._pipe, None
        if pipe is None:
            return
        try:  # a round waiting for a step that will not come is dropped, on every rank alike
            pipe.close()
        except Exception:
            if not quiet:
                raise
            logger.exception("closing the sparse-dist pipeline after an error")

    def __enter__(self) -> "PipelinedLoader":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close(quiet=exc[0] is not None)
