"""Row-wise sharded packed tables: id ``i`` of every table lives on rank ``i % world_size``, row ``i // world_size``.

Each rank keeps one shard of every table, packed like the full tables would
be (one buffer per pack, the fused optimizer of that pack). A lookup is
grouped per pack, as HybridBackend's grouped all-to-all does (one exchange per
pack, not one per table: the "too many alltoall ops" pain point):

forward, per pack
    1. ids of the pack's fields -> (owner = id % W, owner-local buffer row);
       deduplicated per destination with one ``torch.unique`` over
       ``owner * R + row`` (sorted, so the send buffer is already grouped by
       destination and ``bincount`` gives the split sizes);
    2. ``all_to_all_single`` of the unique rows' ids (the split sizes of every
       pack travel first, in one all-to-all for all packs);
    3. the owner gathers those rows from its shard and sends them back
       (``all_to_all_single`` with the splits reversed);
    4. the requesting rank pools locally: one ``embedding_bag`` over the
       received unique rows (indices = the inverse of the unique), with its
       own per-sample weights and mean scaling, into ``[B, sum D]``.

We return rows and pool locally rather than pooling remotely because (a) the
bytes scale with *unique* ids per destination, which under Zipf-skewed ids is
far fewer than the ``B x fields`` partial bags remote pooling must send back
(and must send from every owner, W times the bags); (b) the backward then
needs exactly one row gradient per unique id, which the local pooling's
autograd produces already summed; and (c) the owner never sees bag
structure, per-sample weights or mean pooling, so pooling options stay a
local concern. This is HybridBackend's flow (ids alltoallv, unique, gather,
embeddings alltoallv, stitch).

backward
    autograd through the local pooling yields ``[unique, D]`` row gradients;
    they are stored, and :meth:`sparse_step` sends them to the owners
    (``all_to_all_single`` with the forward's splits), which sum them per row
    over all source ranks and micro-batches, scale by
    ``grad_scale / world_size`` (each rank's loss is a mean over its local
    batch, so this is the gradient of the mean loss over the global batch) and
    apply the pack's fused optimizer once. Deferring the exchange to the step
    keeps collectives out of autograd's backward order and makes gradient
    accumulation one optimizer step.

Every rank must run the same sequence of forwards (training and eval) and
``sparse_step`` calls: lookups are collectives.

Example::

    >>> from picasso_ops.embedding import TableSpec
    >>> from picasso_ops.distributed import RowShardedEmbeddingCollection
    >>> emb = RowShardedEmbeddingCollection([TableSpec("user", 10**6, 16, optimizer="rowwise_adagrad")])
    >>> out = emb(batch)                 # two all-to-alls per pack
    >>> loss_fn(out.values).backward()   # stores the unique rows' gradients
    >>> emb.sparse_step()                # gradients to their owners, one optimizer step there
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Sequence, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd.function import once_differentiable

from picasso_ops.contracts import SparseStepModule
from picasso_ops.distributed.comm import (
    ProcessGroup,
    all_gather_varsize,
    all_to_all_varsize,
    coalesce_rows,
    world_info,
)
from picasso_ops.distributed.data_parallel import apply_rows, apply_to_packed
from picasso_ops.embedding.packed import KeyedEmbeddings, PackedEmbeddingCollection
from picasso_ops.embedding.spec import TableSpec
from picasso_ops.jagged import JaggedBatch

__all__ = ["RowShardedEmbeddingCollection", "PreparedLookup", "shard_rows"]

logger = logging.getLogger(__name__)


def shard_rows(num_embeddings: int, rank: int, world_size: int) -> int:
    """Rows of a table held by ``rank``: ids ``i < num_embeddings`` with ``i % world_size == rank``.

    Example::

        >>> [shard_rows(10, r, 4) for r in range(4)]
        [3, 3, 2, 2]
    """
    return max(0, (num_embeddings - rank + world_size - 1) // world_size)


@dataclass
class _PackPlan:
    """One pack's exchange for one batch (kept until the sparse step)."""

    send_counts: list[int]  # unique ids sent to each owner
    recv_counts: list[int]  # ids received from each requester
    send_rows: Tensor  # [U] owner-local buffer rows, grouped by owner
    recv_rows: Optional[Tensor] = None  # [R] rows of this rank's shard that were requested
    rows: Optional[Tensor] = None  # [U, D] the rows, fetched ahead by a pipeline (taken by the forward)


@dataclass
class PreparedLookup:
    """One batch's exchange done ahead of its forward (a sparse-dist pipeline): per pack, its ids and rows.

    Built by :meth:`RowShardedEmbeddingCollection.prepare_ids` (ids deduplicated and sent to their owners)
    and completed by :meth:`RowShardedEmbeddingCollection.fetch_prepared` (the rows sent back), both on a
    process group of their own; :meth:`RowShardedEmbeddingCollection.arm` hands it to the next forward.
    """

    subs: list[JaggedBatch]  # per pack: the pack's fields of the batch
    plans: list[_PackPlan]
    inverses: list[Tensor]  # per pack: each id's slot among the unique rows


@dataclass
class _PackLayout:
    """Static per-pack constants."""

    features: tuple[str, ...]  # in the shard kernel's feature order
    feature_table: Tensor  # [F_p] table index (within the pack) of each feature
    feature_rows: Tensor  # [F_p] global table size of each feature
    feature_mean: Tensor  # [F_p] bool, mean pooling
    owner_offsets: Tensor  # [W, T_p] first buffer row of table t in owner o's shard pack
    key_stride: int  # > any owner's buffer rows: key = owner * stride + row
    dim: int


class RowShardedEmbeddingCollection(nn.Module, SparseStepModule):
    """Packed tables sharded row-wise (``id % world_size``) over a process group.

    Args:
        specs: the tables; pooled (``sum``/``mean``) tables only.
        packing: pack compatible tables (one exchange per pack).
        process_group: the group the rows are sharded over (default: the world).
        device: where the shard lives.

    Attributes:
        shard: this rank's :class:`PackedEmbeddingCollection` of shard tables
            (table ``t``'s local row ``j`` is global id ``j * world_size + rank``);
            its ``state_dict`` is this rank's shard.

    Tables are initialised uniform in ``±sqrt(1 / num_embeddings)`` of the full
    table, with a per-rank stream so shards differ. Use
    :meth:`load_full_state_dict` to load weights of an unsharded collection and
    :meth:`full_state_dict` (a collective) to gather them back.

    Example::

        >>> emb = RowShardedEmbeddingCollection([TableSpec("a", 10, 4), TableSpec("b", 7, 4, pooling="mean")])
        >>> emb.shard.table_weight("a").shape  # one rank: the whole table
        torch.Size([10, 4])
    """

    def __init__(
        self,
        specs: Sequence[TableSpec],
        *,
        packing: bool = True,
        process_group: Optional[ProcessGroup] = None,
        device: Optional[Union[torch.device, str]] = None,
    ) -> None:
        super().__init__()
        self.specs: tuple[TableSpec, ...] = tuple(specs)
        sequence = [s.name for s in self.specs if s.pooling == "none"]
        if sequence:
            raise ValueError(
                f"row-sharded tables must be pooled (sum/mean); sequence tables {sequence} are not supported"
            )
        self.process_group = process_group
        self.rank, self.world_size = world_info(process_group)
        device = torch.device(device) if device is not None else torch.device("cpu")
        W = self.world_size
        # a table smaller than the world leaves some ranks no rows; they keep one unused row (TableSpec needs >= 1)
        shard_specs = [
            dataclasses.replace(s, num_embeddings=max(1, shard_rows(s.num_embeddings, self.rank, W)))
            for s in self.specs
        ]
        # rank-local by design: each rank's shard holds other rows; sparse_step exchanges their gradients
        self.shard = PackedEmbeddingCollection(shard_specs, packing=packing, mode="fused", device=device,
                                               rank_local=True)
        self.pooled_features: tuple[str, ...] = self.shard.pooled_features
        self.column_offsets = self.shard.column_offsets
        global_rows = {s.name: s.num_embeddings for s in self.specs}
        self._layouts: list[_PackLayout] = []
        for kernel in self.shard.kernels:
            group = kernel.group
            if not group.sub_rows_uniform:
                raise ValueError("row-sharded tables need same-dim packs (across_dims packing is not supported)")
            table_index = {p.spec.name: i for i, p in enumerate(group.tables)}
            sizes = torch.tensor(
                [[max(1, shard_rows(global_rows[p.spec.name], o, W)) for p in group.tables] for o in range(W)],
                dtype=torch.int64,
            )
            offsets = torch.cumsum(sizes, 1) - sizes
            tables = [p for _, p in kernel.features]
            self._layouts.append(
                _PackLayout(
                    features=tuple(name for name, _ in kernel.features),
                    feature_table=torch.tensor([table_index[p.spec.name] for p in tables], device=device),
                    feature_rows=torch.tensor([global_rows[p.spec.name] for p in tables], device=device),
                    feature_mean=torch.tensor([p.spec.pooling == "mean" for p in tables], device=device),
                    owner_offsets=offsets.to(device),
                    key_stride=int(sizes.sum(1).max()) + 1,
                    dim=group.width,
                )
            )
        # the output's columns: the packs' features side by side, gathered into pooled_features order
        start, where = 0, {}
        for layout in self._layouts:
            for name in layout.features:
                where[name] = (start, start + layout.dim)
                start += layout.dim
        perm = [c for name in self.pooled_features for c in range(*where[name])]
        self._columns: Optional[Tensor] = (None if perm == list(range(len(perm)))
                                           else torch.tensor(perm, dtype=torch.long, device=device))
        self._pending: list[list[tuple[_PackPlan, Tensor]]] = [[] for _ in self.shard.kernels]
        self._armed: Optional[PreparedLookup] = None  # taken by the next training forward
        self.reset_parameters()

    # ------------------------------------------------------------ parameters
    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Uniform ``±sqrt(1 / global rows)`` per table from a per-rank stream; optimizer state zeroed."""
        self.shard.reset_parameters()
        # one draw from the (rank-identical) global RNG, offset by rank, so shards are independent
        seed = int(torch.randint(0, 2**62, ())) + self.rank
        gen = torch.Generator().manual_seed(seed)
        for spec in self.specs:
            w = self.shard.table_weight(spec.name)
            bound = (1.0 / spec.num_embeddings) ** 0.5
            w.copy_(torch.empty(w.shape, dtype=w.dtype).uniform_(-bound, bound, generator=gen))
        self.discard_pending()

    def _apply(self, fn: Callable[[Tensor], Tensor], recurse: bool = True) -> "RowShardedEmbeddingCollection":
        apply_to_packed(self.shard, fn)  # tables keep their dtype and fp32 optimizer state
        return self

    def table_weight(self, table: str) -> Tensor:
        """This rank's shard of a table, ``[shard rows, D]`` (a view; local row ``j`` is id ``j * world_size + rank``).

        Example::

            >>> RowShardedEmbeddingCollection([TableSpec("a", 10, 4)]).table_weight("a").shape  # one rank
            torch.Size([10, 4])
        """
        return self.shard.table_weight(table)

    @property
    def lr(self) -> float:
        """The learning rate of every pack (see ``PackedEmbeddingCollection.lr``)."""
        return self.shard.lr

    @lr.setter
    def lr(self, value: float) -> None:
        self.shard.lr = value

    # --------------------------------------------------------------- forward
    def forward(self, batch: JaggedBatch) -> KeyedEmbeddings:
        """Pooled embeddings ``[B, sum D]`` of this rank's batch (a collective: every rank calls it).

        Example::

            >>> out = emb(JaggedBatch(["a", "b"], torch.tensor([1, 2, 3]), torch.tensor([[1, 1], [1, 0]])))
            >>> out.values.shape
            torch.Size([2, 8])
        """
        B = batch.batch_size
        training = torch.is_grad_enabled()
        armed = self._armed if training else None  # an evaluation's forward leaves a training batch's lookup armed
        if training:
            self._armed = None
        if armed is not None:  # ids (and rows) exchanged ahead by a pipeline: check it is this batch
            subs, plans, inverses = armed.subs, armed.plans, armed.inverses
            for layout, prepared in zip(self._layouts, subs):
                sub = batch.select(layout.features)
                same_weights = (sub.weights is None and prepared.weights is None) or (
                    sub.weights is not None and prepared.weights is not None
                    and torch.equal(sub.weights, prepared.weights))
                if not (same_weights and torch.equal(sub.lengths, prepared.lengths)
                        and torch.equal(sub.values, prepared.values)):
                    raise RuntimeError(f"rank {self.rank}: the lookup prepared ahead is of another batch than the "
                                       "forward's (a pipeline out of step with the training loop)")
        else:
            subs, plans, inverses = self._plan_batch(batch, self.process_group)
        anchor = torch.empty(0, requires_grad=True) if training else None
        blocks: list[Tensor] = []
        for pi, (layout, sub, plan, inverse) in enumerate(zip(self._layouts, subs, plans, inverses)):
            if training:
                rows = _RemoteRows.apply(anchor, self, pi, plan)
            else:
                rows = self._fetch(pi, plan)
            pooled = F.embedding_bag(
                inverse, rows, sub.offsets, mode="sum", per_sample_weights=_weights(sub, rows.dtype),
                include_last_offset=True,
            )
            if bool(layout.feature_mean.any()):
                inv_len = sub.lengths.reshape(-1).to(rows.dtype).clamp(min=1.0).reciprocal()
                scale = torch.where(layout.feature_mean.repeat_interleave(B), inv_len, torch.ones_like(inv_len))
                pooled = pooled * scale.unsqueeze(1)
            # [F_p * B, D] field-major -> [B, F_p * D]: one copy, whose backward is one copy too (slicing out
            # each feature would make autograd add F_p full-size gradients: quadratic in the pack's fields)
            blocks.append(pooled.view(len(layout.features), B, layout.dim).transpose(0, 1).reshape(B, -1))
        if not blocks:
            return KeyedEmbeddings(self.pooled_features, torch.empty(B, 0), self.column_offsets, {})
        values = blocks[0] if len(blocks) == 1 else torch.cat(blocks, dim=1)
        if self._columns is not None:  # packs' features -> pooled_features order
            values = values.index_select(1, self._columns.to(values.device))
        return KeyedEmbeddings(self.pooled_features, values, self.column_offsets, {})

    def _plan_batch(self, batch: JaggedBatch,
                    group: Optional[ProcessGroup]) -> tuple[list[JaggedBatch], list[_PackPlan], list[Tensor]]:
        """Every pack's dedup per owner and the exchange of the counts over ``group`` (each plan's ``recv_counts``)."""
        planned = self.plan_ids(batch)
        self._exchange_counts(planned.plans, batch.values.device, group)
        return planned.subs, planned.plans, planned.inverses

    def plan_ids(self, batch: JaggedBatch) -> PreparedLookup:
        """Every pack's ids deduplicated per owner (local, no collective); an id out of range is an ``IndexError``."""
        subs, plans, inverses = [], [], []
        for layout in self._layouts:
            sub = batch.select(layout.features)
            plan, inverse = self._plan(layout, sub)
            subs.append(sub)
            plans.append(plan)
            inverses.append(inverse)
        return PreparedLookup(subs, plans, inverses)

    def _exchange_counts(self, plans: list[_PackPlan], device: torch.device, group: Optional[ProcessGroup]) -> None:
        W = self.world_size
        send = torch.tensor([p.send_counts for p in plans], dtype=torch.int64, device=device).view(-1, W)  # [P, W]
        recv = all_to_all_varsize(send.t().contiguous(), [1] * W, [1] * W, group).t() if W > 1 else send
        for plan, counts in zip(plans, recv.tolist()):  # one host read for every pack
            plan.recv_counts = counts

    # ---------------------------------------------------------- pipelining
    @torch.no_grad()
    def prepare_ids(self, batch: JaggedBatch, group: Optional[ProcessGroup]) -> PreparedLookup:
        """A batch's ids deduplicated per owner and sent to the owners over ``group``, ahead of its forward.

        A collective over ``group`` (every rank, the same batches in the same order); reads no rows, so
        it may run while another batch trains. :meth:`fetch_prepared` then fetches the rows, once the
        tables are as the forward will see them.

        Example::

            >>> prepared = emb.prepare_ids(next_batch, pipeline_group)   # while this batch trains
            >>> emb.fetch_prepared(prepared, pipeline_group)              # after this batch's sparse step
            >>> emb.arm(prepared); out = emb(next_batch)                  # no exchange in the forward
        """
        return self.exchange_ids(self.plan_ids(batch), group)

    @torch.no_grad()
    def exchange_ids(self, planned: PreparedLookup, group: Optional[ProcessGroup]) -> PreparedLookup:
        """The collective half of :meth:`prepare_ids`: counts and ids of :meth:`plan_ids`' result to the owners."""
        device = planned.subs[0].values.device if planned.subs else torch.device("cpu")
        self._exchange_counts(planned.plans, device, group)
        for plan in planned.plans:
            plan.recv_rows = all_to_all_varsize(plan.send_rows, plan.send_counts, plan.recv_counts, group)
        return planned

    @torch.no_grad()
    def fetch_prepared(self, prepared: PreparedLookup, group: Optional[ProcessGroup]) -> None:
        """The owners send the prepared batch's rows back over ``group`` (a collective): the rows as they are now.

        Call it after the last sparse step before the prepared batch's forward: rows fetched earlier
        would miss that step's update.
        """
        for pi, plan in enumerate(prepared.plans):
            assert plan.recv_rows is not None
            local = self.shard.kernels[pi].weight.index_select(0, plan.recv_rows)
            plan.rows = all_to_all_varsize(local, plan.recv_counts, plan.send_counts, group)

    def arm(self, prepared: Optional[PreparedLookup]) -> None:
        """Hand ``prepared`` to the next training forward (which checks that it is of its batch); ``None`` disarms."""
        self._armed = prepared

    def _plan(self, layout: _PackLayout, sub: JaggedBatch) -> tuple[_PackPlan, Tensor]:
        """Owner and owner-local row of each id, deduplicated per owner (sorted by owner); and each id's unique slot."""
        W = self.world_size
        counts = sub.field_offsets[1:] - sub.field_offsets[:-1]
        ids = sub.values.long()
        n = ids.numel()
        if n:
            bound = torch.repeat_interleave(layout.feature_rows, counts, output_size=n)
            bad = (ids < 0) | (ids >= bound)
            if bool(bad.any()):
                i = int(bad.nonzero()[0, 0])
                field = int(torch.searchsorted(torch.cumsum(counts, 0), torch.tensor(i), right=True))
                raise IndexError(
                    f"field {layout.features[field]!r}: id {int(ids[i])} is out of range for a table of "
                    f"{int(layout.feature_rows[field])} rows"
                )
        table = torch.repeat_interleave(layout.feature_table, counts, output_size=n)
        owner = ids % W
        key = owner * layout.key_stride + layout.owner_offsets[owner, table] + ids // W
        uniq, inverse = torch.unique(key, sorted=True, return_inverse=True)
        owners = uniq // layout.key_stride
        send_counts = torch.bincount(owners, minlength=W).tolist()
        plan = _PackPlan(send_counts=send_counts, recv_counts=[], send_rows=uniq - owners * layout.key_stride)
        return plan, inverse

    def _fetch(self, pack: int, plan: _PackPlan) -> Tensor:
        """Ids to owners, rows back: ``[U, D]`` in the order of ``plan.send_rows`` (or the rows fetched ahead)."""
        if plan.rows is not None:
            rows, plan.rows = plan.rows, None
            return rows
        plan.recv_rows = all_to_all_varsize(plan.send_rows, plan.send_counts, plan.recv_counts, self.process_group)
        local = self.shard.kernels[pack].weight.index_select(0, plan.recv_rows)
        return all_to_all_varsize(local, plan.recv_counts, plan.send_counts, self.process_group)

    # ---------------------------------------------------------------- update
    @torch.no_grad()
    def sparse_step(self, grad_scale: float = 1.0) -> None:
        """Send stored row gradients to their owners, which sum them per row and apply one optimizer step.

        Args:
            grad_scale: multiplies the combined gradient (e.g. ``1 / loss_scale``).

        Collective: every rank calls it after the same forwards/backwards.
        """
        scale = grad_scale / self.world_size
        for pi, kernel in enumerate(self.shard.kernels):
            entries, self._pending[pi] = self._pending[pi], []
            if not entries:
                continue
            rows, grads = [], []
            for plan, grad in entries:  # one all-to-all per micro-batch of the accumulation window
                grads.append(all_to_all_varsize(grad, plan.send_counts, plan.recv_counts, self.process_group))
                rows.append(plan.recv_rows)
            row_ids, summed = coalesce_rows(torch.cat(rows), torch.cat(grads))
            apply_rows(kernel, row_ids, summed * scale)

    def step(self) -> None:
        """Same as ``sparse_step()``."""
        self.sparse_step()

    def discard_pending(self) -> None:
        """Drop stored gradients without a step (local, no collective)."""
        self._pending = [[] for _ in self.shard.kernels]

    # ------------------------------------------------------------ full state
    @torch.no_grad()
    def full_state_dict(self) -> dict[str, Tensor]:
        """Every table's full weight and optimizer state, gathered from all shards (a collective).

        Keys are those of an unsharded ``PackedEmbeddingCollection`` (``"<table>.weight"``, ...);
        meant for tests and exports of tables that fit in memory.
        """
        W, out = self.world_size, {}
        for spec in self.specs:
            sizes = [shard_rows(spec.num_embeddings, o, W) for o in range(W)]
            for key, local in self.shard._table_tensors(spec.name).items():
                if local.dim() == 0:  # a step counter: equal on every rank
                    out[f"{spec.name}.{key}"] = local.clone()
                    continue
                mine = local[: sizes[self.rank]].contiguous()
                gathered = all_gather_varsize(mine, sizes, self.process_group)
                full = local.new_empty((spec.num_embeddings,) + tuple(local.shape[1:]))
                start = 0
                for o, n in enumerate(sizes):
                    full[o::W] = gathered[start : start + n]
                    start += n
                out[f"{spec.name}.{key}"] = full
        return out

    @torch.no_grad()
    def load_full_state_dict(self, state: Mapping[str, Tensor]) -> None:
        """Load this rank's rows (``rank::world_size``) of full per-table tensors (local, no collective).

        Example::

            >>> emb.load_full_state_dict(PackedEmbeddingCollection(emb.specs).state_dict())
        """
        for spec in self.specs:
            n = shard_rows(spec.num_embeddings, self.rank, self.world_size)
            for key, local in self.shard._table_tensors(spec.name).items():
                full = state[f"{spec.name}.{key}"]
                if local.dim() == 0:
                    local.copy_(full)
                else:
                    local[:n].copy_(full[self.rank :: self.world_size])
        for kernel in self.shard.kernels:
            kernel.after_load()
        self.discard_pending()


    @torch.no_grad()
    def shard_state(self) -> dict[str, Any]:
        """This rank's rows of every table and their optimizer state, for a checkpoint (local, no collective).

        ``{"rank": r, "world_size": W, "tables": {"<table>.<key>": tensor}}``: the rows ``r::W`` of each
        table (no padding row), step counters as they are. :meth:`load_shard_states` reads every rank's
        back, at this world size or another.

        Example::

            >>> emb = RowShardedEmbeddingCollection([TableSpec("a", 10, 4)])
            >>> emb.shard_state()["tables"]["a.weight"].shape  # one rank: every row
            torch.Size([10, 4])
        """
        tables: dict[str, Tensor] = {}
        for spec in self.specs:
            n = shard_rows(spec.num_embeddings, self.rank, self.world_size)
            for key, local in self.shard._table_tensors(spec.name).items():
                tables[f"{spec.name}.{key}"] = local.clone() if local.dim() == 0 else local[:n].clone()
        return {"rank": self.rank, "world_size": self.world_size, "tables": tables}

    @torch.no_grad()
    def load_shard_states(self, states: Sequence[Mapping[str, Any]]) -> None:
        """Load the shards :meth:`shard_state` wrote on every rank of a run (local, no collective).

        ``states``: one per rank of the saving run, any order. Saved by as many ranks as now, this
        rank's own shard is loaded as it was; saved by another number of ranks, the full tables are
        put together from all shards and this rank takes its rows (``rank::world_size``).

        Example::

            >>> emb.load_shard_states([emb.shard_state()])
        """
        if not states:
            raise ValueError("load_shard_states: no shard states given")
        saved_world = int(states[0]["world_size"])
        by_rank = {int(s["rank"]): s for s in states}
        if sorted(by_rank) != list(range(saved_world)) or any(int(s["world_size"]) != saved_world for s in states):
            raise ValueError(f"load_shard_states: the shards must come from ranks 0..{saved_world - 1} of one run "
                             f"of {saved_world} ranks; got ranks {sorted(by_rank)} of world sizes "
                             f"{sorted({int(s['world_size']) for s in states})}")
        if saved_world == self.world_size:
            mine = by_rank[self.rank]["tables"]
            for spec in self.specs:
                n = shard_rows(spec.num_embeddings, self.rank, self.world_size)
                for key, local in self.shard._table_tensors(spec.name).items():
                    saved = _saved(mine, f"{spec.name}.{key}", self.rank)
                    if local.dim() == 0:
                        local.copy_(saved)
                    else:
                        _check_shape(saved, (n,) + tuple(local.shape[1:]), f"{spec.name}.{key}", self.rank)
                        local[:n].copy_(saved)
            for kernel in self.shard.kernels:
                kernel.after_load()
            self.discard_pending()
            return
        full: dict[str, Tensor] = {}
        for spec in self.specs:  # every table put together from the saved shards: id i is on rank i % saved_world
            for key, local in self.shard._table_tensors(spec.name).items():
                name = f"{spec.name}.{key}"
                if local.dim() == 0:
                    full[name] = _saved(by_rank[0]["tables"], name, 0)
                    continue
                out = local.new_empty((spec.num_embeddings,) + tuple(local.shape[1:]))
                for o in range(saved_world):
                    part = _saved(by_rank[o]["tables"], name, o)
                    _check_shape(part, (shard_rows(spec.num_embeddings, o, saved_world),) + tuple(local.shape[1:]),
                                 name, o)
                    out[o::saved_world] = part
                full[name] = out
        self.load_full_state_dict(full)


def _saved(tables: Mapping[str, Tensor], key: str, rank: int) -> Tensor:
    if key not in tables:
        raise KeyError(f"the saved shard of rank {rank} has no {key!r} (it has {sorted(tables)[:6]}...): "
                       "saved by other tables")
    return tables[key]


def _check_shape(saved: Tensor, want: tuple[int, ...], key: str, rank: int) -> None:
    if tuple(saved.shape) != want:
        raise ValueError(f"the saved shard of rank {rank}: {key!r} has shape {tuple(saved.shape)}, "
                         f"this table's shard needs {want}")


def _weights(sub: JaggedBatch, dtype: torch.dtype) -> Optional[Tensor]:
    return None if sub.weights is None else sub.weights.to(dtype)


class _RemoteRows(torch.autograd.Function):
    """The exchange of one pack's unique rows; backward stores their gradients for the sparse step."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, anchor: Tensor, owner: RowShardedEmbeddingCollection, pack: int, plan: _PackPlan
    ) -> Tensor:
        ctx.owner, ctx.pack, ctx.plan = owner, pack, plan
        return owner._fetch(pack, plan)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: Tensor) -> tuple[None, None, None, None]:  # type: ignore[override]
        if ctx.plan is None:
            raise RuntimeError("backward ran twice through a row-sharded lookup; that would apply the update twice")
        ctx.owner._pending[ctx.pack].append((ctx.plan, grad.contiguous()))
        ctx.plan = None
        return None, None, None, None
