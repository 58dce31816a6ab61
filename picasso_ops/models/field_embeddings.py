"""The models' embedding modules: one ``nn.EmbeddingBag`` per field (the plain baseline) or one table per
field in a packed, data-parallel or row-sharded collection, and :class:`SparseArgs`, how packed tables are
stored, updated and spread over ranks.

Both modules map the field-major batch ``(values, lengths [F, B])`` to ``[B, F, dim]``, so every model
takes either.

Example::

    >>> emb = PackedFieldEmbeddings([50] * 4, 8, "sum", SparseArgs(), 0.01, "emb")
    >>> emb(torch.arange(8) % 50, torch.ones(4, 2, dtype=torch.long)).shape
    torch.Size([2, 4, 8])
"""
from __future__ import annotations

import dataclasses
from typing import Any, Literal, Mapping, Optional

import torch
from torch import nn

from picasso_ops.distributed.data_parallel import DataParallelEmbeddingCollection
from picasso_ops.distributed.row_sharded import RowShardedEmbeddingCollection
from picasso_ops.embedding.spec import TableSpec
from picasso_ops.jagged import JaggedBatch

Sharding = Literal["data_parallel", "row_wise"]
__all__ = ["FieldEmbeddings", "PackedFieldEmbeddings", "SparseArgs", "Sharding"]


class FieldEmbeddings(nn.Module):
    """One EmbeddingBag per field; ``forward`` returns pooled rows ``[B, F, dim]`` (a ``FieldEmbeddingLookup``).

    Example::

        >>> FieldEmbeddings([10, 20], 4, "sum", 0.01)(torch.tensor([1, 2, 3]), torch.tensor([[1, 1], [1, 0]])).shape
        torch.Size([2, 2, 4])
    """

    def __init__(self, vocab_sizes: list[int], dim: int, pooling: str, init_std: float):
        super().__init__()
        self.bags = nn.ModuleList(nn.EmbeddingBag(v, dim, mode=pooling) for v in vocab_sizes)
        for bag in self.bags:
            nn.init.normal_(bag.weight, std=init_std)

    def forward(self, values: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        num_fields, batch = lengths.shape
        flat = lengths.reshape(-1)
        starts = torch.zeros(flat.numel() + 1, dtype=torch.long, device=flat.device)
        torch.cumsum(flat, 0, out=starts[1:])
        pooled = []
        for f, bag in enumerate(self.bags):
            lo = starts[f * batch]
            offsets = starts[f * batch:(f + 1) * batch] - lo
            hi = starts[(f + 1) * batch]
            pooled.append(bag(values[lo:hi], offsets))
        return torch.stack(pooled, dim=1)


@dataclasses.dataclass(frozen=True)
class SparseArgs:
    """How a packed model's tables are stored, updated and spread over ranks.

    Attributes:
        optimizer: the sparse optimizer fused into the tables' update (``sgd``,
            ``rowwise_adagrad``, ``adam``).
        optimizer_params: its hyperparameters (``lr``, ``eps``, ``beta1``, ``beta2``).
        packing: pack compatible tables into one buffer and one lookup.
        sharding: ``"data_parallel"`` (every rank holds every row; global sparse
            gradient applied on each) or ``"row_wise"`` (row ``i`` lives on rank
            ``i % world_size``; lookups are all-to-alls, so every rank must run
            the same forwards, eval included).
        process_group: the group tables are replicated or sharded over (default: world).

    Example::

        >>> SparseArgs(optimizer="adam", optimizer_params={"lr": 0.01}).sharding
        'data_parallel'
    """

    optimizer: str = "rowwise_adagrad"
    optimizer_params: Mapping[str, float] = dataclasses.field(default_factory=lambda: {"lr": 0.05})
    packing: bool = True
    sharding: Sharding = "data_parallel"
    process_group: Optional[Any] = None

    @classmethod
    def from_block(cls, block: Any) -> "SparseArgs":
        """The settings of a validated ``picasso`` block; only the hyperparameters its optimizer takes.

        Example::

            >>> from picasso_ops.config import PicassoConfig
            >>> SparseArgs.from_block(PicassoConfig.model_validate({"optimizer": {"type": "sgd"}})).optimizer_params
            {'lr': 0.05}
        """
        from picasso_ops.embedding.sparse_optim import OPTIMIZERS

        opt = block.optimizer
        params = {k: float(getattr(opt, k)) for k in OPTIMIZERS[opt.type].defaults}
        placement = block.table_placement  # "auto": the planner places each table itself (data-parallel otherwise)
        return cls(optimizer=opt.type, optimizer_params=params, packing=block.packing,
                   sharding="data_parallel" if placement == "auto" else placement)


class PackedFieldEmbeddings(nn.Module):
    """One table per field in a packed (data-parallel or row-sharded) collection; ``forward`` gives ``[B, F, dim]``.

    A drop-in for :class:`FieldEmbeddings` (same ``forward(values, lengths)``
    on the field-major batch). Field ``f`` is table ``{prefix}{f}``.

    Args:
        vocab_sizes: rows per field.
        dim: embedding dim.
        pooling: ``"sum"`` or ``"mean"``.
        sparse: storage, optimizer and sharding.
        init_std: ``None`` keeps the collection's uniform init; ``0.0`` zeros
            (a wide part); otherwise normal with this std (the plain model's init).
        prefix: table name prefix (state_dict keys ``{prefix}{f}.weight``).

    Example::

        >>> emb = PackedFieldEmbeddings([10, 20], dim=4, pooling="mean", sparse=SparseArgs())
        >>> emb(torch.tensor([1, 2, 3]), torch.tensor([[1, 1], [1, 0]])).shape
        torch.Size([2, 2, 4])
    """

    def __init__(
        self,
        vocab_sizes: list[int],
        dim: int,
        pooling: str,
        sparse: SparseArgs,
        init_std: Optional[float] = None,
        prefix: str = "field",
    ) -> None:
        super().__init__()
        self.keys = tuple(f"f{i}" for i in range(len(vocab_sizes)))
        self.dim = dim
        specs = [
            TableSpec(f"{prefix}{i}", int(v), dim, pooling, sparse.optimizer, dict(sparse.optimizer_params),
                      feature_names=(key,))
            for i, (v, key) in enumerate(zip(vocab_sizes, self.keys))
        ]
        self.collection: nn.Module
        if sparse.sharding == "data_parallel":
            self.collection = DataParallelEmbeddingCollection(specs, packing=sparse.packing,
                                                              process_group=sparse.process_group)
        elif sparse.sharding == "row_wise":
            self.collection = RowShardedEmbeddingCollection(specs, packing=sparse.packing,
                                                            process_group=sparse.process_group)
        else:
            raise ValueError(f"sharding must be 'data_parallel' or 'row_wise', got {sparse.sharding!r}")
        if init_std is not None:
            self._init(specs, init_std)

    @torch.no_grad()
    def _init(self, specs: list[TableSpec], std: float) -> None:
        coll = self.collection
        for spec in specs:
            w = coll.table_weight(spec.name)  # row-sharded: this rank's rows only
            if std == 0.0:
                w.zero_()
            else:
                w.normal_(std=std)
        if isinstance(coll, DataParallelEmbeddingCollection):
            coll.broadcast_tables()  # ranks' RNG streams may differ: rank 0's init wins

    def forward(self, values: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        batch = JaggedBatch(self.keys, values, lengths, validate=False)
        out = self.collection(batch).values  # [B, F * dim], fields in order
        return out.view(out.shape[0], len(self.keys), self.dim)
