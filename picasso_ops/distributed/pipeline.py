"""A sparse-dist pipeline: the next batch's ids read, deduplicated and exchanged while this batch trains.

The way torchrec's ``TrainPipelineSparseDist`` moves input distribution off the critical path, for
packed tables: while batch ``i``'s forward, backward and step run on the caller's thread, a
background thread reads batch ``i+1`` and, on a gloo process group of its own,

* row-wise tables (:class:`RowShardedEmbeddingCollection`): deduplicates its ids per owner and sends
  them to the owners (the two all-to-alls of counts and ids); once batch ``i``'s step is done
  (:meth:`SparseDistPipeline.release`) the owners send the rows back, so they carry that step's update;
* data-parallel tables (:class:`DataParallelEmbeddingCollection`): the distinct rows each rank's
  backward will touch and their union over the ranks, so the sparse step gathers only gradients and
  skips the dedup of the gathered rows.

Batch ``i+1``'s forward then finds its rows ready and does no exchange. The results equal the
unpipelined step bit for bit: the same rows (fetched after the update they must see), the same
dedup, the same sums in the same order. The thread runs torch ops at the process's thread count
and never changes it; its collectives go over its own group, created once at construction on every
rank in the same order, so two threads' collectives never interleave on one group.

Protocol, on every rank, per training micro-step (collective: the same calls in the same order)::

    pipe = SparseDistPipeline(model, peek=stream.peek, to_batch=lambda b: (b.values, b.lengths))
    batch = pipe.next_item(lambda: next(batches, None))   # the batch read ahead (or read now)
    pipe.submit()                                           # start the next one
    pipe.arm()                                              # this batch's prepared lookups into the tables
    loss = model(batch); loss.backward(); step()            # no exchange in the tables' forward
    pipe.release()                                          # the tables are updated: fetch the next rows
    ...
    pipe.close()

A round where some rank has no batch (the data ended, an epoch ended) is void on every rank: that
micro-step's batch runs unprepared. Every wait has a deadline (``timeout_s``, also the group's
collective timeout); an error on the thread is raised on the caller's thread at its next call, as a
:class:`PipelineError` naming the rank.
"""
from __future__ import annotations

import datetime
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence, Union

import torch
import torch.distributed as dist
from torch import Tensor, nn

from picasso_ops.distributed.comm import ProcessGroup, world_info
from picasso_ops.distributed.data_parallel import DataParallelEmbeddingCollection
from picasso_ops.distributed.mixed import MixedEmbeddingCollection
from picasso_ops.distributed.row_sharded import PreparedLookup, RowShardedEmbeddingCollection
from picasso_ops.jagged import JaggedBatch

__all__ = ["SparseDistPipeline", "PipelineError", "pipelined_tables"]

logger = logging.getLogger(__name__)

Tables = Union[DataParallelEmbeddingCollection, RowShardedEmbeddingCollection]


class PipelineError(RuntimeError):
    """The pipeline's thread failed, or a wait passed its deadline; the message names the rank."""


@dataclass
class _Target:
    """A field-embedding module's collection part and the keys its batches carry."""

    keys: tuple[str, ...]
    tables: Tables


@dataclass
class _Round:
    """One batch read ahead and its lookups prepared."""

    needs_releases: int  # release() calls before its rows may be fetched
    item: Any = None
    read: threading.Event = field(default_factory=threading.Event)
    ready: threading.Event = field(default_factory=threading.Event)
    void: bool = False  # some rank had no batch: nothing prepared
    prepared: list[Any] = field(default_factory=list)  # per target: PreparedLookup or unions
    error: Optional[BaseException] = None


def pipelined_tables(model: nn.Module, data_parallel: bool = True) -> list[_Target]:
    """The packed table collections of ``model``'s field-embedding modules the pipeline prepares, with their keys.

    Field-embedding modules (``picasso_ops.models``' packed ones) call their collection with a
    ``JaggedBatch(keys, values, lengths)``; a mixed collection counts as its two parts.
    ``data_parallel`` False: the row-wise collections only.

    Example::

        >>> pipelined_tables(nn.Linear(2, 2))
        []
    """
    out: list[_Target] = []
    for module in model.modules():
        keys, coll = getattr(module, "keys", None), getattr(module, "collection", None)
        if not isinstance(keys, tuple) or coll is None:
            continue
        parts: Sequence[nn.Module] = coll.parts if isinstance(coll, MixedEmbeddingCollection) else [coll]
        kinds = (DataParallelEmbeddingCollection, RowShardedEmbeddingCollection) if data_parallel else (
            RowShardedEmbeddingCollection,)
        out += [_Target(keys, p) for p in parts if isinstance(p, kinds)]
    return out


class SparseDistPipeline:
    """Reads and prepares the next training batch's sparse lookups on a thread while the current one trains.

    Args:
        model: the model whose packed tables (:func:`pipelined_tables`) are prepared.
        peek: reads the next training item without consuming it (``None``: no batch on this rank now);
            the item the next ``next_item``'s ``take()`` returns must be this one.
        to_batch: an item's field-major ``(values, lengths)`` or ``(values, lengths, per-sample weights)``, as
            the field-embedding modules pass them to their collections.
        timeout_s: deadline of every wait and of the group's collectives.
        group: the pipeline's process group (default: a new gloo group over the world, a collective).
        data_parallel: also prepare the data-parallel tables' row unions (False: the row-wise tables only;
            the union's local dedup can cost as much as the step's dedup it saves, benchmarks/RESULTS.md).

    Example::

        >>> pipe = SparseDistPipeline(model, peek=stream.peek, to_batch=lambda b: (b.values, b.lengths))
    """

    def __init__(self, model: nn.Module, peek: Callable[[], Any], to_batch: Callable[[Any], tuple[Tensor, ...]],
                 *, timeout_s: float = 300.0, group: Optional[ProcessGroup] = None,
                 data_parallel: bool = True) -> None:
        self.targets = pipelined_tables(model, data_parallel)
        if not self.targets:
            kinds = "data-parallel or row-sharded" if data_parallel else "row-sharded"
            raise ValueError(f"SparseDistPipeline: the model has no {kinds} packed tables under a field-embedding "
                             "module (nothing to prepare)")
        self.rank, self.world_size = world_info(None)
        if group is None and self.world_size > 1:  # every rank, in the same order: a collective
            group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
        self.group = group
        self.peek, self.to_batch, self.timeout_s = peek, to_batch, timeout_s
        self._jobs: "queue.Queue[Optional[_Round]]" = queue.Queue()
        self._delivered: list[_Round] = []  # submitted rounds not yet taken by next_item
        self._current: Optional[_Round] = None  # the round of the batch being trained
        self._cond = threading.Condition()
        self._releases, self._closing = 0, False
        self._failure: Optional[BaseException] = None
        self.stats = {"rounds": 0, "void": 0, "unprepared": 0}
        self._thread = threading.Thread(target=self._run, name=f"sparse-dist-rank{self.rank}", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------ caller's thread
    def next_item(self, take: Callable[[], Any]) -> Any:
        """The next training item: ``take()``'s, after the thread's read of it (if one was submitted) is done."""
        self._check()
        rnd = self._delivered.pop(0) if self._delivered else None
        if rnd is not None:
            self._wait(rnd.read, "reading the next batch")
        item = take()
        if rnd is not None and item is not rnd.item:
            raise PipelineError(f"rank {self.rank}: the batch read ahead is not the one the loop took next "
                                "(the stream was read past the pipeline)")
        self._current = rnd
        return item

    def submit(self) -> None:
        """Start reading and preparing the item after the current one (call it once per trained micro-step)."""
        self._check()
        with self._cond:
            rnd = _Round(needs_releases=self._releases + 1)
        self._delivered.append(rnd)
        self._jobs.put(rnd)

    def arm(self) -> None:
        """Wait for the current item's prepared lookups (deadline) and hand them to the tables' next forward."""
        rnd, self._current = self._current, None
        if rnd is None:
            self.stats["unprepared"] += 1
            return
        self._wait(rnd.ready, "preparing the batch's lookups")
        if rnd.void:
            self.stats["unprepared"] += 1
            return
        for target, prepared in zip(self.targets, rnd.prepared):
            target.tables.arm(prepared)

    def release(self) -> None:
        """The tables' step for the current item is done: the next item's rows may be fetched now."""
        with self._cond:
            self._releases += 1
            self._cond.notify_all()

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._closing

    def close(self) -> None:
        """Stop the thread (a round in flight completes its collectives first); raises a pending thread error."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._jobs.put(None)
        self._thread.join(timeout=self.timeout_s)
        if self._thread.is_alive():
            logger.warning("rank %d: the sparse-dist pipeline's thread did not stop within %.0f s", self.rank,
                           self.timeout_s)
        for target in self.targets:  # nothing prepared outlives the pipeline
            if isinstance(target.tables, RowShardedEmbeddingCollection):
                target.tables.arm(None)
        self._check()

    def _wait(self, event: threading.Event, what: str) -> None:
        deadline = time.monotonic() + self.timeout_s
        while not event.wait(timeout=0.5):
            self._check()
            if not self._thread.is_alive():
                raise PipelineError(f"rank {self.rank}: the sparse-dist pipeline's thread stopped while {what}")
            if time.monotonic() > deadline:
                raise PipelineError(f"rank {self.rank}: the sparse-dist pipeline passed its deadline of "
                                    f"{self.timeout_s:.0f} s while {what}")
        self._check()

    def _check(self) -> None:
        if self._failure is not None:
            exc = self._failure
            raise PipelineError(f"rank {self.rank}: the sparse-dist pipeline's thread failed: "
                                f"{type(exc).__name__}: {exc}") from exc

    # ------------------------------------------------------------ the thread
    def _run(self) -> None:
        while True:
            rnd = self._jobs.get()
            if rnd is None:
                return
            try:
                self._prepare(rnd)
            except BaseException as exc:  # noqa: BLE001  (reported on the caller's thread, with the rank)
                logger.error("rank %d: sparse-dist pipeline failed: %s: %s", self.rank, type(exc).__name__, exc)
                rnd.error = self._failure = exc
                rnd.read.set()
                rnd.ready.set()
                return
            self.stats["rounds"] += 1

    @torch.no_grad()
    def _prepare(self, rnd: _Round) -> None:
        rnd.item = self.peek()
        rnd.read.set()
        planned: list[Any] = []
        ok = rnd.item is not None
        if ok:
            values, lengths, *weights = self.to_batch(rnd.item)
            batches: dict[tuple[str, ...], JaggedBatch] = {}
            for target in self.targets:
                batch = batches.setdefault(target.keys, JaggedBatch(target.keys, values, lengths, *weights,
                                                                    validate=False))
                if isinstance(target.tables, RowShardedEmbeddingCollection):
                    try:
                        planned.append(target.tables.plan_ids(batch))
                    except IndexError:  # the forward reports the bad id, unpipelined
                        ok = False
                        break
                else:
                    planned.append(target.tables.local_rows(batch))
        flag = torch.tensor([int(ok)], dtype=torch.int64)
        if self.world_size > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.group)
        if not int(flag):
            rnd.void = True
            self.stats["void"] += 1
            rnd.ready.set()
            return
        for target, local in zip(self.targets, planned):
            if isinstance(target.tables, RowShardedEmbeddingCollection):
                rnd.prepared.append(target.tables.exchange_ids(local, self.group))
            else:
                rnd.prepared.append(target.tables.exchange_rows(local, self.group))
        if any(isinstance(t.tables, RowShardedEmbeddingCollection) for t in self.targets):
            if not self._released(rnd):
                rnd.void = True  # closed before the step it waits for: the prepared rows are never used
                rnd.ready.set()
                return
            for target, prepared in zip(self.targets, rnd.prepared):
                if isinstance(target.tables, RowShardedEmbeddingCollection):
                    assert isinstance(prepared, PreparedLookup)
                    target.tables.fetch_prepared(prepared, self.group)
        rnd.ready.set()

    def _released(self, rnd: _Round) -> bool:
        """Wait until the step before ``rnd``'s batch is done (True) or the pipeline closes (False); deadline."""
        deadline = time.monotonic() + self.timeout_s
        with self._cond:
            while self._releases < rnd.needs_releases:
                if self._closing:
                    return False
                if time.monotonic() > deadline:
                    raise PipelineError(f"rank {self.rank}: no step was released within {self.timeout_s:.0f} s")
                self._cond.wait(timeout=0.5)
        return True
