"""D-interleaving inside an engine's forward/backward/step: for training loops that own the step (DeepSpeed).

:class:`~picasso_ops.interleave.InterleavedTrainer` runs the whole step with a
torch optimizer. Under DeepSpeed the loop is ``engine(batch)``,
``engine.backward(loss)``, ``engine_step(engine)``, and the engine must run the
dense backward itself (it scales the loss, reduces gradients across ranks,
ZeRO hooks). :class:`InterleavedForward` puts the same stages into those calls:

forward (training, grad enabled)
    the batch is split into ``K`` micro-batches; on stage threads, ``lookup``
    runs the embedding forward of micro-batch ``i`` (ids, dedup, cache lookups;
    then it starts the cache prefetch of micro-batch ``i + 1``) while
    ``dense`` runs the dense forward of ``i - 1``. The embeddings enter the
    dense graph through a hand-off node; the logits of the micro-batches are
    concatenated in order, so the loss the loop computes is the whole batch's.
backward (the engine's, one autograd pass)
    runs the dense backward of every micro-batch; when it reaches a
    micro-batch's hand-off node it queues that micro-batch's embedding
    backward on a ``sparse`` thread and goes on with the next micro-batch's
    dense backward. The sparse backward only stores row gradients (the tables
    defer their update), so it never races the lookups of the next forward.
step
    ``picasso_ops.distributed.sparse_step`` (inside ``engine_step``) first
    waits for the sparse thread (:meth:`wait_sparse_backward`), then the tables
    take their one optimizer step as without interleaving.

On CUDA tensors the lookup, dense and sparse threads each issue their kernels
on a stream of their own, ordered by events (:mod:`picasso_ops.interleave.streams`).

Result: the same step as ``K = 1`` up to float rounding, not bitwise: the
dense weight gradients are sums of ``K`` partial matmuls instead of one, and
each row's sparse gradient is a sum of ``K`` partial sums. Evaluation (no
grad, or ``eval()``) runs the wrapped model directly.

The wrapper registers the model's children as its own, so ``state_dict`` keys,
parameters and checkpoints are exactly the wrapped model's.

Example::

    >>> model = InterleavedForward(packed_wide_and_deep(args, SparseArgs()), micro_batches=2)
    >>> engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds)
    >>> loss = loss_fn(engine(b.dense, b.values, b.lengths), b.labels)
    >>> engine.backward(loss); engine_step(engine)    # doctest: +SKIP
"""
from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Optional

import torch
from torch import Tensor, nn

from picasso_ops.contracts import FieldRowPrefetcher, SparseBackwardQueue
from picasso_ops.data.batch import CTRBatch
from picasso_ops.interleave.pipeline import PipelineTimeout, StagedModel, StageError, ThreadPipeline, stages_for
from picasso_ops.interleave.streams import StageStreams, stage_streams
from picasso_ops.interleave.trace import Timeline
from picasso_ops.vocab.dynamic_table import with_sparse_update

__all__ = ["InterleavedForward"]

logger = logging.getLogger(__name__)


class InterleavedForward(nn.Module, SparseBackwardQueue):
    """A CTR model whose training forward and backward run ``micro_batches`` interleaved micro-batches.

    Args:
        model: a model with deferred sparse tables (``packed_wide_and_deep``,
            ``packed_dlrm``, or one with cached tables), called as ``model(dense, values, lengths)``.
        micro_batches: ``K >= 1`` (1: the model runs as is).
        stages: how to cut ``model`` (default :func:`~picasso_ops.interleave.stages_for`).
        timeline: records ``lookup``, ``dense`` and ``sparse`` spans (see :mod:`picasso_ops.interleave.trace`).
        timeout_s: deadline of one forward's stages and of one wait for the sparse thread.

    Example::

        >>> from picasso_ops.models import SparseArgs, WideAndDeepArgs, packed_wide_and_deep
        >>> m = InterleavedForward(packed_wide_and_deep(WideAndDeepArgs([50] * 4, 3), SparseArgs()), 2)
        >>> sorted(m.state_dict()) == sorted(m.model.state_dict())
        True
    """

    def __init__(self, model: nn.Module, micro_batches: int, *, stages: Optional[StagedModel] = None,
                 timeline: Optional[Timeline] = None, timeout_s: float = 300.0) -> None:
        super().__init__()
        if micro_batches < 1:
            raise ValueError(f"micro_batches must be >= 1, got {micro_batches}")
        if any(True for _ in model.parameters(recurse=False)) or any(True for _ in model.buffers(recurse=False)):
            raise TypeError(f"{type(model).__name__} has parameters of its own; only models whose state lives in "
                            "submodules can be wrapped (their children are registered here)")
        object.__setattr__(self, "model", model)  # not a child: the state_dict keys stay the model's own
        for name, child in model.named_children():
            self.add_module(name, child)
        self.micro_batches = int(micro_batches)
        self.stages = stages or stages_for(model)
        self.timeline = timeline or Timeline(enabled=False)
        self.timeout_s = float(timeout_s)
        self._prefetchers = [m for m in model.modules() if isinstance(m, FieldRowPrefetcher)]
        self._parts: list[CTRBatch] = []
        self._pipeline: Optional[ThreadPipeline] = None
        self._streams: StageStreams = StageStreams()  # lookup, dense, sparse; CUDA streams once a CUDA batch comes
        self._sparse_pool: Optional[ThreadPoolExecutor] = None
        self._sparse_jobs: list[tuple[int, int, Future]] = []  # (step, micro-batch, job) not yet waited for
        self._lock = threading.Lock()
        self._step = 0

    def train(self, mode: bool = True) -> "InterleavedForward":
        super().train(mode)
        self.model.training = mode  # the wrapped model's own flag (its children are ours)
        return self

    # ------------------------------------------------------------------ forward
    def forward(self, dense: Tensor, values: Tensor, lengths: Tensor) -> Tensor:
        """Logits ``[B]``; in training with grad, computed over interleaved micro-batches."""
        batch_size = int(lengths.shape[1])
        k = min(self.micro_batches, batch_size)
        if k <= 1 or not self.training or not torch.is_grad_enabled():
            return self.model(dense, values, lengths)
        whole = CTRBatch(dense, values, lengths, torch.zeros(batch_size, dtype=dense.dtype))
        self._parts = whole.split(k)
        if self._pipeline is None or self._pipeline.closed:
            self._streams = stage_streams(dense.device, 3)
            self._pipeline = ThreadPipeline([("lookup", self._lookup), ("dense", self._dense)], depth=2,
                                            timeout_s=self.timeout_s, timeline=self.timeline, streams=self._streams)
        try:
            logits = self._pipeline.map(list(range(k)), step=self._step)
        finally:
            self._parts = []
        self._step += 1
        return torch.cat(logits)

    def _lookup(self, i: int, _: Any) -> tuple[CTRBatch, list[Tensor]]:
        mb = self._parts[i]
        embedded = self.stages.lookup(mb)
        if i + 1 < len(self._parts):
            nxt = self._parts[i + 1]
            for m in self._prefetchers:  # on this thread: a cache is not thread-safe, lookups run here too
                m.prefetch_ids(nxt.values, nxt.lengths)
        return mb, embedded

    def _dense(self, i: int, item: tuple[CTRBatch, list[Tensor]]) -> Tensor:
        mb, embedded = item
        step = self._step
        leaves = [with_sparse_update(e, self._handoff(e, step, i)) if e.requires_grad else e for e in embedded]
        return self.stages.dense(mb, leaves)

    # ------------------------------------------------------------------ sparse backward
    def _handoff(self, embedded: Tensor, step: int, index: int):
        """The hand-off node's backward: queue ``embedded``'s backward with this gradient on the sparse thread."""

        def submit(grad: Tensor) -> None:
            ready = self._streams.token()  # autograd runs this on the stream that produced grad
            with self._lock:
                if self._sparse_pool is None:
                    self._sparse_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="interleave-sparse")
                job = self._sparse_pool.submit(self._sparse_backward, embedded, grad, ready, step, index)
                self._sparse_jobs.append((step, index, job))

        return submit

    def _sparse_backward(self, embedded: Tensor, grad: Tensor, ready: Any, step: int, index: int) -> Any:
        """The embedding backward on the sparse stream; returns its stream mark for :meth:`wait_sparse_backward`."""
        self._streams.accept(2, ready, (embedded, grad))
        with self._streams.run(2):
            with self.timeline.span("sparse", index, step):
                torch.autograd.backward([embedded], [grad])
            return self._streams.token()

    def wait_sparse_backward(self) -> None:
        """Wait until every queued embedding backward has run; re-raises a failure as :class:`StageError`.

        ``picasso_ops.distributed.sparse_step`` calls it before the tables' step.

        Example::

            >>> engine.backward(loss); model.wait_sparse_backward()  # doctest: +SKIP
        """
        with self._lock:
            jobs, self._sparse_jobs = self._sparse_jobs, []
        deadline = time.monotonic() + self.timeout_s
        error: Optional[StageError] = None
        for step, index, job in jobs:
            try:
                self._streams.wait(job.result(timeout=max(0.0, deadline - time.monotonic())), None)
            except TimeoutError:
                raise PipelineTimeout(f"the sparse backward of micro-batch {index} of step {step} did not finish "
                                      f"within {self.timeout_s:.0f}s") from None
            except BaseException as exc:  # noqa: BLE001 - reported with the stage name after the rest finished
                if error is None:
                    error = StageError("sparse", index, step, exc)
                    error.__cause__ = exc
        if error is not None:
            raise error

    def close(self) -> None:
        """Stop the stage threads (after waiting for queued sparse work)."""
        try:
            self.wait_sparse_backward()
        finally:
            if self._pipeline is not None:
                self._pipeline.close()
            if self._sparse_pool is not None:
                self._sparse_pool.shutdown(wait=True)
                self._sparse_pool = None

    def __deepcopy__(self, memo: dict) -> "InterleavedForward":
        # threads and locks do not copy: a copy is a fresh wrapper around a copy of the model
        import copy

        return InterleavedForward(copy.deepcopy(self.model, memo), self.micro_batches, timeout_s=self.timeout_s)

    def extra_repr(self) -> str:
        return f"micro_batches={self.micro_batches}, model={type(self.model).__name__}"

