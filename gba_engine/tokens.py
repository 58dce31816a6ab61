"""GBA token control as plain, process-free code: versions, admission of M gradients, aggregation.

Semantics (DESIGN.md "GBA"; one instance per parameter-server shard):

* The model version starts at 0 and grows by one per applied update. A worker's token is
  the version its batch started from; staleness ``tau = version - token`` is measured
  when the gradient reaches the server.
* Each gradient gets ``weight = decay(tau)``. A gradient of weight 0 (dropped) is
  tallied but does **not** count toward M: the global batch is then always made of M
  admitted local gradients, and a dropped straggler cannot stall progress because the
  other workers keep pushing. Decayed gradients (0 < weight < 1) count toward M.
* When M gradients are admitted the buffer yields the weighted global-batch gradient
  and the version increments. Every local gradient enters with its sample count ``n``:

      dense   = sum_i w_i n_i g_i / sum_i n_i
      row[id] = sum_i w_i n_i r_i[id] / sum_i n_i      (r_i: local mean-loss row gradient)

  With equal local batches and weights 1 this is the plain mean over M, i.e. exactly
  what a synchronous all-reduce of mean-loss gradients gives; with uneven batches it is
  the global batch's mean loss. The denominator keeps decayed samples at full count so
  a decay shrinks a stale gradient's influence instead of rescaling the fresh ones.

Example::

    control = TokenControl(grads_per_update=2, decay=StalenessDecay("drop", threshold=1))
    buf = GlobalBatchBuffer(dense_numel=3, table_dims={"user": 4})
    a = control.admit(token=0)                   # Admission(tau=0, weight=1.0, counted=True, ready=False)
    buf.add(a.weight, 8, torch.ones(3), {"user": torch.tensor([5])}, {"user": torch.ones(1, 4)})
    ...                                          # a second admission -> ready=True
    batch = buf.mean(); buf.clear(); control.commit()   # version 0 -> 1
"""
from __future__ import annotations

import collections
import dataclasses
from typing import Mapping

import torch
from torch import Tensor

from .decay import StalenessDecay


def grads_per_update(global_batch: int, local_batch: int) -> int:
    """M = global batch / local batch: how many local gradients make one update.

    Example::

        grads_per_update(global_batch=2048, local_batch=512)   # 4
    """
    for name, value in (("global_batch", global_batch), ("local_batch", local_batch)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if global_batch % local_batch:
        raise ValueError(
            f"global batch {global_batch} is not a multiple of the local batch {local_batch}: "
            "GBA aggregates a whole number M of local gradients per update"
        )
    return global_batch // local_batch


@dataclasses.dataclass(frozen=True)
class Admission:
    """The token-control verdict on one incoming gradient."""

    tau: int
    weight: float
    counted: bool  # counts toward M (weight > 0)
    ready: bool  # M gradients are now admitted: aggregate and commit


@dataclasses.dataclass
class TokenStats:
    """Running tallies for observability (staleness histogram, dropped/decayed counts)."""

    received: int = 0
    counted: int = 0
    dropped: int = 0
    decayed: int = 0  # 0 < weight < 1
    rejected: int = 0  # token newer than the version: a client bug or a restored server
    staleness: collections.Counter = dataclasses.field(default_factory=collections.Counter)

    def as_dict(self) -> dict:
        """Plain-data copy (for logging, wandb, or returning across processes)."""
        return {
            "received": self.received,
            "counted": self.counted,
            "dropped": self.dropped,
            "decayed": self.decayed,
            "rejected": self.rejected,
            "staleness": dict(sorted(self.staleness.items())),
        }


class TokenControl:
    """Versions and the M-gradient admission rule of one server shard.

    Example::

        tc = TokenControl(grads_per_update=2, decay=StalenessDecay("drop", threshold=0))
        tc.admit(0).ready, tc.admit(0).ready     # (False, True)
        tc.commit()                              # 1
        tc.admit(0)                              # tau=1 > threshold: weight 0, not counted
    """

    def __init__(self, grads_per_update: int, decay: StalenessDecay, version: int = 0) -> None:
        if isinstance(grads_per_update, bool) or not isinstance(grads_per_update, int) or grads_per_update < 1:
            raise ValueError(f"grads_per_update (M) must be a positive integer, got {grads_per_update!r}")
        if version < 0:
            raise ValueError(f"version must be >= 0, got {version}")
        self.m = grads_per_update
        self.decay = decay
        self._version = version
        self._pending = 0
        self.stats = TokenStats()

    @property
    def version(self) -> int:
        """Updates applied so far; the token handed to a worker that pulls now."""
        return self._version

    @property
    def pending(self) -> int:
        """Gradients admitted toward the current update (0 <= pending < M between calls)."""
        return self._pending

    def admit(self, token: int) -> Admission:
        """Weigh one gradient computed from version ``token``; raises ValueError for a future token."""
        self.stats.received += 1
        if token > self._version:
            self.stats.rejected += 1
            raise ValueError(f"token {token} is newer than the model version {self._version}")
        if self._pending >= self.m:
            raise RuntimeError(f"{self.m} gradients are already admitted: commit() before admitting more")
        tau = self._version - token
        weight = self.decay(tau)
        self.stats.staleness[tau] += 1
        if weight <= 0.0:
            self.stats.dropped += 1
            return Admission(tau=tau, weight=0.0, counted=False, ready=False)
        if weight < 1.0:
            self.stats.decayed += 1
        self.stats.counted += 1
        self._pending += 1
        return Admission(tau=tau, weight=weight, counted=True, ready=self._pending == self.m)

    def commit(self) -> int:
        """Close the update after its M gradients were applied; returns the new version."""
        if self._pending != self.m:
            raise RuntimeError(f"commit() needs exactly M={self.m} admitted gradients, have {self._pending}")
        self._pending = 0
        self._version += 1
        return self._version


@dataclasses.dataclass(frozen=True)
class GlobalBatchGradient:
    """The aggregated gradient of one global batch (rows only for ids present in it)."""

    dense: Tensor  # [dense_numel] float32
    ids: dict[str, Tensor]  # table -> unique ids (int64, sorted)
    rows: dict[str, Tensor]  # table -> [len(ids), dim] float32
    num_samples: int
    count: int  # local gradients aggregated (M)


class GlobalBatchBuffer:
    """Accumulates weighted local gradients of one global batch in bounded memory.

    Dense gradients are summed into one preallocated vector as they arrive; embedding
    row gradients are kept as the received (ids, rows) blocks and reduced per id with one
    ``unique`` + ``index_add_`` at :meth:`mean`, so memory is bounded by the ids of one
    global batch, not by the table size. Inputs are never modified.

    Example::

        buf = GlobalBatchBuffer(4, {"item": 8})
        buf.add(1.0, 16, dense_grad, {"item": ids}, {"item": row_grads})
        g = buf.mean()      # GlobalBatchGradient(dense=..., ids={"item": ...}, ...)
    """

    def __init__(self, dense_numel: int, table_dims: Mapping[str, int]) -> None:
        if dense_numel < 0:
            raise ValueError(f"dense_numel must be >= 0, got {dense_numel}")
        self.dense_numel = dense_numel
        self.table_dims = dict(table_dims)
        self._dense = torch.zeros(dense_numel, dtype=torch.float32)
        self._blocks: dict[str, list[tuple[Tensor, Tensor, float]]] = {t: [] for t in self.table_dims}
        self._samples = 0
        self._count = 0

    @property
    def count(self) -> int:
        """Local gradients added since the last clear()."""
        return self._count

    def add(
        self,
        weight: float,
        num_samples: int,
        dense_grad: Tensor | None,
        ids: Mapping[str, Tensor],
        rows: Mapping[str, Tensor],
    ) -> None:
        """Add one local gradient (mean-loss gradients of a batch of ``num_samples``) with its weight."""
        if num_samples < 1:
            raise ValueError(f"num_samples must be >= 1, got {num_samples}")
        if not 0.0 < weight <= 1.0:
            raise ValueError(f"weight must be in (0, 1], got {weight}")
        scale = float(weight) * float(num_samples)
        if self.dense_numel:
            if dense_grad is None or dense_grad.shape != (self.dense_numel,):
                got = None if dense_grad is None else tuple(dense_grad.shape)
                raise ValueError(f"dense gradient must have shape ({self.dense_numel},), got {got}")
            self._dense.add_(dense_grad.to(torch.float32), alpha=scale)
        unknown = set(ids) - set(self.table_dims)
        if unknown or set(ids) != set(rows):
            raise ValueError(f"ids/rows tables {sorted(ids)}/{sorted(rows)} do not match {sorted(self.table_dims)}")
        for table, t_ids in ids.items():
            t_rows = rows[table]
            if t_rows.shape != (t_ids.numel(), self.table_dims[table]):
                raise ValueError(
                    f"table {table!r}: rows shape {tuple(t_rows.shape)} != ({t_ids.numel()}, {self.table_dims[table]})"
                )
            if t_ids.numel():
                self._blocks[table].append((t_ids, t_rows, scale))
        self._samples += int(num_samples)
        self._count += 1

    def mean(self) -> GlobalBatchGradient:
        """The global-batch gradient: weighted sums divided by the summed sample count."""
        if self._count == 0:
            raise RuntimeError("no gradient was added to this global batch")
        denom = float(self._samples)
        out_ids: dict[str, Tensor] = {}
        out_rows: dict[str, Tensor] = {}
        for table, blocks in self._blocks.items():
            dim = self.table_dims[table]
            if not blocks:
                out_ids[table] = torch.empty(0, dtype=torch.int64)
                out_rows[table] = torch.empty(0, dim, dtype=torch.float32)
                continue
            all_ids = torch.cat([b[0] for b in blocks])
            all_rows = torch.cat([b[1].to(torch.float32) * b[2] for b in blocks])
            uniq, inverse = torch.unique(all_ids, return_inverse=True)
            summed = torch.zeros(uniq.numel(), dim, dtype=torch.float32).index_add_(0, inverse, all_rows)
            out_ids[table] = uniq
            out_rows[table] = summed / denom
        return GlobalBatchGradient(
            dense=self._dense / denom, ids=out_ids, rows=out_rows, num_samples=self._samples, count=self._count
        )

    def clear(self) -> None:
        """Start the next global batch."""
        self._dense.zero_()
        self._blocks = {t: [] for t in self.table_dims}
        self._samples = 0
        self._count = 0
