"""Bad-row accounting shared by the file readers: count, report the first few, fail past a limit.

    tracker = BadRowTracker(max_bad_fraction=0.01)
    tracker.start_file("day_0.tsv")
    tracker.record(rows=50_000, bad=800, describe=lambda k: first_k_bad_rows(k))
    tracker.check(final=True)   # raises DataError: 800 / 50_000 = 1.6% > 1%
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable

logger = logging.getLogger(__name__)

__all__ = ["DataError", "BadRow", "BadRowTracker"]

MIN_ROWS_FOR_EARLY_CHECK = 10_000  # before a file ends, judge the bad fraction only on this many rows


class DataError(ValueError):
    """A data file is malformed beyond the allowed fraction, or cannot be used at all."""


@dataclass(frozen=True)
class BadRow:
    """One skipped row: ``BadRow("a.tsv", "line 7", "label must be 0 or 1", "2\\t1\\t...")``."""

    path: str
    location: str
    reason: str
    text: str

    def __str__(self) -> str:
        return f"{self.path}:{self.location}: {self.reason}: {self.text[:200]!r}"


@dataclass
class FileCounts:
    """Rows and bad rows this reader has seen in one file."""

    path: str
    rows: int = 0
    bad: int = 0
    first_bad: BadRow | None = None


@dataclass
class BadRowTracker:
    """Counts bad rows per file, logs the first ``max_reported``, raises past ``max_bad_fraction``."""

    max_bad_fraction: float = 0.01
    max_reported: int = 5
    total_rows: int = 0
    total_bad: int = 0
    reported: list[BadRow] = field(default_factory=list)
    current: FileCounts | None = None
    _quiet: bool = False

    def __post_init__(self) -> None:
        if not 0.0 <= self.max_bad_fraction <= 1.0:
            raise ValueError(f"max_bad_fraction must lie in [0, 1], got {self.max_bad_fraction}")

    def start_file(self, path: str) -> None:
        """Begin counting a new file: ``tracker.start_file(path)``."""
        self.current = FileCounts(path)

    def record(self, rows: int, bad: int, describe: Callable[[int], list[BadRow]]) -> None:
        """Add ``rows`` seen (bad included) and ``bad`` skipped; ``describe(k)`` gives the first k bad rows."""
        if self.current is None:
            raise RuntimeError("start_file must be called before record")
        self.current.rows += rows
        self.total_rows += rows
        if bad == 0:
            return
        can_log = max(self.max_reported - len(self.reported), 0)
        need_first = self.current.first_bad is None
        wanted = min(bad, max(can_log, 1 if need_first else 0))
        examples = describe(wanted) if wanted else []
        if need_first and examples:
            self.current.first_bad = examples[0]
        for example in examples[:can_log]:
            self.reported.append(example)
            logger.warning("skipping bad row %s", example)
        if bad > can_log and not self._quiet:
            self._quiet = True
            logger.warning("more bad rows follow; they are counted, not logged (max_reported=%d)", self.max_reported)
        self.current.bad += bad
        self.total_bad += bad

    def check(self, final: bool) -> None:
        """Raise DataError when the current file's bad fraction is over the limit.

        Before the file ends (``final=False``) only after ``MIN_ROWS_FOR_EARLY_CHECK`` rows,
        so a few bad rows at the top of a large file do not stop it.
        """
        counts = self.current
        if counts is None or counts.rows == 0 or counts.bad == 0:
            return
        if not final and counts.rows < MIN_ROWS_FOR_EARLY_CHECK:
            return
        fraction = counts.bad / counts.rows
        if fraction > self.max_bad_fraction:
            raise DataError(
                f"{counts.path}: {counts.bad} of {counts.rows} rows read (this rank's share) are bad "
                f"({fraction:.2%} > max_bad_fraction {self.max_bad_fraction:.2%}); first bad row: {counts.first_bad}")

    def finish_file(self) -> None:
        """Final check and a summary line for the current file: ``tracker.finish_file()``."""
        self.check(final=True)
        if self.current is not None and self.current.bad:
            logger.warning("%s: skipped %d bad rows of %d", self.current.path, self.current.bad, self.current.rows)
