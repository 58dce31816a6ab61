"""What a packed lookup does with an embedding id outside its table, and a guard against non-finite weights.

FBGEMM's table-batched embeddings take a ``BoundsCheckMode``: ``FATAL`` stops at an id
``< 0`` or ``>= num_rows``, ``WARNING`` warns and looks the id up as row 0, ``IGNORE``
quietly does the same. The ``picasso`` block's ``bounds_check`` key picks one of:

* ``"fatal"`` (default): an ``IndexError`` naming the field, the table, the bad id and the
  valid range (the same check the lookups always made; no extra cost);
* ``"warn"``: FBGEMM's WARNING: the id becomes row 0, logged once per table, counted;
* ``"clamp"``: the id is clamped into ``[0, num_rows - 1]`` (a negative id to row 0, a large one
  to the last row), logged once per table at INFO, counted.

``warn`` and ``clamp`` cost one ``aminmax`` over each pack's ids per lookup (``fatal`` lets
the custom op check the ids while it reads them). The counts are per process
(:meth:`BoundsCheck.counts`); train_rec prints them in its summary.

Example::

    >>> check = BoundsCheck("warn")
    >>> check.record({"user": 3}, {"user": ("f_user", -1, 100)})
    >>> check.counts()
    {'user': 3}
"""
from __future__ import annotations

import logging
import threading
from typing import Literal, Mapping, Optional

import torch
from torch import Tensor

__all__ = ["BoundsCheck", "BoundsCheckMode", "BOUNDS_CHECK_MODES", "check_finite_weights"]

logger = logging.getLogger(__name__)

BoundsCheckMode = Literal["fatal", "warn", "clamp"]
BOUNDS_CHECK_MODES: tuple[str, ...] = ("fatal", "warn", "clamp")


class BoundsCheck:
    """The mode and the per-table counts of out-of-range ids that ``warn`` / ``clamp`` replaced.

    Shared by a collection's packs; ``record`` may be called from the interleaving threads.

    Example::

        >>> BoundsCheck("clamp").mode
        'clamp'
    """

    def __init__(self, mode: str = "fatal") -> None:
        self.mode = mode  # validated by the setter
        self._counts: dict[str, int] = {}
        self._logged: set[str] = set()
        self._lock = threading.Lock()

    @property
    def mode(self) -> str:
        """``"fatal"``, ``"warn"`` or ``"clamp"``."""
        return self._mode

    @mode.setter
    def mode(self, value: str) -> None:
        if value not in BOUNDS_CHECK_MODES:
            raise ValueError(f"bounds_check must be one of {', '.join(BOUNDS_CHECK_MODES)}, got {value!r}")
        self._mode = value

    def __getstate__(self) -> dict:
        """Copies and pickles (``copy.deepcopy`` of a model, a spawned process) get their own lock."""
        state = dict(self.__dict__)
        del state["_lock"]
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def counts(self) -> dict[str, int]:
        """Out-of-range ids replaced so far, by table (tables without any are left out)."""
        with self._lock:
            return dict(self._counts)

    def reset(self) -> None:
        """Forget the counts (the once-per-table log lines stay logged)."""
        with self._lock:
            self._counts.clear()

    def record(self, per_table: Mapping[str, int], example: Mapping[str, tuple[str, int, int]]) -> None:
        """Count replaced ids by table; log the first of each table once (``example``: table -> (field, id, rows))."""
        with self._lock:
            for table, n in per_table.items():
                self._counts[table] = self._counts.get(table, 0) + int(n)
            first_time = [t for t in per_table if t not in self._logged]
            self._logged.update(first_time)
        for table in first_time:
            field, bad, rows = example[table]
            target = "row 0" if self.mode == "warn" else "the nearest valid row"
            logger.log(logging.WARNING if self.mode == "warn" else logging.INFO,
                       "picasso.bounds_check %r: field %r: id %d is out of range for table %r of %d rows "
                       "(valid ids are 0..%d); looked up as %s. Further out-of-range ids of this table are "
                       "counted, not logged.", self.mode, field, bad, table, rows, rows - 1, target)

    def replace(self, raw: Tensor, bound: Tensor, bad: Tensor) -> Tensor:
        """A copy of ``raw`` whose ``bad`` ids are replaced as the mode says (``raw`` itself is not changed)."""
        if self.mode == "warn":
            return torch.where(bad, torch.zeros_like(raw), raw)
        return torch.minimum(raw.clamp(min=0), (bound - 1).to(raw.dtype))


def check_finite_weights(weights: Optional[Tensor], field_offsets: Tensor, keys: tuple[str, ...]) -> None:
    """Raise ``ValueError`` naming the field, position and value of the first NaN/inf per-sample weight.

    A NaN weight would be written into the looked-up rows' gradients, so into the table and its
    optimizer state, and stay there. One ``isfinite`` pass (a host sync) per weighted batch.

    Example::

        >>> check_finite_weights(torch.tensor([1.0, float("nan")]), torch.tensor([0, 1, 2]), ("a", "b"))
        Traceback (most recent call last):
        ...
        ValueError: per-sample weights: field 'b': weight 0 of the field (position 1 of the batch) is nan; ...
    """
    if weights is None or weights.numel() == 0:
        return
    finite = torch.isfinite(weights)
    if bool(finite.all()):
        return
    i = int((~finite).nonzero()[0, 0])
    f = int(torch.searchsorted(field_offsets, torch.tensor(i, device=field_offsets.device), right=True)) - 1
    bad = int((~finite).sum())
    raise ValueError(
        f"per-sample weights: field {keys[f]!r}: weight {i - int(field_offsets[f])} of the field (position {i} of "
        f"the batch) is {float(weights[i])}; {bad} of {weights.numel()} weights are not finite. A NaN/inf weight "
        "would write NaN into the table rows and their optimizer state: fix or drop these samples")
