"""A wide-and-deep CTR model with an FM pairwise term, over one ``nn.EmbeddingBag`` per field.

    >>> model = WideAndDeep(WideAndDeepArgs(vocab_sizes=[1000] * 26, num_dense=13))
    >>> logits = model(batch.dense, batch.values, batch.lengths)   # [B]

The per-field embeddings are the plain baseline (what torchrec's unsharded
EmbeddingBagCollection does); picasso_ops' packed collection replaces them:

    >>> model = packed_wide_and_deep(WideAndDeepArgs(vocab_sizes=[1000] * 26, num_dense=13),
    ...                              SparseArgs(optimizer="rowwise_adagrad", sharding="data_parallel"))
    >>> loss_fn(model(batch.dense, batch.values, batch.lengths), batch.labels).backward()
    >>> sparse_step(model)   # picasso_ops.distributed: the tables' one optimizer step (every rank)

The packed variant's tables take their step in ``sparse_step`` (see
``picasso_ops.distributed.step`` for the contract with DeepSpeed's engine);
the dense layers are ordinary parameters for DeepSpeed's optimizer.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable, Literal, Mapping, Optional

import torch
from torch import nn

from picasso_ops.contracts import FieldEmbeddingLookup, StageableModel
from picasso_ops.distributed.data_parallel import DataParallelEmbeddingCollection
from picasso_ops.distributed.row_sharded import RowShardedEmbeddingCollection
from picasso_ops.embedding.spec import TableSpec
from picasso_ops.jagged import JaggedBatch
from picasso_ops.models.layers import TowerFactory, fm_interaction, mlp_tower
from picasso_ops.models.stages import WideAndDeepStages

logger = logging.getLogger(__name__)

Sharding = Literal["data_parallel", "row_wise"]
__all__ = ["FieldEmbeddings", "PackedFieldEmbeddings", "SparseArgs", "TowerFactory", "WideAndDeep", "WideAndDeepArgs",
           "mlp_tower", "packed_wide_and_deep"]  # TowerFactory, mlp_tower: from .layers, named here as before


@dataclasses.dataclass(frozen=True)
class WideAndDeepArgs:
    vocab_sizes: list[int]
    num_dense: int
    embedding_dim: int = 16
    hidden: tuple[int, ...] = (256, 128)
    pooling: str = "mean"  # of a multi-hot field's rows
    fm: bool = True  # the factorisation-machine pairwise term over field embeddings
    dropout: float = 0.0  # after each hidden ReLU of the deep MLP (training only)


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


class WideAndDeep(nn.Module, StageableModel):
    """logit = wide (per-id weights + linear dense) + FM pairwise term + MLP(embeddings, dense).

    ``embeddings`` (``[B, F, embedding_dim]``) and ``wide`` (``[B, F, 1]``) are any
    :class:`~picasso_ops.contracts.FieldEmbeddingLookup` (default :class:`FieldEmbeddings`).
    ``deep_tower`` (a :data:`TowerFactory`) builds the deep MLP from its input width
    ``F * embedding_dim + num_dense``, e.g. one with MoE layers; by default it is
    ``args.hidden``'s ReLU MLP (``mlp.0.weight``, ...), the same module with or without the argument.

    Example::

        >>> WideAndDeep(WideAndDeepArgs([5, 5], 2))(torch.zeros(3, 2), torch.arange(6) % 5, torch.ones(2, 3, dtype=torch.long)).shape
        torch.Size([3])
        >>> WideAndDeep(WideAndDeepArgs([5, 5], 2), deep_tower=lambda width: nn.Linear(width, 1)).mlp
        Linear(in_features=34, out_features=1, bias=True)
    """

    def __init__(self, args: WideAndDeepArgs, embeddings: FieldEmbeddingLookup | None = None,
                 wide: FieldEmbeddingLookup | None = None, deep_tower: TowerFactory | None = None):
        super().__init__()
        self.args = args
        num_fields = len(args.vocab_sizes)
        self.embeddings = embeddings or FieldEmbeddings(args.vocab_sizes, args.embedding_dim, args.pooling, 0.01)
        self.wide = wide or FieldEmbeddings(args.vocab_sizes, 1, args.pooling, 0.0)
        self.wide_dense = nn.Linear(args.num_dense, 1)
        width = num_fields * args.embedding_dim + args.num_dense
        # built where the default MLP is, so the RNG draws of everything before it are the same either way
        self.mlp = deep_tower(width) if deep_tower is not None else mlp_tower(width, args.hidden,
                                                                               dropout=args.dropout)

    def forward(self, dense: torch.Tensor, values: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        emb = self.embeddings(values, lengths)  # [B, F, D]
        logit = self.wide(values, lengths).sum(dim=(1, 2)) + self.wide_dense(dense).squeeze(-1)
        if self.args.fm:
            logit = logit + fm_interaction(emb)
        deep_in = torch.cat([emb.flatten(1), dense], dim=1)
        return logit + self.mlp(deep_in).squeeze(-1)

    def pipeline_stages(self) -> WideAndDeepStages:
        """This model cut at its two embedding modules, for ``picasso_ops.interleave`` (same math as :meth:`forward`)."""
        return WideAndDeepStages(self)


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
        return cls(optimizer=opt.type, optimizer_params=params, packing=block.packing, sharding=block.sharding)


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


def packed_wide_and_deep(args: WideAndDeepArgs, sparse: SparseArgs,
                         field_embeddings: Optional[Callable[..., FieldEmbeddingLookup]] = None,
                         deep_tower: TowerFactory | None = None) -> WideAndDeep:
    """:class:`WideAndDeep` whose deep and wide embeddings are packed collections.

    Deep tables start like the plain model's (normal, std 0.01) and wide ones at
    zero; both collections use ``sparse``'s optimizer and sharding.
    ``field_embeddings(vocab_sizes, dim, pooling, sparse, init_std, prefix)``
    builds each of the two (default :class:`PackedFieldEmbeddings`; the picasso
    block passes one that builds straight into a hot-row cache's store).
    ``deep_tower``: the deep MLP's factory, as in :class:`WideAndDeep`.

    Example::

        >>> model = packed_wide_and_deep(WideAndDeepArgs(vocab_sizes=[50] * 4, num_dense=3), SparseArgs())
        >>> sum(p.numel() for p in model.parameters()) > 0  # only the dense layers are parameters
        True
    """
    make = field_embeddings or PackedFieldEmbeddings
    embeddings = make(args.vocab_sizes, args.embedding_dim, args.pooling, sparse, 0.01, "emb")
    wide = make(args.vocab_sizes, 1, args.pooling, sparse, 0.0, "wide")
    return WideAndDeep(args, embeddings=embeddings, wide=wide, deep_tower=deep_tower)
