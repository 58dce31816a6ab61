"""Vectorised parsing of text fields and hashing of categorical values (numpy, no per-row loops).

Fields are spans ``[starts[i], ends[i])`` of one byte buffer, as in a TSV chunk or an
Arrow string column::

    buf = np.frombuffer(b"12\\t-3\\t\\tx", dtype=np.uint8)
    values, present, ok = parse_decimal(buf, np.array([0, 3, 6, 7]), np.array([2, 5, 6, 8]))
    # values [12, -3, 0, 0], present [T, T, F, T], ok [T, T, T, F]
"""
from __future__ import annotations

import logging
from typing import Sequence

import numpy as np

logger = logging.getLogger(__name__)

__all__ = ["parse_decimal", "parse_hex", "parse_number", "hash_text", "split_spans", "CategoricalHasher",
           "dense_transform", "MAX_DECIMAL_DIGITS", "MAX_HEX_DIGITS", "MAX_NUMBER_BYTES"]

MAX_DECIMAL_DIGITS = 18  # always fits int64
MAX_HEX_DIGITS = 16      # always fits uint64
MAX_NUMBER_BYTES = 64    # a longer decimal number text is a bad value
_SHORT_TEXT_WORDS = 8    # text values up to 64 bytes are hashed together; longer ones in a second pass

# SWAR ("SIMD within a register"): the bytes of a field are loaded as big-endian uint64
# words and checked and converted 8 characters per integer operation.
_U = np.uint64
_HIGH_BITS = _U(0x8080808080808080)
_ASCII_ZEROS = _U(0x3030303030303030)
_ALL_ONES = _U(0xFFFFFFFFFFFFFFFF)


def _load_words(buf: np.ndarray, ends: np.ndarray, num_words: int) -> list[np.ndarray]:
    """The ``8 * num_words`` bytes before each span end as big-endian uint64 words, first word first.

    Right-aligning every span in a fixed window makes the digit position of each byte
    the same for all spans; bytes before the window's start read as zero padding.
    """
    width = 8 * num_words
    padded = np.concatenate([np.zeros(width, np.uint8), np.asarray(buf, np.uint8), np.zeros(8, np.uint8)])
    # an unaligned uint64 starting at every byte offset (stride 1), read without copying
    words = np.ndarray(shape=(len(padded) - 7,), dtype=">u8", buffer=padded, strides=(1,))
    return [words[ends + 8 * i].astype(np.uint64) for i in range(num_words)]


def _low_bytes_mask(count: np.ndarray) -> np.ndarray:
    """uint64 whose low ``count`` bytes (clipped to 0..8) are all ones."""
    c = np.clip(count, 0, 8).astype(np.uint64)
    return np.where(c >= 8, _ALL_ONES, (_U(1) << (c * _U(8))) - _U(1))


def _byte_in_range(word: np.ndarray, lo: int, hi: int) -> np.ndarray:
    """High bit of each byte set where lo <= byte <= hi (bytes must be < 0x80, checked elsewhere)."""
    at_least_lo = word + _U((0x80 - lo) * 0x0101010101010101)
    above_hi = word + _U((0x7F - hi) * 0x0101010101010101)
    return at_least_lo & ~above_hi & _HIGH_BITS


def _decimal_word(word: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Value of 8 ASCII digits in a big-endian word, and whether all 8 are digits."""
    ok = ((word & _HIGH_BITS) == 0) & (_byte_in_range(word, 0x30, 0x39) == _HIGH_BITS)
    d = word - _ASCII_ZEROS
    # combine neighbours pairwise: 8 digits -> 4 two-digit lanes -> 2 four-digit lanes -> 1 value
    d = ((d >> _U(8)) & _U(0x00FF00FF00FF00FF)) * _U(10) + (d & _U(0x00FF00FF00FF00FF))
    d = ((d >> _U(16)) & _U(0x0000FFFF0000FFFF)) * _U(100) + (d & _U(0x0000FFFF0000FFFF))
    d = (d >> _U(32)) * _U(10000) + (d & _U(0xFFFFFFFF))
    return d, ok


def _hex_word(word: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Value of 8 ASCII hex digits in a big-endian word, and whether all 8 are hex digits."""
    is_digit = _byte_in_range(word, 0x30, 0x39)
    is_letter = _byte_in_range(word | _U(0x2020202020202020), 0x61, 0x66)  # | 0x20 folds A-F onto a-f
    ok = ((word & _HIGH_BITS) == 0) & ((is_digit | is_letter) == _HIGH_BITS)
    n = (word & _U(0x0F0F0F0F0F0F0F0F)) + (is_letter >> _U(7)) * _U(9)  # 'a' = 0x61: 1 + 9 = 10
    # pack one nibble per byte into 32 bits: 8 bytes -> 4 -> 2 -> 1
    n = (n | (n >> _U(4))) & _U(0x00FF00FF00FF00FF)
    n = (n | (n >> _U(8))) & _U(0x0000FFFF0000FFFF)
    n = (n | (n >> _U(16))) & _U(0xFFFFFFFF)
    return n, ok


def parse_decimal(buf: np.ndarray, starts: np.ndarray, ends: np.ndarray
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Parse optionally negative decimal integers: ``values, present, ok = parse_decimal(buf, s, e)``.

    Returns int64 values (0 where empty or invalid), ``present`` (span not empty) and
    ``ok`` (empty, or ``-?[0-9]{1,18}``).
    """
    starts = np.asarray(starts, dtype=np.int64)
    ends = np.asarray(ends, dtype=np.int64)
    length = ends - starts
    present = length > 0
    n = len(starts)
    if n == 0 or not present.any():
        return np.zeros(n, np.int64), present, np.ones(n, bool)
    neg = present & (buf[np.minimum(starts, len(buf) - 1)] == ord("-"))
    num_digits = length - neg
    ok = ~present | ((num_digits >= 1) & (num_digits <= MAX_DECIMAL_DIGITS))
    num_words = int(-(-min(int(num_digits.max()), MAX_DECIMAL_DIGITS) // 8))
    values = np.zeros(n, np.uint64)
    for i, word in enumerate(_load_words(buf, ends, num_words)):
        inside = _low_bytes_mask(num_digits - 8 * (num_words - 1 - i))
        # bytes before the digits (padding, a '-', other fields) become '0'
        digits, word_ok = _decimal_word((word & inside) | (_ASCII_ZEROS & ~inside))
        ok &= word_ok
        values = values * _U(100_000_000) + digits
    signed = values.astype(np.int64)  # < 10^18 wherever ok
    signed = np.where(neg, -signed, signed)
    signed[~ok] = 0
    return signed, present, ok


def parse_hex(buf: np.ndarray, starts: np.ndarray, ends: np.ndarray
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Parse hex strings of 1-16 digits: ``values, present, ok = parse_hex(buf, s, e)``.

    Returns uint64 values (0 where empty or invalid), ``present`` and ``ok``.
    """
    starts = np.asarray(starts, dtype=np.int64)
    ends = np.asarray(ends, dtype=np.int64)
    length = ends - starts
    present = length > 0
    n = len(starts)
    if n == 0 or not present.any():
        return np.zeros(n, np.uint64), present, np.ones(n, bool)
    ok = length <= MAX_HEX_DIGITS
    num_words = 1 if int(length.max()) <= 8 else 2  # Criteo's 8-digit values need one word
    values = np.zeros(n, np.uint64)
    for i, word in enumerate(_load_words(buf, ends, num_words)):
        inside = _low_bytes_mask(length - 8 * (num_words - 1 - i))
        nibbles, word_ok = _hex_word((word & inside) | (_ASCII_ZEROS & ~inside))
        ok &= word_ok
        values = (values << _U(32)) | nibbles
    values[~ok] = 0
    return values, present, ok


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser on uint64 (wrapping arithmetic is intended)."""
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


class CategoricalHasher:
    """Maps raw categorical values (uint64) of F fields to ids in each field's vocabulary.

    ``id = mix64(raw ^ salt_f) mod V_f`` where ``salt_f`` depends on the field index and
    ``seed``, so equal raw values in different fields land on unrelated ids::

        hasher = CategoricalHasher([1000] * 26, seed=0)
        ids = hasher(raw)   # raw uint64 [n, 26] -> int64 [n, 26]
    """

    def __init__(self, vocab_sizes: Sequence[int], seed: int = 0) -> None:
        if not vocab_sizes or any(int(v) < 1 for v in vocab_sizes):
            raise ValueError(f"vocab sizes must be >= 1, got {list(vocab_sizes)}")
        self.vocab_sizes = np.asarray(vocab_sizes, dtype=np.uint64)
        fields = np.arange(1, len(vocab_sizes) + 1, dtype=np.uint64)
        self._salt = _mix64(fields * np.uint64(0x9E3779B97F4A7C15) + np.uint64(seed & ((1 << 64) - 1)))

    @property
    def num_fields(self) -> int:
        """Number of categorical fields: ``hasher.num_fields``."""
        return int(len(self.vocab_sizes))

    def __call__(self, raw: np.ndarray) -> np.ndarray:
        """Hash uint64 ``raw`` of shape ``[n, F]`` (or ``[n, F, H]``, multi-hot) to int64 ids in ``[0, V_f)``."""
        if raw.ndim not in (2, 3) or raw.shape[1] != self.num_fields:
            raise ValueError(f"raw values must be [n, {self.num_fields}] or [n, {self.num_fields}, H], got {raw.shape}")
        salt, vocab = (self._salt, self.vocab_sizes) if raw.ndim == 2 else \
            (self._salt[:, None], self.vocab_sizes[:, None])
        mixed = _mix64(raw.astype(np.uint64, copy=False) ^ salt)
        return (mixed % vocab).astype(np.int64)


def dense_transform(values: np.ndarray, present: np.ndarray | None = None) -> np.ndarray:
    """Criteo integer features to model inputs: missing and negative -> 0, then log1p.

    ``dense_transform(np.array([[3, -1]]))`` -> ``[[1.386, 0.0]]`` as float32.
    """
    x = np.maximum(np.asarray(values, dtype=np.float64), 0.0)
    if present is not None:
        x = np.where(present, x, 0.0)
    x = np.nan_to_num(x, nan=0.0)
    return np.log1p(x).astype(np.float32)


def _hash_words(buf: np.ndarray, ends: np.ndarray, length: np.ndarray, num_words: int) -> np.ndarray:
    h = _mix64(length.astype(np.uint64) + _U(0x243F6A8885A308D3))
    for i, word in enumerate(_load_words(buf, ends, num_words)):
        count = length - 8 * (num_words - 1 - i)  # bytes of the value in this word
        mixed = _mix64(h ^ (word & _low_bytes_mask(count)))
        h = np.where(count > 0, mixed, h)  # words before the value leave h alone: the hash ignores num_words
    return h


def hash_text(buf: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """A 64-bit hash of each span's bytes (uint64): equal texts, equal hashes, wherever they were read.

    ``hash_text(np.frombuffer(b"ab,ab", np.uint8), np.array([0, 3]), np.array([2, 5]))`` -> two equal values.
    The empty span has a hash too (callers treat it as missing).
    """
    starts = np.asarray(starts, dtype=np.int64)
    ends = np.asarray(ends, dtype=np.int64)
    length = ends - starts
    out = np.zeros(len(starts), np.uint64)
    if len(starts) == 0:
        return out
    short = length <= 8 * _SHORT_TEXT_WORDS
    for part in (short, ~short):
        if part.any():
            num_words = max(1, int(-(-int(length[part].max()) // 8)))
            out[part] = _hash_words(buf, ends[part], length[part], num_words)
    return out


def parse_number(buf: np.ndarray, starts: np.ndarray, ends: np.ndarray
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Parse decimal numbers (``-12``, ``3.5``, ``1e-3``): ``values, present, ok = parse_number(buf, s, e)``.

    Returns float64 values (0 where empty or invalid), ``present`` (span not empty) and ``ok``
    (empty, or a number made of digits, one sign, '.', 'e'/'E'; no spaces, no "nan"/"inf"). Integers take
    the vectorised path of :func:`parse_decimal`; the other spans are converted by numpy in one call.
    """
    ints, present, ok = parse_decimal(buf, starts, ends)
    values = ints.astype(np.float64)
    retry = np.flatnonzero(present & ~ok)
    if len(retry) == 0:
        return values, present, ok
    s = np.asarray(starts, dtype=np.int64)[retry]
    e = np.asarray(ends, dtype=np.int64)[retry]
    width = int(min((e - s).max(), MAX_NUMBER_BYTES))
    index = s[:, None] + np.arange(width)
    inside = index < e[:, None]
    chars = np.where(inside, np.asarray(buf, np.uint8)[np.minimum(index, len(buf) - 1)], 0).astype(np.uint8)
    allowed = np.zeros(256, bool)
    allowed[np.frombuffer(b"0123456789+-.eE", np.uint8)] = True
    fine = (e - s <= MAX_NUMBER_BYTES) & (allowed[chars] | ~inside).all(axis=1) & \
        (np.isin(chars, np.frombuffer(b"0123456789", np.uint8))).any(axis=1)
    text = np.ascontiguousarray(chars).view(f"S{width}").ravel()
    parsed = np.zeros(len(retry), np.float64)
    try:
        parsed[fine] = text[fine].astype(np.float64)
    except ValueError:  # a malformed one among them ("1.2.3", "1e"): convert one by one to find it
        for j in np.flatnonzero(fine):
            try:
                parsed[j] = float(text[j])
            except ValueError:
                fine[j] = False
    values[retry] = np.where(fine, parsed, 0.0)
    ok[retry] = fine
    return values, present, ok


def split_spans(buf: np.ndarray, starts: np.ndarray, ends: np.ndarray, separator: int
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Split each span at ``separator`` (a byte value) into its non-empty pieces.

    Returns ``(piece_starts, piece_ends, owner, rank)``: piece ``k`` is ``[piece_starts[k], piece_ends[k])``
    of span ``owner[k]``, its ``rank[k]``-th non-empty piece. ``split_spans(b"a|b||c", [0], [6], ord("|"))``
    -> pieces a, b, c of span 0 with ranks 0, 1, 2.
    """
    starts = np.asarray(starts, dtype=np.int64)
    ends = np.asarray(ends, dtype=np.int64)
    seps = np.flatnonzero(np.asarray(buf, np.uint8) == separator)
    first = np.searchsorted(seps, starts)
    inner = np.searchsorted(seps, ends) - first  # separators inside each span
    pieces = np.where(ends > starts, inner + 1, 0)
    owner = np.repeat(np.arange(len(starts), dtype=np.int64), pieces)
    j = np.arange(int(pieces.sum()), dtype=np.int64) - np.repeat(np.cumsum(pieces) - pieces, pieces)
    sep_at = first[owner] + j
    last_sep = max(len(seps) - 1, 0)
    safe = seps if len(seps) else np.zeros(1, np.int64)
    p_start = np.where(j == 0, starts[owner], safe[np.clip(sep_at - 1, 0, last_sep)] + 1)
    p_end = np.where(j == inner[owner], ends[owner], safe[np.clip(sep_at, 0, last_sep)])
    keep = p_end > p_start
    p_start, p_end, owner = p_start[keep], p_end[keep], owner[keep]
    counts = np.bincount(owner, minlength=len(starts))
    rank = np.arange(len(owner), dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
    return p_start, p_end, owner, rank
