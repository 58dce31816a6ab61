"""Triton kernels for the GPU path of the packed lookup and the fused backward+optimizer.

Same arguments and semantics as ``picasso_ops.ops.reference`` (see
``picasso_ops.ops.packed_lookup``). The lookup runs one program per bag and
writes it straight into its columns of the ``[B, sum D]`` output. The backward
dedups rows with one device sort (as FBGEMM's TBE backward does), then runs one
program per unique row that sums the row's gradient in registers and applies
the optimizer in place; no dense gradient is built and no two programs write
the same row.

On CPU the kernels run under ``TRITON_INTERPRET=1`` (set before this module is
imported), which is how the tests check them without a GPU.

Example (on a CUDA machine; ``picasso_ops.ops.packed_lookup`` picks this path by itself)::

    from picasso_ops.ops import triton_kernels
    w = torch.randn(10, 4, device="cuda"); out = torch.empty(1, 4, device="cuda")
    ids, offsets = torch.tensor([1, 2], device="cuda"), torch.tensor([0, 2], device="cuda")
    triton_kernels.packed_lookup(w, ids, offsets, torch.tensor([0], device="cuda"), out)  # out[0] = w[1] + w[2]
"""

from __future__ import annotations

from typing import Mapping, Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from picasso_ops.ops.reference import _check_rows, _column_counts

__all__ = ["packed_lookup", "packed_backward_update"]

_OPTIMIZERS = {"sgd": 0, "rowwise_adagrad": 1, "adam": 2}


@triton.jit
def _lookup_kernel(
    weight_ptr, indices_ptr, offsets_ptr, col_starts_ptr, row_offsets_ptr, psw_ptr, mean_ptr, out_ptr,
    B, W, ld,
    HAS_ROW_OFFSETS: tl.constexpr, HAS_WEIGHTS: tl.constexpr, HAS_MEAN: tl.constexpr, BLOCK_W: tl.constexpr,
):
    g = tl.program_id(0).to(tl.int64)
    c = g // B
    b = g - c * B
    s = tl.load(offsets_ptr + g)
    e = tl.load(offsets_ptr + g + 1)
    cols = tl.arange(0, BLOCK_W)
    mask = cols < W
    roff = tl.zeros([], dtype=tl.int64)
    if HAS_ROW_OFFSETS:
        roff = tl.load(row_offsets_ptr + c)
    acc = tl.zeros([BLOCK_W], dtype=tl.float32)
    for p in range(s, e):
        r = tl.load(indices_ptr + p).to(tl.int64) + roff
        row = tl.load(weight_ptr + r * W + cols, mask=mask, other=0.0)
        if HAS_WEIGHTS:
            row = row * tl.load(psw_ptr + p)
        acc += row
    if HAS_MEAN:
        n = e - s
        is_mean = (tl.load(mean_ptr + c) != 0) & (n > 0)
        acc = acc * tl.where(is_mean, 1.0 / tl.maximum(n, 1).to(tl.float32), 1.0)
    start = tl.load(col_starts_ptr + c)
    tl.store(out_ptr + b * ld + start + cols, acc, mask=mask)


@triton.jit
def _update_kernel(
    weight_ptr, m1_ptr, m2_ptr, grad_ptr, rows_ptr, starts_ptr, goff_ptr, coef_ptr,
    W, lr, eps, beta1, beta2, bias1, bias2,
    OPT: tl.constexpr, BLOCK_W: tl.constexpr,
):
    u = tl.program_id(0).to(tl.int64)
    row = tl.load(rows_ptr + u)
    s = tl.load(starts_ptr + u)
    e = tl.load(starts_ptr + u + 1)
    cols = tl.arange(0, BLOCK_W)
    mask = cols < W
    acc = tl.zeros([BLOCK_W], dtype=tl.float32)
    for p in range(s, e):
        off = tl.load(goff_ptr + p)
        acc += tl.load(grad_ptr + off + cols, mask=mask, other=0.0) * tl.load(coef_ptr + p)
    wp = weight_ptr + row * W + cols
    w = tl.load(wp, mask=mask, other=0.0)
    if OPT == 0:
        w = w + acc * -lr
    elif OPT == 1:
        m = tl.load(m1_ptr + row) + tl.sum(acc * acc, axis=0) / W
        tl.store(m1_ptr + row, m)
        w = w + acc * ((1.0 / (tl.sqrt(m) + eps)) * -lr)
    else:
        p1 = m1_ptr + row * W + cols
        p2 = m2_ptr + row * W + cols
        a1 = tl.load(p1, mask=mask, other=0.0) * beta1 + acc * (1.0 - beta1)
        a2 = tl.load(p2, mask=mask, other=0.0) * beta2 + acc * acc * (1.0 - beta2)
        tl.store(p1, a1, mask=mask)
        tl.store(p2, a2, mask=mask)
        w = w + ((a1 / bias1) / (tl.sqrt(a2 / bias2) + eps)) * -lr
    tl.store(wp, w, mask=mask)


def _block(width: int) -> int:
    return max(16, triton.next_power_of_2(width))


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
    """Triton version of ``reference.packed_lookup`` (float32 ``weight`` and ``out``); returns ``out``."""
    C, B, W = column_starts.numel(), out.shape[0], weight.shape[1]
    if C * B == 0:
        return out
    if out.stride(1) != 1 or not weight.is_contiguous():
        raise ValueError("packed_lookup: weight must be contiguous and out must have unit column stride")
    offsets = offsets.long().contiguous()
    if row_offsets is not None:
        rows = indices.long() + torch.repeat_interleave(row_offsets.long(), _column_counts(offsets, B))
    else:
        rows = indices
    _check_rows(rows, weight.shape[0], "packed_lookup")  # one sync: a bad id must raise, not read stray memory
    dummy = weight
    _lookup_kernel[(C * B,)](
        weight, indices.contiguous(), offsets, column_starts.long().contiguous(),
        dummy if row_offsets is None else row_offsets.long().contiguous(),
        dummy if per_sample_weights is None else per_sample_weights.float().contiguous(),
        dummy if mean_columns is None else mean_columns.to(torch.int8).contiguous(),
        out, B, W, out.stride(0),
        HAS_ROW_OFFSETS=row_offsets is not None,
        HAS_WEIGHTS=per_sample_weights is not None,
        HAS_MEAN=mean_columns is not None,
        BLOCK_W=_block(W),
    )
    return out


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
    """Triton version of ``reference.packed_backward_update``, in place."""
    del segments  # one device sort dedups all rows at once
    if optimizer not in _OPTIMIZERS:
        raise ValueError(f"unknown optimizer {optimizer!r} (sgd, rowwise_adagrad, adam)")
    N, W = indices.numel(), weight.shape[1]
    if N == 0:
        return
    if grad.stride(1) != 1:
        grad = grad.contiguous()
    grad = grad.float()
    device = indices.device
    rows = indices.long()
    coef = per_sample_weights.float() if per_sample_weights is not None else torch.ones(N, device=device)
    if offsets is None:
        goff = torch.arange(N, device=device) * grad.stride(0)
    else:
        assert column_starts is not None, "pooled updates need column_starts"
        B = grad.shape[0]
        offsets = offsets.long()
        lengths = offsets[1:] - offsets[:-1]
        bag = torch.repeat_interleave(torch.arange(lengths.numel(), device=device), lengths, output_size=N)
        col = bag // B
        if row_offsets is not None:
            rows = rows + row_offsets.long()[col]
        goff = (bag - col * B) * grad.stride(0) + column_starts.long()[col]
        if mean_columns is not None:
            is_mean = mean_columns.bool()[col]
            coef = torch.where(is_mean, coef / lengths[bag].float(), coef)
    _check_rows(rows, weight.shape[0], "packed_backward_update")
    sorted_rows, perm = torch.sort(rows, stable=True)
    unique, counts = torch.unique_consecutive(sorted_rows, return_counts=True)
    starts = torch.zeros(unique.numel() + 1, dtype=torch.int64, device=device)
    torch.cumsum(counts, 0, out=starts[1:])
    lr = float(hyperparams["lr"])
    eps = float(hyperparams.get("eps", 1e-8))
    beta1, beta2 = float(hyperparams.get("beta1", 0.9)), float(hyperparams.get("beta2", 0.999))
    m1 = state.get("momentum1", weight)
    m2 = state.get("momentum2", weight)
    _update_kernel[(unique.numel(),)](
        weight, m1, m2, grad, unique, starts, goff[perm].contiguous(), coef[perm].contiguous(),
        W, lr, eps, beta1, beta2, 1.0 - beta1**step, 1.0 - beta2**step,
        OPT=_OPTIMIZERS[optimizer], BLOCK_W=_block(W),
    )
