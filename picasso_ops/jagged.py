"""Field-major jagged sparse batches (the input of packed embedding lookups).

A :class:`JaggedBatch` holds ``F`` sparse fields for a batch of ``B`` samples in
one flat id tensor, laid out field-major like torchrec's ``KeyedJaggedTensor``:
all ids of field 0 (sample 0, then sample 1, ...), then all ids of field 1, and
so on. ``lengths[f, b]`` is the number of ids of field ``f`` in sample ``b``.

Example::

    >>> import torch
    >>> from picasso_ops.jagged import JaggedBatch
    >>> batch = JaggedBatch(
    ...     keys=["user", "item"],
    ...     values=torch.tensor([7, 1, 2, 3, 4, 5]),
    ...     lengths=torch.tensor([[1, 2], [0, 3]]),  # [F, B], field-major
    ... )
    >>> batch.offsets.tolist()
    [0, 1, 3, 3, 6]
    >>> batch.field_values("item").tolist()
    [3, 4, 5]
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
from torch import Tensor

__all__ = ["JaggedBatch"]

_INDEX_DTYPES = (torch.int32, torch.int64)


class JaggedBatch:
    """Keys, flat ids, field-major lengths/offsets and optional per-id weights.

    Args:
        keys: field names, one per field, unique.
        values: integer ids ``[nnz]`` (int64 or int32), field-major.
        lengths: ids per (field, sample), ``[F, B]`` or flat ``[F * B]``.
        weights: optional per-id float weights ``[nnz]``.
        validate: check shapes, dtypes, non-negative lengths and that the
            lengths add up to ``nnz`` (one host sync); turn off only for
            batches that were already checked.

    Attributes:
        keys: the field names (a tuple).
        values: ids ``[nnz]``.
        lengths: ``[F, B]`` (a view of the given tensor, never a copy).
        weights: ``[nnz]`` or ``None``.
        offsets: ``[F * B + 1]`` int64, ``offsets[f * B + b]`` is where bag
            ``(f, b)`` starts in ``values``.

    Example::

        >>> b = JaggedBatch(["a"], torch.tensor([1, 2]), torch.tensor([2, 0]))
        >>> (b.num_fields, b.batch_size, b.num_values)
        (1, 2, 2)
    """

    __slots__ = ("keys", "values", "lengths", "weights", "offsets", "_key_index")

    def __init__(
        self,
        keys: Sequence[str],
        values: Tensor,
        lengths: Tensor,
        weights: Optional[Tensor] = None,
        *,
        validate: bool = True,
    ) -> None:
        self.keys: tuple[str, ...] = tuple(keys)
        num_fields = len(self.keys)
        if lengths.dim() == 1:
            if num_fields == 0 or lengths.numel() % num_fields != 0:
                raise ValueError(
                    f"flat lengths of size {lengths.numel()} do not split into "
                    f"{num_fields} fields of equal batch size"
                )
            lengths = lengths.view(num_fields, -1)
        self.values: Tensor = values
        self.lengths: Tensor = lengths
        self.weights: Optional[Tensor] = weights
        self.offsets: Tensor = _lengths_to_offsets(lengths.reshape(-1))
        self._key_index: Optional[dict[str, int]] = None
        if validate:
            self._validate()

    # ------------------------------------------------------------------ build
    @classmethod
    def from_offsets(
        cls,
        keys: Sequence[str],
        values: Tensor,
        offsets: Tensor,
        weights: Optional[Tensor] = None,
    ) -> "JaggedBatch":
        """Build from ``offsets [F * B + 1]`` instead of lengths.

        Example::

            >>> JaggedBatch.from_offsets(["a", "b"], torch.arange(3), torch.tensor([0, 1, 1, 3, 3])).lengths.tolist()
            [[1, 0], [2, 0]]
        """
        if offsets.dim() != 1 or offsets.numel() < 1:
            raise ValueError(f"offsets must be 1-D with F * B + 1 entries, got shape {tuple(offsets.shape)}")
        return cls(keys, values, offsets[1:] - offsets[:-1], weights)

    @classmethod
    def from_kjt(cls, kjt: Any) -> "JaggedBatch":
        """Build from a torchrec ``KeyedJaggedTensor`` (ids and weights are shared, not copied).

        Needs every key to have the same batch size (no variable stride).

        Example::

            >>> batch = JaggedBatch.from_kjt(kjt)  # doctest: +SKIP
        """
        keys = list(kjt.keys())
        return cls(keys, kjt.values(), kjt.lengths(), kjt.weights_or_none())

    def to_kjt(self) -> Any:
        """Convert to a torchrec ``KeyedJaggedTensor`` (needs torchrec installed).

        Example::

            >>> kjt = batch.to_kjt()  # doctest: +SKIP
            >>> kjt.keys(), kjt.lengths()  # doctest: +SKIP
        """
        try:
            from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
        except ImportError as exc:  # torchrec is an optional peer, never a dependency
            raise ImportError(
                "JaggedBatch.to_kjt() needs torchrec; install fbgemm-gpu-cpu, then torchrec with --no-deps "
                "(see DESIGN.md, Environment facts)"
            ) from exc
        return KeyedJaggedTensor(
            keys=list(self.keys),
            values=self.values,
            weights=self.weights,
            lengths=self.lengths.reshape(-1),
        )

    # ------------------------------------------------------------ properties
    @property
    def num_fields(self) -> int:
        """Number of fields ``F``."""
        return len(self.keys)

    @property
    def batch_size(self) -> int:
        """Number of samples ``B`` (the stride of every field)."""
        return self.lengths.shape[1]

    @property
    def num_values(self) -> int:
        """Number of ids ``nnz``."""
        return self.values.numel()

    @property
    def field_offsets(self) -> Tensor:
        """``[F + 1]`` int64: field ``f``'s ids are ``values[field_offsets[f]:field_offsets[f + 1]]`` (a strided view)."""
        return self.offsets[:: max(self.batch_size, 1)] if self.batch_size > 0 else self.offsets.new_zeros(self.num_fields + 1)

    def key_index(self, key: str) -> int:
        """Position of field ``key``; raises ``KeyError`` naming the known keys."""
        if self._key_index is None:
            self._key_index = {k: i for i, k in enumerate(self.keys)}
        try:
            return self._key_index[key]
        except KeyError:
            raise KeyError(f"field {key!r} is not in this batch; its keys are {list(self.keys)}") from None

    def field_values(self, key: str) -> Tensor:
        """The ids of one field, a view into ``values``.

        Example::

            >>> JaggedBatch(["a", "b"], torch.tensor([5, 6, 7]), torch.tensor([[1], [2]])).field_values("b").tolist()
            [6, 7]
        """
        f = self.key_index(key)
        start, end = self.field_offsets[f : f + 2].tolist()
        return self.values[start:end]

    # -------------------------------------------------------------- reshape
    def select(self, keys: Sequence[str]) -> "JaggedBatch":
        """A new batch with only ``keys``, in that order (one vectorised gather, no per-field loop).

        Example::

            >>> b = JaggedBatch(["a", "b"], torch.tensor([5, 6, 7]), torch.tensor([[1], [2]]))
            >>> b.select(["b", "a"]).values.tolist()
            [6, 7, 5]
        """
        idx = torch.tensor([self.key_index(k) for k in keys], dtype=torch.long, device=self.lengths.device)
        lengths = self.lengths.index_select(0, idx)
        field_offsets = self.field_offsets
        starts = field_offsets.index_select(0, idx)
        counts = field_offsets[1:].index_select(0, idx) - starts
        total = int(counts.sum())
        # each selected field is one contiguous run of values: gather index = run start + position in run
        new_starts = torch.cumsum(counts, 0) - counts
        src = torch.repeat_interleave(starts - new_starts, counts, output_size=total)
        src += torch.arange(total, device=src.device)
        weights = None if self.weights is None else self.weights.index_select(0, src)
        return JaggedBatch(keys, self.values.index_select(0, src), lengths, weights, validate=False)

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "JaggedBatch":
        """A copy on ``device`` (returns ``self`` when already there)."""
        device = torch.device(device)
        if self.values.device == device:
            return self
        return JaggedBatch(
            self.keys,
            self.values.to(device, non_blocking=non_blocking),
            self.lengths.to(device, non_blocking=non_blocking),
            None if self.weights is None else self.weights.to(device, non_blocking=non_blocking),
            validate=False,
        )

    def __repr__(self) -> str:
        weighted = "weighted, " if self.weights is not None else ""
        return (
            f"JaggedBatch({weighted}F={self.num_fields}, B={self.batch_size}, nnz={self.num_values}, "
            f"keys={list(self.keys[:4])}{'...' if self.num_fields > 4 else ''})"
        )

    # ------------------------------------------------------------ internals
    def _validate(self) -> None:
        if len(set(self.keys)) != len(self.keys):
            dupes = sorted({k for k in self.keys if self.keys.count(k) > 1})
            raise ValueError(f"duplicate keys in a JaggedBatch: {dupes}")
        if self.lengths.dim() != 2 or self.lengths.shape[0] != len(self.keys):
            raise ValueError(
                f"lengths must be [F, B] with F={len(self.keys)} keys, got shape {tuple(self.lengths.shape)}"
            )
        if self.values.dim() != 1 or self.values.dtype not in _INDEX_DTYPES:
            raise ValueError(
                f"values must be 1-D int64 or int32, got shape {tuple(self.values.shape)} dtype {self.values.dtype}"
            )
        if self.lengths.dtype not in _INDEX_DTYPES:
            raise ValueError(f"lengths must be int64 or int32, got {self.lengths.dtype}")
        if self.lengths.numel() > 0 and int(self.lengths.min()) < 0:
            raise ValueError("lengths must be non-negative")
        total = int(self.offsets[-1])
        if total != self.values.numel():
            raise ValueError(f"lengths add up to {total} ids but values has {self.values.numel()}")
        if self.weights is not None:
            if self.weights.shape != self.values.shape or not self.weights.is_floating_point():
                raise ValueError(
                    f"weights must be a float tensor shaped like values {tuple(self.values.shape)}, "
                    f"got {tuple(self.weights.shape)} {self.weights.dtype}"
                )


def _lengths_to_offsets(lengths: Tensor) -> Tensor:
    """Exclusive prefix sum with a leading zero: ``[n]`` lengths -> ``[n + 1]`` int64 offsets."""
    offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int64, device=lengths.device)
    torch.cumsum(lengths, 0, dtype=torch.int64, out=offsets[1:])
    return offsets
