"""The value rules both file readers apply: what a good dense value is, and how categorical values become ids.

One function decides whether a dense value is usable, :func:`check_dense`, for a TSV/CSV field and a
parquet cell alike, so a value is the same bad row (counted against ``max_bad_fraction``) whichever
file it came from: it must be finite and at most ``DENSE_LIMIT`` in magnitude (1e308 would
otherwise train as ``log1p(1e308)`` = 709.2, and a float32 input overflows at 3.4e38)::

    features, ok = check_dense(np.array([[3.0, 1e308]]), np.array([[True, True]]), "log1p")
    # features [[1.386, 0.0]], ok [[True, False]]
    raw, counts, ok = decode_categorical(buf, starts, ends, separator="|", values="text")
"""
from __future__ import annotations

import logging
from typing import Literal

import numpy as np

from .parsing import dense_transform, hash_text, parse_decimal, parse_hex, parse_number, split_spans

logger = logging.getLogger(__name__)

__all__ = ["DENSE_LIMIT", "check_dense", "dense_problem", "decode_dense", "decode_categorical", "pack_values",
           "stack_categorical"]

# The largest dense magnitude used: an 18-digit integer (the longest a text field may hold as an integer) is
# below it, and it fits float32 with room to spare.
DENSE_LIMIT = 1e18


def check_dense(values: np.ndarray, present: np.ndarray, transform: Literal["log1p", "none"] = "log1p"
                ) -> tuple[np.ndarray, np.ndarray]:
    """Model inputs and the good-value mask of float64 dense ``values`` ``[n, D]``: ``features, ok = check_dense(...)``.

    A value is good when missing (``present`` False: it becomes 0) or finite with ``|v| <= DENSE_LIMIT``.
    ``transform`` "log1p": Criteo's ``log1p(max(v, 0))``; "none": the value as float32. Bad values
    become 0 in ``features``; the caller drops their rows.
    """
    values = np.asarray(values, dtype=np.float64)
    with np.errstate(invalid="ignore"):
        ok = ~present | (np.isfinite(values) & (np.abs(values) <= DENSE_LIMIT))
    usable = np.where(present & ok, values, 0.0)
    features = dense_transform(usable) if transform == "log1p" else usable.astype(np.float32)
    return features, ok


def dense_problem(column: str, text: str, value: float | None) -> str:
    """Why a dense value failed :func:`check_dense` or its parser, for a bad-row report.

    ``dense_problem("I3", "1e308", 1e308)`` -> ``"column I3 is out of range (1e308): |value| must be <= 1e+18"``.
    """
    if value is None:
        return f"column {column} is not a number ({text!r})"
    if not np.isfinite(value):
        return f"column {column} is not finite ({text})"
    return f"column {column} is out of range ({text}): |value| must be <= {DENSE_LIMIT:g}"


def decode_dense(buf: np.ndarray, starts: np.ndarray, ends: np.ndarray, values: Literal["decimal", "integer"]
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Text spans of dense values to ``(float64 values, present, parsed)``; :func:`check_dense` judges the values.

    ``values`` "integer": ``-?[0-9]{1,18}`` only (Criteo's); "decimal": also ``3.5``, ``1e-3``.
    """
    if values == "integer":
        ints, present, parsed = parse_decimal(buf, starts, ends)
        return ints.astype(np.float64), present, parsed
    return parse_number(buf, starts, ends)


def _parse_categorical(buf: np.ndarray, starts: np.ndarray, ends: np.ndarray, values: Literal["text", "hex"]
                       ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    if values == "hex":
        return parse_hex(buf, starts, ends)
    present = np.asarray(ends) > np.asarray(starts)
    return hash_text(buf, starts, ends), present, np.ones(len(present), bool)


def decode_categorical(buf: np.ndarray, starts: np.ndarray, ends: np.ndarray, separator: str | None,
                       values: Literal["text", "hex"]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Text spans of one categorical column (or several, raveled) to ``(raw, counts, ok)``.

    Without a separator: ``raw`` uint64 ``[n]``, ``counts`` bool ``[n]`` (value present), ``ok`` ``[n]``.
    With one (multi-hot): ``raw`` ``[n, H]`` (H = most values in a row, at least 1), ``counts`` int64 ``[n]``
    (values in the row; empty pieces are skipped), ``ok`` ``[n]`` (every piece parsed). The raw values
    go to :class:`~picasso_ops.data.parsing.CategoricalHasher`.
    """
    if separator is None:
        return _parse_categorical(buf, starts, ends, values)
    p_start, p_end, owner, _ = split_spans(buf, starts, ends, ord(separator))
    piece_raw, _, piece_ok = _parse_categorical(buf, p_start, p_end, values)
    return pack_values(piece_raw, piece_ok, owner, len(starts))


def pack_values(raw: np.ndarray, ok: np.ndarray, owner: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Values of ``n`` rows, value ``k`` belonging to row ``owner[k]`` (``owner`` sorted), as multi-hot
    ``(raw [n, H], counts [n], ok [n])``: ``pack_values(np.array([7, 8, 9]), ok, np.array([0, 0, 2]), 3)``
    -> raw ``[[7, 8], [0, 0], [9, 0]]``, counts ``[2, 0, 1]``."""
    counts = np.bincount(owner, minlength=n).astype(np.int64)
    rank = np.arange(len(owner), dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
    packed = np.zeros((n, max(1, int(counts.max()) if n else 1)), np.uint64)
    packed[owner, rank] = raw
    row_ok = np.bincount(owner, weights=~np.asarray(ok, bool), minlength=n) == 0
    return packed, counts, row_ok


def stack_categorical(columns: list[tuple[np.ndarray, np.ndarray, np.ndarray]], multi_hot: bool
                      ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per-column results of :func:`decode_categorical` as ``raw [n, F]`` / ``present [n, F]`` (``multi_hot``
    False) or ``raw [n, F, H]`` / ``counts [n, F]``, with ``ok [n, F]``: what ``RowBlock`` holds."""
    if not multi_hot:
        return tuple(np.stack([c[i] for c in columns], axis=1) for i in range(3))  # type: ignore[return-value]
    width = max(c[0].shape[1] if c[0].ndim == 2 else 1 for c in columns)
    n = len(columns[0][2])
    raw = np.zeros((n, len(columns), width), np.uint64)
    for f, (r, _, _) in enumerate(columns):
        r2 = r[:, None] if r.ndim == 1 else r
        raw[:, f, :r2.shape[1]] = r2
    counts = np.stack([c[1].astype(np.int64) for c in columns], axis=1)
    ok = np.stack([c[2] for c in columns], axis=1)
    return raw, counts, ok
