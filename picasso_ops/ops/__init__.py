"""Custom ops for packed embeddings: fused lookup, fused backward+optimizer, hash table.

Each op has three implementations, picked per call from the tensors' device:

* ``"cpp"``: C++ CPU kernels in ``csrc/`` registered as ``torch.ops.picasso.*``,
  JIT-built on first use (``builder``); float32 weights on CPU tensors.
* ``"triton"``: Triton kernels (``triton_kernels``) for CUDA tensors, when
  Triton is importable.
* ``"reference"``: pure torch (``reference``), the semantics the others must
  match; used where no kernel applies, with one warning when that is because
  the kernels are unavailable.

``backend=`` forces one (tests run the Triton kernels on CPU with
``TRITON_INTERPRET=1`` this way). Which kernels may be used and how the C++
ops are built comes from the process's :class:`OpsConfig`, bound by
:func:`configure` at the edge (the ops never read the environment). The C++ and Triton ops release the GIL and
run on torch's intra-op threads, so other Python threads (data loading, an
interleaved micro-batch) proceed meanwhile.

Example::

    >>> import torch
    >>> from picasso_ops import ops
    >>> w = torch.randn(10, 4); out = torch.empty(2, 8)
    >>> ids = torch.tensor([1, 2, 3, 4, 5]); offsets = torch.tensor([0, 2, 3, 3, 5])  # 2 columns x 2 samples
    >>> _ = ops.packed_lookup(w, ids, offsets, torch.tensor([0, 4]), out)
    >>> torch.allclose(out[0, :4], w[1] + w[2])
    True
    >>> ops.packed_backward_update(w, {}, ids, offsets, torch.ones(2, 8), torch.tensor([0, 4]),
    ...                            optimizer="sgd", hyperparams={"lr": 0.1})
"""

from __future__ import annotations

import importlib.util
import logging
import math
from typing import Literal, Mapping, Optional

import torch
from torch import Tensor

from picasso_ops.ops import reference
from picasso_ops.ops.config import OpsConfig, configure, current_config

__all__ = [
    "Backend",
    "HashTable",
    "OpsConfig",
    "configure",
    "current_config",
    "advise_hugepages",
    "output_pool_stats",
    "packed_backward_update",
    "pooled_empty",
    "packed_lookup",
    "select_backend",
    "triton_available",
]

logger = logging.getLogger(__name__)

Backend = Literal["cpp", "triton", "reference"]
_BACKENDS = ("cpp", "triton", "reference")
_warned: set[str] = set()


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        logger.warning(message)


def _cpp_ops() -> bool:
    """Build or load the C++ ops (once); imported here so ``python -m picasso_ops.ops.builder`` runs cleanly."""
    from picasso_ops.ops import builder

    return builder.load_ops()


def triton_available() -> bool:
    """Whether ``triton`` can be imported (does not import it)."""
    return importlib.util.find_spec("triton") is not None


def select_backend(device: torch.device, dtype: torch.dtype = torch.float32, backend: Optional[str] = None) -> Backend:
    """The implementation a call on ``device`` with ``dtype`` weights uses (``backend`` forces one).

    Example::

        >>> select_backend(torch.device("cpu"), torch.float64)
        'reference'
    """
    if backend is not None:
        if backend not in _BACKENDS:
            raise ValueError(f"backend must be one of {_BACKENDS}, got {backend!r}")
        if backend == "cpp" and not _cpp_ops():
            raise RuntimeError("backend='cpp' requested but the C++ ops could not be built (see the warning above)")
        return backend  # type: ignore[return-value]
    if dtype != torch.float32:
        return "reference"  # the kernels are float32; other dtypes are rare enough for the reference
    if device.type == "cuda":
        if triton_available() and current_config().use_triton:
            return "triton"
        _warn_once(
            "triton",
            "picasso_ops: Triton is not importable, so CUDA embedding ops use the slower pure-torch reference "
            "path. Fix: pip install triton",
        )
        return "reference"
    if device.type == "cpu" and _cpp_ops():  # load_ops warns once when it cannot build
        return "cpp"
    return "reference"


def _empty_state(like: Tensor) -> Tensor:
    return torch.empty(0, dtype=torch.float32, device=like.device)


def packed_lookup(
    weight: Tensor,
    indices: Tensor,
    offsets: Tensor,
    column_starts: Tensor,
    out: Tensor,
    *,
    row_offsets: Optional[Tensor] = None,
    per_sample_weights: Optional[Tensor] = None,
    mean_columns: Optional[Tensor] = None,
    column_rows: Optional[Tensor] = None,
    backend: Optional[str] = None,
) -> Tensor:
    """One pack's pooled lookup straight into the ``[B, sum D]`` output; returns ``out``.

    ``weight [R, W]`` is the pack's buffer; the ``C`` columns of ``B`` bags each
    are column-major (bag ``c * B + b`` holds ``indices[offsets[g]:offsets[g+1]]``,
    ``offsets`` has ``C * B + 1`` entries, ``B = out.shape[0]``). Column ``c``
    is written to ``out[:, column_starts[c] : column_starts[c] + W]``; its rows
    are ``indices + row_offsets[c]`` when given (raw ids of a table at buffer
    row offset ``row_offsets[c]``), else the indices. Pooling is sum, times
    ``per_sample_weights``, divided by the bag length for ``mean_columns``.
    Not differentiable itself: pair it with :func:`packed_backward_update`
    in a custom autograd function. Raises ``RuntimeError`` on a row outside
    the buffer and, with ``column_rows``, on an id of column ``c`` outside
    ``[0, column_rows[c])`` (its table's size; the C++ kernel checks while it
    reads the ids, so callers need no separate pass over them).

    Example::

        >>> w = torch.arange(6.0).view(3, 2); out = torch.zeros(1, 4)
        >>> packed_lookup(w, torch.tensor([0, 0, 1]), torch.tensor([0, 2, 3]), torch.tensor([2, 0]), out,
        ...               row_offsets=torch.tensor([1, 1])).tolist()
        [[4.0, 5.0, 4.0, 6.0]]
    """
    which = select_backend(weight.device, weight.dtype, backend)
    if which == "cpp":
        if out.dtype != torch.float32:
            raise TypeError(f"packed_lookup: out must be float32 like weight, got {out.dtype}")
        torch.ops.picasso.packed_lookup(
            weight, indices, offsets, column_starts, row_offsets, per_sample_weights, mean_columns, out, column_rows
        )
        return out
    if column_rows is not None:
        reference.check_column_rows(indices, offsets, column_rows, out.shape[0], "packed_lookup")
    if which == "triton":
        from picasso_ops.ops import triton_kernels

        return triton_kernels.packed_lookup(
            weight, indices, offsets, column_starts, out,
            row_offsets=row_offsets, per_sample_weights=per_sample_weights, mean_columns=mean_columns,
        )
    return reference.packed_lookup(
        weight, indices, offsets, column_starts, out,
        row_offsets=row_offsets, per_sample_weights=per_sample_weights, mean_columns=mean_columns,
    )


def advise_hugepages(tensor: Tensor) -> bool:
    """Ask for transparent huge pages under a large CPU tensor that was not written yet; ``True`` if advised.

    A fresh multi-MB output (``torch.empty`` above glibc's mmap threshold)
    is otherwise page-faulted 4 KiB at a time by its first writes, which on
    our machines costs more than the embedding lookup that fills it. Only
    the whole huge pages inside the tensor's storage are advised (Linux
    ``madvise(MADV_HUGEPAGE)``, honoured when
    ``/sys/kernel/mm/transparent_hugepage/enabled`` is ``always`` or
    ``madvise``); anything else (no C++ ops, not CPU, another OS) is a no-op
    returning ``False``. Does not trigger a build of the C++ ops.

    Example::

        >>> advise_hugepages(torch.empty(0))
        False
    """
    if tensor.device.type != "cpu" or not _cpp_loaded():
        return False
    return bool(torch.ops.picasso.advise_hugepages(tensor))


def pooled_empty(rows: int, cols: int, dtype: torch.dtype = torch.float32) -> Tensor:
    """An uninitialised CPU ``[rows, cols]`` tensor from the recycling pool of huge-page blocks.

    When the tensor's storage dies (all its views gone) its block returns to the
    pool, and the next call for the same size gets it back already faulted in:
    a training step's output of 100+ MB costs no page faults after the first
    step (``csrc/output_pool.cpp``). Without the C++ ops: ``torch.empty``.
    The storage cannot be resized. Does not trigger a build of the C++ ops.

    Example::

        >>> pooled_empty(2, 3).shape
        torch.Size([2, 3])
    """
    if not _cpp_loaded():
        return torch.empty(rows, cols, dtype=dtype)
    return torch.ops.picasso.pooled_empty(rows, cols, dtype)


def output_pool_stats(limit_bytes: int | None = None) -> dict[str, int]:
    """The output pool's free bytes held, hits and misses; ``limit_bytes`` sets its cap (default 1 GiB).

    Example::

        >>> sorted(output_pool_stats())
        ['cached_bytes', 'hits', 'misses']
    """
    if not _cpp_loaded():
        return {"cached_bytes": 0, "hits": 0, "misses": 0}
    cached, hits, misses = torch.ops.picasso.output_pool_stats(-1 if limit_bytes is None else int(limit_bytes))
    return {"cached_bytes": cached, "hits": hits, "misses": misses}


def _cpp_loaded() -> bool:
    from picasso_ops.ops import builder

    return builder.ops_available()


def packed_backward_update(
    weight: Tensor,
    state: Mapping[str, Tensor],
    indices: Tensor,
    offsets: Optional[Tensor],
    grad: Tensor,
    column_starts: Optional[Tensor],
    *,
    optimizer: str,
    hyperparams: Mapping[str, float],
    step: float = 1,
    row_offsets: Optional[Tensor] = None,
    per_sample_weights: Optional[Tensor] = None,
    mean_columns: Optional[Tensor] = None,
    segments: Optional[Tensor] = None,
    backend: Optional[str] = None,
) -> None:
    """Backward of :func:`packed_lookup` with one sparse optimizer step, applied in place.

    Arguments as in :func:`packed_lookup`, plus ``grad``: the gradient of the
    whole ``[B, sum D]`` output (read at the pack's ``column_starts``), or with
    ``offsets=None`` one gradient row per index (sequence features).
    ``optimizer`` is ``"sgd"``, ``"rowwise_adagrad"`` (``state["momentum1"]``,
    ``[R]``) or ``"adam"`` (lazy: ``momentum1``, ``momentum2`` ``[R, W]``, bias
    correction with the global ``step``, 1-based); ``hyperparams`` holds
    ``lr`` and as needed ``eps``, ``beta1``, ``beta2`` (an optimizer's
    ``hyperparams`` dict from ``embedding.sparse_optim``). A buffer row is one
    table row (row-wise state is per buffer row). ``segments``: ascending bag
    boundaries ``[0, ..., C * B]`` of column groups whose rows are disjoint
    (one group per table): the C++ kernel dedups each group on its own thread.
    Dense ``[R, W]`` gradients are never built.

    Example::

        >>> w = torch.zeros(4, 2); m = {"momentum1": torch.zeros(4)}
        >>> packed_backward_update(w, m, torch.tensor([3]), torch.tensor([0, 1]), torch.ones(1, 2),
        ...                        torch.tensor([0]), optimizer="rowwise_adagrad", hyperparams={"lr": 0.1})
        >>> round(w[3, 0].item(), 4), m["momentum1"][3].item()
        (-0.1, 1.0)
    """
    if float(hyperparams.get("weight_decay", 0.0)) != 0.0:  # never drop a decay silently
        raise ValueError("packed_backward_update: weight_decay is applied by SparseOptimizer.update (the torch path), "
                         "not by the fused op; call it with weight_decay 0")
    which = select_backend(weight.device, weight.dtype, backend)
    if which == "cpp":
        hp = hyperparams
        torch.ops.picasso.packed_backward_update(
            weight,
            state.get("momentum1", _empty_state(weight)),
            state.get("momentum2", _empty_state(weight)),
            indices,
            offsets,
            grad if grad.dtype == torch.float32 else grad.float(),
            column_starts,
            row_offsets,
            per_sample_weights,
            mean_columns,
            segments,
            optimizer,
            float(hp["lr"]),
            float(hp.get("eps", 1e-8)),
            float(hp.get("beta1", 0.9)),
            float(hp.get("beta2", 0.999)),
            float(step),
        )
        return
    kwargs = dict(
        optimizer=optimizer, hyperparams=hyperparams, step=step, row_offsets=row_offsets,
        per_sample_weights=per_sample_weights, mean_columns=mean_columns, segments=segments,
    )
    if which == "triton":
        from picasso_ops.ops import triton_kernels

        triton_kernels.packed_backward_update(weight, state, indices, offsets, grad, column_starts, **kwargs)
        return
    reference.packed_backward_update(weight, state, indices, offsets, grad, column_starts, **kwargs)


class HashTable:
    """An int64 key -> int64 slot map over ``num_slots`` slots (open addressing, batch ops).

    New keys take free slots (``0, 1, 2, ...`` on a fresh table; erased keys'
    slots are reused last-freed first). A full table returns ``-1`` for keys it
    could not insert and changes nothing for them. The state is four CPU int64
    tensors (``state_dict()``), the same for the C++ op and the reference, so
    a checkpoint moves between them. Keys ``-2**63`` and ``-2**63 + 1`` are
    reserved.

    Example::

        >>> t = HashTable(4)
        >>> t.insert(torch.tensor([10, 99, 10])).tolist()
        [0, 1, 0]
        >>> t.find(torch.tensor([99, 5])).tolist()
        [1, -1]
        >>> t.erase(torch.tensor([10])).tolist(), len(t)
        ([0], 1)
    """

    def __init__(self, num_slots: int, *, backend: Optional[str] = None) -> None:
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        self.num_slots = int(num_slots)
        capacity = 1 << max(1, math.ceil(math.log2(2 * self.num_slots)))  # load factor <= 1/2
        self.keys = torch.full((capacity,), reference.EMPTY_KEY, dtype=torch.int64)
        self.slots = torch.full((capacity,), -1, dtype=torch.int64)
        self.free = torch.arange(self.num_slots - 1, -1, -1, dtype=torch.int64)  # a stack: pops 0, 1, 2, ...
        self.meta = torch.tensor([0, self.num_slots, 0], dtype=torch.int64)  # size, free slots, tombstones
        self._backend = select_backend(torch.device("cpu"), torch.float32, backend)
        if self._backend == "triton":
            raise ValueError("HashTable has no Triton kernel; its state lives on the CPU (backend 'cpp' or 'reference')")

    @property
    def capacity(self) -> int:
        """Number of buckets (a power of two, at least twice the slots)."""
        return self.keys.numel()

    def __len__(self) -> int:
        return int(self.meta[0])

    @staticmethod
    def _query(keys: Tensor) -> Tensor:
        return keys.to(device="cpu", dtype=torch.int64).reshape(-1)

    def find(self, keys: Tensor) -> Tensor:
        """Slot of each key, ``-1`` when absent (CPU int64, flattened)."""
        q = self._query(keys)
        if self._backend == "cpp":
            return torch.ops.picasso.hash_find(self.keys, self.slots, q)
        return reference.hash_find(self.keys, self.slots, q)

    def insert(self, keys: Tensor) -> Tensor:
        """Slot of each key, inserting absent ones; ``-1`` for keys that did not fit."""
        q = self._query(keys)
        op = torch.ops.picasso.hash_insert if self._backend == "cpp" else reference.hash_insert
        return op(self.keys, self.slots, self.free, self.meta, q)

    def erase(self, keys: Tensor) -> Tensor:
        """Remove keys; the slot each held (now free), ``-1`` when absent."""
        q = self._query(keys)
        op = torch.ops.picasso.hash_erase if self._backend == "cpp" else reference.hash_erase
        return op(self.keys, self.slots, self.free, self.meta, q)

    def state_dict(self) -> dict[str, Tensor]:
        """The four state tensors (copies)."""
        return {name: getattr(self, name).clone() for name in ("keys", "slots", "free", "meta")}

    def load_state_dict(self, state: Mapping[str, Tensor]) -> None:
        """Restore a :meth:`state_dict` of a table with the same number of slots."""
        for name in ("keys", "slots", "free", "meta"):
            if state[name].shape != getattr(self, name).shape:
                raise ValueError(
                    f"hash table state {name!r} has shape {tuple(state[name].shape)}, "
                    f"this table needs {tuple(getattr(self, name).shape)}"
                )
            getattr(self, name).copy_(state[name])
