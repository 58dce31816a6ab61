"""K-interleaving: overlap one pack group's communication with another group's gather/compute.

PICASSO's K-interleaving runs the communication-bound shuffle of one
feature group while the memory-bound gather of another is in progress. Here
the groups are the packs of a collection and the tool is
``torch.distributed``'s ``async_op=True``: every pack's collective is issued
first, then the packs are completed in order, so pack ``p``'s local work
(gathering the requested rows, or combining and applying row gradients)
runs while the collectives of packs ``p + 1 ..`` are in flight.

* :func:`interleaved_sparse_step` - the data-parallel step: every pack's
  all-gather of row gradients is started at once; pack ``p`` is coalesced and
  its optimizer applied while later packs' all-gathers run.
* :class:`KInterleavedRowShardedCollection` - row-sharded lookups: all packs'
  id all-to-alls start together; as each arrives the owner gathers its rows
  and starts the row all-to-all back, while the next pack's ids are still
  travelling; its :meth:`~KInterleavedRowShardedCollection.sparse_step` sends
  every pack's gradients at once and applies pack ``p`` while later packs'
  gradients travel.

Results equal the sequential exchanges exactly (same data, same summation
order). Every wait has a deadline (``timeout_s``). Tested on gloo (CPU);
whether the overlap pays depends on the backend running collectives off the
calling thread (gloo and NCCL both do).

Example::

    >>> from picasso_ops.interleave import interleaved_sparse_step, KInterleavedRowShardedCollection
    >>> emb = DataParallelEmbeddingCollection(specs)
    >>> loss_fn(emb(batch).values).backward()
    >>> interleaved_sparse_step(emb)          # instead of emb.sparse_step()
    >>> rw = KInterleavedRowShardedCollection(specs)   # a drop-in RowShardedEmbeddingCollection
"""
from __future__ import annotations

import datetime
import logging
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import once_differentiable

from picasso_ops.distributed.comm import ProcessGroup, coalesce_rows, pack_rows, unpack_rows, world_info
from picasso_ops.distributed.data_parallel import DataParallelEmbeddingCollection, apply_rows, take_pending
from picasso_ops.distributed.row_sharded import RowShardedEmbeddingCollection, _PackPlan
from picasso_ops.embedding.packed import KeyedEmbeddings
from picasso_ops.interleave.trace import Timeline
from picasso_ops.jagged import JaggedBatch

__all__ = ["AsyncExchange", "interleaved_sparse_step", "KInterleavedRowShardedCollection"]

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 120.0


class AsyncExchange:
    """One in-flight collective and its output; :meth:`wait` returns the output (with a deadline).

    Example::

        >>> ex = AsyncExchange.all_to_all(t, [2, 2], [2, 2], group)   # doctest: +SKIP
        >>> received = ex.wait(timeout_s=30)
    """

    def __init__(self, work: Optional[Any], finish: Any, what: str) -> None:
        self._work, self._finish, self.what = work, finish, what

    @staticmethod
    def all_to_all(
        t: Tensor, send_counts: Sequence[int], recv_counts: Sequence[int], group: Optional[ProcessGroup] = None
    ) -> "AsyncExchange":
        """Start ``all_to_all_varsize`` (chunk ``r`` of ``t`` to rank ``r``) without waiting."""
        if len(send_counts) == 1:
            return AsyncExchange(None, t, "all_to_all")
        out = t.new_empty((int(sum(recv_counts)),) + tuple(t.shape[1:]))
        work = dist.all_to_all_single(
            out, t.contiguous(), output_split_sizes=list(recv_counts), input_split_sizes=list(send_counts),
            group=group, async_op=True,
        )
        return AsyncExchange(work, out, "all_to_all")

    @staticmethod
    def all_gather(t: Tensor, counts: Sequence[int], group: Optional[ProcessGroup] = None) -> "AsyncExchange":
        """Start ``all_gather_varsize`` (every rank's rows, rank order; padded to the largest count) without waiting."""
        world = len(counts)
        if world == 1:
            return AsyncExchange(None, t, "all_gather")
        padded = t.new_zeros((max(counts),) + tuple(t.shape[1:]))
        padded[: t.shape[0]] = t
        parts = [torch.empty_like(padded) for _ in range(world)]
        work = dist.all_gather(parts, padded, group=group, async_op=True)
        return AsyncExchange(work, lambda: torch.cat([p[:n] for p, n in zip(parts, counts)]), "all_gather")

    def wait(self, timeout_s: float = DEFAULT_TIMEOUT_S) -> Tensor:
        """Block until the collective completes (at most ``timeout_s``; gloo raises past it) and return its output."""
        if self._work is not None:
            if not self._work.wait(timeout=datetime.timedelta(seconds=timeout_s)):
                raise TimeoutError(f"{self.what} did not complete within {timeout_s:.0f}s")
            self._work = None
        return self._finish() if callable(self._finish) else self._finish


@torch.no_grad()
def interleaved_sparse_step(
    collection: DataParallelEmbeddingCollection,
    grad_scale: float = 1.0,
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    timeline: Optional[Timeline] = None,
) -> None:
    """``collection.sparse_step(grad_scale)`` with every pack's all-gather in flight while earlier packs are applied.

    Same result as ``sparse_step`` bit for bit. Collective: every rank calls it.

    Example::

        >>> loss.backward(); interleaved_sparse_step(emb)   # doctest: +SKIP
    """
    tl = timeline or Timeline(enabled=False)
    group = collection.process_group
    _, world = world_info(group)
    local = [take_pending(kernel) for kernel in collection.kernels]
    device = collection.kernels[0].weight.device
    meta = torch.tensor([[rows.numel(), int(ran)] for ran, rows, _ in local], dtype=torch.int64, device=device)
    meta = meta.view(-1, 2)
    if world > 1:
        metas = [torch.empty_like(meta) for _ in range(world)]
        AsyncExchange(dist.all_gather(metas, meta, group=group, async_op=True), None, "all_gather").wait(timeout_s)
        all_meta = torch.stack(metas)
    else:
        all_meta = meta.unsqueeze(0)
    counts = all_meta[:, :, 0].tolist()
    ran_any = all_meta[:, :, 1].amax(0).tolist()
    scale = grad_scale / world
    exchanges: list[Optional[AsyncExchange]] = []
    for pi, (_, rows, grads) in enumerate(local):  # issue every pack's all-gather before completing any
        if not ran_any[pi] or world == 1:
            exchanges.append(None)
            continue
        with tl.span("comm_start", pi):
            exchanges.append(AsyncExchange.all_gather(pack_rows(rows, grads), [c[pi] for c in counts], group))
    for pi, (kernel, (_, rows, grads)) in enumerate(zip(collection.kernels, local)):
        if not ran_any[pi]:
            continue
        ex = exchanges[pi]
        if ex is not None:
            with tl.span("comm_wait", pi):
                gathered = ex.wait(timeout_s)
            with tl.span("apply", pi):
                rows, grads = coalesce_rows(*unpack_rows(gathered, kernel.width))
                apply_rows(kernel, rows, grads * scale)
        else:
            with tl.span("apply", pi):
                apply_rows(kernel, rows, grads * scale)


class KInterleavedRowShardedCollection(RowShardedEmbeddingCollection):
    """A :class:`RowShardedEmbeddingCollection` whose packs' exchanges overlap (K-interleaving).

    Args: those of :class:`RowShardedEmbeddingCollection`, plus ``timeout_s``
    (deadline of each wait) and ``timeline`` (spans ``ids``, ``gather``,
    ``rows``, ``pool`` and ``grads``/``apply`` per pack, ``micro_batch`` = pack index).

    Forward: all packs' id all-to-alls start at once; as pack ``p``'s ids
    arrive its owner gathers the rows and starts sending them back, while
    packs ``p + 1 ..`` are still exchanging ids; then each pack pools as its
    rows arrive. Same outputs, gradients and updates as the parent (tested
    against it on 2 gloo ranks). State dicts are the parent's, so the two load
    each other's checkpoints.

    Example::

        >>> emb = KInterleavedRowShardedCollection([TableSpec("a", 10**6, 16), TableSpec("b", 10**5, 8)])
        >>> out = emb(batch); loss_fn(out.values).backward(); emb.sparse_step()   # doctest: +SKIP
    """

    def __init__(self, *args: Any, timeout_s: float = DEFAULT_TIMEOUT_S, timeline: Optional[Timeline] = None,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.timeout_s = timeout_s
        self.timeline = timeline or Timeline(enabled=False)

    def forward(self, batch: JaggedBatch) -> KeyedEmbeddings:
        """Pooled embeddings ``[B, sum D]`` (a collective), exchanges of the packs interleaved."""
        tl, group, W, B = self.timeline, self.process_group, self.world_size, batch.batch_size
        planned = self.plan_ids(batch)  # every pack's dedup per owner, as the parent plans it
        subs, plans, inverses = planned.subs, planned.plans, planned.inverses
        device = batch.values.device
        send = torch.tensor([p.send_counts for p in plans], dtype=torch.int64, device=device).view(-1, W)
        if W > 1:
            recv_ex = AsyncExchange.all_to_all(send.t().contiguous(), [1] * W, [1] * W, group)
            recv = recv_ex.wait(self.timeout_s).t()
        else:
            recv = send
        recv_counts = recv.tolist()
        id_ex = []
        for pi, plan in enumerate(plans):  # every pack's ids leave before any pack's rows are gathered
            plan.recv_counts = recv_counts[pi]
            with tl.span("ids", pi):
                id_ex.append(AsyncExchange.all_to_all(plan.send_rows, plan.send_counts, plan.recv_counts, group))
        row_ex = []
        for pi, plan in enumerate(plans):
            with tl.span("gather", pi):
                plan.recv_rows = id_ex[pi].wait(self.timeout_s)
                local = self.shard.kernels[pi].weight.index_select(0, plan.recv_rows)
                row_ex.append(AsyncExchange.all_to_all(local, plan.recv_counts, plan.send_counts, group))
        training = torch.is_grad_enabled()
        anchor = torch.empty(0, requires_grad=True) if training else None
        blocks: list[Tensor] = []
        for pi, (layout, sub, plan, inverse) in enumerate(zip(self._layouts, subs, plans, inverses)):
            with tl.span("rows", pi):
                if training:
                    rows = _FetchedRows.apply(anchor, row_ex[pi], self.timeout_s, self, pi, plan)
                else:
                    rows = row_ex[pi].wait(self.timeout_s)
            with tl.span("pool", pi):
                pooled = F.embedding_bag(
                    inverse, rows, sub.offsets, mode="sum",
                    per_sample_weights=None if sub.weights is None else sub.weights.to(rows.dtype),
                    include_last_offset=True,
                )
                if bool(layout.feature_mean.any()):
                    inv_len = sub.lengths.reshape(-1).to(rows.dtype).clamp(min=1.0).reciprocal()
                    scale = torch.where(layout.feature_mean.repeat_interleave(B), inv_len, torch.ones_like(inv_len))
                    pooled = pooled * scale.unsqueeze(1)
                # field-major -> batch-major once per pack, not one slice per field
                blocks.append(pooled.view(len(layout.features), B, layout.dim).transpose(0, 1).reshape(B, -1))
        if not blocks:
            return KeyedEmbeddings(self.pooled_features, torch.empty(B, 0), self.column_offsets, {})
        values = torch.cat(blocks, dim=1)
        if self._columns is not None:  # packs' features -> pooled_features order
            values = values.index_select(1, self._columns.to(values.device))
        return KeyedEmbeddings(self.pooled_features, values, self.column_offsets, {})

    @torch.no_grad()
    def sparse_step(self, grad_scale: float = 1.0) -> None:
        """The parent's sparse step with every pack's gradient all-to-alls in flight while earlier packs are applied."""
        tl, group, scale = self.timeline, self.process_group, grad_scale / self.world_size
        pending, self._pending = self._pending, [[] for _ in self.shard.kernels]
        exchanges: list[list[tuple[_PackPlan, AsyncExchange]]] = []
        for pi, entries in enumerate(pending):
            with tl.span("grads", pi):
                exchanges.append([
                    (plan, AsyncExchange.all_to_all(grad, plan.send_counts, plan.recv_counts, group))
                    for plan, grad in entries
                ])
        for pi, (kernel, entries) in enumerate(zip(self.shard.kernels, exchanges)):
            if not entries:
                continue
            with tl.span("apply", pi):
                grads = [ex.wait(self.timeout_s) for _, ex in entries]
                rows = [plan.recv_rows for plan, _ in entries]
                row_ids, summed = coalesce_rows(torch.cat(rows), torch.cat(grads))
                apply_rows(kernel, row_ids, summed * scale)


class _FetchedRows(torch.autograd.Function):
    """Waits for one pack's rows; backward stores their gradient for the sparse step (as the parent's does)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, anchor: Tensor, exchange: AsyncExchange, timeout_s: float,
        owner: RowShardedEmbeddingCollection, pack: int, plan: _PackPlan,
    ) -> Tensor:
        ctx.owner, ctx.pack, ctx.plan = owner, pack, plan
        return exchange.wait(timeout_s)  # a fresh tensor (the receive buffer), so no aliasing of inputs

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: Tensor) -> tuple[None, ...]:  # type: ignore[override]
        if ctx.plan is None:
            raise RuntimeError("backward ran twice through a row-sharded lookup; that would apply the update twice")
        ctx.owner._pending[ctx.pack].append((ctx.plan, grad.contiguous()))
        ctx.plan = None
        return None, None, None, None, None, None
