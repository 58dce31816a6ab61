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

__all__ = ["DataParallelEmbeddingCollection", "take_pending", "apply_rows", "apply_to_packed"]

logger = logging.getLogger(__name__)


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
        device = self.kernels[0].weight.device  # NCCL needs the counts on the GPU too
        meta = torch.tensor([[rows.numel(), int(ran)] for ran, rows, _ in local], dtype=torch.int64, device=device)
        meta = meta.view(-1, 2)
        if world > 1:
            metas = [torch.empty_like(meta) for _ in range(world)]
            torch.distributed.all_gather(metas, meta, group=self.process_group)
            all_meta = torch.stack(metas)  # [world, packs, 2]
        else:
            all_meta = meta.unsqueeze(0)
        counts = all_meta[:, :, 0].tolist()  # one host read for every pack
        ran_any = all_meta[:, :, 1].amax(0).tolist()
        scale = grad_scale / world
        for pi, (kernel, (_, rows, grads)) in enumerate(zip(self.kernels, local)):
            if not ran_any[pi]:
                continue  # no rank ran this pack's backward: no step, as in a single process
            pack_counts = [c[pi] for c in counts]
            if world > 1:
                gathered = all_gather_varsize(pack_rows(rows, grads), pack_counts, self.process_group)
                rows, grads = coalesce_rows(*unpack_rows(gathered, kernel.width))
            apply_rows(kernel, rows, grads * scale)

    def discard_pending(self) -> None:
        """Drop the stored row gradients without a step (e.g. after an fp16 overflow); local, no collective."""
        for kernel in self.kernels:
            kernel.discard_pending()
