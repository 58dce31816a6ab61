"""Dispatch: move tokens into an expert-major buffer and back, by index (no one-hot tensors).

The buffer holds only the kept routes, sorted by expert (stably, kept routes of an
expert in the row order the routing record assigned), plus per-expert row counts. The
experts then compute exactly ``sum(tokens_per_expert)`` rows: empty capacity slots
cost nothing. Capacity mode and dropless share this layout; they differ only in
whether the router dropped routes.

The plan also holds the inverse permutation (token-major order of the kept routes), so
the combine and both backward passes are single gathers (``embedding_bag`` in sum mode,
with the gate as per-sample weight where it applies) instead of weighted copies and
scatter-adds into zero-filled buffers: at S=4096, d=256, E=16 top-1 this cut the
non-expert time of a forward+backward step by about a third (see
``benchmarks/moe_layer.py``).

The local permutation is kept apart from any exchange between processes: under expert
parallelism :mod:`moe_proto.parallel` moves the buffer (split by ``tokens_per_expert``) to
the ranks owning the experts between :func:`permute` and the experts, and back before
:func:`unpermute`.

Example::

    plan = plan_dispatch(record)
    buffer = permute(x, plan)                       # [total_kept, d], expert-major
    y = experts(buffer, plan.tokens_per_expert)
    out = unpermute(y, plan, num_tokens=x.shape[0]) # [S, d], gate-weighted sum
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import once_differentiable

from .buffer_pool import default_pool
from .ops import cpu_ops_for
from .routing import RoutingRecord


@dataclass(frozen=True)
class DispatchPlan:
    """Where every row of the expert-major buffer comes from and how it is weighted.

    Two views of the same R kept routes: buffer order (expert-major, what the experts see)
    and route order (token-major: token 0's kept routes, then token 1's, ...; what the
    combine sums). Each is the other's inverse permutation, so both directions of the
    dispatch, and both backward passes, are gathers: nothing is scatter-added into a
    zero-filled buffer.

    Attributes:
        token_index: ``[R]`` int64 source token of each buffer row (R = kept routes).
        gate: ``[R]`` fp32 combine weight of each buffer row (differentiable, from the record).
        tokens_per_expert: ``[E]`` int64 rows per expert, in buffer order.
        capacity: rows per expert of the routing (None when dropless); sizes fixed-split exchanges.
        route_row: ``[R]`` int64 buffer row of each kept route, routes in token-major order.
        route_offsets: ``[S]`` int64 start of token t's routes in ``route_row`` (its kept
            routes are ``route_row[route_offsets[t]:route_offsets[t + 1]]``; none when dropped).
        route_token: ``[R]`` int64 token of each kept route in token-major order (non-decreasing).
    """

    token_index: Tensor
    gate: Tensor
    tokens_per_expert: Tensor
    capacity: Optional[int] = None
    route_row: Optional[Tensor] = None
    route_offsets: Optional[Tensor] = None
    route_token: Optional[Tensor] = None

    @property
    def num_tokens(self) -> int:
        return 0 if self.route_offsets is None else self.route_offsets.shape[0]


def plan_dispatch(record: RoutingRecord) -> DispatchPlan:
    """Build the permutation that sorts the kept routes by expert, and its inverse.

    A kept route of expert e with slot j lands on row ``start[e] + j`` (``start`` is the
    exclusive cumulative sum of ``tokens_per_expert``); slots are dense per expert, so
    this is the stable sort by expert without running a sort.

    Example::

        plan = plan_dispatch(route(logits, top_k=2))
    """
    s, k = record.expert_index.shape
    counts = record.tokens_per_expert
    kept_total = int(counts.sum())
    # Positions of the kept routes among the S*K (one nonzero for all three fields; none when all are kept).
    kept_index = None if kept_total == s * k else torch.nonzero(record.keep.reshape(-1)).squeeze(1)

    def kept(t: Tensor) -> Tensor:  # the kept routes of an [S, K] tensor, token-major
        return t.reshape(-1) if kept_index is None else t.reshape(-1).index_select(0, kept_index)

    start = torch.cumsum(counts, dim=0) - counts
    # Buffer row of every kept route, routes in token-major order.
    row = start[kept(record.expert_index)] + kept(record.slot)
    # route_of_row is the inverse permutation: buffer row -> position among kept routes.
    route_of_row = torch.empty_like(row).index_copy_(0, row, torch.arange(row.numel(), device=row.device))
    routes_of_token = record.keep.sum(dim=1)
    route_offsets = torch.cumsum(routes_of_token, dim=0) - routes_of_token
    tokens = torch.repeat_interleave(torch.arange(s, device=row.device), routes_of_token, output_size=kept_total)
    return DispatchPlan(
        token_index=tokens.index_select(0, route_of_row),
        gate=kept(record.gate).index_select(0, route_of_row),
        tokens_per_expert=counts,
        capacity=record.capacity,
        route_row=row,
        route_offsets=route_offsets,
        route_token=tokens,
    )


def permute(hidden: Tensor, plan: DispatchPlan, grad_handoff: Optional["DispatchGradHandoff"] = None) -> Tensor:
    """Gather ``hidden [S, d]`` into the expert-major buffer ``[R, d]``.

    The backward sums each token's buffer-row gradients with one gather over the inverse
    permutation (``embedding_bag`` over ``plan.route_row``): no zero-filled ``[S, d]``
    buffer and no scatter-add. Tokens with no kept route get a zero gradient. With
    ``grad_handoff`` (the layer passes the router's, see :class:`DispatchGradHandoff`) that
    gather is left to the node that produced ``hidden``.

    Example::

        buffer = permute(x, plan)
    """
    if plan.route_row is None:
        return hidden.index_select(0, plan.token_index)
    return _Permute.apply(hidden, plan.token_index, plan.route_row, plan.route_offsets, grad_handoff)


class DispatchGradHandoff:
    """Hands the dispatch's backward to the node that produced its input, so both run as one pass.

    The layer's router returns its input ``x`` again as a view that the dispatch gathers (see
    ``moe_proto.router._RouterLogits``), so x's gradient is the gather-sum of the buffer's
    gradient plus the router's term ``grad_logits @ w``. Separately that is two passes over
    ``[S, d]`` (one writes the gather-sum, the next reads it back); here the dispatch's backward
    deposits the buffer gradient and its inverse permutation and returns a zero-stride zero
    placeholder, and the router's backward - which autograd runs after it, since it consumes
    that gradient - takes the deposit and writes both terms in one C++ pass. Anything else
    autograd summed into the placeholder (the view used elsewhere too) is kept and added.

    Example::

        handoff = DispatchGradHandoff()
        buffer = permute(x_view, plan, grad_handoff=handoff)   # backward: handoff.put(...)
        deposit, rest = handoff.take(grad_x)                   # in the producer's backward
    """

    def __init__(self) -> None:
        self._deposit: Optional[Tuple[Tensor, Tensor, Tensor]] = None
        self._placeholder: Optional[Tensor] = None

    @staticmethod
    def accepts(grad: Tensor) -> bool:
        """Only where the fused C++ pass exists (fp32 CPU and the op library built)."""
        return cpu_ops_for(grad) is not None

    def put(self, grad: Tensor, route_row: Tensor, route_offsets: Tensor, shape: torch.Size) -> Tensor:
        """Deposit the buffer gradient; returns the placeholder gradient of the input (zeros, no memory)."""
        self._deposit = (grad, route_row, route_offsets)
        self._placeholder = grad.new_zeros(()).expand(shape)
        return self._placeholder

    def take(self, grad_x: Optional[Tensor]) -> Tuple[Optional[Tuple[Tensor, Tensor, Tensor]], Optional[Tensor]]:
        """``(deposit or None, grad_x without the placeholder)``; clears the handoff."""
        deposit, placeholder = self._deposit, self._placeholder
        self._deposit = self._placeholder = None
        if deposit is not None and grad_x is not None and placeholder is not None and \
                grad_x.stride() == placeholder.stride() and grad_x.data_ptr() == placeholder.data_ptr():
            grad_x = None  # nothing but the placeholder arrived
        return deposit, grad_x


def unpermute(expert_output: Tensor, plan: DispatchPlan, num_tokens: int) -> Tensor:
    """Sum the gate-weighted rows back into their tokens: ``[R, d] -> [S, d]``.

    Tokens with no kept route get 0 (adding the residual is the caller's choice, as in
    DeepSpeed). Weighting and summation run in at least fp32 and the result is cast back to the
    input dtype, so bf16 experts do not lose precision in the sum over routes.

    One fused pass forward (gather by ``plan.route_row``, times the gate, summed per token:
    ``embedding_bag`` with per-sample weights) and one fused pass per gradient backward
    (expert rows: gather of the output gradient by ``plan.token_index`` times the gate;
    gates: per-route dot products of the output gradient and the expert rows), instead of
    a weighted copy, a zero fill, a cloned scatter-add and three passes back.

    Example::

        out = unpermute(y, plan, num_tokens=x.shape[0])
    """
    if plan.route_row is None or plan.route_offsets.shape[0] != num_tokens:
        return _unpermute_reference(expert_output, plan, num_tokens)
    return _Combine.apply(expert_output, plan.gate, plan.token_index, plan.route_row, plan.route_offsets,
                          plan.route_token)


def _unpermute_reference(expert_output: Tensor, plan: DispatchPlan, num_tokens: int) -> Tensor:
    """The straightforward combine (weighted copy + scatter-add into zeros); the tests' reference."""
    acc = torch.promote_types(expert_output.dtype, torch.float32)
    weighted = expert_output.to(acc) * plan.gate.to(acc).unsqueeze(1)
    out = weighted.new_zeros(num_tokens, expert_output.shape[1])
    return out.index_add(0, plan.token_index, weighted).to(expert_output.dtype)


def _sum_rows(rows: Tensor, index: Tensor, offsets: Tensor, weights: Optional[Tensor] = None) -> Tensor:
    """``out[b] = sum_{i in bag b} weights[i] * rows[index[i]]``, bag b = ``index[offsets[b]:offsets[b+1]]``.

    ``embedding_bag`` in sum mode: one pass, empty bags give zero rows, the output is
    allocated uninitialised (no zero fill).
    """
    return F.embedding_bag(index, rows, offsets, mode="sum", per_sample_weights=weights)


class _Permute(torch.autograd.Function):
    """``x.index_select(0, token_index)`` whose backward is the inverse gather (see :func:`permute`)."""

    @staticmethod
    def forward(ctx, x: Tensor, token_index: Tensor, route_row: Tensor,  # type: ignore[override]
                route_offsets: Tensor, grad_handoff: Optional[DispatchGradHandoff]) -> Tensor:
        ctx.save_for_backward(route_row, route_offsets)
        ctx.grad_handoff, ctx.x_shape = grad_handoff, x.shape
        return x.index_select(0, token_index)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: Tensor):  # type: ignore[override]
        route_row, route_offsets = ctx.saved_tensors
        grad = grad.detach().contiguous()
        if ctx.grad_handoff is not None and ctx.grad_handoff.accepts(grad):
            return ctx.grad_handoff.put(grad, route_row, route_offsets, ctx.x_shape), None, None, None, None
        return _sum_rows(grad, route_row, route_offsets), None, None, None, None


class _Combine(torch.autograd.Function):
    """Gate-weighted combine with hand-written backward (see :func:`unpermute`)."""

    @staticmethod
    def forward(ctx, y: Tensor, gate: Tensor, token_index: Tensor, route_row: Tensor,  # type: ignore[override]
                route_offsets: Tensor, route_token: Tensor) -> Tensor:
        acc = torch.promote_types(y.dtype, torch.float32)
        # Detached: embedding_bag then takes its forward-only kernel (no offset2bag / bag_size outputs).
        y_acc = y.detach().to(acc).contiguous()
        gate_acc = gate.detach().to(acc)
        out = _sum_rows(y_acc, route_row, route_offsets, gate_acc.index_select(0, route_row))
        ctx.save_for_backward(y_acc, gate_acc, token_index, route_row, route_offsets, route_token)
        ctx.y_dtype, ctx.gate_dtype = y.dtype, gate.dtype
        return out.to(y.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: Tensor):  # type: ignore[override]
        y_acc, gate_acc, token_index, route_row, route_offsets, route_token = ctx.saved_tensors
        g = grad_out.to(y_acc.dtype).contiguous()
        grad_y = grad_gate = None
        ops = cpu_ops_for(g, y_acc)
        if ops is not None:  # both gradients in one pass over the buffer rows, the gate's in buffer order
            need_y, need_gate = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
            grad_y = default_pool().empty(y_acc.shape, y_acc.dtype, y_acc.device) if need_y else None
            grad_gate = torch.empty_like(gate_acc) if need_gate else None
            ops.combine_backward(g, y_acc, gate_acc.contiguous(), token_index.contiguous(), grad_y, grad_gate)
            return (None if grad_y is None else grad_y.to(ctx.y_dtype),
                    None if grad_gate is None else grad_gate.to(ctx.gate_dtype), None, None, None, None)
        if ctx.needs_input_grad[0]:
            # Buffer row r gets gate[r] * grad_out[token_index[r]]: bags of one row each.
            one_per_bag = torch.arange(token_index.shape[0], device=g.device)
            grad_y = _sum_rows(g, token_index, one_per_bag, gate_acc).to(ctx.y_dtype)
        if ctx.needs_input_grad[1]:
            # d out[t] / d gate of route i = y[route_row[i]]: a dot product with grad_out[t] per route.
            per_route = _per_route_dot(g, y_acc, route_row, route_offsets, route_token)
            grad_gate = torch.empty_like(per_route).index_copy_(0, route_row, per_route).to(ctx.gate_dtype)
        return grad_y, grad_gate, None, None, None, None


def _per_route_dot(grad_out: Tensor, y: Tensor, route_row: Tensor, route_offsets: Tensor,
                   route_token: Tensor) -> Tensor:
    """``dot(grad_out[route_token[i]], y[route_row[i]])`` for every route i, without gathering rows."""
    if _PSW_BACKWARD is not None:
        return _PSW_BACKWARD(grad_out, y, route_row, route_offsets, route_token, 0)
    return (grad_out.index_select(0, route_token) * y.index_select(0, route_row)).sum(dim=1)


# embedding_bag's per-sample-weight gradient: exactly the per-route dot product, fused (aten, CPU and CUDA).
_PSW_BACKWARD = getattr(torch.ops.aten, "_embedding_bag_per_sample_weights_backward", None)
