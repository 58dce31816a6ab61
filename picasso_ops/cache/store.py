"""Row stores: the slow tier behind a cache, holding every row of a table and its optimizer state.

A :class:`~picasso_ops.contracts.RowStore` (declared in ``picasso_ops.contracts``) holds ``num_rows`` rows of width ``dim`` keyed by ids in
``[0, num_rows)``, plus named optimizer-state columns per row (``state_dims``,
e.g. ``{"momentum1": 1}`` for row-wise Adagrad). Implementations:

* :class:`HostRowStore`: tensors in host memory.
* :class:`MmapRowStore`: one memory-mapped file of fp32 records (row and state
  side by side, so one read brings both), for tables larger than RAM. With
  ``drop_page_cache=True`` every call ends by syncing and dropping the file's
  pages (``fdatasync``, ``madvise(MADV_DONTNEED)``, ``posix_fadvise(POSIX_FADV_DONTNEED)``)
  so each access really goes to the disk: the slow store of the benchmark.
* :class:`TableRowStore`: an adapter over any
  :class:`~picasso_ops.contracts.TableRowService` (``get_rows(table, ids) -> rows``,
  ``put_rows(table, ids, rows)``), which ``gba_engine.ps.PSClient`` is; optimizer state stays in host memory on this
  side (the parameter server keeps its own).

Stores are not thread-safe: callers serialise access (the cache makes every store call on its one I/O thread).
Ids must be int64 in ``[0, num_rows)``; anything else raises a clear error.

Example::

    >>> import torch
    >>> store = HostRowStore(num_rows=100, dim=4, state_dims={"momentum1": 1})
    >>> store.put_rows(torch.tensor([3]), torch.ones(1, 4), {"momentum1": torch.full((1, 1), 2.0)})
    >>> got = store.get_rows(torch.tensor([3, 5]))
    >>> got.rows.sum().item(), got.state["momentum1"].squeeze(1).tolist()
    (4.0, [2.0, 0.0])
"""

from __future__ import annotations

import logging
import mmap
import os
from typing import Mapping, Optional

import numpy as np
import torch
from torch import Tensor

from picasso_ops.contracts import RowStore, StoredRows, TableRowService

__all__ = [
    "StoredRows",
    "RowStore",
    "TableRowService",
    "HostRowStore",
    "MmapRowStore",
    "TableRowStore",
    "check_store_ids",
]

logger = logging.getLogger(__name__)


def check_store_ids(ids: Tensor, num_rows: int, what: str = "store") -> Tensor:
    """``ids`` flattened, after checking they are int64 in ``[0, num_rows)``; raises TypeError/IndexError.

    Example::

        >>> check_store_ids(torch.tensor([-1]), 10)
        Traceback (most recent call last):
        ...
        IndexError: store: ids must be in [0, 10), got ids in [-1, -1] (1 bad, e.g. -1)
    """
    if not isinstance(ids, Tensor) or ids.dtype != torch.int64:
        raise TypeError(f"{what}: ids must be an int64 tensor, got {getattr(ids, 'dtype', type(ids))}")
    flat = ids.reshape(-1)
    if flat.numel():
        lo, hi = int(flat.min()), int(flat.max())
        if lo < 0 or hi >= num_rows:
            bad = flat[(flat < 0) | (flat >= num_rows)]
            raise IndexError(f"{what}: ids must be in [0, {num_rows}), got ids in [{lo}, {hi}] "
                             f"({bad.numel()} bad, e.g. {int(bad[0])})")
    return flat


def _check_put(store: RowStore, ids: Tensor, rows: Tensor, state: Optional[Mapping[str, Tensor]]) -> Tensor:
    flat = check_store_ids(ids, store.num_rows, type(store).__name__)
    if rows.shape != (flat.numel(), store.dim):
        raise ValueError(f"{type(store).__name__}: rows must be [{flat.numel()}, {store.dim}], got {tuple(rows.shape)}")
    for name, block in (state or {}).items():
        if name not in store.state_dims:
            raise KeyError(f"{type(store).__name__}: unknown state {name!r}; this store holds {sorted(store.state_dims)}")
        if block.shape != (flat.numel(), store.state_dims[name]):
            raise ValueError(f"{type(store).__name__}: state {name!r} must be [{flat.numel()}, "
                             f"{store.state_dims[name]}], got {tuple(block.shape)}")
    if flat.numel() > 1 and torch.unique(flat).numel() != flat.numel():
        raise ValueError(f"{type(store).__name__}: put_rows needs unique ids")
    return flat


class HostRowStore:
    """Every row and its state in host-memory tensors.

    Args:
        num_rows, dim: table shape.
        state_dims: state column widths by name (``{"momentum1": 1}``).
        weight: initial rows ``[num_rows, dim]`` (copied); zeros if omitted.

    Example::

        >>> s = HostRowStore(4, 2, weight=torch.arange(8.).view(4, 2))
        >>> s.get_rows(torch.tensor([2])).rows.tolist()
        [[4.0, 5.0]]
    """

    def __init__(self, num_rows: int, dim: int, state_dims: Optional[Mapping[str, int]] = None,
                 weight: Optional[Tensor] = None) -> None:
        self.num_rows, self.dim = int(num_rows), int(dim)
        self.state_dims = dict(state_dims or {})
        if weight is not None and weight.shape != (self.num_rows, self.dim):
            raise ValueError(f"weight must be [{self.num_rows}, {self.dim}], got {tuple(weight.shape)}")
        self.weight = weight.detach().to(torch.float32).clone() if weight is not None else torch.zeros(self.num_rows, self.dim)
        self.state = {k: torch.zeros(self.num_rows, w) for k, w in self.state_dims.items()}

    def get_rows(self, ids: Tensor) -> StoredRows:
        """Rows and state of ``ids`` (copies)."""
        flat = check_store_ids(ids, self.num_rows, "HostRowStore")
        return StoredRows(self.weight.index_select(0, flat), {k: v.index_select(0, flat) for k, v in self.state.items()})

    def put_rows(self, ids: Tensor, rows: Tensor, state: Optional[Mapping[str, Tensor]] = None) -> None:
        """Overwrite rows and the given state columns of unique ``ids``."""
        flat = _check_put(self, ids, rows, state)
        self.weight.index_copy_(0, flat, rows.to(torch.float32))
        for name, block in (state or {}).items():
            self.state[name].index_copy_(0, flat, block.to(torch.float32))


class MmapRowStore:
    """Rows and state as fp32 records in one memory-mapped file; the table may exceed RAM.

    Record ``i`` (bytes ``[i * 4 * width, (i + 1) * 4 * width)``, ``width = dim + sum(state_dims)``)
    holds row ``i`` then its state columns in ``state_dims`` order. Reads and
    writes are torch ``index_select`` / ``index_copy_`` on a tensor over the
    mapping, so they release the GIL (a prefetch thread overlaps them with compute).

    Args:
        path: the file; created (zero-filled, sparse) if missing or if ``create``.
        num_rows, dim, state_dims: table layout; an existing file must match its size.
        weight: initial rows to write when creating.
        drop_page_cache: end every call by syncing and dropping the file's cached pages.

    Example::

        >>> import tempfile, os
        >>> path = os.path.join(tempfile.mkdtemp(), "t.rows")
        >>> s = MmapRowStore(path, num_rows=1000, dim=4, create=True)
        >>> s.put_rows(torch.tensor([999]), torch.ones(1, 4)); s.close()
        >>> MmapRowStore(path, num_rows=1000, dim=4).get_rows(torch.tensor([999])).rows.tolist()
        [[1.0, 1.0, 1.0, 1.0]]
    """

    def __init__(self, path: str | os.PathLike, num_rows: int, dim: int, state_dims: Optional[Mapping[str, int]] = None,
                 *, create: bool = False, weight: Optional[Tensor] = None, drop_page_cache: bool = False) -> None:
        self.path = os.fspath(path)
        self.num_rows, self.dim = int(num_rows), int(dim)
        self.state_dims = dict(state_dims or {})
        self.width = self.dim + sum(self.state_dims.values())
        self.drop_page_cache = drop_page_cache
        size = self.num_rows * self.width * 4
        if create or not os.path.exists(self.path):
            with open(self.path, "wb") as f:
                f.truncate(size)
        elif os.path.getsize(self.path) != size:
            raise ValueError(f"{self.path}: {os.path.getsize(self.path)} bytes, expected {size} for "
                             f"{self.num_rows} rows of {self.width} fp32 values")
        self._fd = os.open(self.path, os.O_RDWR)
        self._map = mmap.mmap(self._fd, size)
        self._map.madvise(mmap.MADV_RANDOM)  # rows are read at random: read-ahead would only waste I/O
        array = np.ndarray((self.num_rows, self.width), dtype=np.float32, buffer=self._map)
        self._data = torch.from_numpy(array)
        self._slices: dict[str, slice] = {}
        col = self.dim
        for name, w in self.state_dims.items():
            self._slices[name] = slice(col, col + w)
            col += w
        if weight is not None:
            if weight.shape != (self.num_rows, self.dim):
                raise ValueError(f"weight must be [{self.num_rows}, {self.dim}], got {tuple(weight.shape)}")
            self._data[:, : self.dim] = weight.detach().to(torch.float32)
            self._drop()

    def get_rows(self, ids: Tensor) -> StoredRows:
        """Rows and state of ``ids``, read from the file."""
        flat = check_store_ids(ids, self.num_rows, "MmapRowStore")
        records = self._data.index_select(0, flat)
        self._drop()
        return StoredRows(records[:, : self.dim], {k: records[:, s] for k, s in self._slices.items()})

    def put_rows(self, ids: Tensor, rows: Tensor, state: Optional[Mapping[str, Tensor]] = None) -> None:
        """Write rows (and given state columns) of unique ``ids`` to the file."""
        flat = _check_put(self, ids, rows, state)
        if state is not None and set(state) == set(self.state_dims):
            records = torch.cat([rows.to(torch.float32), *(state[k].to(torch.float32) for k in self.state_dims)], 1)
        else:  # a partial write keeps the other columns: read-modify-write
            records = self._data.index_select(0, flat)
            records[:, : self.dim] = rows
            for name, block in (state or {}).items():
                records[:, self._slices[name]] = block
        self._data.index_copy_(0, flat, records)
        self._drop()

    def flush(self) -> None:
        """Write dirty pages to disk (``msync``)."""
        self._map.flush()

    def close(self) -> None:
        """Flush and unmap; the store is unusable afterwards."""
        if self._map.closed:
            return
        self._map.flush()
        del self._data  # the tensor holds a buffer export of the mapping, which must go before close()
        self._map.close()
        os.close(self._fd)

    def _drop(self) -> None:
        if not self.drop_page_cache:
            return
        os.fdatasync(self._fd)  # dirty pages cannot be dropped: write them first (releases the GIL; msync would not)
        self._map.madvise(mmap.MADV_DONTNEED)  # unmap our pages so the page cache may drop them
        os.posix_fadvise(self._fd, 0, 0, os.POSIX_FADV_DONTNEED)


class TableRowStore:
    """A :class:`RowStore` over one table of a :class:`TableRowService` (e.g. ``PSClient``); state kept locally.

    Example::

        >>> class Fake:
        ...     def __init__(self): self.t = torch.zeros(10, 2)
        ...     def get_rows(self, table, ids): return self.t[ids]
        ...     def put_rows(self, table, ids, rows): self.t[ids] = rows
        >>> s = TableRowStore(Fake(), "user", num_rows=10, dim=2, state_dims={"momentum1": 1})
        >>> s.put_rows(torch.tensor([1]), torch.ones(1, 2)); s.get_rows(torch.tensor([1])).rows.tolist()
        [[1.0, 1.0]]
    """

    def __init__(self, source: TableRowService, table: str, num_rows: int, dim: int,
                 state_dims: Optional[Mapping[str, int]] = None) -> None:
        if not isinstance(source, TableRowService):
            raise TypeError(f"source must have get_rows(table, ids) and put_rows(table, ids, rows), got {type(source)}")
        self.source, self.table = source, table
        self.num_rows, self.dim = int(num_rows), int(dim)
        self.state_dims = dict(state_dims or {})
        self._state = HostRowStore(num_rows, 1, self.state_dims) if self.state_dims else None

    def get_rows(self, ids: Tensor) -> StoredRows:
        """Rows from the source, state from local memory."""
        flat = check_store_ids(ids, self.num_rows, f"TableRowStore({self.table!r})")
        rows = self.source.get_rows(self.table, flat).reshape(-1, self.dim).to(torch.float32)
        state = self._state.get_rows(flat).state if self._state is not None else {}
        return StoredRows(rows, state)

    def put_rows(self, ids: Tensor, rows: Tensor, state: Optional[Mapping[str, Tensor]] = None) -> None:
        """Rows to the source, state to local memory."""
        flat = _check_put(self, ids, rows, state)
        self.source.put_rows(self.table, flat, rows)
        if self._state is not None and state:
            self._state.put_rows(flat, torch.zeros(flat.numel(), 1), state)
