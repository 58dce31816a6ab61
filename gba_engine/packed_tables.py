"""Packed field embeddings whose rows live on the parameter servers: picasso's layout, the servers' rows.

:class:`ServerPackedFieldEmbeddings` is a drop-in for picasso_ops' field embeddings
(``forward(values, lengths) -> [B, F, dim]`` on a field-major multi-hot batch). It keeps the
picasso layout: the fields are grouped by picasso's own planner
(``picasso_ops.embedding.packing.plan_packing``; ``packing=False``: one group per field) and
each group is ONE server table whose rows are its fields' vocabularies one after another (a
field at its row offset). A forward makes one pull of every group's unique rows (all groups
in one request) and one fused pooled lookup per group over the pulled rows: all the group's
fields' bags in a single ``F.embedding_bag`` call. The lookup is the
:class:`~gba_engine.tables.ServerEmbeddingBagCollection` of the group tables, so the pulled
rows' gradients reach the servers through the engine exactly as they do for per-field server
tables (``fetch_rows`` / ``record_rows``), and the servers aggregate them per id over the
global batch under the same token control as the dense part.

The tables carry the picasso block's sparse optimizer (``TableOptimizerSpec``: ``sgd``,
``rowwise_adagrad``, lazy ``adam``, their lr and lr schedule), which the servers run instead
of the job's DeepSpeed optimizer for these rows.

Example::

    opt = TableOptimizerSpec.of("rowwise_adagrad", lr=0.05, lr_schedule="deepspeed")
    deep = ServerPackedFieldEmbeddings([100_000] * 26, dim=16, pooling="mean", init_std=0.01, optimizer=opt)
    model = WideAndDeep(args, embeddings=deep, wide=ServerPackedFieldEmbeddings([100_000] * 26, 1, "mean", 0.0,
                                                                               opt, prefix="wide"))
    engine = gba_engine.initialize(model=model, config=ds_config_with_gba_block)   # binds the tables
    emb = deep(values, lengths)                                                    # [B, 26, 16]
"""
from __future__ import annotations

import logging
from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd.function import once_differentiable

from picasso_ops import ops
from picasso_ops.embedding.packing import PackGroup, plan_packing
from picasso_ops.embedding.spec import TableSpec

from .ps.optim import TableOptimizerSpec
from .ps.sharding import ServerTableSpec
from .tables import ServerEmbeddingBagCollection

logger = logging.getLogger(__name__)


class ServerPackedFieldEmbeddings(nn.Module):
    """Fields packed into groups (picasso's planner), one server table and one fused lookup per group.

    Args:
        vocab_sizes: rows per field.
        dim: embedding dim (every field's).
        pooling: ``"sum"`` or ``"mean"`` over a bag's rows.
        init_std: the group tables start N(0, init_std) from their seeds (0: zeros, a wide part).
        optimizer: the sparse optimizer the servers run on these rows.
        packing: ``False``: one group (server table) per field, the unpacked layout.
        prefix: group ``g`` is server table ``{prefix}{g}``; names must be unique job-wide.
        seed: the tables' start (group ``g`` draws from ``seed * 100_003 + g``).

    Example::

        emb = ServerPackedFieldEmbeddings([10, 20], 4, "sum", 0.01, TableOptimizerSpec.of("sgd", lr=0.1))
        [t.num_rows for t in emb.collection.tables]        # [30]: both fields in one server table
    """

    def __init__(self, vocab_sizes: Sequence[int], dim: int, pooling: str, init_std: float,
                 optimizer: TableOptimizerSpec, *, packing: bool = True, prefix: str = "pack", seed: int = 0) -> None:
        super().__init__()
        if not vocab_sizes:
            raise ValueError("ServerPackedFieldEmbeddings needs at least one field")
        if pooling not in ("sum", "mean"):
            raise ValueError(f"pooling must be 'sum' or 'mean' for field embeddings, got {pooling!r}")
        fields = [TableSpec(f"field{f}", int(v), dim, pooling, optimizer.type, optimizer.params)
                  for f, v in enumerate(vocab_sizes)]
        self.groups: tuple[PackGroup, ...] = tuple(plan_packing(fields, pack=packing))
        self.num_fields, self.dim = len(fields), dim
        index = {s.name: f for f, s in enumerate(fields)}
        # per group: its fields (batch order) and each field's first row in the group's table
        group_fields = [[index[p.spec.name] for p in g.tables] for g in self.groups]
        # every field has the same dim, pooling and optimizer: one group of all fields, or one per field
        if [f for fs in group_fields for f in fs] != list(range(self.num_fields)):
            raise AssertionError(f"picasso's planner grouped the fields out of order: {group_fields}")
        self.group_ranges = [(fs[0], fs[-1] + 1) for fs in group_fields]
        row_offset = torch.zeros(self.num_fields, dtype=torch.int64)
        for g in self.groups:
            for p in g.tables:
                row_offset[index[p.spec.name]] = p.row_offset
        self.register_buffer("row_offset", row_offset, persistent=False)
        self.register_buffer("vocab", torch.tensor([int(v) for v in vocab_sizes], dtype=torch.int64),
                             persistent=False)
        self.names = [f"{prefix}{g}" for g in range(len(self.groups))]
        specs = [ServerTableSpec(name, g.num_rows, g.width, init_std=init_std, seed=seed * 100_003 + i,
                                 optimizer=optimizer) for i, (name, g) in enumerate(zip(self.names, self.groups))]
        self.collection = ServerEmbeddingBagCollection(specs, mode=pooling)
        self.mean = pooling == "mean"
        logger.info("server packed tables %s: %d fields in %d groups (sizes %s), dim %d, %s", prefix, self.num_fields,
                    len(self.groups), [b - a for a, b in self.group_ranges], dim, optimizer.type)

    def table_ids(self, values: Tensor, lengths: Tensor) -> dict[str, Tensor]:
        """The rows (duplicates kept) each group's server table gives a field-major batch: what a prefetch pulls.

        Example::

            emb.table_ids(values, lengths)     # {"packed0": tensor([...]), ...}
        """
        return self._group_lookups(values, lengths)[0]

    def _group_lookups(self, values: Tensor, lengths: Tensor) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
        # per group: its fields' ids at their row offsets, and the C * B + 1 bag boundaries into them
        if lengths.dim() != 2 or lengths.shape[0] != self.num_fields:
            raise ValueError(f"lengths must be [F={self.num_fields}, B], got shape {tuple(lengths.shape)}")
        batch = lengths.shape[1]
        per_field = lengths.sum(dim=1)
        n = values.numel()
        if int(per_field.sum()) != n:
            raise ValueError(f"values has {n} ids, lengths sum to {int(per_field.sum())}")
        limit = torch.repeat_interleave(self.vocab, per_field, output_size=n)
        bad = (values < 0) | (values >= limit)
        if bool(bad.any()):
            at = int(bad.nonzero()[0])
            field = int(torch.searchsorted(per_field.cumsum(0), torch.tensor(at), right=True))
            raise IndexError(f"field {field}: id {int(values[at])} outside [0, {int(self.vocab[field])})")
        # each field's ids at its row offset in its group's table: one vectorised add
        rows = values + torch.repeat_interleave(self.row_offset, per_field, output_size=n)
        field_start = torch.zeros(self.num_fields + 1, dtype=torch.int64)
        torch.cumsum(per_field, 0, out=field_start[1:])
        bag_start = torch.zeros(self.num_fields * batch + 1, dtype=torch.int64)
        torch.cumsum(lengths.reshape(-1), 0, out=bag_start[1:])
        ids, offsets = {}, {}
        for name, (f0, f1) in zip(self.names, self.group_ranges):  # a group's ids and bags are one slice
            lo = int(field_start[f0])
            ids[name] = rows[lo:int(field_start[f1])]
            offsets[name] = bag_start[f0 * batch:f1 * batch + 1] - lo  # C * B + 1 bag boundaries
        return ids, offsets

    def forward(self, values: Tensor, lengths: Tensor) -> Tensor:
        """Pooled ``[B, F, dim]`` for ``lengths`` ``[F, B]`` and ``values`` field 0's ids, then field 1's, ..."""
        ids, offsets = self._group_lookups(values, lengths)
        batch = lengths.shape[1]
        pulled = self.collection.pull(ids)  # one request for every group's unique rows
        flat_lengths = lengths.reshape(-1)
        blocks = []
        for name, (f0, f1) in zip(self.names, self.group_ranges):  # one fused lookup per group
            inverse, weight = pulled[name]
            blocks.append(_PulledLookup.apply(weight, inverse, offsets[name], flat_lengths[f0 * batch:f1 * batch],
                                              batch, self.mean))
        out = torch.cat(blocks, dim=1) if len(blocks) > 1 else blocks[0]  # [B, F * dim], fields in order
        return out.view(batch, self.num_fields, self.dim)

    def extra_repr(self) -> str:
        return f"fields={self.num_fields}, dim={self.dim}, groups={[b - a for a, b in self.group_ranges]}"



class _PulledLookup(torch.autograd.Function):
    """One group's pooled lookup over its pulled rows, straight into ``[B, C * dim]`` (picasso_ops' packed_lookup).

    Bag ``c * B + b`` (field ``c`` of the group, sample ``b``) pools ``rows[inverse[offsets[g]:offsets[g+1]]]``.
    The backward gives the pulled rows their gradient: each row's output gradients summed in one
    ``embedding_bag`` over the ids sorted by row (what picasso's fused backward does before its update).
    Measured against ``F.embedding_bag`` + its autograd (benchmarks in docs/gba.md, "Packed tables on the servers").
    """

    @staticmethod
    def forward(ctx: Any, rows: Tensor, inverse: Tensor, offsets: Tensor, lengths: Tensor, batch: int,
                mean: bool) -> Tensor:
        columns = lengths.numel() // batch if batch else 0
        dim = rows.shape[1]
        out = torch.empty(batch, columns * dim, dtype=rows.dtype)
        if batch and columns:
            starts = torch.arange(columns, dtype=torch.int64) * dim
            mean_columns = torch.ones(columns, dtype=torch.bool) if mean else None
            ops.packed_lookup(rows.detach(), inverse, offsets, starts, out, mean_columns=mean_columns)
        ctx.save_for_backward(inverse, lengths)
        ctx.shape, ctx.mean = (rows.shape[0], batch, columns, dim), mean
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:
        inverse, lengths = ctx.saved_tensors
        num_rows, batch, columns, dim = ctx.shape
        if not ctx.needs_input_grad[0]:
            return None, None, None, None, None, None
        n = inverse.numel()
        if n == 0:
            return grad_out.new_zeros(num_rows, dim), None, None, None, None, None
        bags = grad_out.reshape(batch, columns, dim).transpose(0, 1).reshape(columns * batch, dim)  # bag-major
        bag_of = torch.repeat_interleave(torch.arange(columns * batch), lengths, output_size=n)
        order = torch.sort(inverse.to(torch.int32), stable=True)[1]  # int32 keys: half the radix passes' bytes
        sources = bag_of.index_select(0, order)
        segments = torch.zeros(num_rows + 1, dtype=torch.int64)
        torch.cumsum(torch.bincount(inverse, minlength=num_rows), 0, out=segments[1:])
        weights = None
        if ctx.mean:  # each id of a bag of length L carries 1 / L of the bag's gradient
            weights = lengths.clamp(min=1).to(grad_out.dtype).reciprocal().index_select(0, sources)
        grad = F.embedding_bag(sources, bags, segments, mode="sum", per_sample_weights=weights,
                               include_last_offset=True)
        return grad, None, None, None, None, None
