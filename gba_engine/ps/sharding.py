"""Which server owns what: contiguous ranges of the flat dense vector, embedding rows by id.

* Dense: all dense parameters are one fp32 vector of ``numel`` elements; server ``s`` of
  ``S`` owns ``[start_s, end_s)``, the balanced split ``torch.tensor_split`` makes (sizes
  differ by at most one).
* Embeddings: row ``id`` lives on server ``id % S`` at local row ``id // S``; ids spread
  evenly whatever their distribution's head, and routing needs no lookup table.

All routing is vectorised (sort by owner, ``bincount``, ``split``): no per-id Python loop.

Example::

    dense = DenseSharding(numel=10, num_servers=3)
    dense.bounds                                 # ((0, 4), (4, 7), (7, 10))
    route = RowRoute.build(torch.tensor([7, 2, 4, 9]), num_servers=2)
    route.counts                                 # (2, 2): ids 2, 4 -> server 0; 7, 9 -> server 1
    parts = route.split(rows_in_id_order)        # one block per server
    rows = route.merge(blocks_from_servers)      # back in the caller's order
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import torch
from torch import Tensor

from .optim import TableOptimizerSpec


@dataclasses.dataclass(frozen=True)
class ServerTableSpec:
    """One embedding table held by the parameter servers, sharded by id (row ``id`` on server ``id % S``).

    Not picasso_ops' ``TableSpec``: that one describes a table a worker holds (pooling,
    sparse optimizer, dtype, fields); this one only what the servers need to own their
    shards (rows, dim, and the seeded per-shard N(0, init_std) start). The servers update its
    rows with the job's optimizer (``OptimizerSpec``, DeepSpeed's ``"optimizer"`` block) unless
    ``optimizer`` gives the table its own (``TableOptimizerSpec``: a picasso block's sparse
    optimizer and lr schedule, used for this table instead).

    Example::

        ServerTableSpec("user_id", num_rows=1_000_000, dim=16, init_std=0.01)
        ServerTableSpec("pack0", 2_600_000, 16, optimizer=TableOptimizerSpec.of("rowwise_adagrad", lr=0.05))
    """

    name: str
    num_rows: int
    dim: int
    init_std: float = 0.01  # N(0, init_std) rows when no initial table is given
    seed: int = 0
    optimizer: TableOptimizerSpec | None = None  # None: the job's optimizer updates the rows

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("an embedding table needs a name")
        if self.num_rows < 1 or self.dim < 1:
            raise ValueError(f"table {self.name!r}: num_rows and dim must be >= 1, got {self.num_rows}, {self.dim}")
        if self.init_std < 0:
            raise ValueError(f"table {self.name!r}: init_std must be >= 0, got {self.init_std}")

    def local_rows(self, server: int, num_servers: int) -> int:
        """Rows of this table held by ``server`` (ids server, server + S, ...)."""
        return max(0, (self.num_rows - server + num_servers - 1) // num_servers)

    def initial_shard(self, server: int, num_servers: int) -> Tensor:
        """The N(0, init_std) rows server ``server`` starts with (local row i is id ``i * S + server``).

        Each shard draws from its own seeded stream, so no rank ever materialises the full table.
        """
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + server)
        return torch.randn(self.local_rows(server, num_servers), self.dim, generator=gen) * self.init_std

    def initial_table(self, num_servers: int) -> Tensor:
        """The whole starting table as ``num_servers`` servers hold it (for references and small tables).

        Example::

            full = ServerTableSpec("item", 10, 4).initial_table(num_servers=2)   # [10, 4]; row 3 from server 1
        """
        full = torch.empty(self.num_rows, self.dim)
        for s in range(num_servers):
            full[s::num_servers] = self.initial_shard(s, num_servers)
        return full

    def check_ids(self, ids: Tensor) -> None:
        """Raise a clear error for non-int64 or out-of-range ids."""
        if ids.dtype != torch.int64:
            raise TypeError(f"table {self.name!r}: ids must be int64, got {ids.dtype}")
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.num_rows):
            raise IndexError(
                f"table {self.name!r}: ids must be in [0, {self.num_rows}), got [{int(ids.min())}, {int(ids.max())}]"
            )




@dataclasses.dataclass(frozen=True)
class DenseSharding:
    """Balanced contiguous ranges of a flat vector over ``num_servers`` servers."""

    numel: int
    num_servers: int

    def __post_init__(self) -> None:
        if self.numel < 0 or self.num_servers < 1:
            raise ValueError(f"need numel >= 0 and num_servers >= 1, got {self.numel}, {self.num_servers}")

    @property
    def bounds(self) -> tuple[tuple[int, int], ...]:
        """``(start, end)`` of each server's range, in server order."""
        base, extra = divmod(self.numel, self.num_servers)
        out, start = [], 0
        for s in range(self.num_servers):
            end = start + base + (1 if s < extra else 0)
            out.append((start, end))
            start = end
        return tuple(out)

    def size(self, server: int) -> int:
        """Elements owned by ``server``."""
        start, end = self.bounds[server]
        return end - start

    def split(self, flat: Tensor) -> list[Tensor]:
        """Views of ``flat`` per server (no copy)."""
        if flat.shape != (self.numel,):
            raise ValueError(f"flat vector must have shape ({self.numel},), got {tuple(flat.shape)}")
        return [flat[a:b] for a, b in self.bounds]

    def join(self, shards: Sequence[Tensor]) -> Tensor:
        """The flat vector from per-server shards (a new tensor)."""
        sizes = [t.numel() for t in shards]
        if sizes != [self.size(s) for s in range(self.num_servers)]:
            raise ValueError(f"shard sizes {sizes} do not match the layout {self.bounds}")
        return torch.cat(list(shards)) if shards else torch.empty(0)


@dataclasses.dataclass(frozen=True)
class RowRoute:
    """How one request's unique ids split over servers, and how replies go back in order.

    ``order`` sorts the unique ids by owner server; ``counts[s]`` ids go to server ``s``.
    ``inverse`` maps each requested id (duplicates allowed) to its unique id.
    """

    unique: Tensor  # sorted unique ids
    inverse: Tensor  # requested position -> index into unique
    order: Tensor  # unique sorted by owner (stable): unique[order] is grouped by server
    counts: tuple[int, ...]

    @classmethod
    def build(cls, ids: Tensor, num_servers: int) -> "RowRoute":
        """Route a 1-D int64 id tensor (duplicates allowed)."""
        unique, inverse = torch.unique(ids.reshape(-1), return_inverse=True)
        owner = unique % num_servers
        order = torch.argsort(owner, stable=True)
        counts = torch.bincount(owner, minlength=num_servers)
        return cls(unique=unique, inverse=inverse, order=order, counts=tuple(int(c) for c in counts))

    def server_ids(self) -> list[Tensor]:
        """Unique ids per server, in server order (what each server is asked for)."""
        return list(torch.split(self.unique[self.order], list(self.counts)))

    def split(self, unique_rows: Tensor) -> list[Tensor]:
        """Rows aligned with ``unique`` -> per-server blocks aligned with :meth:`server_ids`."""
        return list(torch.split(unique_rows[self.order], list(self.counts)))

    def merge(self, blocks: Sequence[Tensor]) -> Tensor:
        """Per-server reply blocks -> rows aligned with the unique ids (a new tensor)."""
        grouped = torch.cat(list(blocks))
        out = torch.empty_like(grouped)
        out[self.order] = grouped
        return out

    def coalesce(self, rows: Tensor) -> Tensor:
        """Per-request rows (duplicates allowed) -> per-unique-id sums (a new tensor)."""
        out = torch.zeros(self.unique.numel(), *rows.shape[1:], dtype=rows.dtype)
        return out.index_add_(0, self.inverse, rows)


def local_index(ids: Tensor, num_servers: int) -> Tensor:
    """Row index inside the owning server's shard: ``id // S``."""
    return torch.div(ids, num_servers, rounding_mode="floor")
