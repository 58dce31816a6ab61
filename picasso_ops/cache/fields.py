"""Per-field tables of a CTR model behind one hot-row cache: a data-parallel drop-in for packed field embeddings.

:class:`CachedFieldEmbeddings` replaces a
:class:`~picasso_ops.models.PackedFieldEmbeddings` with data-parallel
tables. The fields' tables are packed into one :class:`RowStore` (table ``f``
at rows ``[offset_f, offset_f + vocab_f)``, the same layout as the packed
buffer), and a :class:`CachedEmbeddingTable` of ``capacity`` rows in front of
it holds the hot rows and their optimizer state.

The arithmetic is the packed collection's, step for step, so training through
the cache gives bit-identical weights (``tests/e2e/test_train_rec_picasso.py``):

* forward: one ``embedding_bag`` (sum) over the batch's rows in batch order,
  then ``1 / length`` for mean pooling; evaluation (``eval()`` or no grad)
  reads rows with :meth:`CachedEmbeddingTable.peek`, which leaves the cache,
  its policy and its hit-rate statistics alone;
* backward: the gradient of each unique row is summed in batch order (the
  packed kernel's ``_sum_by_row``) and stored; nothing is applied;
* :meth:`sparse_step` (at the accumulation boundary, on every rank): the
  stored rows and gradients are all-gathered and summed per row as
  ``DataParallelEmbeddingCollection.sparse_step`` does, scaled by
  ``grad_scale / world_size``, and applied with one optimizer step. Rows in
  the cache are updated there; rows that are not (looked up on other ranks, or
  evicted since) are updated in the store (write-around), so the cache only
  needs room for one micro-batch's unique rows of this rank.

``state_dict()`` flushes the cache and writes the same per-table entries as the
packed collection (``collection.<table>.weight``, ``.momentum1``, ``.step``),
so a checkpoint taken with the cache loads without it and the other way round.

Example::

    >>> from picasso_ops.models import SparseArgs, WideAndDeepArgs, packed_wide_and_deep
    >>> from picasso_ops.distributed import sparse_step
    >>> model = packed_wide_and_deep(WideAndDeepArgs(vocab_sizes=[100] * 4, num_dense=3), SparseArgs())
    >>> model.embeddings = CachedFieldEmbeddings.from_packed(model.embeddings, capacity=50)
    >>> logits = model(torch.zeros(2, 3), torch.tensor([1, 2, 3, 4, 5, 6, 7, 8]), torch.ones(4, 2, dtype=torch.long))
    >>> logits.sum().backward(); sparse_step(model)   # one optimizer step of the cached tables
    2
"""

from __future__ import annotations

import logging
import math
from typing import Any, Callable, Mapping, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd.function import once_differentiable

from picasso_ops.cache.cached_table import CachedEmbeddingTable, CachePolicy, CacheStats
from picasso_ops.cache.store import HostRowStore, RowStore
from picasso_ops.contracts import FieldRowPrefetcher, SparseStepModule
from picasso_ops.distributed.comm import (ProcessGroup, all_gather_varsize, coalesce_rows, pack_rows, unpack_rows,
                                          world_info)
from picasso_ops.distributed.data_parallel import DataParallelEmbeddingCollection
from picasso_ops.embedding.row_grads import sum_by_row as _sum_by_row  # the packed kernel's per-row sum: same bits as without the cache

__all__ = ["CachedFieldEmbeddings", "CacheTooSmall"]

logger = logging.getLogger(__name__)

StoreFactory = Callable[[int, int, Mapping[str, int]], RowStore]  # (rows, dim, state_dims) -> an empty store


class CacheTooSmall(ValueError):
    """A lookup needed more distinct rows at once than the cache holds."""


class CachedFieldEmbeddings(nn.Module, SparseStepModule, FieldRowPrefetcher):
    """One table per field, packed into one store behind a hot-row cache; ``forward`` gives ``[B, F, dim]``.

    Args:
        table_names: one per field (checkpoint keys ``collection.<name>.<tensor>``).
        vocab_sizes: rows per field.
        dim: embedding dim.
        pooling: ``"mean"`` or ``"sum"`` over a field's ids in one sample.
        store: every row and its optimizer state (``sum(vocab_sizes)`` rows; see :meth:`state_dims`).
        capacity: rows the cache holds (at least one micro-batch's distinct rows).
        optimizer, optimizer_params: the sparse optimizer, as for the packed tables.
        policy: ``"lfu"`` or ``"lru"``.
        prefetch: honour :meth:`prefetch_ids` (reading the next micro-batch's missing rows ahead).
        process_group: the data-parallel group (default: the world).
        capacity_key: how the error for a too-small cache names the setting.

    Example::

        >>> store = HostRowStore(30, 4, CachedFieldEmbeddings.state_dims("rowwise_adagrad", 4))
        >>> emb = CachedFieldEmbeddings(["t0", "t1"], [10, 20], 4, "mean", store, capacity=8,
        ...                             optimizer="rowwise_adagrad", optimizer_params={"lr": 0.1})
        >>> emb(torch.tensor([1, 2, 3]), torch.tensor([[1, 1], [1, 0]])).shape
        torch.Size([2, 2, 4])
    """

    checkpoint_prefix = "collection."  # the packed collection's key layout, so checkpoints load either way

    def __init__(
        self,
        table_names: Sequence[str],
        vocab_sizes: Sequence[int],
        dim: int,
        pooling: str,
        store: RowStore,
        *,
        capacity: int,
        optimizer: str = "rowwise_adagrad",
        optimizer_params: Optional[Mapping[str, float]] = None,
        policy: CachePolicy = "lfu",
        prefetch: bool = True,
        process_group: Optional[ProcessGroup] = None,
        capacity_key: str = "capacity",
    ) -> None:
        super().__init__()
        if len(table_names) != len(vocab_sizes) or not table_names:
            raise ValueError(f"need one table name per field, got {len(table_names)} names for "
                             f"{len(vocab_sizes)} fields")
        if pooling not in ("mean", "sum"):
            raise ValueError(f"pooling must be 'mean' or 'sum', got {pooling!r}")
        self.table_names = tuple(table_names)
        self.vocab_sizes = tuple(int(v) for v in vocab_sizes)
        self.dim, self.pooling = int(dim), pooling
        starts = [0]
        for v in self.vocab_sizes:
            starts.append(starts[-1] + v)
        self.row_starts = tuple(starts)  # table f: store rows [row_starts[f], row_starts[f + 1])
        if store.num_rows != starts[-1] or store.dim != self.dim:
            raise ValueError(f"the store must hold {starts[-1]} rows of dim {self.dim}, "
                             f"got {store.num_rows} x {store.dim}")
        if capacity > starts[-1]:
            raise ValueError(f"{capacity_key} = {capacity} is larger than the {starts[-1]} rows of the "
                             f"{len(self.vocab_sizes)} tables it caches")
        self._offsets = torch.tensor(starts[:-1], dtype=torch.int64)
        self._sizes = torch.tensor(self.vocab_sizes, dtype=torch.int64)
        self.prefetch_enabled = prefetch
        self.process_group = process_group
        self.capacity_key = capacity_key
        # not a registered submodule: this module writes the checkpoint entries itself (packed layout)
        object.__setattr__(self, "cache", CachedEmbeddingTable(store, capacity, optimizer=optimizer,
                                                               optimizer_params=optimizer_params, policy=policy))
        self._pending: list[tuple[Tensor, Tensor]] = []

    # ------------------------------------------------------------ construction
    @staticmethod
    def state_dims(optimizer: str, dim: int) -> dict[str, int]:
        """Optimizer-state columns per row a store needs for ``optimizer`` (``{"momentum1": 1}`` for row-wise Adagrad).

        Example::

            >>> CachedFieldEmbeddings.state_dims("adam", 8)
            {'momentum1': 8, 'momentum2': 8}
        """
        from picasso_ops.embedding.sparse_optim import OPTIMIZERS

        return {k: (1 if kind == "row" else int(dim)) for k, kind in OPTIMIZERS[optimizer].state_kinds.items()}

    @classmethod
    def from_packed(
        cls,
        packed: nn.Module,
        *,
        capacity: int,
        policy: CachePolicy = "lfu",
        prefetch: bool = True,
        store_factory: Optional[StoreFactory] = None,
        capacity_key: str = "capacity",
    ) -> "CachedFieldEmbeddings":
        """The cached equivalent of a data-parallel ``PackedFieldEmbeddings``, starting from its current tables.

        Every table's rows and optimizer state are copied into a new store
        (``store_factory(rows, dim, state_dims)``; default: host memory) one
        table at a time; the packed tables can be dropped afterwards.

        Example::

            >>> cached = CachedFieldEmbeddings.from_packed(model.embeddings, capacity=1000)  # doctest: +SKIP
        """
        coll = getattr(packed, "collection", None)
        if not isinstance(coll, DataParallelEmbeddingCollection):
            raise TypeError(f"the cache serves data-parallel packed tables, got {type(coll).__name__}")
        specs = coll.specs
        dims = {s.embedding_dim for s in specs}
        optimizers = {(s.optimizer, tuple(sorted(dict(s.optimizer_params).items()))) for s in specs}
        pooling = {s.pooling for s in specs}
        if len(dims) != 1 or len(optimizers) != 1 or len(pooling) != 1:
            raise ValueError(f"one cache needs tables of one dim, optimizer and pooling; got dims {sorted(dims)}, "
                             f"{len(optimizers)} optimizer settings, pooling {sorted(pooling)}")
        dim, (opt, params), pool = dims.pop(), optimizers.pop(), pooling.pop()
        state_dims = cls.state_dims(opt, dim)
        store = cls._empty_store([s.num_embeddings for s in specs], dim, state_dims, capacity, capacity_key,
                                 store_factory)
        start = 0
        for spec in specs:
            n = spec.num_embeddings
            tstate = coll.table_state(spec.name)  # views of the packed state
            state = {k: tstate[k].reshape(n, w) for k, w in state_dims.items()}
            store.put_rows(torch.arange(start, start + n), coll.table_weight(spec.name).reshape(n, dim), state)
            start += n
        out = cls([s.name for s in specs], [s.num_embeddings for s in specs], dim, pool, store, capacity=capacity,
                  optimizer=opt, optimizer_params=dict(params), policy=policy, prefetch=prefetch,
                  process_group=coll.process_group, capacity_key=capacity_key)
        out.cache.optimizer_steps = max(int(coll.table_state(s.name).get("step", torch.tensor(0))) for s in specs)
        return out

    @staticmethod
    def _empty_store(sizes: Sequence[int], dim: int, state_dims: Mapping[str, int], capacity: int, capacity_key: str,
                     store_factory: Optional[StoreFactory]) -> RowStore:
        total = sum(sizes)
        if capacity > total:
            raise ValueError(f"{capacity_key} = {capacity} is larger than the {total} rows of the {len(sizes)} tables "
                             "it caches (their vocab sizes summed): a cache that size would hold the whole table")
        return (store_factory or (lambda n, d, sd: HostRowStore(n, d, sd)))(total, dim, state_dims)

    @classmethod
    @torch.no_grad()
    def from_init(
        cls,
        vocab_sizes: Sequence[int],
        dim: int,
        pooling: str,
        sparse: Any,
        init_std: Optional[float],
        prefix: str,
        *,
        capacity: int,
        policy: CachePolicy = "lfu",
        prefetch: bool = True,
        store_factory: Optional[StoreFactory] = None,
        capacity_key: str = "capacity",
        chunk_rows: int = 1 << 16,
    ) -> "CachedFieldEmbeddings":
        """What ``from_packed(PackedFieldEmbeddings(vocab_sizes, dim, pooling, sparse, init_std, prefix))`` gives,
        bit for bit, without ever holding all the tables: rows go to the store as they are initialised.

        Tables larger than RAM together then fit: the peak is one table (its normal
        init, ``init_std > 0``) or ``chunk_rows`` rows. The global RNG is consumed
        exactly as the packed collection and ``PackedFieldEmbeddings`` consume it
        (uniform per table in spec order, in chunks: the CPU uniform kernel draws
        element by element; then normal per table), so the model's later layers
        initialise the same too. Rank 0's values are broadcast, as the packed
        path does. ``sparse`` is a ``SparseArgs`` with data-parallel sharding.

        Example::

            >>> emb = CachedFieldEmbeddings.from_init([1000] * 4, 8, "mean", SparseArgs(), 0.01, "emb",
            ...                                       capacity=500)  # doctest: +SKIP
        """
        from picasso_ops.distributed.comm import broadcast_tensor

        if getattr(sparse, "sharding", "data_parallel") != "data_parallel":
            raise ValueError(f"the cache serves data-parallel tables, got sharding {sparse.sharding!r}")
        sizes = [int(v) for v in vocab_sizes]
        opt, params = sparse.optimizer, dict(sparse.optimizer_params)
        state_dims = cls.state_dims(opt, dim)
        store = cls._empty_store(sizes, dim, state_dims, capacity, capacity_key, store_factory)
        group = getattr(sparse, "process_group", None)

        def put(start: int, rows: Tensor) -> None:
            broadcast_tensor(rows, 0, group)  # ranks' RNG streams may differ: rank 0's init wins
            n = rows.shape[0]
            store.put_rows(torch.arange(start, start + n), rows,
                           {k: torch.zeros(n, w) for k, w in state_dims.items()})

        starts = [0]
        for v in sizes:
            starts.append(starts[-1] + v)
        for start, n in zip(starts, sizes):  # the packed collection's reset_parameters
            bound = math.sqrt(1.0 / n)
            for a in range(0, n, chunk_rows):
                rows = torch.empty(min(chunk_rows, n - a), dim).uniform_(-bound, bound)
                if init_std is None:
                    put(start + a, rows)
        if init_std is not None:  # PackedFieldEmbeddings._init: zeros, or normal over each whole table
            for start, n in zip(starts, sizes):
                for a in range(0, n, chunk_rows if init_std == 0.0 else n):
                    if init_std == 0.0:
                        put(start + a, torch.zeros(min(chunk_rows, n - a), dim))
                    else:  # whole table: the CPU normal kernel fills 16 values at a time, chunks would shift it
                        put(start, torch.empty(n, dim).normal_(std=init_std))
        return cls([f"{prefix}{i}" for i in range(len(sizes))], sizes, dim, pooling, store, capacity=capacity,
                   optimizer=opt, optimizer_params=params, policy=policy, prefetch=prefetch, process_group=group,
                   capacity_key=capacity_key)

    # ------------------------------------------------------------ lookups
    def _global_ids(self, values: Tensor, lengths: Tensor) -> Tensor:
        """``values`` (field-major) shifted to packed store rows; raises ``IndexError`` naming the field."""
        counts = lengths.sum(1)
        if values.numel():
            lo, hi = (int(v) for v in torch.aminmax(values))
            if lo < 0 or hi >= min(self.vocab_sizes):
                bound = torch.repeat_interleave(self._sizes, counts, output_size=values.numel())
                bad = ((values < 0) | (values >= bound)).nonzero()
                if bad.numel():
                    i = int(bad[0, 0])
                    f = int(torch.searchsorted(torch.cumsum(counts, 0), torch.tensor(i), right=True))
                    raise IndexError(f"field 'f{f}': id {int(values[i])} is out of range for table "
                                     f"{self.table_names[f]!r} of size {self.vocab_sizes[f]} "
                                     f"(valid ids are 0..{self.vocab_sizes[f] - 1})")
        return values + torch.repeat_interleave(self._offsets, counts, output_size=values.numel())

    def _rows(self, uniq: Tensor, training: bool) -> Tensor:
        try:
            return self.cache.lookup(uniq) if training else self.cache.peek(uniq)
        except ValueError as exc:
            if "does not fit a cache" not in str(exc):
                raise
            raise CacheTooSmall(f"{self.capacity_key} = {self.cache.capacity} is too small: one lookup needed "
                                f"{uniq.numel()} distinct rows of the {len(self.table_names)} tables "
                                f"{self.table_names[0]}..{self.table_names[-1]} at once; raise it (or split batches "
                                "into more micro-batches)") from exc

    def forward(self, values: Tensor, lengths: Tensor) -> Tensor:
        """Pooled rows ``[B, F, dim]`` of a field-major batch (``values`` ``[nnz]``, ``lengths`` ``[F, B]``)."""
        num_fields, batch = lengths.shape
        if num_fields != len(self.vocab_sizes):
            raise ValueError(f"batch has {num_fields} fields, the tables {len(self.vocab_sizes)}")
        ids = self._global_ids(values, lengths)
        flat_lengths = lengths.reshape(-1)
        offsets = torch.zeros(flat_lengths.numel() + 1, dtype=torch.int64)
        torch.cumsum(flat_lengths, 0, out=offsets[1:])
        scale = flat_lengths.to(torch.float32).clamp(min=1.0).reciprocal() if self.pooling == "mean" else None
        training = self.training and torch.is_grad_enabled()
        uniq, inverse = torch.unique(ids, return_inverse=True)
        rows = self._rows(uniq, training)
        if not training:
            return _pool(rows, inverse, offsets, scale, num_fields, batch)
        anchor = torch.empty(0, requires_grad=True)  # makes the output require grad without a parameter
        return _CachedPooledLookup.apply(anchor, self, rows, ids, inverse, offsets, flat_lengths, scale,
                                         num_fields, batch)

    def prefetch_ids(self, values: Tensor, lengths: Tensor) -> None:
        """Start reading the missing rows of a coming (micro-)batch (no-op unless ``prefetch``); same thread as lookups.

        Example::

            >>> emb.prefetch_ids(next_mb.values, next_mb.lengths)  # doctest: +SKIP
        """
        if self.prefetch_enabled and values.numel():
            self.cache.prefetch(torch.unique(self._global_ids(values, lengths)))

    # ------------------------------------------------------------ the sparse step contract
    @torch.no_grad()
    def sparse_step(self, grad_scale: float = 1.0) -> None:
        """All-gather the stored row gradients, sum per row, one optimizer step; a collective over the group.

        Example::

            >>> emb.sparse_step(grad_scale=1.0)  # doctest: +SKIP
        """
        _, world = world_info(self.process_group)
        pending, self._pending = self._pending, []
        ran = bool(pending)
        if ran:
            rows, grads = coalesce_rows(torch.cat([r.long() for r, _ in pending]), torch.cat([g for _, g in pending]))
        else:
            rows, grads = torch.zeros(0, dtype=torch.int64), torch.zeros(0, self.dim)
        meta = torch.tensor([[rows.numel(), int(ran)]], dtype=torch.int64)
        if world > 1:
            metas = [torch.empty_like(meta) for _ in range(world)]
            torch.distributed.all_gather(metas, meta, group=self.process_group)
            all_meta = torch.cat(metas)
        else:
            all_meta = meta
        if not bool(all_meta[:, 1].any()):
            return  # no rank ran a backward: no step, as without the cache
        if world > 1:
            gathered = all_gather_varsize(pack_rows(rows, grads), all_meta[:, 0].tolist(), self.process_group)
            rows, grads = coalesce_rows(*unpack_rows(gathered, self.dim))
        self.cache.apply_gradients(rows, grads * (grad_scale / world), write_around=True)

    def discard_pending(self) -> None:
        """Drop the stored row gradients without a step (after an fp16 overflow); local."""
        self._pending.clear()

    def flush(self) -> None:
        """Write every dirty cached row back to the store (before a checkpoint or an evaluation)."""
        self.cache.flush()

    def close(self) -> None:
        """Flush, stop the cache's I/O thread and close the store (an mmap file); the module is unusable afterwards."""
        self.cache.close()
        close = getattr(self.cache.store, "close", None)
        if callable(close):
            close()

    @property
    def stats(self) -> CacheStats:
        """The cache's hit/miss/eviction counters."""
        return self.cache.stats

    # ------------------------------------------------------------ checkpoints
    def _table_keys(self) -> list[tuple[int, str]]:
        return list(enumerate(self.table_names))

    def _save_to_state_dict(self, destination: dict, prefix: str, keep_vars: bool) -> None:
        kinds = self.cache.optimizer.state_kinds
        for f, name in self._table_keys():
            n, start = self.vocab_sizes[f], self.row_starts[f]
            got = self.cache.read_store(torch.arange(start, start + n))  # flushes first: the store is complete
            key = f"{prefix}{self.checkpoint_prefix}{name}."
            destination[key + "weight"] = got.rows.reshape(n, self.dim).clone()
            for k, kind in kinds.items():
                shape = (n,) if kind == "row" else (n, self.dim)  # the packed collection's state layout
                destination[key + k] = got.state[k].reshape(shape).clone()
            if self.cache.optimizer.uses_step:
                destination[key + "step"] = torch.tensor(self.cache.optimizer_steps, dtype=torch.int64)

    def _load_from_state_dict(self, state_dict: Mapping[str, Any], prefix: str, local_metadata: Any, strict: bool,
                              missing_keys: list, unexpected_keys: list, error_msgs: list) -> None:
        kinds = self.cache.optimizer.state_kinds
        expected, steps = set(), None
        self._pending.clear()
        for f, name in self._table_keys():
            n, start = self.vocab_sizes[f], self.row_starts[f]
            key = f"{prefix}{self.checkpoint_prefix}{name}."
            names = ["weight", *kinds] + (["step"] if self.cache.optimizer.uses_step else [])
            expected.update(key + k for k in names)
            missing = [key + k for k in names if key + k not in state_dict]
            if missing:
                missing_keys.extend(missing)
                continue
            weight = state_dict[key + "weight"]
            if tuple(weight.shape) != (n, self.dim):
                error_msgs.append(f"size mismatch for {key}weight: checkpoint has {tuple(weight.shape)}, "
                                  f"table {name!r} expects {(n, self.dim)}")
                continue
            state = {k: state_dict[key + k].reshape(n, 1 if kind == "row" else self.dim).float()
                     for k, kind in kinds.items()}
            if "step" in names:
                steps = int(state_dict[key + "step"])
            self.cache.restore(torch.arange(start, start + n), weight.float(), state)
        if steps is not None:
            self.cache.optimizer_steps = steps
        if strict:
            unexpected_keys.extend(k for k in state_dict if k.startswith(prefix + self.checkpoint_prefix)
                                   and k not in expected)

    def __deepcopy__(self, memo: dict) -> "CachedFieldEmbeddings":
        # the I/O thread, locks and a file mapping do not copy: the copy gets the current rows in a host-memory store
        state_dims = dict(self.cache.store.state_dims)
        got = self.cache.read_store(torch.arange(self.row_starts[-1]))
        store = HostRowStore(self.row_starts[-1], self.dim, state_dims)
        store.put_rows(torch.arange(self.row_starts[-1]), got.rows, got.state)
        c = self.cache
        out = CachedFieldEmbeddings(self.table_names, self.vocab_sizes, self.dim, self.pooling, store,
                                    capacity=c.capacity, optimizer=c.optimizer.name,
                                    optimizer_params=c.optimizer.hyperparams, policy=c.policy,
                                    prefetch=self.prefetch_enabled, process_group=self.process_group,
                                    capacity_key=self.capacity_key)
        out.cache.optimizer_steps = c.optimizer_steps
        out.train(self.training)
        return out

    def extra_repr(self) -> str:
        return (f"tables={len(self.table_names)}, rows={self.row_starts[-1]}, dim={self.dim}, "
                f"pooling={self.pooling!r}, cache={self.cache.extra_repr()}")


def _pool(rows: Tensor, inverse: Tensor, offsets: Tensor, scale: Optional[Tensor], num_fields: int,
          batch: int) -> Tensor:
    """``[B, F, dim]``: every bag's rows summed in batch order (times ``1 / length`` for mean), as the packed lookup."""
    out = F.embedding_bag(inverse, rows, offsets, mode="sum", include_last_offset=True)
    if scale is not None:
        out = out * scale.unsqueeze(1)
    return out.view(num_fields, batch, -1).transpose(0, 1).contiguous()  # field-major bags -> [B, F, dim]


class _CachedPooledLookup(torch.autograd.Function):
    """Pooled lookup of cached rows; backward stores each unique row's summed gradient for ``sparse_step``."""

    @staticmethod
    def forward(ctx: Any, anchor: Tensor, module: CachedFieldEmbeddings, rows: Tensor,  # type: ignore[override]
                ids: Tensor, inverse: Tensor, offsets: Tensor, lengths: Tensor, scale: Optional[Tensor],
                num_fields: int, batch: int) -> Tensor:
        ctx.module, ctx.ids, ctx.lengths, ctx.scale = module, ids, lengths, scale
        return _pool(rows, inverse, offsets, scale, num_fields, batch)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: Tensor) -> tuple[None, ...]:  # type: ignore[override]
        if ctx.ids is None:
            raise RuntimeError("backward ran twice through a cached embedding lookup; "
                               "that would apply the update twice")
        batch, num_fields, dim = grad.shape
        g = grad.transpose(0, 1).contiguous().view(num_fields * batch, dim)  # [B, F, dim] -> field-major bags
        if ctx.scale is not None:
            g = g * ctx.scale.to(g.dtype).unsqueeze(1)
        bag_of = torch.repeat_interleave(torch.arange(num_fields * batch), ctx.lengths, output_size=ctx.ids.numel())
        ctx.module._pending.append(_sum_by_row(ctx.ids, bag_of, None, g))
        ctx.ids = None
        return (None,) * 10
