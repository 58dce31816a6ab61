"""Data-parallel packed tables: every rank holds every table and applies the global batch's sparse gradient.

No dense all-reduce of tables: after backward each rank has, per pack, the
unique rows its local batch touched and their summed gradients (the fused
backward with ``defer_updates``). ``sparse_step()`` then

1. exchanges every pack's row count (and whether the pack ran a backward) in
   one ``all_gather``,
2. all-gathers each pack's rows and gradients in one message per pack
   (``[U, 2 + width]``: the int64 row ids' bytes travel beside the gradients;
   padded to the largest count because gloo's all_gather needs equal sizes),
3. sums the gradients per row over all ranks, multiplies by
   ``grad_scale / world_size`` (each rank's loss is a mean over its local
   batch, so this is the gradient of the mean loss over the global batch,
   exactly what DeepSpeed's averaged dense all-reduce gives the dense layers),
4. applies the pack's fused optimizer once.

Every rank computes the same sum in the same order, so replicas stay
bit-identical. Cost per step: ``world_size * unique rows`` row gradients per
rank, which beats a dense all-reduce whenever a step touches less than the
whole table.

Example::

    >>> from picasso_ops.embedding import TableSpec
    >>> from picasso_ops.distributed import DataParallelEmbeddingCollection
    >>> emb = DataParallelEmbeddingCollection([TableSpec("user", 1000, 16, optimizer="rowwise_adagrad")])
    >>> out = emb(batch)                 # local batch, no communication
    >>> loss_fn(out.values).backward()   # stores this rank's row gradients
    >>> emb.sparse_step()                # global exchange + one optimizer step, identical on every rank
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence, Union

import torch
from torch import Tensor, nn

from picasso_ops.contracts import SparseStepModule
from picasso_ops.distributed.comm import (
    ProcessGroup,
    all_gather_varsize,
    broadcast_tensor,
    coalesce_rows,
    pack_rows,
    unpack_rows,
    world_info,
)
from picasso_ops.embedding.packed import PackedEmbeddingCollection
from picasso_ops.embedding.spec import TableSpec
from picasso_ops.jagged import JaggedBatch

__all__ = ["DataParallelEmbeddingCollection", "PackUnion", "take_pending", "apply_rows", "apply_to_packed"]

logger = logging.getLogger(__name__)


@dataclass
class PackUnion:
    """One pack's rows of one batch on every rank, known before its backward (a sparse-dist pipeline).

    ``local``: this rank's distinct buffer rows (ascending), what its backward will store;
    ``rows``/``inverse``: ``torch.unique`` (sorted, with inverse) of every rank's ``local`` concatenated
    in rank order: what :meth:`DataParallelEmbeddingCollection.sparse_step` would compute from the
    gathered rows, so the step skips that dedup.
    """

    local: Tensor
    rows: Tensor
    inverse: Tensor


def take_pending(kernel: Any) -> tuple[bool, Tensor, Tensor]:
    """Pop a pack kernel's deferred row gradients: ``(ran_backward, unique rows, summed grads)``.

    This and :func:`apply_rows` are the only places that reach into the pack
    kernel's deferred-update internals (``_pending``, ``apply_rows``).
    """
    pending = list(kernel._pending)
    kernel._pending.clear()
    width = kernel.width
    if not pending:
        device = kernel.weight.device
        return False, torch.zeros(0, dtype=torch.int64, device=device), kernel.weight.new_zeros(0, width)
    rows = torch.cat([r.long() for r, _ in pending])
    grads = torch.cat([g for _, g in pending])
    rows, grads = coalesce_rows(rows, grads)
    return True, rows, grads


def apply_rows(kernel: Any, rows: Tensor, grads: Tensor) -> None:
    """One optimizer step of a pack kernel on unique ``rows`` (counts the step even when ``rows`` is empty)."""
    with torch.no_grad():
        kernel.apply_rows(rows, grads.to(kernel.weight.dtype))


def apply_to_packed(collection: PackedEmbeddingCollection, fn: Callable[[Tensor], Tensor]) -> None:
    """``nn.Module._apply`` for a packed collection (``.to(device)``) that keeps the tables' dtypes.

    A dtype cast (DeepSpeed's
    ``module.half()``/``bfloat16()`` for fp16/bf16 training) moves the tables
    but keeps their ``TableSpec`` dtype and the fp32 optimizer state, which
    the sparse optimizers require.
    """

    def same_dtype(t: Tensor) -> Tensor:
        out = fn(t)
        return out if out.dtype == t.dtype else t.to(device=out.device)

    nn.Module._apply(collection, same_dtype)


class DataParallelEmbeddingCollection(PackedEmbeddingCollection, SparseStepModule):
    """A :class:`PackedEmbeddingCollection` replicated on every rank, kept identical by a sparse global step.

    Args:
        specs: the tables.
        packing: pack compatible tables (``False``: one pack per table).
        across_dims: pack tables of different dims together.
        process_group: the data-parallel group (default: the world).
        device: where tables live.

    The lookup and backward are the fused ones of the parent class with
    ``defer_updates`` always on; call :meth:`sparse_step` once per optimizer
    step (at the gradient-accumulation boundary), on every rank. Tables are
    broadcast from the group's rank 0 at construction, so replicas start equal
    whatever each rank's RNG state.

    Example::

        >>> emb = DataParallelEmbeddingCollection([TableSpec("a", 10, 4)])
        >>> emb.defer_updates
        True
    """

    def __init__(
        self,
        specs: Sequence[TableSpec],
        *,
        packing: bool = True,
        across_dims: bool = False,
        process_group: Optional[ProcessGroup] = None,
        device: Optional[Union[torch.device, str]] = None,
    ) -> None:
        super().__init__(specs, packing=packing, across_dims=across_dims, mode="fused", device=device)
        self.process_group = process_group
        for kernel in self.kernels:
            kernel._defer = True
        self._prepared: list[list[Optional[PackUnion]]] = []  # per forward since the last step (a pipeline's)
        self.prepared_steps = 0  # pack steps served by a union prepared ahead (their gathered rows not deduped)
        self.broadcast_tables()

    def _apply(self, fn: Callable[[Tensor], Tensor], recurse: bool = True) -> "DataParallelEmbeddingCollection":
        apply_to_packed(self, fn)  # tables keep their dtype and fp32 optimizer state
        return self

    @property
    def defer_updates(self) -> bool:
        """Always ``True``: the update waits for the global exchange in :meth:`sparse_step`."""
        return True

    @defer_updates.setter
    def defer_updates(self, value: bool) -> None:
        if not value:
            raise ValueError("a DataParallelEmbeddingCollection always defers updates to sparse_step()")

    @torch.no_grad()
    def broadcast_tables(self, src: int = 0) -> None:
        """Copy every table and its optimizer state from rank ``src`` of the group (after a custom init)."""
        for kernel in self.kernels:
            broadcast_tensor(kernel.weight, src, self.process_group)
            for buf in kernel.state.values():
                broadcast_tensor(buf, src, self.process_group)

    def step(self) -> None:
        """Same as ``sparse_step()`` with no extra scaling."""
        self.sparse_step()

    @torch.no_grad()
    def sparse_step(self, grad_scale: float = 1.0) -> None:
        """Exchange the row gradients of every pack, combine them per row and apply one optimizer step.

        Args:
            grad_scale: multiplies the combined gradient, e.g. ``1 / loss_scale``
                under fp16 loss scaling (the gradient-accumulation ``1 / gas``
                is already in the gradients when the loss went through
                ``engine.backward``).

        Collective: every rank of the group must call it, the same number of times.
        """
        rank, world = world_info(self.process_group)
        local = [take_pending(kernel) for kernel in self.kernels]
        prepared, self._prepared = self._prepared, []
        # a union prepared ahead serves a step of one forward whose rows it names (else the gathered rows are deduped)
        unions = prepared[0] if len(prepared) == 1 else [None] * len(self.kernels)
        known = [u is not None and torch.equal(rows, u.local) for u, (_, rows, _) in zip(unions, local)]
        device = self.kernels[0].weight.device  # NCCL needs the counts on the GPU too
        meta = torch.tensor([[rows.numel(), int(ran), int(k)] for (ran, rows, _), k in zip(local, known)],
                            dtype=torch.int64, device=device)
        meta = meta.view(-1, 3)
        if world > 1:
            metas = [torch.empty_like(meta) for _ in range(world)]
            torch.distributed.all_gather(metas, meta, group=self.process_group)
            all_meta = torch.stack(metas)  # [world, packs, 2]
        else:
            all_meta = meta.unsqueeze(0)
        counts = all_meta[:, :, 0].tolist()  # one host read for every pack
        ran_any = all_meta[:, :, 1].amax(0).tolist()
        all_known = all_meta[:, :, 2].amin(0).tolist()
        scale = grad_scale / world
        for pi, (kernel, (_, rows, grads)) in enumerate(zip(self.kernels, local)):
            if not ran_any[pi]:
                continue  # no rank ran this pack's backward: no step, as in a single process
            pack_counts = [c[pi] for c in counts]
            union = unions[pi]
            if world > 1 and all_known[pi] and union is not None:  # every rank's rows known: gradients only
                gathered = all_gather_varsize(grads, pack_counts, self.process_group)
                rows = union.rows
                grads = gathered.new_zeros(rows.numel(), gathered.shape[1])
                grads.index_add_(0, union.inverse, gathered)  # as coalesce_rows: the same sum in the same order
                self.prepared_steps += 1
            elif world > 1:
                gathered = all_gather_varsize(pack_rows(rows, grads), pack_counts, self.process_group)
                rows, grads = coalesce_rows(*unpack_rows(gathered, kernel.width))
            apply_rows(kernel, rows, grads * scale)

    def discard_pending(self) -> None:
        """Drop the stored row gradients without a step (e.g. after an fp16 overflow); local, no collective."""
        self._prepared = []
        for kernel in self.kernels:
            kernel.discard_pending()

    # ---------------------------------------------------------- pipelining
    @torch.no_grad()
    def local_rows(self, batch: JaggedBatch) -> Optional[list[Tensor]]:
        """Per pack, the distinct buffer rows ``batch``'s backward will touch on this rank (local, no collective).

        ``None`` where it cannot be known ahead without side effects: ``bounds_check`` other than
        ``"fatal"`` (the lookup counts replaced ids) or an id out of range (the forward reports it).
        """
        if self.bounds_check != "fatal":
            return None
        keys = tuple(self.pooled_features) + tuple(self.sequence_features)
        if tuple(batch.keys) != keys:  # the batch the forward sees (its cached field map stays the forward's)
            batch = batch.select(keys)
        try:
            out = []
            for kernel, (columns, first_field) in zip(self.kernels, self._batch_fields(batch)):
                plan = kernel._torch_plan(kernel.prepare(batch, columns, first_field))
                out.append(torch.unique(plan.indices.long(), sorted=True))
            return out
        except (IndexError, KeyError):
            return None

    @torch.no_grad()
    def exchange_rows(self, local: Optional[list[Tensor]], group: Optional[ProcessGroup]) -> list[Optional[PackUnion]]:
        """Every rank's :meth:`local_rows` over ``group`` (a collective, even with ``local`` None): each pack's union.

        Example::

            >>> unions = emb.exchange_rows(emb.local_rows(next_batch), pipeline_group)  # while a batch trains
            >>> emb.arm(unions); emb(next_batch).values.sum().backward(); emb.sparse_step()
        """
        _, world = world_info(group)
        packs = len(self.kernels)
        mine = [-1] * packs if local is None else [int(r.numel()) for r in local]
        device = self.kernels[0].weight.device
        meta = torch.tensor(mine, dtype=torch.int64, device=device)
        if world > 1:
            metas = [torch.empty_like(meta) for _ in range(world)]
            torch.distributed.all_gather(metas, meta, group=group)
            counts = torch.stack(metas).tolist()  # [world, packs]
        else:
            counts = [mine]
        if any(c < 0 for row in counts for c in row):
            return [None] * packs  # some rank cannot know its rows ahead: the step dedups as usual
        assert local is not None
        out: list[Optional[PackUnion]] = []
        for pi in range(packs):
            pack_counts = [row[pi] for row in counts]
            everyone = all_gather_varsize(local[pi], pack_counts, group) if world > 1 else local[pi]
            rows, inverse = torch.unique(everyone, sorted=True, return_inverse=True)
            out.append(PackUnion(local[pi], rows, inverse))
        return out

    def arm(self, unions: list[Optional[PackUnion]]) -> None:
        """Record the unions of the forward about to run; the sparse step uses them if its step had that forward only."""
        self._prepared.append(unions)
