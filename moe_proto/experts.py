"""Experts: all FFN experts of a layer as stacked weights, one grouped matmul per projection.

Weights are ``w1 [E, d, ffn]`` and ``w2 [E, ffn, d]`` (plus ``w3 [E, d, ffn]`` for
SwiGLU, optional biases ``b1 [E, ffn]``, ``b2 [E, d]``, ``b3 [E, ffn]``). The input is
the expert-major buffer from :mod:`moe_proto.dispatch` with its per-expert row
counts, so only filled rows are computed.

Which path runs, and why (the measurements are in benchmarks/RESULTS.md, "MoE layer" sections):

* ``torch.nn.functional.grouped_mm`` where it accepts the operands (fp32/bf16 on CPU): a padded
  ``[E, C, d]`` bmm pays for empty capacity slots, and a Python loop pays per-expert autograd overhead.
  The loop stays for what it does not accept: float64, strides that are not 16-byte multiples, torch
  builds without it, and CUDA below SM80 or not bf16.
* On CPU, :class:`GroupedExperts` runs the whole FFN per expert in :func:`fused_expert_ffn` (bias and
  activation applied while the slice is in cache, a hand-written backward without per-expert
  allocations); ``GroupedExperts.fused_cpu = False`` restores the grouped_matmul composition.
* The loop's large buffers come from :mod:`moe_proto.buffer_pool` (fresh ones page-fault on every
  step), and fp32 experts with a non-gated activation run the loop in C++ (:mod:`moe_proto.ops`);
  ``GroupedExperts.cpp_ffn = False`` keeps the torch loop.

Expert parameters carry DeepSpeed's markers (``allreduce=False``,
``group_name="ep_size_{ep_size}"``), as ``deepspeed.moe.experts.Experts`` sets them.

Example::

    experts = GroupedExperts(num_experts=4, hidden_size=16, ffn_hidden_size=64,
                             activation="swiglu", expert_group_name="ep_size_1")
    y = experts(buffer, tokens_per_expert)   # buffer [R, 16], tokens_per_expert [4]
"""
from __future__ import annotations

import math
from functools import partial
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd.function import once_differentiable

from .buffer_pool import HostBufferPool, default_pool, empty_rows
from .ops import ACTIVATION_CODES, load_cpu_ops

ACTIVATIONS: Dict[str, Callable[[Tensor], Tensor]] = {
    "gelu": F.gelu,
    "gelu_tanh": partial(F.gelu, approximate="tanh"),
    "relu": F.relu,
    "silu": F.silu,
}
GATED_ACTIVATIONS: Dict[str, Callable[[Tensor], Tensor]] = {"swiglu": F.silu}
ACTIVATION_NAMES: Tuple[str, ...] = tuple(ACTIVATIONS) + tuple(GATED_ACTIVATIONS)

_GROUPED_MM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def grouped_mm_supported(x: Tensor, w: Tensor) -> bool:
    """Whether ``F.grouped_mm(x, w, offs=...)`` accepts these operands (else the loop is used).

    CPU kernels take fp32/bf16/fp16 with 16-byte aligned pointers and strides (checked
    in torch 2.13); the CUDA conditions are those of the ``grouped_mm`` docstring.
    """
    if getattr(F, "grouped_mm", None) is None or x.dtype != w.dtype or x.dtype not in _GROUPED_MM_DTYPES:
        return False
    if x.device.type == "cuda":
        if x.dtype != torch.bfloat16 or torch.cuda.get_device_capability(x.device) < (8, 0):
            return False
    elif x.device.type != "cpu":
        return False
    return _aligned(x) and _aligned(w)


def _aligned(t: Tensor) -> bool:
    size = t.element_size()
    return (t.stride(-1) == 1 and t.data_ptr() % 16 == 0
            and all(st * size % 16 == 0 for st in t.stride()[:-1]))


def _check_blocks(tokens_per_expert: Tensor, num_experts: int, rows: int) -> List[int]:
    """``tokens_per_expert`` (``[E]`` or ``[B, E]``) as a flat list, after checking its shape and sum."""
    if tokens_per_expert.dim() not in (1, 2) or tokens_per_expert.shape[-1] != num_experts:
        raise ValueError(f"tokens_per_expert must be [{num_experts}] (one count per expert) or [blocks, "
                         f"{num_experts}], got shape {tuple(tokens_per_expert.shape)}")
    counts: List[int] = tokens_per_expert.reshape(-1).tolist()
    if sum(counts) != rows:
        raise ValueError(f"tokens_per_expert sums to {sum(counts)} but the buffer has {rows} rows")
    return counts


def segment_rows(starts: Tensor, lengths: Tensor) -> Tensor:
    """Concatenate ``arange(starts[i], starts[i] + lengths[i])`` for all i, without a Python loop.

    Example: ``segment_rows(torch.tensor([5, 0]), torch.tensor([2, 3]))`` is ``tensor([5, 6, 0, 1, 2])``.
    """
    lengths = lengths.to(torch.int64)
    total = int(lengths.sum())
    seg_start = torch.repeat_interleave(starts.to(torch.int64), lengths, output_size=total)
    seg_first = torch.repeat_interleave(torch.cumsum(lengths, 0) - lengths, lengths, output_size=total)
    return seg_start + torch.arange(total, dtype=torch.int64, device=lengths.device) - seg_first


def blocks_to_expert_major(counts: Tensor) -> Tensor:
    """Row order that turns B blocks of expert-major rows (``counts [B, E]``) into one expert-major buffer.

    Returns ``index`` with ``rows[index]`` expert-major: expert 0's rows of block 0, block 1, ...,
    then expert 1's. Example: ``blocks_to_expert_major(torch.tensor([[1, 2], [1, 0]]))`` is
    ``tensor([0, 3, 1, 2])``.
    """
    flat = counts.to(torch.int64).reshape(-1)
    start = (torch.cumsum(flat, 0) - flat).view_as(counts)
    return segment_rows(start.t().reshape(-1), counts.t().reshape(-1))


def run_expert_major(experts: nn.Module, x: Tensor, counts: Tensor) -> Tensor:
    """``experts(rows, [E] counts)`` for B blocks of expert-major rows (``counts [B, E]``), in ``x``'s row order.

    Example: ``run_expert_major(experts, x, torch.tensor([[1, 0], [2, 1]]))`` (rows of peer 0, then peer 1).
    """
    _check_blocks(counts, experts.num_experts, x.shape[0])
    index = blocks_to_expert_major(counts)
    inverse = torch.empty_like(index).index_copy_(0, index, torch.arange(index.numel(), device=index.device))
    y = experts(PermuteRows.apply(x, index, inverse), counts.sum(dim=0))
    return PermuteRows.apply(y, inverse, index)


class PermuteRows(torch.autograd.Function):
    """``x.index_select(0, index)`` for a permutation ``index``; backward gathers by its ``inverse``.

    Autograd's own backward of ``index_select`` zero-fills a full-size gradient and scatter-adds
    into it; for a permutation one gather is the whole job. Large CPU outputs come from the
    default buffer pool. Example: ``PermuteRows.apply(x, index, inverse)``.
    """

    @staticmethod
    def forward(ctx, x: Tensor, index: Tensor, inverse: Tensor) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(inverse)
        return torch.index_select(x, 0, index, out=empty_rows(x, index.shape[0]))

    @staticmethod
    def backward(ctx, grad: Tensor):  # type: ignore[override]
        inverse, = ctx.saved_tensors
        return torch.index_select(grad, 0, inverse, out=empty_rows(grad, inverse.shape[0])), None, None


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward hands on a contiguous gradient.

    grouped_mm's backward rejects stride-0 (expanded) gradients such as those of ``out.sum()``.
    """

    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:  # type: ignore[override]
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:  # type: ignore[override]
        return grad.contiguous()


def grouped_matmul(x: Tensor, w: Tensor, tokens_per_expert: Tensor) -> Tensor:
    """``x[rows of e] @ w[e]`` for every expert e: ``[R, a] x [E, a, b] -> [R, b]``.

    ``x`` is expert-major with ``tokens_per_expert[e]`` rows for expert e (summing to R).

    Example::

        y = grouped_matmul(torch.randn(5, 8), torch.randn(2, 8, 4), torch.tensor([2, 3]))
    """
    x = x.contiguous()
    if grouped_mm_supported(x, w):
        offs = torch.cumsum(tokens_per_expert, dim=0).to(torch.int32)
        return _ContiguousGrad.apply(F.grouped_mm(x, w, offs=offs))
    counts: List[int] = tokens_per_expert.tolist()
    if sum(counts) != x.shape[0]:
        raise ValueError(f"tokens_per_expert sums to {sum(counts)} but the buffer has {x.shape[0]} rows")
    return torch.cat([rows @ w_e for rows, w_e in zip(x.split(counts), w.unbind(0))])


def _gelu_out(approximate: str) -> Callable[[Tensor, Tensor], Tensor]:
    return lambda h, out: torch.ops.aten.gelu.out(h, approximate=approximate, out=out)


def _gelu_grad(approximate: str) -> Callable[[Tensor, Tensor, Tensor], Tensor]:
    return lambda grad, h, out: torch.ops.aten.gelu_backward.grad_input(grad, h, approximate=approximate,
                                                                          grad_input=out)


# Activation into a preallocated row slice, and its derivative from the pre-activation h (the fused
# loop keeps h, so every derivative is expressed through it; relu'(h) = [h > 0] is threshold_backward).
# Both write into given buffers: see _FusedExpertFFN.backward for why nothing is allocated per expert.
_ACT_OUT: Dict[str, Callable[[Tensor, Tensor], Tensor]] = {
    "gelu": _gelu_out("none"),
    "gelu_tanh": _gelu_out("tanh"),
    "relu": lambda h, out: torch.clamp_min(h, 0, out=out),
    "silu": lambda h, out: torch.ops.aten.silu.out(h, out=out),
    "swiglu": lambda h, out: torch.ops.aten.silu.out(h, out=out),
}
_ACT_GRAD: Dict[str, Callable[[Tensor, Tensor, Tensor], Tensor]] = {
    "gelu": _gelu_grad("none"),
    "gelu_tanh": _gelu_grad("tanh"),
    "relu": lambda grad, h, out: torch.ops.aten.threshold_backward.grad_input(grad, h, 0, grad_input=out),
    "silu": lambda grad, h, out: torch.ops.aten.silu_backward.grad_input(grad, h, grad_input=out),
    "swiglu": lambda grad, h, out: torch.ops.aten.silu_backward.grad_input(grad, h, grad_input=out),
}


class _FusedExpertFFN(torch.autograd.Function):
    """The whole expert FFN, one expert's rows at a time, with a hand-written backward.

    Why not autograd over grouped_mm: on CPU ``grouped_mm`` is itself a loop of per-expert
    GEMMs, but around it autograd runs every stage over the full ``[R, ffn]`` buffer (bias
    gather ``b[row_expert]`` and its scatter backward, activation, its backward), each of
    which streams megabytes through memory. Here each expert's ``[rows, ffn]`` slice is
    produced and consumed while it is still in cache: bias added to the GEMM's output slice, the
    activation right after, the bias gradient a row sum, and weight gradients written
    straight into their ``[E, ...]`` slot (no zero-filled full-size gradient). Saved
    tensors are the same as autograd's (input, pre-activation, activation).
    """

    @staticmethod
    def forward(ctx, x: Tensor, counts: List[int], activation: str, pool: HostBufferPool,  # type: ignore[override]
                w1: Tensor, b1: Optional[Tensor], w2: Tensor, b2: Optional[Tensor], w3: Optional[Tensor],
                b3: Optional[Tensor]) -> Tensor:
        rows, ffn = x.shape[0], w1.shape[-1]
        gated = w3 is not None
        h1 = pool.empty((rows, ffn), x.dtype)
        h3 = pool.empty((rows, ffn), x.dtype) if gated else None
        act = pool.empty((rows, ffn), x.dtype)  # activation (times the gate branch when gated): input of w2
        y = pool.empty((rows, w2.shape[-1]), x.dtype)
        act_out = _ACT_OUT[activation]
        start, num_experts = 0, w1.shape[0]
        for i, n in enumerate(counts):
            if n == 0:
                continue
            e = i % num_experts  # segment i of B blocks of expert-major rows
            sl = slice(start, start + n)
            start += n
            _linear_out(x[sl], w1[e], None if b1 is None else b1[e], h1[sl])
            act_out(h1[sl], act[sl])
            if gated:
                _linear_out(x[sl], w3[e], None if b3 is None else b3[e], h3[sl])
                act[sl].mul_(h3[sl])
            _linear_out(act[sl], w2[e], None if b2 is None else b2[e], y[sl])
        ctx.counts = counts
        ctx.activation = activation
        ctx.pool = pool
        ctx.has_bias = (b1 is not None, b2 is not None, b3 is not None)
        ctx.save_for_backward(x, w1, w2, w3, h1, h3, act)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_y: Tensor):  # type: ignore[override]
        x, w1, w2, w3, h1, h3, act = ctx.saved_tensors
        need = ctx.needs_input_grad
        need_x, need_w1, need_b1, need_w2, need_b2, need_w3, need_b3 = need[0], *need[4:10]
        gated = w3 is not None
        # A stride-0 gradient (from ``out.sum()``) would turn every per-expert GEMM into a strided one.
        grad_y = grad_y.contiguous()
        # empty, not zeros: every expert with rows overwrites its slot; empty experts are zeroed below.
        # Pooled: weight gradients come back once the optimizer sets .grad to None (buffer_pool.py).
        pool = ctx.pool
        dx = pool.empty(x.shape, x.dtype) if need_x else None
        dw1 = pool.empty(w1.shape, w1.dtype) if need_w1 else None
        dw2 = pool.empty(w2.shape, w2.dtype) if need_w2 else None
        dw3 = pool.empty(w3.shape, w3.dtype) if gated and need_w3 else None
        db1 = pool.empty((w1.shape[0], w1.shape[2]), w1.dtype) if need_b1 else None
        db2 = pool.empty((w2.shape[0], w2.shape[2]), w2.dtype) if need_b2 else None
        db3 = pool.empty((w3.shape[0], w3.shape[2]), w3.dtype) if gated and need_b3 else None
        act_grad = _ACT_GRAD[ctx.activation]
        # Per-expert temporaries live in buffers sized for the largest expert, allocated once: fresh
        # megabyte-sized tensors per expert make glibc trim and re-map its heap, and the resulting page
        # faults (measured: 4x more than one big GEMM chain) cost more than the activation maths.
        max_rows = max(ctx.counts, default=0)
        d_act_buf = pool.empty((max_rows, h1.shape[1]), grad_y.dtype)
        d_h1_buf = pool.empty((max_rows, h1.shape[1]), grad_y.dtype)
        d_h3_buf = pool.empty((max_rows, h1.shape[1]), grad_y.dtype) if gated else None
        start, num_experts = 0, w1.shape[0]
        written = [False] * num_experts  # an expert's gradients accumulate over its segments (blocks)
        for i, n in enumerate(ctx.counts):
            if n == 0:
                continue
            e = i % num_experts
            acc, written[e] = written[e], True
            # First segment of expert e: write its gradient slots; later segments (blocks): add to them.
            mm = (lambda a, b, out: out.addmm_(a, b)) if acc else (lambda a, b, out: torch.mm(a, b, out=out))
            col_sum = (lambda t, out: out.add_(t.sum(dim=0))) if acc else \
                (lambda t, out: torch.sum(t, dim=0, out=out))
            sl = slice(start, start + n)
            start += n
            g_e = grad_y[sl]
            if dw2 is not None:
                mm(act[sl].t(), g_e, dw2[e])
            if db2 is not None:
                col_sum(g_e, db2[e])
            if not (need_x or need_w1 or need_b1 or need_w3 or need_b3):
                continue
            d_act = torch.mm(g_e, w2[e].t(), out=d_act_buf[:n])
            d_h1 = d_h1_buf[:n]
            d_h3 = None
            if gated:
                # act = silu(h1) * h3: silu(h1) is recomputed in cache rather than kept for backward.
                d_h3 = torch.ops.aten.silu.out(h1[sl], out=d_h3_buf[:n]).mul_(d_act)
                act_grad(d_act.mul_(h3[sl]), h1[sl], d_h1)
            else:
                act_grad(d_act, h1[sl], d_h1)
            if dw1 is not None:
                mm(x[sl].t(), d_h1, dw1[e])
            if db1 is not None:
                col_sum(d_h1, db1[e])
            if d_h3 is not None and dw3 is not None:
                mm(x[sl].t(), d_h3, dw3[e])
            if d_h3 is not None and db3 is not None:
                col_sum(d_h3, db3[e])
            if dx is not None:
                torch.mm(d_h1, w1[e].t(), out=dx[sl])
                if d_h3 is not None:
                    dx[sl].addmm_(d_h3, w3[e].t())
        for e in range(num_experts):  # an expert without rows: its gradients are zero
            for grad in (dw1, dw2, dw3, db1, db2, db3):
                if grad is not None and not written[e]:
                    grad[e].zero_()
        if dx is not None and start < x.shape[0]:
            dx[start:].zero_()
        return dx, None, None, None, dw1, db1, dw2, db2, dw3, db3


class _CppExpertFFN(torch.autograd.Function):
    """:class:`_FusedExpertFFN` for fp32 non-gated experts, the loop in C++ (:mod:`moe_proto.ops`).

    Saves the activation's derivative instead of the pre-activation (same memory), so the
    backward pass multiplies where the torch loop recomputes GELU's erf and exp.
    """

    @staticmethod
    def forward(ctx, x: Tensor, counts: List[int], activation: str, pool: HostBufferPool,  # type: ignore[override]
                ops: object, w1: Tensor, b1: Optional[Tensor], w2: Tensor, b2: Optional[Tensor]) -> Tensor:
        rows, ffn = x.shape[0], w1.shape[-1]
        deriv, act = pool.empty((rows, ffn), x.dtype), pool.empty((rows, ffn), x.dtype)
        y = pool.empty((rows, w2.shape[-1]), x.dtype)
        ops.expert_ffn_forward(x, counts, ACTIVATION_CODES[activation], w1.detach(),
                               None if b1 is None else b1.detach(), w2.detach(),
                               None if b2 is None else b2.detach(), deriv, act, y)
        ctx.counts, ctx.pool, ctx.ops = counts, pool, ops
        ctx.save_for_backward(x, w1, w2, deriv, act)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_y: Tensor):  # type: ignore[override]
        x, w1, w2, deriv, act = ctx.saved_tensors
        need_x, need_w1, need_b1, need_w2, need_b2 = ctx.needs_input_grad[0], *ctx.needs_input_grad[5:9]
        pool = ctx.pool
        num_experts, ffn, hidden = w1.shape[0], w1.shape[2], w2.shape[2]
        dx = pool.empty(x.shape, x.dtype) if need_x else None
        dw1 = pool.empty(w1.shape, w1.dtype) if need_w1 else None
        db1 = pool.empty((num_experts, ffn), w1.dtype) if need_b1 else None
        dw2 = pool.empty(w2.shape, w2.dtype) if need_w2 else None
        db2 = pool.empty((num_experts, hidden), w2.dtype) if need_b2 else None
        d_buf = pool.empty((max(ctx.counts, default=0), ffn), x.dtype)
        ctx.ops.expert_ffn_backward(grad_y.contiguous(), x, deriv, act, w1.detach(), w2.detach(), ctx.counts, dx,
                                    dw1, db1, dw2, db2, d_buf)
        return dx, None, None, None, None, dw1, db1, dw2, db2


def _cpp_ops_for(x: Tensor, activation: str, weights: Tuple[Optional[Tensor], ...]) -> Optional[object]:
    """The C++ op module when it takes these operands (fp32, contiguous, non-gated activation), else None."""
    if activation not in ACTIVATION_CODES or x.dtype != torch.float32:
        return None
    if any(w is not None and (w.dtype != torch.float32 or not w.is_contiguous()) for w in weights):
        return None
    return load_cpu_ops()


def _linear_out(x: Tensor, w: Tensor, b: Optional[Tensor], out: Tensor) -> None:
    """``out = x @ w (+ b)`` written in place.

    ``mm`` then ``add_`` on the slice while it is in cache: about 1-3% faster per expert FFN than
    ``addmm``, which first copies the broadcast bias into ``out`` and then runs the GEMM with
    beta=1 (measured at 256 and 512 rows per expert, d=256, ffn=1024, 1 thread).
    """
    torch.mm(x, w, out=out)
    if b is not None:
        out.add_(b)


def fused_expert_ffn(x: Tensor, tokens_per_expert: Tensor, activation: str, w1: Tensor, b1: Optional[Tensor],
                     w2: Tensor, b2: Optional[Tensor], w3: Optional[Tensor] = None,
                     b3: Optional[Tensor] = None, pool: Optional[HostBufferPool] = None,
                     use_cpp: bool = True) -> Tensor:
    """Expert FFN ``act(x W1 + b1) [* (x W3 + b3)] W2 + b2`` per expert's rows, fused per expert.

    ``tokens_per_expert`` is ``[E]`` (``x`` expert-major) or ``[B, E]``: B blocks of expert-major
    rows, one after the other (the rows received from B expert-parallel peers), computed where
    they lie, each expert's weight gradients summed over its B segments.

    Same maths as composing :func:`grouped_matmul` with the activation (that path stays in
    :class:`GroupedExperts` for CUDA, where one grouped kernel beats a Python loop), but
    faster on CPU; see :class:`_FusedExpertFFN` for why. Reads ``tokens_per_expert`` once
    as a Python list (free on CPU). Not twice differentiable. Its activations, saved tensors
    and gradients come from ``pool`` (default :func:`moe_proto.buffer_pool.default_pool`), so a
    training loop does not page-fault them in again every step. With ``use_cpp`` (the default),
    fp32 experts with a non-gated activation run the loop in C++ (:mod:`moe_proto.ops`; the torch
    loop when it cannot be built).

    Example::

        y = fused_expert_ffn(buffer, counts, "gelu", experts.w1, experts.b1, experts.w2, experts.b2)
    """
    counts = _check_blocks(tokens_per_expert, w1.shape[0], x.shape[0])
    x = x.contiguous()
    pool = pool or default_pool()
    ops = _cpp_ops_for(x, activation, (w1, b1, w2, b2)) if use_cpp and w3 is None else None
    if ops is not None:
        return _CppExpertFFN.apply(x, counts, activation, pool, ops, w1, b1, w2, b2)
    return _FusedExpertFFN.apply(x, counts, activation, pool, w1, b1, w2, b2, w3, b3)


class GroupedExperts(nn.Module):
    """E feed-forward experts with stacked weights (see the module docstring).

    Args:
        num_experts: experts held by this module (the local experts under expert parallelism).
        activation: one of ``ACTIVATION_NAMES``; ``"swiglu"`` adds ``w3``.
        bias: add per-expert biases (needed to copy DeepSpeed-style ``nn.Linear`` experts).
        expert_group_name: DeepSpeed expert group (``"ep_size_1"``); None leaves the
            parameters unmarked (a dense MLP).
    """

    def __init__(self, num_experts: int, hidden_size: int, ffn_hidden_size: int, activation: str = "gelu",
                 bias: bool = False, expert_group_name: Optional[str] = None,
                 device: Optional[torch.device] = None, dtype: Optional[torch.dtype] = None) -> None:
        super().__init__()
        if activation not in ACTIVATION_NAMES:
            raise ValueError(f"activation={activation!r} is not one of {ACTIVATION_NAMES}")
        if min(num_experts, hidden_size, ffn_hidden_size) < 1:
            raise ValueError(f"num_experts, hidden_size and ffn_hidden_size must be >= 1, got "
                             f"{num_experts}, {hidden_size}, {ffn_hidden_size}")
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.ffn_hidden_size = ffn_hidden_size
        self.activation = activation
        self.expert_group_name = expert_group_name
        # CPU: the per-expert fused loop (see fused_expert_ffn); set False to force the grouped_matmul path.
        self.fused_cpu = True
        # Where the fused loop's large buffers come from (buffer_pool.py); HostBufferPool(0) turns pooling off.
        self.buffer_pool = default_pool()
        # fp32 non-gated experts: the fused loop in C++ (moe_proto/ops.py); False keeps the torch loop.
        self.cpp_ffn = True
        # [B, E] counts: the fused loop computes the blocks where they lie when they average at least this many
        # rows per nonempty (block, expert) segment, else they are gathered expert-major (None: ffn_hidden_size
        # // 2, where reading an expert's weights once more per segment costs what the gathers save).
        self.min_block_rows: Optional[int] = None
        gated = activation in GATED_ACTIVATIONS
        kw = {"device": device, "dtype": dtype}
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden_size, ffn_hidden_size, **kw))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden_size, ffn_hidden_size, **kw)) if gated else None
        self.w2 = nn.Parameter(torch.empty(num_experts, ffn_hidden_size, hidden_size, **kw))
        self.b1 = nn.Parameter(torch.empty(num_experts, ffn_hidden_size, **kw)) if bias else None
        self.b3 = nn.Parameter(torch.empty(num_experts, ffn_hidden_size, **kw)) if bias and gated else None
        self.b2 = nn.Parameter(torch.empty(num_experts, hidden_size, **kw)) if bias else None
        # Each stacked tensor's key in one expert's own state dict (moe_proto/ds_layout.py: DeepSpeed's layout).
        self.expert_keys: Dict[str, str] = {name: f"fc{name[1]}.{'weight' if name[0] == 'w' else 'bias'}"
                                            for name in ("w1", "b1", "w3", "b3", "w2", "b2")
                                            if getattr(self, name) is not None}
        self.reset_parameters()
        if expert_group_name is not None:
            for param in self.parameters():
                param.allreduce = False
                param.group_name = expert_group_name

    def reset_parameters(self) -> None:
        """Every expert independently, with ``nn.Linear``'s default bounds (1/sqrt(fan_in))."""
        for name, fan_in in (("w1", self.hidden_size), ("w3", self.hidden_size), ("w2", self.ffn_hidden_size),
                             ("b1", self.hidden_size), ("b3", self.hidden_size), ("b2", self.ffn_hidden_size)):
            param = getattr(self, name)
            if param is not None:
                bound = 1.0 / math.sqrt(fan_in)
                nn.init.uniform_(param, -bound, bound)

    def forward(self, x: Tensor, tokens_per_expert: Tensor) -> Tensor:
        """``[R, d]`` expert-major rows (``tokens_per_expert[e]`` rows for expert e) -> ``[R, d]``.

        ``tokens_per_expert`` may also be ``[B, E]``: B blocks of expert-major rows one after the
        other, as :func:`moe_proto.parallel.dispatch_to_experts` returns them (block w: the rows
        from expert-parallel peer w). The fused CPU loop computes them where they lie when the
        segments are long enough (``min_block_rows``); otherwise, and on the grouped-matmul path,
        they are gathered expert-major and back.

        Example::

            y = experts(torch.randn(5, 16), torch.tensor([[1, 0, 1, 0], [2, 1, 0, 0]]))
        """
        fused = self.fused_cpu and x.device.type == "cpu" and x.dim() == 2
        if fused and (tokens_per_expert.dim() == 1 or self._blocks_in_place(tokens_per_expert)):
            return fused_expert_ffn(x, tokens_per_expert, self.activation, self.w1, self.b1, self.w2, self.b2,
                                    self.w3, self.b3, pool=self.buffer_pool, use_cpp=self.cpp_ffn)
        if tokens_per_expert.dim() == 2:  # gathered expert-major, computed, and put back
            return run_expert_major(self, x, tokens_per_expert)
        row_expert = None
        if self.b1 is not None:
            experts = torch.arange(self.num_experts, device=x.device)
            row_expert = torch.repeat_interleave(experts, tokens_per_expert, output_size=x.shape[0])
        h = self._project(x, self.w1, self.b1, tokens_per_expert, row_expert)
        if self.w3 is not None:
            h = GATED_ACTIVATIONS[self.activation](h) * self._project(x, self.w3, self.b3, tokens_per_expert,
                                                                      row_expert)
        else:
            h = ACTIVATIONS[self.activation](h)
        return self._project(h, self.w2, self.b2, tokens_per_expert, row_expert)

    def _blocks_in_place(self, counts: Tensor) -> bool:
        """Whether the fused loop should take ``[B, E]`` counts as they lie (see ``min_block_rows``).

        Measured at ep=2 (2-core Xeon, d=256, ffn=1024, 2 ranks, benchmarks/moe_ep_layout.py): 512 rows per
        expert in two blocks ran 0.5-3.6% slower in place than gathered, 1,024 rows 0.8-2.5% faster.
        """
        nonempty = int(torch.count_nonzero(counts))
        least = self.ffn_hidden_size // 2 if self.min_block_rows is None else self.min_block_rows
        return nonempty == 0 or int(counts.sum()) >= least * nonempty

    @staticmethod
    def _project(x: Tensor, w: Tensor, b: Optional[Tensor], tokens_per_expert: Tensor,
                 row_expert: Optional[Tensor]) -> Tensor:
        y = grouped_matmul(x, w, tokens_per_expert)
        return y if b is None else y + b[row_expert]

    @classmethod
    def from_module(cls, expert: nn.Module, num_experts: int,
                    expert_group_name: Optional[str] = None) -> "GroupedExperts":
        """Stack ``num_experts`` copies of a DeepSpeed-style expert module.

        DeepSpeed's ``Experts`` deep-copies the module, so every expert starts from the same
        weights; this copies its weights into every row of the stacks likewise. Accepted:
        a module whose leaf layers are ``Linear(d, ffn)``, one of GELU (erf or tanh), ReLU,
        SiLU, and ``Linear(ffn, d)``, or a gated one: two ``Linear(d, ffn)`` (gate and up, in
        either order), ``Linear(ffn, d)`` and optionally a ``SiLU`` leaf, computing
        ``down(silu(gate(x)) * up(x))`` (``Identity`` and ``Dropout(p=0)`` are ignored). The
        copy is checked against the module's own forward on a probe batch.

        Example::

            mlp = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16))
            experts = GroupedExperts.from_module(mlp, num_experts=8, expert_group_name="ep_size_1")
        """
        error: Optional[ValueError] = None
        # The stacks' own initialisation is overwritten by the copy: it must not draw from the global RNG, or the
        # layers built after this one would start from other weights than beside DeepSpeed's layer (a deep copy).
        cuda = [p.device for p in expert.parameters() if p.device.type == "cuda"][:1]
        with torch.random.fork_rng(devices=cuda):
            for fc1, fc3, activation, fc2 in _parse_ffn(expert):
                try:
                    return cls._copy_of(expert, num_experts, expert_group_name, fc1, fc3, activation, fc2)
                except ValueError as why:  # a gated guess whose forward differs: try the next reading
                    error = why
        raise error

    @classmethod
    def _copy_of(cls, expert: nn.Module, num_experts: int, expert_group_name: Optional[str], fc1: nn.Linear,
                 fc3: Optional[nn.Linear], activation: str, fc2: nn.Linear) -> "GroupedExperts":
        linears = {"1": fc1, "2": fc2, **({"3": fc3} if fc3 is not None else {})}
        if len({lin.bias is None for lin in linears.values()}) != 1:
            raise ValueError("expert module: all its Linear layers must have a bias or none")
        bias = fc1.bias is not None
        stacked = cls(num_experts, fc1.in_features, fc1.out_features, activation=activation, bias=bias,
                      expert_group_name=expert_group_name, device=fc1.weight.device, dtype=fc1.weight.dtype)
        names = {id(m): n for n, m in expert.named_modules()}
        stacked.expert_keys = {}
        with torch.no_grad():
            for i, lin in linears.items():
                getattr(stacked, f"w{i}").copy_(lin.weight.t().expand_as(getattr(stacked, f"w{i}")))
                stacked.expert_keys[f"w{i}"] = f"{names[id(lin)]}.weight"
                if bias:
                    getattr(stacked, f"b{i}").copy_(lin.bias.expand_as(getattr(stacked, f"b{i}")))
                    stacked.expert_keys[f"b{i}"] = f"{names[id(lin)]}.bias"
        stacked._check_matches(expert)
        return stacked

    def _check_matches(self, expert: nn.Module) -> None:
        """Compare expert 0 with the source module on a probe batch (own RNG: no global state touched)."""
        device, dtype = self.w1.device, self.w1.dtype
        probe = torch.randn(4, self.hidden_size, generator=torch.Generator(device=device).manual_seed(0),
                            device=device, dtype=dtype)
        counts = torch.zeros(self.num_experts, dtype=torch.long, device=device)
        counts[0] = probe.shape[0]
        with torch.no_grad():
            ref = expert(probe)
            ref = ref[0] if isinstance(ref, tuple) else ref  # DeepSpeed also drops a returned bias term
            ours = self(probe, counts)
        tol = 1e-2 if dtype in (torch.float16, torch.bfloat16) else 1e-4
        if ref.shape != ours.shape or not torch.allclose(ref, ours, rtol=tol, atol=tol):
            raise ValueError(f"expert module {type(expert).__name__}: its forward is not Linear -> activation -> "
                             "Linear as its layers suggest; pass expert=None with ffn_hidden_size instead")


def _parse_ffn(expert: nn.Module) -> List[Tuple[nn.Linear, Optional[nn.Linear], str, nn.Linear]]:
    """The readings ``(fc1, fc3 or None, activation, fc2)`` of an expert module's leaves, to check in order."""
    leaves = [m for m in expert.modules() if next(m.children(), None) is None]
    leaves = [m for m in leaves if not isinstance(m, nn.Identity) and not (isinstance(m, nn.Dropout) and m.p == 0)]
    names = [type(m).__name__ for m in leaves]
    if len(leaves) == 3 and isinstance(leaves[0], nn.Linear) and isinstance(leaves[2], nn.Linear):
        fc1, act, fc2 = leaves
        activation = _activation_name(act)
        if (activation is not None and fc2.in_features == fc1.out_features
                and fc2.out_features == fc1.in_features):
            return [(fc1, None, activation, fc2)]
    linears = [m for m in leaves if isinstance(m, nn.Linear)]
    others = [m for m in leaves if not isinstance(m, nn.Linear)]
    if len(linears) == 3 and all(isinstance(m, nn.SiLU) for m in others) and len(others) <= 1:
        shapes = [(m.in_features, m.out_features) for m in linears]
        for i, (ffn, d) in enumerate(shapes):  # the down projection: one Linear(ffn, d) beside two Linear(d, ffn)
            ins = [m for j, m in enumerate(linears) if j != i and shapes[j] == (d, ffn)]
            if d != ffn and len(ins) == 2:
                return [(ins[0], ins[1], "swiglu", linears[i]), (ins[1], ins[0], "swiglu", linears[i])]
    raise ValueError(f"cannot stack expert module {type(expert).__name__} with layers {names}: supported is "
                     "Linear(d, ffn) -> GELU/ReLU/SiLU -> Linear(ffn, d), or a SwiGLU (two Linear(d, ffn), "
                     "Linear(ffn, d)); otherwise pass expert=None with ffn_hidden_size and activation")


def _activation_name(module: nn.Module) -> Optional[str]:
    if isinstance(module, nn.GELU):
        return "gelu" if module.approximate == "none" else "gelu_tanh"
    if isinstance(module, nn.ReLU):
        return "relu"
    if isinstance(module, nn.SiLU):
        return "silu"
    return None
