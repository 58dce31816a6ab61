"""Variable-size collectives and row-gradient helpers shared by the distributed table collections.

Everything here is vectorised (no per-id Python loops) and works on gloo and
NCCL through ``torch.distributed``. With no process group initialised the
world is one rank and every exchange is the identity, so the same code runs in
a single process.

Example::

    >>> import torch
    >>> from picasso_ops.distributed.comm import coalesce_rows
    >>> rows, grads = coalesce_rows(torch.tensor([3, 1, 3]), torch.ones(3, 2))
    >>> rows.tolist(), grads.tolist()
    ([1, 3], [[1.0, 1.0], [2.0, 2.0]])
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = [
    "world_info",
    "coalesce_rows",
    "pack_rows",
    "unpack_rows",
    "all_gather_varsize",
    "all_to_all_varsize",
    "broadcast_tensor",
]

ProcessGroup = Any  # torch.distributed.ProcessGroup; Any keeps the annotation importable without a group


def world_info(group: Optional[ProcessGroup] = None) -> tuple[int, int]:
    """``(rank, world_size)`` in ``group``; ``(0, 1)`` when torch.distributed is not initialised.

    Example::

        >>> world_info()  # in a plain process
        (0, 1)
    """
    if not dist.is_available() or not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def coalesce_rows(rows: Tensor, grads: Tensor) -> tuple[Tensor, Tensor]:
    """Unique ``rows`` (ascending, int64) and the sum of ``grads`` per row.

    Example::

        >>> coalesce_rows(torch.tensor([2, 2]), torch.tensor([[1.0], [2.0]]))[1].tolist()
        [[3.0]]
    """
    if rows.numel() == 0:
        return rows.long(), grads
    uniq, inverse = torch.unique(rows.long(), sorted=True, return_inverse=True)
    out = grads.new_zeros(uniq.numel(), grads.shape[1])
    out.index_add_(0, inverse, grads)
    return uniq, out


def pack_rows(rows: Tensor, grads: Tensor) -> Tensor:
    """One ``[U, k + width]`` tensor of ``grads``' dtype whose first ``k`` columns are the int64 ``rows``' bytes.

    Sending ids and gradients in one message halves the collectives; the bytes
    of the ids are only copied, never computed on, so they travel exactly.

    Example::

        >>> p = pack_rows(torch.tensor([5, 7]), torch.ones(2, 3))
        >>> p.shape, unpack_rows(p, 3)[0].tolist()
        (torch.Size([2, 5]), [5, 7])
    """
    k = 8 // grads.element_size()
    ids = rows.long().contiguous().view(grads.dtype).view(-1, k)
    return torch.cat([ids, grads], dim=1)


def unpack_rows(packed: Tensor, width: int) -> tuple[Tensor, Tensor]:
    """The inverse of :func:`pack_rows`: ``(rows int64 [U], grads [U, width])``."""
    k = packed.shape[1] - width
    rows = packed[:, :k].contiguous().view(torch.int64).view(-1)
    return rows, packed[:, k:]


def all_gather_varsize(t: Tensor, counts: Sequence[int], group: Optional[ProcessGroup] = None) -> Tensor:
    """Concatenate, in rank order, every rank's ``t`` (``counts[r]`` rows on rank ``r``, rows of equal shape).

    ``counts`` must already be known on every rank (exchange them first, all
    of a step's counts in one collective). gloo's all_gather needs equal sizes,
    so each rank pads to the largest count.

    Example::

        >>> all_gather_varsize(torch.ones(2, 3), [2]).shape
        torch.Size([2, 3])
    """
    world = len(counts)
    if world == 1:
        return t
    width = max(counts)
    padded = t.new_zeros((width,) + tuple(t.shape[1:]))
    padded[: t.shape[0]] = t
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded, group=group)
    return torch.cat([p[:n] for p, n in zip(parts, counts)])


def all_to_all_varsize(
    t: Tensor,
    send_counts: Sequence[int],
    recv_counts: Sequence[int],
    group: Optional[ProcessGroup] = None,
) -> Tensor:
    """Send chunk ``r`` of ``t`` (split by ``send_counts``) to rank ``r``; return the received chunks in rank order.

    Example::

        >>> all_to_all_varsize(torch.arange(3), [3], [3]).tolist()
        [0, 1, 2]
    """
    if len(send_counts) == 1:
        return t
    out = t.new_empty((int(sum(recv_counts)),) + tuple(t.shape[1:]))
    dist.all_to_all_single(
        out, t.contiguous(), output_split_sizes=list(recv_counts), input_split_sizes=list(send_counts), group=group
    )
    return out


def broadcast_tensor(t: Tensor, src: int = 0, group: Optional[ProcessGroup] = None) -> None:
    """Overwrite ``t`` in place with ``src``'s copy (no-op in a single process).

    Example::

        >>> broadcast_tensor(torch.zeros(2))
    """
    if world_info(group)[1] == 1:
        return
    global_src = dist.get_global_rank(group, src) if group is not None else src
    dist.broadcast(t, src=global_src, group=group)
