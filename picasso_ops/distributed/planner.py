"""Which packed tables to replicate on every rank and which to shard row-wise: a per-table cost model.

:func:`plan_tables` gives each table a placement, ``"data_parallel"``
(:class:`~picasso_ops.distributed.DataParallelEmbeddingCollection`: every rank holds every row) or
``"row_wise"`` (:class:`~picasso_ops.distributed.RowShardedEmbeddingCollection`: id ``i`` on rank
``i % W``), from the table's size, the world size ``W`` and the ids a batch is expected to touch.

The cost model, per rank and optimizer step, for a table of ``R`` rows of dim ``D`` where one
rank's batch touches ``u`` distinct rows and the global batch ``g``:

============  ===========================================  ==========================  ===================
placement     bytes received (what the implementation      rows updated on this rank   memory on this rank
              sends)
============  ===========================================  ==========================  ===================
data_parallel ``(W-1) u 4 (D+2)``: the all-gather of every  ``g``: every rank applies   ``R`` rows
              rank's unique rows' gradients (fp32, with     every rank's rows
              the int64 row id as two fp32 columns)
row_wise      ``(W-1)/W u (8 + 8D)``: ids to their owners,  ``g / W``: only the rows    ``ceil(R / W)`` rows
              rows back, gradients to the owners            it owns
============  ===========================================  ==========================  ===================

A row's memory is its weight (``D`` x the table dtype's bytes) plus its optimizer state (fp32: one
value per row for ``rowwise_adagrad``, ``2 D`` for ``adam``, none for ``sgd``). Seconds are
``bytes / bandwidth + rows updated x D x update cost per value``, plus, for row-wise, a cost per
looked-up id (its routing, dedup and local pooling run as torch ops where the data-parallel lookup
runs the fused kernel) (:class:`CostModel`; set its constants for the network and CPU at hand).
With ``pipelined`` (the sparse-dist pipeline prepares the row-wise lookups on a thread while the
previous batch trains: ``picasso.pipeline``), the ids to the owners, the rows back and the
``1 - CostModel.row_wise_step_share`` of the per-id cost done there leave the step: only the
gradients to the owners (``(W-1)/W u 4D``) and the rest of the per-id cost stay on it.
``u`` is the expected number of distinct rows among ``n = batch size x ids per field x fields of the
table`` ids drawn uniformly, ``R (1 - (1 - 1/R)^n)`` (an upper bound for skewed ids; see
:func:`expected_unique_ids` for Zipf-skewed ones), unless the caller gives ``u``; ``g`` is then
``R (1 - (1 - u/R)^W)``, the ranks drawing independently.

The rules, in order (the first that applies decides, and is the plan's *why*):

1. an override for the table (``picasso.table_sharding``);
2. one rank, or a sequence (``pooling="none"``) table: data-parallel (nothing to shard / row-wise
   tables are pooled only);
3. a replicated copy larger than ``CostModel.max_replicated_bytes``: row-wise (it does not fit);
4. row-wise saves more than ``CostModel.min_saving_s`` per step: row-wise; else data-parallel (a
   small or hot table: the whole of it moves either way, and a replica keeps lookups local).

Then, for the plan as a whole: row-wise tables cost a fixed ``CostModel.latency_s`` per collective
(one exchange of counts, three per pack: ids, rows, gradients; pipelined: the gradients' only), paid
on the step; when no table *must* be row-wise (rules 1 and 3) and the tables chosen by rule 4 save less than
that together, they go back to data-parallel.

Example::

    >>> from picasso_ops.embedding import TableSpec
    >>> plan = plan_tables([TableSpec("small", 100, 16), TableSpec("huge", 50_000_000, 16)],
    ...                    world_size=4, batch_size=256)
    >>> plan.choice("small"), plan.choice("huge")
    ('data_parallel', 'row_wise')
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import math
from dataclasses import dataclass
from typing import Literal, Mapping, Optional, Sequence

import torch

from picasso_ops.embedding.sparse_optim import OPTIMIZERS
from picasso_ops.embedding.spec import TableSpec

__all__ = ["CostModel", "TableChoice", "ShardingPlan", "Placement", "PLACEMENTS", "plan_tables",
           "expected_unique_ids", "resolve_overrides"]

logger = logging.getLogger(__name__)

Placement = Literal["data_parallel", "row_wise"]
PLACEMENTS: tuple[str, ...] = ("data_parallel", "row_wise")

@dataclass(frozen=True)
class CostModel:
    """The constants of the planner's cost model (see the module docstring for how they are used).

    Attributes:
        bandwidth_bytes_per_s: bytes per second one rank receives in a collective.
        update_s_per_value: seconds to apply the optimizer to one value of one row (dedup included).
        row_wise_s_per_id: extra seconds per looked-up id on the row-wise path (owner routing, dedup,
            local pooling and their backward, against the fused data-parallel lookup).
        row_wise_step_share: with the sparse-dist pipeline, the share of ``row_wise_s_per_id`` still
            on the step (the local pooling and its backward; routing and dedup run on its thread).
        latency_s: fixed seconds of one collective (paid per exchange, whatever its size).
        min_saving_s: a table goes row-wise by cost only when that saves more than this per step.
        max_replicated_bytes: a table whose replicated copy (weights and optimizer state) is larger
            goes row-wise whatever the cost.

    The defaults are rough figures for gloo over loopback on a 2-core CPU host (``benchmarks/planner.py``
    times the placements); set them for the cluster.

    Example::

        >>> CostModel(max_replicated_bytes=2**30).latency_s > 0
        True
    """

    bandwidth_bytes_per_s: float = 1.0e9
    update_s_per_value: float = 1.0e-8
    row_wise_s_per_id: float = 2.0e-7
    row_wise_step_share: float = 0.5
    latency_s: float = 1.0e-4
    min_saving_s: float = 2.0e-5
    max_replicated_bytes: int = 1 << 30

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"CostModel.{f.name} must be a positive finite number, got {value!r}")


@dataclass(frozen=True)
class TableChoice:
    """One table's placement, why, and the model's figures for both placements (per rank, per step)."""

    name: str
    rows: int
    dim: int
    choice: Placement
    why: str
    unique_ids: float  # expected distinct rows of one rank's batch
    seconds: Mapping[str, float]  # placement -> modelled seconds per step
    memory_bytes: Mapping[str, int]  # placement -> bytes held on one rank


@dataclass(frozen=True)
class ShardingPlan:
    """The placement of every table, in the order given to :func:`plan_tables`.

    Example::

        >>> plan = plan_tables([TableSpec("a", 10, 4)], world_size=2, batch_size=8)
        >>> plan.choice("a"), plan.names("row_wise")
        ('data_parallel', ())
    """

    tables: tuple[TableChoice, ...]
    world_size: int

    def choice(self, name: str) -> Placement:
        """The placement of table ``name``."""
        for t in self.tables:
            if t.name == name:
                return t.choice
        raise KeyError(f"no table {name!r} in the plan; tables: {[t.name for t in self.tables]}")

    def names(self, placement: str) -> tuple[str, ...]:
        """The tables placed ``placement``, in plan order."""
        return tuple(t.name for t in self.tables if t.choice == placement)

    @property
    def uniform(self) -> Optional[Placement]:
        """The one placement of every table, or ``None`` for a mixed plan."""
        kinds = {t.choice for t in self.tables}
        return next(iter(kinds)) if len(kinds) == 1 else None  # type: ignore[return-value]

    def format(self) -> str:
        """The plan as a small text table: table, rows, dim, choice, why (one line per table).

        Example::

            >>> print(plan_tables([TableSpec("a", 10, 4)], world_size=1, batch_size=8).format())  # doctest: +SKIP
            table  rows  dim  choice         why
            a      10    4    data_parallel  one rank: nothing to shard
        """
        head = ("table", "rows", "dim", "choice", "why")
        lines = [head] + [(t.name, f"{t.rows:,}", str(t.dim), t.choice, t.why) for t in self.tables]
        widths = [max(len(line[i]) for line in lines) for i in range(len(head) - 1)]
        return "\n".join("  ".join([c.ljust(w) for c, w in zip(line[:-1], widths)] + [line[-1]]) for line in lines)

    def log(self, rank: int = 0, what: str = "tables") -> None:
        """Log the plan once, on rank 0 only (``logging`` INFO)."""
        if rank == 0:
            counts = {p: len(self.names(p)) for p in PLACEMENTS}
            logger.info("sharding plan for %s over %d ranks (%d data_parallel, %d row_wise):\n%s", what,
                        self.world_size, counts["data_parallel"], counts["row_wise"], self.format())


def expected_unique_ids(rows: int, draws: float, *, zipf_exponent: Optional[float] = None) -> float:
    """Expected distinct values among ``draws`` draws from ``rows`` values: ``sum_k 1 - (1 - p_k)^n``.

    Uniform draws (``p_k = 1/R``): ``R (1 - (1 - 1/R)^n)``. ``zipf_exponent`` s: the k-th most
    frequent value has ``p_k ~ k^-s`` (the synthetic stream's ids), far fewer distinct values.

    Example::

        >>> round(expected_unique_ids(1000, 1000), 1)
        632.3
        >>> round(expected_unique_ids(1000, 1000, zipf_exponent=1.1), 1)
        279.7
        >>> expected_unique_ids(1, 50)
        1.0
    """
    if rows < 1 or draws < 0:
        raise ValueError(f"expected_unique_ids: rows must be >= 1 and draws >= 0, got {rows} and {draws}")
    if zipf_exponent is None:
        return rows * -math.expm1(draws * math.log1p(-1.0 / rows)) if rows > 1 else float(draws > 0)
    if not zipf_exponent > 0:
        raise ValueError(f"expected_unique_ids: zipf_exponent must be > 0, got {zipf_exponent}")
    return _zipf_unique(int(rows), float(draws), float(zipf_exponent))


@functools.lru_cache(maxsize=256)
def _zipf_unique(rows: int, draws: float, s: float) -> float:
    chunk = 1 << 20
    norm = 0.0
    for lo in range(1, rows + 1, chunk):
        norm += float(torch.arange(lo, min(rows, lo + chunk - 1) + 1, dtype=torch.float64).pow(-s).sum())
    total = 0.0
    for lo in range(1, rows + 1, chunk):
        p = torch.arange(lo, min(rows, lo + chunk - 1) + 1, dtype=torch.float64).pow(-s) / norm
        total += float(-torch.expm1(draws * torch.log1p(-p.clamp(max=1 - 1e-16))).sum())
    return total


def _global_unique(rows: int, local: float, world_size: int) -> float:
    """Distinct rows over ``world_size`` ranks that each touch ``local`` of ``rows`` independently."""
    frac = min(1.0, local / rows)
    return rows * (1.0 - (1.0 - frac) ** world_size)


def _row_bytes(spec: TableSpec) -> int:
    """Bytes of one row: its weight and its fp32 optimizer state (one value per row or one per element)."""
    d = spec.embedding_dim
    kinds = OPTIMIZERS[spec.optimizer].state_kinds.values()  # TableSpec validated the optimizer's name
    return d * spec.dtype.itemsize + 4 * sum(1 if kind == "row" else d for kind in kinds)


def resolve_overrides(overrides: Mapping[str, str], specs: Sequence[TableSpec],
                      field_index: Optional[Mapping[str, int]] = None, *,
                      where: str = "table_sharding") -> dict[str, Placement]:
    """Table name -> placement from overrides keyed by table name or field index (``"3"``).

    ``field_index``: table name -> the index of its field (a key ``"3"`` names every table whose field
    is 3, e.g. both the deep and the wide table of field 3). A key that names no table, or a placement
    other than ``data_parallel`` / ``row_wise``, is an error naming ``where`` and the key.

    Example::

        >>> resolve_overrides({"b": "row_wise", "0": "data_parallel"}, [TableSpec("a", 5, 4), TableSpec("b", 5, 4)],
        ...                   {"a": 0, "b": 1})
        {'a': 'data_parallel', 'b': 'row_wise'}
    """
    names = [s.name for s in specs]
    by_field: dict[str, list[str]] = {}
    for name, index in (field_index or {}).items():
        by_field.setdefault(str(index), []).append(name)
    out: dict[str, Placement] = {}
    for key, value in overrides.items():
        if value not in PLACEMENTS:
            raise ValueError(f"{where}.{key}: placement must be one of {list(PLACEMENTS)}, got {value!r}")
        if key in names:
            targets = [key]
        elif key in by_field:
            targets = by_field[key]
        else:
            fields = f" or a field index 0..{len(by_field) - 1}" if by_field else ""
            raise ValueError(f"{where}.{key}: no table is named {key!r}; keys are table names "
                             f"{names[:6]}{' ...' if len(names) > 6 else ''}{fields}")
        for name in targets:
            if name in out and out[name] != value:
                raise ValueError(f"{where}.{key}: table {name!r} is also overridden to {out[name]!r}")
            out[name] = value  # type: ignore[assignment]
    return {name: out[name] for name in names if name in out}  # in table order


def plan_tables(specs: Sequence[TableSpec], *, world_size: int, batch_size: int, ids_per_field: float = 1.0,
                unique_ids: Optional[Mapping[str, float]] = None,
                overrides: Optional[Mapping[str, str]] = None, cost: CostModel = CostModel(),
                pipelined: bool = False) -> ShardingPlan:
    """Place each table data-parallel or row-wise by the cost model (module docstring), overrides first.

    Args:
        specs: the tables (a table's fields are its ``feature_names``; one if it names none).
        world_size: ranks the tables span.
        batch_size: samples per rank per step.
        ids_per_field: mean ids per sample and field (1 for one-hot features).
        unique_ids: table name -> expected distinct rows of one rank's batch, in place of the
            uniform estimate (e.g. counted over a few batches of the real data).
        overrides: table name -> placement (already resolved, see :func:`resolve_overrides`).
        cost: the model's constants.
        pipelined: the row-wise lookups are prepared ahead by the sparse-dist pipeline (module docstring).

    Example::

        >>> plan = plan_tables([TableSpec("t", 10**6, 16)], world_size=2, batch_size=512,
        ...                    overrides={"t": "data_parallel"})
        >>> plan.tables[0].why
        'override (table_sharding)'
    """
    if world_size < 1 or batch_size < 1 or not ids_per_field > 0:
        raise ValueError(f"plan_tables: world_size and batch_size must be >= 1 and ids_per_field > 0, got "
                         f"{world_size}, {batch_size}, {ids_per_field}")
    overrides = dict(overrides or {})
    unique_ids = dict(unique_ids or {})
    names = {s.name for s in specs}
    for where, keys in (("overrides", overrides), ("unique_ids", unique_ids)):
        unknown = sorted(set(keys) - names)
        if unknown:
            raise ValueError(f"plan_tables: {where} name tables {unknown} that are not among {sorted(names)}")
    W = world_size
    choices: list[TableChoice] = []
    by_cost: list[int] = []  # indices chosen row-wise by rule 4 only
    forced_row_wise = False
    for spec in specs:
        R, D = int(spec.num_embeddings), int(spec.embedding_dim)
        fields = max(1, len(spec.feature_names))
        draws = batch_size * ids_per_field * fields  # ids looked up in this table per rank and step
        if spec.name in unique_ids:
            u = float(unique_ids[spec.name])
            if not 0 <= u:
                raise ValueError(f"plan_tables: unique_ids[{spec.name!r}] must be >= 0, got {u}")
            u = min(u, float(R))
        else:
            u = expected_unique_ids(R, draws)
        g = _global_unique(R, u, W)
        seconds = {
            "data_parallel": (W - 1) * u * 4 * (D + 2) / cost.bandwidth_bytes_per_s + g * D * cost.update_s_per_value,
            "row_wise": (W - 1) / W * u * (4 * D if pipelined else 8 + 8 * D) / cost.bandwidth_bytes_per_s
            + g / W * D * cost.update_s_per_value
            + draws * cost.row_wise_s_per_id * (cost.row_wise_step_share if pipelined else 1.0),
        }
        row = _row_bytes(spec)
        memory = {"data_parallel": R * row, "row_wise": -(-R // W) * row}
        saving = seconds["data_parallel"] - seconds["row_wise"]
        choice: Placement
        if spec.name in overrides:
            choice, why = overrides[spec.name], "override (table_sharding)"  # type: ignore[assignment]
            forced_row_wise |= choice == "row_wise"
        elif W == 1:
            choice, why = "data_parallel", "one rank: nothing to shard"
        elif spec.pooling == "none":
            choice, why = "data_parallel", "sequence table: row-wise tables are pooled only"
        elif memory["data_parallel"] > cost.max_replicated_bytes:
            choice = "row_wise"
            why = (f"a replica needs {memory['data_parallel'] / 2**20:,.0f} MiB > "
                   f"{cost.max_replicated_bytes / 2**20:,.0f} MiB")
            forced_row_wise = True
        elif saving > cost.min_saving_s:
            choice = "row_wise"
            why = f"saves {saving * 1e6:,.0f} us/step (~{u:,.0f} unique ids/rank)"
            by_cost.append(len(choices))
        else:
            hot = "hot (the batch touches most rows): " if u >= 0.5 * R else ""
            gain = (f"row-wise saves only {saving * 1e6:,.1f} us/step" if saving > 0
                    else f"row-wise costs {-saving * 1e6:,.1f} us/step more")
            choice, why = "data_parallel", f"{hot}{gain} (~{u:,.0f} unique ids/rank)"
        choices.append(TableChoice(spec.name, R, D, choice, why, u, seconds, memory))
    if by_cost and not forced_row_wise:
        packs = len({(s.embedding_dim, s.optimizer, s.dtype) for s in specs if s.name in
                     {choices[i].name for i in by_cost}})
        fixed = (packs if pipelined else 1 + 3 * packs) * cost.latency_s  # pipelined: the gradients' exchange only
        total = sum(choices[i].seconds["data_parallel"] - choices[i].seconds["row_wise"] for i in by_cost)
        if total < fixed:
            for i in by_cost:
                choices[i] = dataclasses.replace(
                    choices[i], choice="data_parallel",
                    why=f"row-wise would save {total * 1e6:,.0f} us/step in all, < its exchange's "
                        f"{fixed * 1e6:,.0f} us fixed cost")
    return ShardingPlan(tuple(choices), W)
