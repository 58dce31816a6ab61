"""``PackedEmbeddingCollection``: many embedding tables, one fused lookup and one fused sparse update per pack.

Tables that can share a kernel (see ``packing``) live in one weight buffer.
A forward does one ``embedding_bag`` call per pack over all of its fields:
the ids keep the batch's field-major order (read in place when the pack's
fields are consecutive in the batch, one gather otherwise), are shifted by
their table's row offset in one vectorised pass, and the pooled rows are
copied straight into the pack's columns of the one ``[B, sum D]`` output (that
copy is the field-major to batch-major transpose; there is no concatenation).
Per-feature outputs are column views of it. Sequence (``pooling="none"``)
features get ``[ids, D]`` row blocks; per-sample weights apply to pooled
features only.

Backward (``mode="fused"``, the default) never builds a dense gradient: the
weight buffer is a plain buffer, not a parameter, and a custom autograd
function's backward sorts the batch's buffer rows, sums the output gradient
into the unique rows (one ``embedding_bag`` over the output gradient, in row
order, with the per-sample weights) and applies the pack's sparse optimizer to
those rows in place, as FBGEMM's table-batched embedding does. It does this
per block of whole tables (``sort_block`` ids) so sorts and updates stay in
cache. So ``loss.backward()`` has already updated the tables: there is no
optimizer step to call for them, each backward is one optimizer step, and
calling the collection twice before one backward means two steps. For
gradient accumulation set ``defer_updates = True``: backward then only stores
the unique rows' gradients and ``step()`` applies their sum as one step. The
learning rate is the ``lr`` attribute, set by the training loop.

``mode="autograd"`` is the plain reference: each pack's buffer is an
``nn.Parameter``, the lookup is ``F.embedding_bag(..., sparse=True)``,
backward leaves a sparse ``.grad`` and ``step()`` applies the same optimizer.

``state_dict()`` holds one entry per table and state (``"<table>.weight"``,
``"<table>.momentum1"``, ...), whatever the packing, so a checkpoint loads
into any other packing of the same tables.

Example::

    >>> import torch
    >>> from picasso_ops.jagged import JaggedBatch
    >>> from picasso_ops.embedding import PackedEmbeddingCollection, TableSpec
    >>> emb = PackedEmbeddingCollection([
    ...     TableSpec("user", 100, 8, optimizer="rowwise_adagrad", optimizer_params={"lr": 0.1}),
    ...     TableSpec("item", 50, 8, pooling="mean", optimizer="rowwise_adagrad", optimizer_params={"lr": 0.1}),
    ... ])
    >>> batch = JaggedBatch(["user", "item"], torch.tensor([3, 7, 1, 2]), torch.tensor([[1, 1], [2, 0]]))
    >>> out = emb(batch)
    >>> out.values.shape, out["item"].shape
    (torch.Size([2, 16]), torch.Size([2, 8]))
    >>> out.values.sum().backward()  # the two tables are updated here
"""

from __future__ import annotations

import logging
import math
import warnings
from typing import Any, Literal, Mapping, Optional, Sequence, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd.function import once_differentiable

from picasso_ops import ops as custom_ops
from picasso_ops.contracts import SparseStepModule
from picasso_ops.embedding.bounds import BoundsCheck, check_finite_weights
from picasso_ops.embedding.id_check import check_ids, check_plan_ids
from picasso_ops.embedding.lookup_plan import LookupPlan, Run, build_plan, torch_plan
from picasso_ops.embedding.pack_columns import PackColumns, long_tensor
from picasso_ops.embedding.packing import PackGroup, plan_packing
from picasso_ops.embedding.row_grads import cumsum, row_update, sum_by_row, update_blocks
from picasso_ops.embedding.sparse_optim import SparseOptimizer, create_optimizer
from picasso_ops.embedding.spec import TableSpec
from picasso_ops.jagged import JaggedBatch

__all__ = ["PackedEmbeddingCollection", "KeyedEmbeddings"]

logger = logging.getLogger(__name__)

Mode = Literal["fused", "autograd"]
_HUGEPAGE_MIN_BYTES = 8 << 20  # smaller outputs are usually recycled by malloc, already faulted in
# what to use instead of tables that update each rank's copy alone (the warning below and replica_problems)
REPLICA_ADVICE = (
    "use picasso_ops.distributed.DataParallelEmbeddingCollection (every rank holds every row) or "
    "RowShardedEmbeddingCollection (rows spread over the ranks) and call "
    "picasso_ops.distributed.engine_step(engine) in place of engine.step(), or build the tables with "
    "sparse_scale.tables_from_block(...); for tables meant to differ per rank, pass rank_local=True"
)


class KeyedEmbeddings:
    """The collection's output: pooled features as one ``[B, sum D]`` tensor, sequences per feature.

    ``out[name]`` is a view (never a copy): columns of ``values`` for a pooled
    feature, or the ``[nnz_f, D]`` rows of a sequence feature, aligned with the
    batch's ids of that field.

    Example::

        >>> out = KeyedEmbeddings(("a", "b"), torch.arange(12.).view(2, 6), (0, 2, 6), {})
        >>> out["b"].tolist()
        [[2.0, 3.0, 4.0, 5.0], [8.0, 9.0, 10.0, 11.0]]
    """

    __slots__ = ("keys", "values", "column_offsets", "sequences", "_index")

    def __init__(
        self,
        keys: tuple[str, ...],
        values: Tensor,
        column_offsets: tuple[int, ...],
        sequences: Mapping[str, Tensor],
    ) -> None:
        self.keys = keys
        self.values = values
        self.column_offsets = column_offsets
        self.sequences = dict(sequences)
        self._index = {k: i for i, k in enumerate(keys)}

    def __getitem__(self, key: str) -> Tensor:
        i = self._index.get(key)
        if i is not None:
            return self.values[:, self.column_offsets[i] : self.column_offsets[i + 1]]
        if key in self.sequences:
            return self.sequences[key]
        raise KeyError(f"no feature {key!r}; pooled: {list(self.keys)}, sequence: {list(self.sequences)}")

    def to_dict(self) -> dict[str, Tensor]:
        """Every feature's embeddings, pooled then sequence, as views."""
        out = {k: self[k] for k in self.keys}
        out.update(self.sequences)
        return out


class _PackKernel(nn.Module):
    """One pack: its buffer and optimizer state, and which kernel runs its lookup and backward+update.

    The batch's ids become a :class:`LookupPlan` (``lookup_plan.py``) over the pack's columns
    (``pack_columns.py``), checked by ``id_check.py``; the backward sums row gradients
    (``row_grads.py``) and applies the pack's optimizer, or keeps them for ``step()`` when deferred.
    A custom op (C++ on CPU, Triton on CUDA) runs both where it applies, else the torch path does.
    """

    # ids per backward block: at least torch's radix-sort threshold (32k), small enough to stay in cache
    sort_block: int = 1 << 17

    def __init__(self, group: PackGroup, mode: Mode, device: Optional[torch.device], custom_ops: bool = False,
                 bounds: Optional[BoundsCheck] = None) -> None:
        super().__init__()
        self.group = group
        self.bounds = bounds if bounds is not None else BoundsCheck()  # shared by the collection's packs
        self.mode = mode
        self.custom_ops = custom_ops
        self.optimizer: SparseOptimizer = create_optimizer(group.optimizer, dict(group.hyperparams))
        self.columns = PackColumns(group, device)
        self.width = group.width
        self.uniform = self.columns.uniform
        self.features = self.columns.features

        weight = torch.empty(group.num_storage_rows, group.width, dtype=group.dtype, device=device)
        if mode == "autograd":
            self.weight = nn.Parameter(weight)
        else:
            self.register_buffer("weight", weight, persistent=False)
        state = self.optimizer.init_state(
            group.num_storage_rows, group.width, num_logical_rows=group.num_rows, device=device
        )
        self._state_keys = tuple(state)
        for key, tensor in state.items():
            self.register_buffer(f"state_{key}", tensor, persistent=False)
        self.register_buffer("steps", torch.zeros(len(group.tables), dtype=torch.int64, device=device), persistent=False)
        self._uniform_step: Optional[int] = 0  # python mirror of steps while all tables agree (no sync)
        self._pending: list[tuple[Tensor, Tensor]] = []
        self._defer = False  # set through PackedEmbeddingCollection.defer_updates
        self._column_starts: dict[tuple[Run, ...], Tensor] = {}

    # ------------------------------------------------------------------ state
    @property
    def state(self) -> dict[str, Tensor]:
        """The optimizer state buffers, by state name."""
        return {key: getattr(self, f"state_{key}") for key in self._state_keys}

    def table_tensors(self, index: int) -> dict[str, Tensor]:
        """Views of table ``index``'s weight ``[rows, D]`` and optimizer state."""
        p = self.group.tables[index]
        n, d = p.spec.num_embeddings, p.spec.embedding_dim
        s0, s1 = p.storage_offset, p.storage_offset + n * p.sub_rows
        out = {"weight": self.weight[s0:s1].view(n, d)}
        for key, kind in self.optimizer.state_kinds.items():
            buf = getattr(self, f"state_{key}")
            out[key] = buf[p.row_offset : p.row_offset + n] if kind == "row" else buf[s0:s1].view(n, d)
        if self.optimizer.uses_step:
            out["step"] = self.steps[index]
        return out

    def after_load(self) -> None:
        """Refresh the python step mirror after ``steps`` was written."""
        lo, hi = (int(v) for v in torch.aminmax(self.steps))
        self._uniform_step = lo if lo == hi else None

    def _save_to_state_dict(self, destination: dict, prefix: str, keep_vars: bool) -> None:
        """Nothing: the collection saves per-table entries itself, independent of packing."""

    def _load_from_state_dict(self, *args: Any, **kwargs: Any) -> None:
        """Nothing: the collection loads per-table entries itself."""

    # --------------------------------------------------------------- forward
    def prepare(self, batch: JaggedBatch, columns: Tensor, first_field: Optional[int]) -> LookupPlan:
        """This pack's plan for ``batch`` (``columns``: the batch field of each column; see :func:`build_plan`)."""
        op_path = self.group.pooled and self.uniform and self._op_backend() is not None
        return build_plan(self.columns, batch, columns, first_field, self._check_ids, op_path,
                          check_in_op=self.bounds.mode == "fatal")  # the op raises on a bad id itself

    def _check_ids(self, raw: Tensor, counts: Tensor) -> Tensor:
        return check_ids(self.columns, self.bounds, raw, counts)

    def _torch_plan(self, plan: LookupPlan) -> LookupPlan:
        return torch_plan(self.columns, plan)

    def lookup(self, plan: LookupPlan) -> Tensor:
        """Pooled: ``[C * B, width]`` bags column-major; sequence: ``[buffer rows, width]``."""
        check_plan_ids(self.columns, self.bounds, plan)  # the torch kernels only check rows against the whole buffer
        plan = self._torch_plan(plan)
        sparse = self.mode == "autograd"
        if not self.group.pooled:
            return F.embedding(plan.indices, self.weight, sparse=sparse)
        weights = plan.weights
        if weights is not None and weights.dtype != self.weight.dtype:
            weights = weights.to(self.weight.dtype)
        out = F.embedding_bag(
            plan.indices,
            self.weight,
            plan.offsets,
            mode="sum",
            per_sample_weights=weights,
            include_last_offset=True,
            sparse=sparse,
        )
        if plan.bag_scale is not None:
            out = out * plan.bag_scale.to(out.dtype).unsqueeze(1)
        return out

    def write_columns(self, values: Tensor, out: Tensor, runs: Sequence[Run]) -> None:
        """Copy the ``[C * B, width]`` lookup into its columns of ``values [B, sum D]`` (the transpose is this copy)."""
        B, w = values.shape[0], self.width
        blocks = out.view(self.columns.num_columns, B, w)
        for c0, c1, start in runs:
            values[:, start : start + (c1 - c0) * w].view(B, c1 - c0, w).copy_(blocks[c0:c1].transpose(0, 1))

    def read_columns(self, grad: Tensor, runs: Sequence[Run]) -> Tensor:
        """The inverse of ``write_columns`` for a gradient: ``[B, sum D]`` -> contiguous ``[C * B, width]``."""
        B, w = grad.shape[0], self.width
        blocks = torch.empty(self.columns.num_columns, B, w, dtype=self.weight.dtype, device=grad.device)
        for c0, c1, start in runs:
            blocks[c0:c1].copy_(grad[:, start : start + (c1 - c0) * w].reshape(B, c1 - c0, w).transpose(0, 1))
        return blocks.view(-1, w)

    # ------------------------------------------------------- custom ops
    def _op_backend(self) -> Optional[str]:
        """The custom-op backend (C++ on CPU, Triton on CUDA) for this pack, or ``None`` to keep the torch path.

        The ops take fused mode, float32 buffers whose storage rows are table rows (no sub-row packs).
        """
        if not self.custom_ops or self.mode != "fused" or not self.uniform or self.weight.dtype != torch.float32:
            return None
        backend = custom_ops.select_backend(self.weight.device, self.weight.dtype)
        return None if backend == "reference" else backend

    def _starts(self, runs: Sequence[Run]) -> Tensor:
        """Output column of each kernel column for these runs (cached: runs are fixed per collection)."""
        key = tuple(runs)
        starts = self._column_starts.get(key)
        if starts is None:
            cols = [0] * self.columns.num_columns
            for c0, c1, start in runs:
                for c in range(c0, c1):
                    cols[c] = start + (c - c0) * self.width
            starts = self._column_starts[key] = long_tensor(cols, self.weight.device)
        return starts

    def _mean_columns(self) -> Optional[Tensor]:
        return self.columns.mean if self.columns.has_mean else None

    def lookup_into(self, values: Tensor, plan: LookupPlan, runs: Sequence[Run]) -> None:
        """Pooled lookup written into ``values``' columns: one custom op call, else ``lookup`` + ``write_columns``."""
        backend = self._op_backend() if values.dtype == torch.float32 else None
        if backend is None:
            self.write_columns(values, self.lookup(plan), runs)
            return
        try:
            custom_ops.packed_lookup(
                self.weight, plan.indices, plan.offsets, self._starts(runs), values,
                row_offsets=plan.row_offsets, per_sample_weights=plan.weights,
                mean_columns=self._mean_columns(), column_rows=plan.column_rows, backend=backend,
            )
        except RuntimeError:
            check_plan_ids(self.columns, self.bounds, plan)  # an id outside its table: the IndexError naming the field
            raise

    @torch.no_grad()
    def backward_update_op(self, plan: LookupPlan, grad: Tensor, runs: Optional[Sequence[Run]]) -> bool:
        """``backward_update`` as one custom op call, reading the pooled gradient in place; ``False`` if not applicable.

        ``grad`` is the whole ``[B, sum D]`` output gradient for pooled packs
        (``runs`` locate the pack's columns) or ``[rows, width]`` for sequences.
        Not applicable: deferred updates, Adam while tables disagree on the step,
        weight decay, or no kernel (then the caller runs the torch path).
        """
        backend = self._op_backend()
        if backend is None or self._defer or grad.dtype != torch.float32:
            return False
        if self.optimizer.uses_step and self._uniform_step is None:
            return False
        if self.optimizer.hyperparams.get("weight_decay", 0.0) > 0.0:
            return False  # the kernels take no decay: the torch path applies it to the touched rows
        self._count_step()
        firsts = self.columns.table_first_columns
        if self.group.pooled:
            assert runs is not None
            B = plan.batch_size
            segments = long_tensor([c * B for c in firsts] + [self.columns.num_columns * B], grad.device)
        else:
            first = [0] + list(cumsum(plan.seq_rows))
            segments = long_tensor([first[c] for c in firsts] + [first[-1]], grad.device)
        custom_ops.packed_backward_update(
            self.weight, self.state, plan.indices, plan.offsets if self.group.pooled else None,
            grad if grad.stride(-1) == 1 else grad.contiguous(),
            self._starts(runs) if runs is not None else None,
            optimizer=self.optimizer.name, hyperparams=self.optimizer.hyperparams,
            step=self._uniform_step if self._uniform_step is not None else 1,
            row_offsets=plan.row_offsets, per_sample_weights=plan.weights, mean_columns=self._mean_columns(),
            segments=segments, backend=backend,
        )
        return True

    # ------------------------------------------------------- backward/update
    @torch.no_grad()
    def backward_update(self, plan: LookupPlan, grad: Tensor) -> None:
        """Sum ``grad`` (``[C * B, width]`` or ``[rows, width]``) into the unique rows of ``plan`` and update them.

        Block by block (whole tables, about ``sort_block`` ids each, see :func:`update_blocks`). With
        ``defer_updates`` the row gradients are kept for ``step()`` instead.
        """
        plan = self._torch_plan(plan)
        if plan.bag_scale is not None:
            grad = grad * plan.bag_scale.to(grad.dtype).unsqueeze(1)
        grad = grad.contiguous()
        if not self._defer:
            self._count_step()
        for e0, e1, g0, g1 in update_blocks(self.columns, plan, self.sort_block):
            bag_of = None
            if self.group.pooled:  # bag of each id, relative to the block's first bag
                bags = torch.arange(g1 - g0, device=grad.device)
                bag_of = torch.repeat_interleave(bags, plan.lengths[g0:g1], output_size=e1 - e0)
            weights = None if plan.weights is None else plan.weights[e0:e1]
            rows, grad_rows = sum_by_row(plan.indices[e0:e1], bag_of, weights, grad[g0:g1])
            if self._defer:
                self._pending.append((rows, grad_rows))
            else:
                self._update(rows, grad_rows)

    @torch.no_grad()
    def step(self) -> None:
        """Apply what was accumulated: deferred row gradients (fused) or the sparse ``.grad`` (autograd)."""
        if self.mode == "autograd":
            grad = self.weight.grad
            if grad is None:
                return
            self.weight.grad = None
            if grad.is_sparse:
                grad = grad.coalesce()
                self.apply_rows(grad.indices()[0], grad.values())
            else:  # someone densified it: still update touched rows only
                rows = grad.abs().sum(1).nonzero().squeeze(1)
                self.apply_rows(rows, grad.index_select(0, rows))
            return
        if not self._pending:
            return
        rows = torch.cat([r.long() for r, _ in self._pending])
        grads = torch.cat([g for _, g in self._pending])
        self._pending.clear()
        self.apply_rows(*sum_by_row(rows, None, None, grads))

    def discard_pending(self) -> None:
        """Drop deferred gradients without applying them."""
        self._pending.clear()

    def apply_rows(self, rows: Tensor, grad_rows: Tensor) -> None:
        """One optimizer step with these unique rows' gradients."""
        self._count_step()
        self._update(rows, grad_rows)

    def _count_step(self) -> None:
        self.steps += 1
        if self._uniform_step is not None:
            self._uniform_step += 1

    def _update(self, rows: Tensor, grad_rows: Tensor) -> None:
        """Apply the optimizer to unique ``rows`` for the step already counted."""
        if rows.numel() == 0:
            return
        upd = row_update(self.columns, rows, grad_rows, self._uniform_step, self.steps)
        self.optimizer.update(self.weight.data if self.mode == "autograd" else self.weight, self.state, upd)


class _PooledLookup(torch.autograd.Function):
    """Pooled pack lookup written into the shared output; backward applies the sparse optimizer.

    Every pooled pack writes its columns of one ``[B, sum D]`` tensor in place
    (``mark_dirty``), so the output is assembled without concatenation, and
    passes the output gradient on unchanged to the packs before it.
    """

    @staticmethod
    def forward(ctx: Any, values: Tensor, anchor: Tensor, kernel: _PackKernel, plan: LookupPlan, runs: Sequence[Run]) -> Tensor:  # type: ignore[override]
        kernel.lookup_into(values, plan, runs)
        ctx.mark_dirty(values)
        ctx.kernel, ctx.plan, ctx.runs = kernel, plan, runs
        return values

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: Tensor) -> tuple[Optional[Tensor], None, None, None, None]:  # type: ignore[override]
        _check_first_backward(ctx)
        if not ctx.kernel.backward_update_op(ctx.plan, grad, ctx.runs):
            ctx.kernel.backward_update(ctx.plan, ctx.kernel.read_columns(grad, ctx.runs))
        ctx.plan = None  # frees the batch's indices and catches a second backward
        return (grad if ctx.needs_input_grad[0] else None), None, None, None, None


class _SequenceLookup(torch.autograd.Function):
    """Sequence pack lookup (one row per id); backward applies the sparse optimizer."""

    @staticmethod
    def forward(ctx: Any, anchor: Tensor, kernel: _PackKernel, plan: LookupPlan) -> Tensor:  # type: ignore[override]
        ctx.kernel, ctx.plan = kernel, plan
        return kernel.lookup(plan)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: Tensor) -> tuple[None, None, None]:  # type: ignore[override]
        _check_first_backward(ctx)
        if not ctx.kernel.backward_update_op(ctx.plan, grad, None):
            ctx.kernel.backward_update(ctx.plan, grad)
        ctx.plan = None
        return None, None, None


def _check_first_backward(ctx: Any) -> None:
    if ctx.plan is None:
        raise RuntimeError(
            "backward ran twice through a fused embedding lookup; that would apply the sparse update twice"
        )


class PackedEmbeddingCollection(nn.Module):
    """Embedding tables packed into few buffers, looked up and updated with one fused op per pack.

    Args:
        specs: the tables; feature names must be unique across tables.
        packing: ``False`` gives one pack per table (same results, more calls).
        across_dims: pack tables of different dims together (see ``packing``).
        min_width: smallest buffer row width when packing across dims.
        mode: ``"fused"`` (sparse optimizer inside backward) or ``"autograd"``
            (the reference: parameters with sparse ``.grad``, updated by
            ``step()``; keep them out of the dense optimizer).
        device: where buffers live.
        custom_ops: in fused mode, run float32 packs whose rows are table rows
            through ``picasso_ops.ops`` (C++ on CPU, Triton on CUDA; one op
            call for the lookup and one for backward+update; the same results
            up to float summation order); other packs, and machines without
            the kernels (one warning), keep the torch path. Default on; False
            pins the pure-torch kernels (bitwise-reproducible references).
        bounds_check: what a lookup does with an id outside its table
            (``picasso_ops.embedding.bounds``): ``"fatal"`` (default) raises
            ``IndexError`` naming the field, the id and the range; ``"warn"``
            looks it up as row 0 (FBGEMM's WARNING), ``"clamp"`` as the nearest
            valid row; both count it (:meth:`bounds_check_counts`) and log once
            per table. Settable later through the ``bounds_check`` attribute.
        rank_local: the tables are meant to differ per rank. In fused mode
            each backward updates this process's copy only, so under
            ``torch.distributed`` with more than one rank the replicas drift
            apart: the first training forward there (training mode, grad
            enabled) warns once (``RuntimeWarning`` and the log), and
            ``picasso_ops.distributed.replica_problems`` lists the module.
            ``True`` (or the ``rank_local`` attribute) silences both, e.g. for
            a row shard (``RowShardedEmbeddingCollection.shard``) or tables
            trained per rank on purpose. To keep replicas equal, use
            ``DataParallelEmbeddingCollection`` with ``engine_step(engine)``.

    Attribute ``hugepage_output`` (default: ``custom_ops``): a ``[B, sum D]``
    CPU output of 8 MiB or more comes from ``ops.pooled_empty``: huge-page
    blocks that return to a pool when the output dies and are handed back,
    already faulted in, to the next step of the same shape (page-faulting a
    fresh large output costs more than the lookup; the pool keeps at most
    1 GiB of free blocks, ``ops.output_pool_stats``). Needs the C++ ops
    loaded; set it to ``False`` for plain ``torch.empty`` outputs.

    Tables are initialised uniform in ``±sqrt(1 / num_embeddings)`` (torchrec's
    default), one table after another in spec order, so the initial weights
    do not depend on packing.

    Example::

        >>> emb = PackedEmbeddingCollection([TableSpec("a", 10, 4), TableSpec("b", 10, 4)])
        >>> [len(g.tables) for g in emb.groups]
        [2]
        >>> emb.lr = 0.05  # every pack's learning rate, e.g. from a schedule
    """

    def __init__(
        self,
        specs: Sequence[TableSpec],
        *,
        packing: bool = True,
        across_dims: bool = False,
        min_width: int = 4,
        mode: Mode = "fused",
        device: Optional[Union[torch.device, str]] = None,
        custom_ops: bool = True,
        bounds_check: str = "fatal",
        rank_local: bool = False,
    ) -> None:
        super().__init__()
        self._bounds = BoundsCheck(bounds_check)
        self.rank_local = bool(rank_local)
        # subclasses with a sparse step (DataParallelEmbeddingCollection) keep their ranks in sync themselves
        self._replicas_unchecked = not isinstance(self, SparseStepModule)
        if mode not in ("fused", "autograd"):
            raise ValueError(f"mode must be 'fused' or 'autograd', got {mode!r}")
        self.specs: tuple[TableSpec, ...] = tuple(specs)
        if not self.specs:
            raise ValueError("PackedEmbeddingCollection needs at least one TableSpec")
        owner: dict[str, str] = {}
        for spec in self.specs:
            for feature in spec.feature_names:
                if feature in owner:
                    raise ValueError(f"feature {feature!r} is looked up in both {owner[feature]!r} and {spec.name!r}")
                owner[feature] = spec.name
        self.mode: Mode = mode
        device = torch.device(device) if device is not None else None
        self.groups: tuple[PackGroup, ...] = tuple(
            plan_packing(self.specs, pack=packing, across_dims=across_dims, min_width=min_width)
        )
        self.kernels = nn.ModuleList([_PackKernel(g, mode, device, custom_ops, self._bounds) for g in self.groups])
        logger.info(
            "packed %d tables into %d packs (sizes %s), mode=%s",
            len(self.specs), len(self.groups), [len(g.tables) for g in self.groups], mode,
        )
        self._where: dict[str, tuple[int, int]] = {
            p.spec.name: (gi, ti) for gi, g in enumerate(self.groups) for ti, p in enumerate(g.tables)
        }

        pooled = [(f, s) for s in self.specs if s.pooling != "none" for f in s.feature_names]
        self.pooled_features: tuple[str, ...] = tuple(f for f, _ in pooled)
        self.sequence_features: tuple[str, ...] = tuple(
            f for s in self.specs if s.pooling == "none" for f in s.feature_names
        )
        dims = [s.embedding_dim for _, s in pooled]
        self.column_offsets: tuple[int, ...] = tuple([0] + list(cumsum(dims)))
        # output assembly: each pooled pack copies runs of its columns straight into the output
        feature_kernel = {f: (gi, fi) for gi, k in enumerate(self.kernels) for fi, (f, _) in enumerate(k.features)}
        self._runs: dict[int, list[Run]] = {}
        previous, start = None, 0
        for f, s in pooled:
            gi, fi = feature_kernel[f]
            kernel = self.kernels[gi]
            c0 = kernel.columns.feature_first_column[fi]
            c1 = c0 + s.embedding_dim // kernel.width
            runs = self._runs.setdefault(gi, [])
            if previous == gi and runs[-1][1] == c0:
                runs[-1] = (runs[-1][0], c1, runs[-1][2])
            else:
                runs.append((c0, c1, start))
            previous, start = gi, start + s.embedding_dim
        dtypes = [g.dtype for g in self.groups if g.pooled]
        self._values_dtype = dtypes[0] if dtypes else torch.float32
        for dtype in dtypes[1:]:
            self._values_dtype = torch.promote_types(self._values_dtype, dtype)
        self._keys_cache: Optional[tuple[tuple[str, ...], list[tuple[Tensor, Optional[int]]]]] = None
        # a large [B, sum D] CPU output comes from the recycling pool of huge-page blocks (C++ ops loaded): faulting a
        # fresh output of ~100 MB in 4 KiB pages costs more than the lookup itself at B=2048, F=200, D=64
        self.hugepage_output = bool(custom_ops)
        self.reset_parameters()

    # ------------------------------------------------------------ parameters
    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Re-initialise every table (spec order, packing-independent) and zero optimizer state."""
        for spec in self.specs:
            tensors = self._table_tensors(spec.name)
            bound = math.sqrt(1.0 / spec.num_embeddings)
            tensors["weight"].uniform_(-bound, bound)
        for kernel in self.kernels:
            for buf in kernel.state.values():
                buf.zero_()
            kernel.steps.zero_()
            kernel.after_load()
            kernel.discard_pending()

    @property
    def lr(self) -> float:
        """The learning rate of every pack; raises if packs differ (set it to make them equal)."""
        rates = {k.optimizer.lr for k in self.kernels}
        if len(rates) != 1:
            raise ValueError(f"packs have different learning rates {sorted(rates)}; read them per table with table_lr()")
        return rates.pop()

    @lr.setter
    def lr(self, value: float) -> None:
        for kernel in self.kernels:
            kernel.optimizer.lr = value

    def table_lr(self, table: str) -> float:
        """The learning rate applied to one table."""
        gi, _ = self._locate(table)
        return self.kernels[gi].optimizer.lr

    @property
    def bounds_check(self) -> str:
        """``"fatal"``, ``"warn"`` or ``"clamp"``: what a lookup does with an out-of-range id (see the class doc)."""
        return self._bounds.mode

    @bounds_check.setter
    def bounds_check(self, value: str) -> None:
        self._bounds.mode = value

    def bounds_check_counts(self) -> dict[str, int]:
        """Out-of-range ids that ``warn`` / ``clamp`` replaced in this process, by table (empty: none).

        Example::

            >>> PackedEmbeddingCollection([TableSpec("a", 10, 4)], bounds_check="warn").bounds_check_counts()
            {}
        """
        return self._bounds.counts()

    @property
    def defer_updates(self) -> bool:
        """When ``True`` (fused mode), backward keeps row gradients and ``step()`` applies their sum."""
        return any(k._defer for k in self.kernels)

    @defer_updates.setter
    def defer_updates(self, value: bool) -> None:
        if value and self.mode != "fused":
            raise ValueError("defer_updates is for mode='fused'; mode='autograd' always updates in step()")
        for kernel in self.kernels:
            kernel._defer = bool(value)

    def step(self) -> None:
        """Apply accumulated sparse gradients (deferred fused updates, or autograd ``.grad``) as one step."""
        for kernel in self.kernels:
            kernel.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop accumulated sparse gradients (and any autograd ``.grad``)."""
        super().zero_grad(set_to_none=set_to_none)
        for kernel in self.kernels:
            kernel.discard_pending()

    def table_weight(self, table: str) -> Tensor:
        """A ``[rows, D]`` view of one table's weights (no copy).

        Example::

            >>> PackedEmbeddingCollection([TableSpec("a", 10, 4)]).table_weight("a").shape
            torch.Size([10, 4])
        """
        return self._table_tensors(table)["weight"]

    def table_state(self, table: str) -> dict[str, Tensor]:
        """Views of one table's optimizer state (e.g. ``momentum1``, ``step``)."""
        tensors = self._table_tensors(table)
        tensors.pop("weight")
        return tensors

    # --------------------------------------------------------------- forward
    def forward(self, batch: Union[JaggedBatch, Any]) -> KeyedEmbeddings:
        """Look up every feature of ``batch`` (a ``JaggedBatch`` or torchrec ``KeyedJaggedTensor``).

        The batch may carry extra fields; missing ones raise ``KeyError``.
        Ids outside their table raise ``IndexError`` naming the field (``bounds_check`` "fatal"), or are
        replaced and counted ("warn", "clamp"). A NaN/inf per-sample weight raises ``ValueError`` naming its field.
        """
        if self._replicas_unchecked and self.training and torch.is_grad_enabled():
            self._check_replicas()
        if not isinstance(batch, JaggedBatch):
            batch = JaggedBatch.from_kjt(batch)
        if batch.weights is not None:  # before any lookup: a NaN weight would reach the rows and optimizer state
            check_finite_weights(batch.weights, batch.field_offsets.contiguous(), batch.keys)
        fields = self._batch_fields(batch)
        fused = self.mode == "fused" and torch.is_grad_enabled()
        anchor = torch.empty(0, requires_grad=True) if fused else None
        shape, device = (batch.batch_size, self.column_offsets[-1]), batch.values.device
        if (self.hugepage_output and device.type == "cpu"
                and shape[0] * shape[1] * self._values_dtype.itemsize >= _HUGEPAGE_MIN_BYTES):
            values = custom_ops.pooled_empty(*shape, dtype=self._values_dtype)  # see hugepage_output
        else:
            values = torch.empty(shape, dtype=self._values_dtype, device=device)
        sequences: dict[str, Tensor] = {}
        for gi, (kernel, (columns, first_field)) in enumerate(zip(self.kernels, fields)):
            plan = kernel.prepare(batch, columns, first_field)
            if kernel.group.pooled:
                if fused:
                    values = _PooledLookup.apply(values, anchor, kernel, plan, self._runs[gi])
                else:  # inference, or the autograd reference (the copy is differentiable)
                    kernel.lookup_into(values, plan, self._runs[gi])
                continue
            out = _SequenceLookup.apply(anchor, kernel, plan) if fused else kernel.lookup(plan)
            chunks = torch.split(out, list(plan.seq_rows), dim=0)
            for (name, p), chunk, n in zip(kernel.features, chunks, plan.seq_ids):
                sequences[name] = chunk.view(n, p.spec.embedding_dim)
        return KeyedEmbeddings(self.pooled_features, values, self.column_offsets, sequences)

    def _check_replicas(self) -> None:
        """Warn once if this rank-local collection trains on more than one rank (see ``rank_local``)."""
        if self.rank_local or self.mode != "fused":
            self._replicas_unchecked = False  # autograd mode: .grad is all-reduced by DDP / DeepSpeed
            return
        dist = torch.distributed
        if not (dist.is_available() and dist.is_initialized()):
            return  # checked again at the next training forward
        self._replicas_unchecked = False
        world = dist.get_world_size()
        if world <= 1:
            return
        names = [s.name for s in self.specs]
        tables = f"{names[:4]}{' and %d more' % (len(names) - 4) if len(names) > 4 else ''}"
        message = (f"{type(self).__name__} (tables {tables}) is training on {world} ranks (torch.distributed world "
                   f"size {world}), but its fused backward updates each rank's copy alone: its {world} replicas will "
                   f"diverge. To keep them equal, {REPLICA_ADVICE}.")
        warnings.warn(message, RuntimeWarning, stacklevel=3)
        logger.warning("%s", message)

    def _batch_fields(self, batch: JaggedBatch) -> list[tuple[Tensor, Optional[int]]]:
        """Per pack, the batch field of each column, and the first one when they are consecutive; cached per keys."""
        if self._keys_cache is not None and self._keys_cache[0] == batch.keys:
            cached = self._keys_cache[1]
            if not cached or cached[0][0].device == batch.values.device:
                return cached
        index = {k: i for i, k in enumerate(batch.keys)}
        missing = [f for f in self.pooled_features + self.sequence_features if f not in index]
        if missing:
            raise KeyError(f"batch lacks features {missing} (batch keys: {list(batch.keys)[:20]})")
        result = []
        for kernel in self.kernels:
            ids = [index[kernel.features[owner][0]] for owner in kernel.columns.column_owner]
            consecutive = ids == list(range(ids[0], ids[0] + len(ids)))
            result.append((torch.tensor(ids, dtype=torch.long, device=batch.values.device), ids[0] if consecutive else None))
        self._keys_cache = (batch.keys, result)
        return result

    # ------------------------------------------------------------ state dict
    def _locate(self, table: str) -> tuple[int, int]:
        try:
            return self._where[table]
        except KeyError:
            raise KeyError(f"no table {table!r}; tables: {[s.name for s in self.specs]}") from None

    def _table_tensors(self, table: str) -> dict[str, Tensor]:
        gi, ti = self._locate(table)
        return self.kernels[gi].table_tensors(ti)

    def _save_to_state_dict(self, destination: dict, prefix: str, keep_vars: bool) -> None:
        for spec in self.specs:
            for key, tensor in self._table_tensors(spec.name).items():
                destination[f"{prefix}{spec.name}.{key}"] = tensor if keep_vars else tensor.detach()

    def _load_from_state_dict(
        self,
        state_dict: Mapping[str, Any],
        prefix: str,
        local_metadata: dict,
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        expected = set()
        with torch.no_grad():
            for spec in self.specs:
                for key, tensor in self._table_tensors(spec.name).items():
                    full = f"{prefix}{spec.name}.{key}"
                    expected.add(full)
                    if full not in state_dict:
                        missing_keys.append(full)
                        continue
                    value = state_dict[full]
                    if not isinstance(value, Tensor) or value.shape != tensor.shape:
                        shape = tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__
                        error_msgs.append(
                            f"size mismatch for {full}: checkpoint has {shape}, table {spec.name!r} "
                            f"expects {tuple(tensor.shape)}"
                        )
                        continue
                    tensor.copy_(value)
        for kernel in self.kernels:
            kernel.after_load()
            kernel.discard_pending()
        if strict:
            unexpected_keys.extend(k for k in state_dict if k.startswith(prefix) and k not in expected)

    def extra_repr(self) -> str:
        packs = ", ".join(
            f"[{'+'.join(p.spec.name for p in g.tables)}: width {g.width}, {g.optimizer}]"
            if len(g.tables) <= 4
            else f"[{len(g.tables)} tables: width {g.width}, {g.optimizer}]"
            for g in self.groups
        )
        return f"mode={self.mode}, tables={len(self.specs)}, packs={len(self.groups)}: {packs}"
