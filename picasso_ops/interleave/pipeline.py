"""D-interleaving: split a batch into micro-batches and overlap their stages on a small thread pipeline (CPU).

One training step on a batch of ``B`` samples with ``n`` micro-batches runs
these stages, each on its own thread, connected by bounded queues:

``split``   cut micro-batch ``i`` out of the batch (and call the optional
            ``prefetch`` hook, e.g. a cache's ``prefetch(next_ids)``);
``lookup``  the embedding forward of micro-batch ``i`` (id handling and the
            fused packed lookups; row-sharded tables exchange ids here);
``dense``   the dense forward and backward of micro-batch ``i`` on detached
            copies of its embeddings, loss scaled by ``b_i / B``;
``sparse``  the embedding backward of micro-batch ``i`` with the gradients
            the dense stage left on those copies: the fused backward sums
            them into unique rows and *stores* them (deferred updates).

So while micro-batch ``i`` is in ``dense``, ``i + 1`` can be in ``lookup`` and
``i - 1`` in ``sparse``. After the last micro-batch the main thread applies
the dense optimizer and the sparse tables' step once (``update``): the step
equals the non-interleaved one on the whole batch (same sums, up to float
rounding order). Across steps, :meth:`InterleavedTrainer.train` loads the
next batch on a ``load`` thread while the current one trains.

torch ops release the GIL, so stages overlap as far as the cores allow; on a
2-core machine expect little (measure with ``benchmarks/interleave.py``).
Every queue wait polls a stop flag and a deadline, so a failing or stuck
stage ends the step with :class:`StageError` or :class:`PipelineTimeout`
naming the stage, never a hang. On CUDA tensors each stage thread issues its
kernels on a stream of its own, hand-offs ordered by events
(:mod:`picasso_ops.interleave.streams`), so micro-batches' kernels can overlap
on the device too.

Example::

    >>> from picasso_ops.interleave import InterleavedTrainer
    >>> trainer = InterleavedTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), micro_batches=4)
    >>> loss = trainer.step(batch)                 # one optimizer step, 4 interleaved micro-batches
    >>> losses = trainer.train(iter(stream), 100)  # next batch loads while this one trains
    >>> trainer.close()
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from picasso_ops.contracts import StageableModel, StagedModel
from picasso_ops.data.batch import CTRBatch
from picasso_ops.data.prefetch import Prefetcher, PrefetchTimeout
from picasso_ops.distributed.step import sparse_modules, sparse_step
from picasso_ops.embedding.packed import PackedEmbeddingCollection
from picasso_ops.interleave.streams import StageStreams, stage_streams
from picasso_ops.interleave.trace import Timeline

__all__ = [
    "StageError",
    "PipelineTimeout",
    "ThreadPipeline",
    "BatchPrefetcher",
    "StagedModel",
    "stages_for",
    "InterleavedTrainer",
]

logger = logging.getLogger(__name__)

StageFn = Callable[[int, Any], Any]  # (micro-batch index, item) -> item for the next stage


class StageError(RuntimeError):
    """A pipeline stage raised; ``stage`` and ``micro_batch`` say where, ``__cause__`` is the original error."""

    def __init__(self, stage: str, micro_batch: Optional[int], step: int, cause: BaseException) -> None:
        where = f"micro-batch {micro_batch}" if micro_batch is not None else "the batch"
        super().__init__(f"stage {stage!r} failed on {where} of step {step}: {type(cause).__name__}: {cause}")
        self.stage, self.micro_batch, self.step = stage, micro_batch, step


class PipelineTimeout(TimeoutError):
    """A pipeline wait passed its deadline; the message names what each stage was doing."""


@dataclass
class _Item:
    step: int
    index: int
    payload: Any
    token: Any = None  # the producer's stream mark (a CUDA event), None on CPU


class ThreadPipeline:
    """Persistent stage threads joined by bounded queues; :meth:`map` pushes items through all stages in order.

    Args:
        stages: ``(name, fn)`` pairs; ``fn(index, item)`` returns the next stage's item.
        depth: capacity of each queue between stages (bounds memory: at most
            about ``depth + 1`` items per stage in flight).
        timeout_s: deadline of one :meth:`map` call.
        timeline: where spans are recorded (one per stage and item).
        poll_s: how often blocked waits re-check the stop flag and the deadline.
        streams: the stages' device streams (index = stage position); default
            none (CPU). :func:`~picasso_ops.interleave.streams.stage_streams`
            gives one CUDA stream per stage on a CUDA device.

    A stage that raises stops every thread; :meth:`map` raises :class:`StageError`
    with the stage's name and the pipeline is closed (build a new one to go on).

    Example::

        >>> with ThreadPipeline([("double", lambda i, x: 2 * x), ("inc", lambda i, x: x + 1)]) as p:
        ...     p.map([1, 2, 3])
        [3, 5, 7]
    """

    def __init__(
        self,
        stages: Sequence[tuple[str, StageFn]],
        *,
        depth: int = 2,
        timeout_s: float = 300.0,
        timeline: Optional[Timeline] = None,
        poll_s: float = 0.05,
        streams: Optional[StageStreams] = None,
    ) -> None:
        if not stages:
            raise ValueError("a pipeline needs at least one stage")
        if depth < 1 or timeout_s <= 0 or poll_s <= 0:
            raise ValueError(f"need depth >= 1, timeout_s > 0, poll_s > 0; got {depth}, {timeout_s}, {poll_s}")
        self.names = [name for name, _ in stages]
        self.timeout_s = timeout_s
        self.poll_s = poll_s
        self.timeline = timeline or Timeline(enabled=False)
        self.streams = streams or StageStreams()
        self._stop = threading.Event()
        self._error: Optional[StageError] = None
        self._reported = False  # the first map after a failure raises the StageError itself
        self._close_s = max(1.0, 20 * poll_s)  # a failing map joins this long: a stuck thread cannot be joined anyway
        self._error_lock = threading.Lock()
        self._busy: dict[str, Optional[tuple[int, int]]] = {name: None for name in self.names}
        # inputs of stage k are queues[k]; the last queue collects results and is unbounded (never blocks a stage)
        self._queues: list[queue.Queue] = [queue.Queue(maxsize=depth) for _ in stages]
        self._queues.append(queue.Queue())
        self._threads = [
            threading.Thread(target=self._worker, args=(k, name, fn), name=f"interleave-{name}", daemon=True)
            for k, (name, fn) in enumerate(stages)
        ]
        for t in self._threads:
            t.start()

    def __enter__(self) -> "ThreadPipeline":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @property
    def closed(self) -> bool:
        """``True`` after :meth:`close` or a stage failure."""
        return self._stop.is_set()

    def _fail(self, error: StageError) -> None:
        with self._error_lock:
            if self._error is None:
                self._error = error
        self._stop.set()

    def _put(self, q: queue.Queue, item: Any, deadline: float) -> bool:
        """Put with polling; ``False`` when the pipeline stopped first."""
        while not self._stop.is_set():
            try:
                q.put(item, timeout=self.poll_s)
                return True
            except queue.Full:
                if time.monotonic() > deadline:
                    raise PipelineTimeout(f"queue full past the deadline; stages busy with {self._busy}") from None
        return False

    def _worker(self, k: int, name: str, fn: StageFn) -> None:
        inbox, outbox = self._queues[k], self._queues[k + 1]
        while not self._stop.is_set():
            try:
                item = inbox.get(timeout=self.poll_s)
            except queue.Empty:
                continue
            self._busy[name] = (item.step, item.index)
            try:
                self.streams.accept(k, item.token, item.payload)
                with self.streams.run(k):
                    with self.timeline.span(name, item.index, item.step):
                        out = fn(item.index, item.payload)
                    token = self.streams.token()  # on this stage's stream: the next stage waits for it
            except BaseException as exc:  # noqa: BLE001 - handed to the caller with the stage name
                error = StageError(name, item.index, item.step, exc)
                error.__cause__ = exc
                self._fail(error)
                return
            finally:
                self._busy[name] = None
            try:
                # a stage downstream that stopped leaves nothing to wait for: the caller sees the error
                self._put(outbox, _Item(item.step, item.index, out, token), time.monotonic() + self.timeout_s)
            except PipelineTimeout as exc:
                self._fail(StageError(name, item.index, item.step, exc))
                return

    def _raise_if_failed(self) -> None:
        if self._error is not None and not self._reported:
            self._reported = True
            self.close(timeout_s=self._close_s)
            raise self._error
        if self._stop.is_set():
            cause = f" after: {self._error}" if self._error is not None else ""
            raise RuntimeError(f"the pipeline is closed{cause}") from self._error

    def map(self, items: Sequence[Any], step: int = 0) -> list[Any]:
        """Run every item through all stages; returns the last stage's outputs in item order.

        Raises :class:`StageError` (a stage raised) or :class:`PipelineTimeout`
        (``timeout_s`` passed); either closes the pipeline.
        """
        self._raise_if_failed()
        deadline = time.monotonic() + self.timeout_s
        results: dict[int, Any] = {}
        first, last = self._queues[0], self._queues[-1]
        ready = self.streams.token()  # the caller's queued work (the batch, the last update) before stage 0
        try:
            for i, payload in enumerate(items):
                if not self._put(first, _Item(step, i, payload, ready), deadline):
                    self._raise_if_failed()
            while len(results) < len(items):
                try:
                    out = last.get(timeout=self.poll_s)
                except queue.Empty:
                    self._raise_if_failed()
                    if time.monotonic() > deadline:
                        raise PipelineTimeout(
                            f"step {step}: {len(results)}/{len(items)} items done after {self.timeout_s:.0f}s; "
                            f"stages busy with (step, micro-batch) {self._busy}"
                        ) from None
                    continue
                self.streams.wait(out.token, out.payload)
                results[out.index] = out.payload
        except PipelineTimeout:
            self.close(timeout_s=self._close_s)
            raise
        return [results[i] for i in range(len(items))]

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the threads and join them (each join waits at most ``timeout_s`` in total)."""
        self._stop.set()
        deadline = time.monotonic() + timeout_s
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(timeout=max(0.0, deadline - time.monotonic()))
        stuck = [t.name for t in self._threads if t.is_alive()]
        if stuck:
            # daemon threads: a torch op that never returns cannot be interrupted, only abandoned
            logger.warning("pipeline threads still running after close: %s", stuck)


class BatchPrefetcher:
    """Pull batches from an iterator on a ``load`` thread (data loading overlapped with training).

    A :class:`~picasso_ops.data.prefetch.Prefetcher` with this pipeline's error
    types and ``load`` spans on the timeline.

    Args:
        batches: the source (e.g. ``iter(SyntheticCTRStream(...))``).
        depth: batches loaded ahead.
        timeout_s: deadline of each :meth:`next` wait.
        timeline: records one ``load`` span per batch.
        first_index: step number of the first batch (spans are labelled ``first_index``, ``+1``, ...).

    Example::

        >>> with BatchPrefetcher(iter([1, 2])) as loader:
        ...     loader.next(), loader.next(), loader.next()
        (1, 2, None)
    """

    def __init__(
        self,
        batches: Iterator[Any],
        *,
        depth: int = 2,
        timeout_s: float = 300.0,
        timeline: Optional[Timeline] = None,
        poll_s: float = 0.05,
        first_index: int = 0,
    ) -> None:
        self.timeout_s = timeout_s
        self.timeline = timeline or Timeline(enabled=False)
        self._index = first_index  # the step number of the next batch (labels spans and errors)
        self._loader: Prefetcher[Any] = Prefetcher(_timed_loads(batches, self.timeline, first_index), depth,
                                                   timeout_s=timeout_s, poll_s=poll_s, name="interleave-load")

    def __enter__(self) -> "BatchPrefetcher":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def next(self) -> Any:
        """The next batch, or ``None`` when the source is exhausted; raises the loader's error as :class:`StageError`."""
        try:
            batch = next(self._loader)
        except StopIteration:
            return None
        except PrefetchTimeout:
            raise PipelineTimeout(f"no batch from the load stage within {self.timeout_s:.0f}s") from None
        except Exception as exc:  # noqa: BLE001 - the source's error, named by stage and step
            raise StageError("load", None, self._index, exc) from exc
        self._index += 1
        return batch

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the load thread (it finishes the batch it is reading) and join it with a deadline."""
        self._loader.close(timeout_s=timeout_s)


def _timed_loads(batches: Iterator[Any], timeline: Timeline, first_index: int) -> Iterator[Any]:
    """``batches`` with one ``load`` span per ``next`` (runs on the load thread)."""
    index = first_index
    while True:
        with timeline.span("load", None, index):
            try:
                item = next(batches)
            except StopIteration:
                return
        yield item
        index += 1


def stages_for(model: nn.Module) -> StagedModel:
    """The :class:`StagedModel` a model cuts itself into (a :class:`~picasso_ops.contracts.StageableModel`).

    The interleaving knows no concrete model: the reference models
    (``picasso_ops.models.WideAndDeep``, ``DLRM``) declare ``pipeline_stages()``;
    any other model is cut by the caller's ``stages=``.

    Example::

        >>> type(stages_for(packed_wide_and_deep(args, SparseArgs()))).__name__  # doctest: +SKIP
        'EmbedScoreStages'
    """
    if isinstance(model, StageableModel):
        return model.pipeline_stages()
    raise TypeError(f"no stage adapter for {type(model).__name__}; pass stages= (a StagedModel)")


def _device_of(model: nn.Module) -> torch.device:
    """Where ``model`` runs: the device of its first parameter or buffer (CPU when it has none)."""
    for t in model.parameters():
        return t.device
    for t in model.buffers():
        return t.device
    return torch.device("cpu")


def _bce(logits: Tensor, labels: Tensor) -> Tensor:
    return F.binary_cross_entropy_with_logits(logits, labels.to(logits.dtype))


class InterleavedTrainer:
    """Train steps whose micro-batches run interleaved through split/lookup/dense/sparse stage threads.

    Args:
        model: a model with packed (fused, deferred) sparse tables, e.g.
            ``packed_wide_and_deep``; its dense parameters belong to ``dense_optimizer``.
        dense_optimizer: a torch optimizer over the dense parameters.
        micro_batches: ``n``; 1 still runs the stages on threads (one micro-batch, no overlap).
        stages: how to cut ``model`` (default :func:`stages_for`).
        loss_fn: ``loss_fn(logits, labels)``, a mean over the samples.
        timeline: records every stage span (see :mod:`picasso_ops.interleave.trace`).
        prefetch: called in the ``split`` stage with the *next* micro-batch (the
            first one of the next batch is not known there), e.g. a cache's
            ``lambda mb: table.prefetch(mb.values)``.
        depth: queue capacity between stages.
        timeout_s: deadline of one step (and of each wait for a loaded batch).

    Each step: micro-batch ``i``'s loss is ``loss_fn`` on it times ``b_i / B``,
    so dense gradients accumulate to the whole batch's; sparse row gradients
    are stored by the fused backward; then one dense ``optimizer.step()`` and
    one sparse step (``sparse_step`` of data-parallel / row-sharded tables,
    ``step()`` of plain packed collections). The trainer binds ``model``: it
    switches the model's plain packed collections to ``defer_updates`` in place
    (their update must wait for the step). The result equals a non-interleaved
    step on the batch.

    Example::

        >>> model = packed_wide_and_deep(WideAndDeepArgs(vocab_sizes=[100] * 26, num_dense=13), SparseArgs())
        >>> with InterleavedTrainer(model, torch.optim.Adagrad(model.parameters()), micro_batches=2) as tr:
        ...     loss = tr.step(batch)
    """

    def __init__(
        self,
        model: nn.Module,
        dense_optimizer: torch.optim.Optimizer,
        *,
        micro_batches: int,
        stages: Optional[StagedModel] = None,
        loss_fn: Callable[[Tensor, Tensor], Tensor] = _bce,
        timeline: Optional[Timeline] = None,
        prefetch: Optional[Callable[[CTRBatch], None]] = None,
        depth: int = 2,
        timeout_s: float = 300.0,
    ) -> None:
        if micro_batches < 1:
            raise ValueError(f"micro_batches must be >= 1, got {micro_batches}")
        self.model = model
        self.dense_optimizer = dense_optimizer
        self.micro_batches = micro_batches
        self.stages = stages or stages_for(model)
        self.loss_fn = loss_fn
        self.timeline = timeline or Timeline(enabled=False)
        self.prefetch = prefetch
        self.timeout_s = timeout_s
        self._sparse = list(sparse_modules(model))
        inside = {id(m) for s in self._sparse for m in s.modules()}
        self._plain = [m for m in model.modules() if isinstance(m, PackedEmbeddingCollection) and id(m) not in inside]
        for m in self._plain:
            # updates inside backward would race with the next micro-batch's lookup and split one step into n
            m.defer_updates = True
        self._batch: Optional[CTRBatch] = None
        self._parts: list[CTRBatch] = []
        self._step = 0
        stages = [("split", self._split), ("lookup", self._lookup), ("dense", self._dense), ("sparse", self._sparse_bwd)]
        self.pipeline = ThreadPipeline(stages, depth=depth, timeout_s=timeout_s, timeline=self.timeline,
                                       streams=stage_streams(_device_of(model), len(stages)))

    def __enter__(self) -> "InterleavedTrainer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ---------------------------------------------------------------- stages
    def _split(self, i: int, _: Any) -> tuple[CTRBatch, float]:
        batch = self._batch
        assert batch is not None
        mb = self._parts[i]
        if self.prefetch is not None and i + 1 < len(self._parts):
            self.prefetch(self._parts[i + 1])
        return mb, mb.batch_size / batch.batch_size

    def _lookup(self, i: int, item: tuple[CTRBatch, float]) -> tuple[CTRBatch, float, list[Tensor]]:
        mb, weight = item
        return mb, weight, self.stages.lookup(mb)

    def _dense(self, i: int, item: tuple[CTRBatch, float, list[Tensor]]) -> tuple[list[Tensor], list[Tensor], Tensor]:
        mb, weight, embedded = item
        # cut the graph: the dense backward stops here; the sparse stage continues from these gradients
        leaves = [e.detach().requires_grad_(e.requires_grad) for e in embedded]
        loss = self.loss_fn(self.stages.dense(mb, leaves), mb.labels) * weight
        loss.backward()
        grads = [leaf.grad if leaf.grad is not None else torch.zeros_like(leaf) for leaf in leaves]
        return embedded, grads, loss.detach()  # a tensor: float() here would wait for this stage's stream

    def _sparse_bwd(self, i: int, item: tuple[list[Tensor], list[Tensor], Tensor]) -> Tensor:
        embedded, grads, loss = item
        pairs = [(e, g) for e, g in zip(embedded, grads) if e.requires_grad]
        if pairs:
            torch.autograd.backward([e for e, _ in pairs], [g for _, g in pairs])
        return loss

    # ------------------------------------------------------------------ step
    def step(self, batch: CTRBatch) -> float:
        """One optimizer step on ``batch`` through the interleaved micro-batches; returns the batch's mean loss."""
        n = min(self.micro_batches, batch.batch_size)
        self._batch, self._parts = batch, batch.split(n)
        self.dense_optimizer.zero_grad(set_to_none=True)
        try:
            losses = self.pipeline.map(list(range(n)), step=self._step)
        except BaseException:
            self._discard()
            raise
        with self.timeline.span("update", None, self._step):
            self.dense_optimizer.step()
            sparse_step(self.model)
            for m in self._plain:
                m.step()
        self._step += 1
        self._batch, self._parts = None, []
        return float(torch.stack(losses).sum())

    def _discard(self) -> None:
        """Drop the failed step's gradients so a later step starts clean."""
        self.dense_optimizer.zero_grad(set_to_none=True)
        for m in self._sparse:
            m.discard_pending()
        for m in self._plain:
            m.zero_grad()

    def train(self, batches: Iterator[CTRBatch], num_steps: int) -> list[float]:
        """``num_steps`` steps (fewer if ``batches`` ends), loading the next batch on a thread; returns the losses.

        Example::

            >>> trainer.train(iter(SyntheticCTRStream(cfg, 4096)), num_steps=10)  # doctest: +SKIP
        """
        losses: list[float] = []
        with BatchPrefetcher(batches, timeout_s=self.timeout_s, timeline=self.timeline,
                             first_index=self._step) as loader:
            for _ in range(num_steps):
                batch = loader.next()
                if batch is None:
                    break
                losses.append(self.step(batch))
        return losses

    def close(self) -> None:
        """Stop the stage threads."""
        self.pipeline.close()
