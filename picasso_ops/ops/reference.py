"""Pure-torch reference for every picasso op: the semantics the C++ and Triton kernels must match.

Used by the tests, and as the fallback where no kernel is available (no
compiler, no Triton on a GPU, a dtype the kernels do not take). The packed
ops follow what ``picasso_ops.embedding.packed`` does today: an
``embedding_bag`` lookup, and a backward that sorts the touched rows, sums the
output gradient into the unique rows with one ``embedding_bag`` and applies
the optimizer to those rows only (formulas in ``embedding.sparse_optim``).
The hash table works on the same state tensors as the C++ op, so the two can
be swapped mid-run.

Example::

    >>> import torch
    >>> from picasso_ops.ops import reference as ref
    >>> w = torch.arange(8.0).view(4, 2); out = torch.zeros(1, 2)
    >>> ref.packed_lookup(w, torch.tensor([1, 3]), torch.tensor([0, 2]), torch.tensor([0]), out).tolist()
    [[8.0, 10.0]]
"""

from __future__ import annotations

import math
from typing import Mapping, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "check_column_rows",
    "packed_lookup",
    "packed_backward_update",
    "hash_find",
    "hash_insert",
    "hash_erase",
    "EMPTY_KEY",
    "TOMBSTONE_KEY",
    "HASH_MULTIPLIER",
]

EMPTY_KEY = -(2**63)
TOMBSTONE_KEY = -(2**63) + 1
HASH_MULTIPLIER = 0x9E3779B97F4A7C15  # Fibonacci hashing: 2**64 / golden ratio
_MASK64 = 2**64 - 1


def _column_counts(offsets: Tensor, batch_size: int) -> Tensor:
    """Ids per column of a column-major bag layout."""
    col = offsets[::batch_size].long()
    return col[1:] - col[:-1]


def _column_index(column_starts: Tensor, width: int) -> Tensor:
    """``[C * W]`` output columns of the packed columns, in column order."""
    return (column_starts.long().unsqueeze(1) + torch.arange(width, device=column_starts.device)).reshape(-1)


def _bag_scale(offsets: Tensor, mean_columns: Tensor, batch_size: int) -> Tensor:
    lengths = (offsets[1:] - offsets[:-1]).to(torch.float32)
    inv = lengths.clamp(min=1.0).reciprocal()
    return torch.where(mean_columns.bool().repeat_interleave(batch_size), inv, torch.ones_like(inv))


def _rows(indices: Tensor, offsets: Optional[Tensor], row_offsets: Optional[Tensor], batch_size: int) -> Tensor:
    rows = indices.long()
    if row_offsets is not None:
        assert offsets is not None
        counts = _column_counts(offsets, batch_size)
        rows = rows + torch.repeat_interleave(row_offsets.long(), counts, output_size=rows.numel())
    return rows


def _check_rows(rows: Tensor, num_rows: int, op: str) -> None:
    if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= num_rows):
        bad = int(((rows < 0) | (rows >= num_rows)).nonzero()[0, 0])
        raise IndexError(f"{op}: index {bad} points at a row outside the buffer of {num_rows} rows")


def check_column_rows(indices: Tensor, offsets: Tensor, column_rows: Tensor, batch: int, op: str) -> None:
    """Raise ``RuntimeError`` unless every id of column ``c`` is in ``[0, column_rows[c])`` (bags column-major).

    Example::

        >>> check_column_rows(torch.tensor([0, 2]), torch.tensor([0, 1, 2]), torch.tensor([1, 3]), 1, "op")
    """
    if indices.numel() == 0 or column_rows.numel() == 0:
        return
    counts = offsets[:: max(batch, 1)].diff() if batch > 0 else offsets.new_zeros(column_rows.numel())
    bound = torch.repeat_interleave(column_rows.to(indices.device, torch.int64), counts.long(),
                                    output_size=indices.numel())
    bad = (indices < 0) | (indices.long() >= bound)
    if bool(bad.any()):
        p = int(bad.nonzero()[0, 0])
        raise RuntimeError(
            f"{op}: index {p} (id {int(indices[p])}) is outside its column's table (column_rows) or the buffer"
        )


def packed_lookup(
    weight: Tensor,
    indices: Tensor,
    offsets: Tensor,
    column_starts: Tensor,
    out: Tensor,
    row_offsets: Optional[Tensor] = None,
    per_sample_weights: Optional[Tensor] = None,
    mean_columns: Optional[Tensor] = None,
) -> Tensor:
    """Pooled lookup of ``C`` columns of ``B`` bags each, written into ``out[:, column_starts[c] : +W]``.

    Bag ``g = c * B + b`` (``B = out.shape[0]``) holds ids
    ``indices[offsets[g] : offsets[g + 1]]``; its buffer rows are
    ``indices + row_offsets[c]`` (or the indices themselves). The bag is the
    sum of its rows, each times its per-sample weight, divided by the bag's
    length when ``mean_columns[c]`` (empty bags are zero). Returns ``out``.

    Example::

        >>> w = torch.eye(3); out = torch.zeros(2, 6)
        >>> packed_lookup(w, torch.tensor([0, 1, 2]), torch.tensor([0, 1, 1, 1, 3]), torch.tensor([3, 0]), out,
        ...               mean_columns=torch.tensor([False, True])).tolist()
        [[0.0, 0.0, 0.0, 1.0, 0.0, 0.0], [0.0, 0.5, 0.5, 0.0, 0.0, 0.0]]
    """
    C, B, W = column_starts.numel(), out.shape[0], weight.shape[1]
    if C * B == 0:
        return out
    rows = _rows(indices, offsets, row_offsets, B)
    _check_rows(rows, weight.shape[0], "packed_lookup")
    psw = None if per_sample_weights is None else per_sample_weights.to(weight.dtype)
    bags = F.embedding_bag(
        rows, weight, offsets.long(), mode="sum", per_sample_weights=psw, include_last_offset=True
    )
    if mean_columns is not None:
        bags = bags * _bag_scale(offsets, mean_columns, B).to(bags.dtype).unsqueeze(1)
    out[:, _column_index(column_starts, W)] = bags.view(C, B, W).transpose(0, 1).reshape(B, C * W).to(out.dtype)
    return out


def sum_by_row(
    rows: Tensor, bag_of: Optional[Tensor], weights: Optional[Tensor], grad: Tensor
) -> tuple[Tensor, Tensor]:
    """Unique ``rows`` (ascending) and ``sum_i w_i * grad[bag_of[i]]`` per row (``bag_of=None``: ``grad[i]``).

    Example::

        >>> rows, grad = sum_by_row(torch.tensor([2, 0, 2]), None, None, torch.ones(3, 1))
        >>> rows.tolist(), grad.tolist()
        ([0, 2], [[1.0], [2.0]])
    """
    if rows.numel() == 0:
        return rows.new_zeros(0, dtype=torch.int64), grad.new_zeros(0, grad.shape[1])
    sorted_rows, perm = torch.sort(rows, stable=True)
    unique, counts = torch.unique_consecutive(sorted_rows, return_counts=True)
    segments = torch.zeros(counts.numel() + 1, dtype=torch.int64, device=rows.device)
    torch.cumsum(counts, 0, out=segments[1:])
    sources = perm if bag_of is None else bag_of.index_select(0, perm)
    w = None if weights is None else weights.index_select(0, perm).to(grad.dtype)
    summed = F.embedding_bag(sources, grad, segments, mode="sum", per_sample_weights=w, include_last_offset=True)
    return unique, summed


def apply_optimizer(
    weight: Tensor,
    state: Mapping[str, Tensor],
    rows: Tensor,
    grad: Tensor,
    optimizer: str,
    hyperparams: Mapping[str, float],
    step: float,
) -> None:
    """One sparse step on unique ``rows`` (formulas of ``embedding.sparse_optim``, storage row = table row)."""
    lr = float(hyperparams["lr"])
    grad = grad.float()
    if optimizer == "sgd":
        delta = grad * -lr
    elif optimizer == "rowwise_adagrad":
        acc = state["momentum1"]
        new_acc = acc.index_select(0, rows) + grad.square().sum(1) / weight.shape[1]
        acc.index_copy_(0, rows, new_acc)
        delta = grad * new_acc.sqrt_().add_(float(hyperparams.get("eps", 1e-8))).reciprocal_().mul_(-lr).unsqueeze(1)
    elif optimizer == "adam":
        beta1, beta2 = float(hyperparams.get("beta1", 0.9)), float(hyperparams.get("beta2", 0.999))
        eps = float(hyperparams.get("eps", 1e-8))
        m1 = state["momentum1"].index_select(0, rows).mul_(beta1).add_(grad, alpha=1.0 - beta1)
        m2 = state["momentum2"].index_select(0, rows).mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
        state["momentum1"].index_copy_(0, rows, m1)
        state["momentum2"].index_copy_(0, rows, m2)
        bc1, bc2 = 1.0 - beta1**step, 1.0 - beta2**step
        delta = (m1 / bc1).div_((m2 / bc2).sqrt_().add_(eps)).mul_(-lr)
    else:
        raise ValueError(f"unknown optimizer {optimizer!r} (sgd, rowwise_adagrad, adam)")
    weight.index_put_((rows,), delta.to(weight.dtype), accumulate=True)


@torch.no_grad()
def packed_backward_update(
    weight: Tensor,
    state: Mapping[str, Tensor],
    indices: Tensor,
    offsets: Optional[Tensor],
    grad: Tensor,
    column_starts: Optional[Tensor],
    *,
    optimizer: str,
    hyperparams: Mapping[str, float],
    step: float = 1,
    row_offsets: Optional[Tensor] = None,
    per_sample_weights: Optional[Tensor] = None,
    mean_columns: Optional[Tensor] = None,
    segments: Optional[Tensor] = None,
) -> None:
    """The backward of :func:`packed_lookup` with one optimizer step fused in, in place.

    ``grad`` is the gradient of the whole ``[B, sum D]`` output (the pack's
    columns are read at ``column_starts``), or, with ``offsets=None``, one row
    per index (sequence features). Each touched buffer row gets
    ``g = sum over its ids of grad[bag] * weight * (1/len for mean columns)``
    and one step of ``optimizer`` (``sgd``, ``rowwise_adagrad`` with
    ``state["momentum1"]`` ``[rows]``, ``adam`` with ``momentum1/2``
    ``[rows, W]`` and global ``step``). ``segments`` (bag boundaries of
    groups with disjoint rows) only steers how kernels split the work.

    Example::

        >>> w = torch.zeros(3, 2); g = torch.ones(1, 2)
        >>> packed_backward_update(w, {}, torch.tensor([2, 2]), torch.tensor([0, 2]), g, torch.tensor([0]),
        ...                        optimizer="sgd", hyperparams={"lr": 0.5})
        >>> w[2].tolist()
        [-1.0, -1.0]
    """
    del segments
    if offsets is None:
        rows, bag_of, g = indices.long(), None, grad
    else:
        assert column_starts is not None, "pooled updates need column_starts"
        C, B, W = column_starts.numel(), grad.shape[0], weight.shape[1]
        if C * B == 0:
            return
        rows = _rows(indices, offsets, row_offsets, B)
        g = grad[:, _column_index(column_starts, W)].reshape(B, C, W).transpose(0, 1).reshape(C * B, W)
        if mean_columns is not None:
            g = g * _bag_scale(offsets, mean_columns, B).to(g.dtype).unsqueeze(1)
        lengths = (offsets[1:] - offsets[:-1]).long()
        bag_of = torch.repeat_interleave(torch.arange(C * B, device=grad.device), lengths, output_size=rows.numel())
    _check_rows(rows, weight.shape[0], "packed_backward_update")
    unique, summed = sum_by_row(rows, bag_of, per_sample_weights, g.contiguous())
    if unique.numel():
        apply_optimizer(weight, state, unique, summed, optimizer, hyperparams, step)


# ------------------------------------------------------------------ hash table
def _home(keys: Tensor, bits: int) -> Tensor:
    """Fibonacci hash of int64 keys to ``bits``-bit bucket numbers (int64 products wrap, as in C++)."""
    signed = HASH_MULTIPLIER - 2**64  # the same 64 bits as a signed int64
    return ((keys * signed) >> (64 - bits)) & ((1 << bits) - 1)


def _home_int(key: int, bits: int) -> int:
    return (((key & _MASK64) * HASH_MULTIPLIER) & _MASK64) >> (64 - bits)


def _bits(capacity: int) -> int:
    return int(math.log2(capacity))


def hash_find(keys: Tensor, slots: Tensor, query: Tensor) -> Tensor:
    """Slot of each query key, ``-1`` when absent (vectorised linear probing).

    Example::

        >>> k = torch.full((4,), EMPTY_KEY); s = torch.full((4,), -1)
        >>> f = torch.tensor([1, 0]); m = torch.tensor([0, 2, 0])
        >>> hash_insert(k, s, f, m, torch.tensor([42])).tolist(), hash_find(k, s, torch.tensor([42, 7])).tolist()
        ([0], [0, -1])
    """
    cap = keys.numel()
    mask = cap - 1
    pos = _home(query.long(), _bits(cap))
    out = torch.full_like(query, -1, dtype=torch.int64)
    active = torch.arange(query.numel(), device=query.device)
    while active.numel():
        k = keys[pos]
        hit = k == query[active]
        out[active[hit]] = slots[pos[hit]]
        go_on = ~hit & (k != EMPTY_KEY)
        active, pos = active[go_on], (pos[go_on] + 1) & mask
    return out


def _rebuild(k: list[int], s: list[int], meta: list[int], bits: int) -> None:
    live = [(key, slot) for key, slot in zip(k, s) if key not in (EMPTY_KEY, TOMBSTONE_KEY)]
    cap = len(k)
    k[:] = [EMPTY_KEY] * cap
    s[:] = [-1] * cap
    for key, slot in live:
        h = _home_int(key, bits)
        while k[h] != EMPTY_KEY:
            h = (h + 1) & (cap - 1)
        k[h], s[h] = key, slot
    meta[2] = 0


def hash_insert(keys: Tensor, slots: Tensor, free: Tensor, meta: Tensor, query: Tensor) -> Tensor:
    """Slot of each key, inserting absent keys with the next free slot; ``-1`` where the table is full.

    State layout and policies are those of ``csrc/hash_table.cpp``; a Python
    loop over the keys (a reference, not a fast path).
    """
    k, s, f, m = keys.tolist(), slots.tolist(), free.tolist(), meta.tolist()
    q = query.tolist()
    if any(key in (EMPTY_KEY, TOMBSTONE_KEY) for key in q):
        raise RuntimeError(f"hash_insert: keys {EMPTY_KEY} and {TOMBSTONE_KEY} are reserved")
    cap = len(k)
    bits, mask = _bits(cap), cap - 1
    if m[2] > cap // 4:
        _rebuild(k, s, m, bits)
    out = []
    for key in q:
        h, tomb, found = _home_int(key, bits), -1, -1
        while True:
            if k[h] == key:
                found = s[h]
                break
            if k[h] == EMPTY_KEY:
                break
            if k[h] == TOMBSTONE_KEY and tomb < 0:
                tomb = h
            h = (h + 1) & mask
        if found >= 0:
            out.append(found)
            continue
        if m[1] == 0:
            out.append(-1)
            continue
        b = tomb if tomb >= 0 else h
        m[1] -= 1
        k[b], s[b] = key, f[m[1]]
        m[0] += 1
        if tomb >= 0:
            m[2] -= 1
        out.append(s[b])
    keys.copy_(torch.tensor(k, dtype=torch.int64))
    slots.copy_(torch.tensor(s, dtype=torch.int64))
    free.copy_(torch.tensor(f, dtype=torch.int64))
    meta.copy_(torch.tensor(m, dtype=torch.int64))
    return torch.tensor(out, dtype=torch.int64, device=query.device)


def hash_erase(keys: Tensor, slots: Tensor, free: Tensor, meta: Tensor, query: Tensor) -> Tensor:
    """Remove keys; the slot each one held (now free again), ``-1`` for keys not present."""
    k, s, f, m = keys.tolist(), slots.tolist(), free.tolist(), meta.tolist()
    cap = len(k)
    bits, mask = _bits(cap), cap - 1
    out = []
    for key in query.tolist():
        slot = -1
        if key not in (EMPTY_KEY, TOMBSTONE_KEY):
            h = _home_int(key, bits)
            while k[h] != EMPTY_KEY:
                if k[h] == key:
                    slot = s[h]
                    f[m[1]] = slot
                    m[1] += 1
                    k[h], s[h] = TOMBSTONE_KEY, -1
                    m[0] -= 1
                    m[2] += 1
                    break
                h = (h + 1) & mask
        out.append(slot)
    if m[2] > cap // 4:
        _rebuild(k, s, m, bits)
    keys.copy_(torch.tensor(k, dtype=torch.int64))
    slots.copy_(torch.tensor(s, dtype=torch.int64))
    free.copy_(torch.tensor(f, dtype=torch.int64))
    meta.copy_(torch.tensor(m, dtype=torch.int64))
    return torch.tensor(out, dtype=torch.int64, device=query.device)
