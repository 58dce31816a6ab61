"""Embedding tables whose rows live on the parameter servers, in every mode (sync, gba, auto).

A :class:`ServerEmbeddingBagCollection` holds no parameters: DeepSpeed and the dense vector
never see its tables. Its forward asks the engine it is bound to for the rows of the
batch's unique ids (one pull for all tables), pools them like ``nn.EmbeddingBag`` and keeps
the pulled rows as leaf tensors; the engine pushes their gradients at the step boundary.
The servers aggregate the rows' gradients per id over the global batch and apply the
config's optimizer lazily (only rows present in the batch), once per global batch in sync
mode and with GBA's token control in gba mode. Tables therefore never move on a mode
switch: only the dense part is handed over.

Example::

    tables = [ServerTableSpec("user", 1_000_000, 16), ServerTableSpec("item", 200_000, 16)]
    emb = ServerEmbeddingBagCollection(tables, mode="sum")
    model = nn.ModuleDict({"emb": emb, "mlp": mlp})        # any model that contains it
    engine = gba_engine.initialize(model=model, config="ds_configs/gba_cpu.json")
    pooled = emb({"user": user_ids, "item": item_ids}, {"user": user_offsets, "item": item_offsets})
    # pooled["user"]: [B, 16]
"""
from __future__ import annotations

from typing import Mapping, Protocol, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .ps.sharding import ServerTableSpec

_MODES = ("sum", "mean", "max")


class ServerRowClient(Protocol):
    """What a bound collection needs from its engine: the servers' rows and where their gradients go.

    ``GBAEngine`` implements it (not picasso_ops' ``RowStore``, a worker-side store of rows).
    """

    def fetch_rows(self, ids: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """Current rows of unique ``ids`` per table, ``[len(ids), dim]``, detached."""

    def record_rows(self, table: str, ids: Tensor, rows: Tensor) -> None:
        """Remember a pulled leaf whose ``.grad`` the engine pushes at the step boundary."""


class ServerEmbeddingBagCollection(nn.Module):
    """Pooled lookups into parameter-server tables (bind it by passing the model to ``gba_engine.initialize``).

    Example::

        emb = ServerEmbeddingBagCollection([ServerTableSpec("user", 10_000, 8)])
        out = emb({"user": torch.tensor([1, 5, 5])}, {"user": torch.tensor([0, 2])})    # {"user": [2, 8]}
    """

    def __init__(self, tables: Sequence[ServerTableSpec], mode: str = "sum") -> None:
        super().__init__()
        names = [t.name for t in tables]
        if not names:
            raise ValueError("ServerEmbeddingBagCollection needs at least one table")
        if len(set(names)) != len(names):
            raise ValueError(f"table names must be unique, got {names}")
        if mode not in _MODES:
            raise ValueError(f"pooling mode must be one of {_MODES}, got {mode!r}")
        self.tables = tuple(tables)
        self.mode = mode
        self._dims = {t.name: t.dim for t in tables}
        self._source: ServerRowClient | None = None

    def bind(self, source: ServerRowClient) -> None:
        """Attach the engine that serves the rows (``gba_engine.initialize`` does this)."""
        self._source = source

    def forward(self, ids: Mapping[str, Tensor], offsets: Mapping[str, Tensor],
                per_sample_weights: Mapping[str, Tensor] | None = None) -> dict[str, Tensor]:
        """Pooled ``[bags, dim]`` per table; ``ids``/``offsets`` per table as for ``nn.EmbeddingBag`` (1-D + offsets)."""
        if set(ids) != set(offsets):
            raise KeyError(f"ids {sorted(ids)} / offsets {sorted(offsets)} must name the same tables among "
                           f"{sorted(self._dims)}")
        pulled = self.pull(ids)
        out = {}
        for name, (inverse, weight) in pulled.items():
            psw = None if per_sample_weights is None else per_sample_weights.get(name)
            out[name] = F.embedding_bag(inverse, weight, offsets[name], mode=self.mode, per_sample_weights=psw)
        return out

    def pull(self, ids: Mapping[str, Tensor]) -> dict[str, tuple[Tensor, Tensor]]:
        """Per table ``(inverse, rows)``: ``rows[inverse]`` are the rows of ``ids``, pulled once per unique id.

        One request to the engine for every table; in training the rows are leaves whose
        gradients the engine pushes at the step boundary (any lookup over them may be used).

        Example::

            inverse, rows = emb.pull({"user": torch.tensor([5, 1, 5])})["user"]     # inverse [1, 0, 1], rows [2, D]
        """
        if self._source is None:
            raise RuntimeError("ServerEmbeddingBagCollection is not bound to a parameter server: pass the model that "
                               "contains it to gba_engine.initialize(model=...) before calling it")
        unknown = set(ids) - set(self._dims)
        if unknown:
            raise KeyError(f"ids name tables {sorted(unknown)} not among {sorted(self._dims)}")
        unique, inverse = {}, {}
        for name, t in ids.items():
            if t.dim() != 1:
                raise ValueError(f"table {name!r}: ids must be 1-D with offsets, got shape {tuple(t.shape)}")
            unique[name], inverse[name] = torch.unique(t, return_inverse=True)
        rows = self._source.fetch_rows(unique)
        record = torch.is_grad_enabled() and self.training
        out = {}
        for name in ids:
            weight = rows[name]
            if record:
                weight = weight.detach().requires_grad_(True)
                self._source.record_rows(name, unique[name], weight)
            out[name] = (inverse[name], weight)
        return out

    def extra_repr(self) -> str:
        return f"tables={[(t.name, t.num_rows, t.dim) for t in self.tables]}, mode={self.mode!r}"


class ServerFieldEmbeddings(nn.Module):
    """One server table per field of a field-major multi-hot batch; ``forward(values, lengths)`` gives ``[B, F, dim]``.

    A drop-in for picasso_ops' ``FieldEmbeddings`` (``WideAndDeep(args, embeddings=...)``):
    ``lengths`` is ``[F, B]`` and ``values`` the ids of field 0's bags, then field 1's, ...
    Field ``f`` is table ``{prefix}{f}``.

    Example::

        emb = ServerFieldEmbeddings([1000] * 26, dim=16, pooling="mean", init_std=0.01)
        model = WideAndDeep(args, embeddings=emb, wide=ServerFieldEmbeddings([1000] * 26, 1, "mean", 0.0, "wide"))
    """

    def __init__(self, vocab_sizes: Sequence[int], dim: int, pooling: str, init_std: float,
                 prefix: str = "field", seed: int = 0) -> None:
        super().__init__()
        self.names = [f"{prefix}{f}" for f in range(len(vocab_sizes))]
        specs = [ServerTableSpec(n, int(v), dim, init_std=init_std, seed=seed * 100_003 + f)
                 for f, (n, v) in enumerate(zip(self.names, vocab_sizes))]
        self.collection = ServerEmbeddingBagCollection(specs, mode=pooling)

    def forward(self, values: Tensor, lengths: Tensor) -> Tensor:
        num_fields, batch = lengths.shape
        if num_fields != len(self.names):
            raise ValueError(f"lengths has {num_fields} fields, this module {len(self.names)}")
        per_field = lengths.sum(dim=1)
        ids = dict(zip(self.names, values.split(per_field.tolist())))
        starts = torch.zeros_like(lengths)
        starts[:, 1:] = lengths[:, :-1].cumsum(dim=1)  # each field's bag offsets, from 0
        pooled = self.collection(ids, dict(zip(self.names, starts.unbind(0))))
        return torch.stack([pooled[n] for n in self.names], dim=1)


def server_tables(model: nn.Module) -> tuple[list[ServerTableSpec], list[ServerEmbeddingBagCollection]]:
    """Every server table of ``model`` and the collections that hold them; names must be unique job-wide."""
    collections = [m for m in model.modules() if isinstance(m, ServerEmbeddingBagCollection)]
    specs = [t for c in collections for t in c.tables]
    names = [t.name for t in specs]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"server table names must be unique across the model, repeated: {dup}")
    return specs, collections
