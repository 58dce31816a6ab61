"""The ``picasso`` config block applied to a packed CTR model: the hot-row cache, interleaving, their statistics.

``launch/train_rec.py`` builds the packed model from the block's packing,
sharding, embedding dim and optimizer, then calls :func:`apply_picasso_block`
for the rest:

* ``cache`` (``rows``, ``policy``, ``store``, ``prefetch``): every packed
  field-embedding module of the model (wide-and-deep: the deep ``embeddings``
  and the ``wide`` weights) becomes a
  :class:`~picasso_ops.cache.CachedFieldEmbeddings`: its fields' tables packed
  into one store (``"memory"``: host tensors; ``"mmap"``: a file per rank and
  module under ``workdir/picasso_cache/``) behind a cache of ``rows`` rows.
  Training through it gives the same weights as without it, bit for bit.
  ``"ps"`` (rows on gba_engine's parameter servers) is refused here: with a
  ``gba`` block train_rec puts that cache in front of the servers instead
  (``gba_engine/row_cache.py``), without one there are no servers. The cache
  serves data-parallel tables only.
* ``interleave.micro_batches`` ``K > 1``: the model is wrapped in
  :class:`~picasso_ops.interleave.InterleavedForward` (lookups, dense compute
  and embedding backwards of ``K`` micro-batches overlap on threads inside the
  engine's forward and backward; equal to ``K = 1`` up to float rounding).
  With a cache and ``prefetch``, the lookup of micro-batch ``i`` starts the
  store reads of micro-batch ``i + 1``; with ``K = 1`` there is no next
  micro-batch inside the model to read ahead, so ``prefetch`` does nothing.
* ``interleave.prefetch_batches`` is not about the model: ``launch/train_rec.py``
  reads its training stream through a :class:`~picasso_ops.data.prefetch.Prefetcher`
  that many batches ahead (0: off).

Errors name the block's key (``picasso.cache.rows``, ``picasso.cache.store``...).

Example::

    >>> model = packed_wide_and_deep(args, sparse_args(block))
    >>> model = apply_picasso_block(model, block, workdir=Path("runs/x"), rank=0)
    >>> flush_caches(model)                       # before a checkpoint or an evaluation
    >>> picasso_summary(model)["cache_hit_rate"]  # doctest: +SKIP
    0.83
"""
from __future__ import annotations

import copy
import logging
from pathlib import Path
from typing import Any, Callable, Optional

from torch import nn

from picasso_ops.cache.fields import CachedFieldEmbeddings
from picasso_ops.cache.store import HostRowStore, MmapRowStore, RowStore
from picasso_ops.config import CacheConfig, PicassoConfig
from picasso_ops.distributed.data_parallel import DataParallelEmbeddingCollection
from picasso_ops.embedding.packed import PackedEmbeddingCollection
from picasso_ops.interleave.forward import InterleavedForward
from picasso_ops.models.field_embeddings import PackedFieldEmbeddings

__all__ = ["PicassoBlockError", "apply_picasso_block", "bounds_check_summary", "cached_field_embeddings",
           "cached_modules", "flush_caches", "picasso_summary", "monitor_events", "scheduled_sparse_lr",
           "set_bounds_check", "with_children"]

logger = logging.getLogger(__name__)


class PicassoBlockError(ValueError):
    """A ``picasso`` block value that cannot be used with this model or job; the message names the key."""


def _packed_children(model: nn.Module) -> list[tuple[str, PackedFieldEmbeddings]]:
    return [(name, m) for name, m in model.named_children() if isinstance(m, PackedFieldEmbeddings)]


def with_children(model: nn.Module, replacements: dict[str, nn.Module]) -> nn.Module:
    """A shallow copy of ``model`` whose direct children ``replacements`` are swapped; ``model`` is not changed.

    The other children (and parameters, buffers) are the same objects as
    ``model``'s: the copy trains them. Only the copy's own registries (children,
    parameters, buffers, hooks) are new, so later edits of one do not show in the other.

    Example::

        >>> seq = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
        >>> new = with_children(seq, {"1": nn.Tanh()})
        >>> type(seq[1]).__name__, type(new[1]).__name__, new[0] is seq[0]
        ('ReLU', 'Tanh', True)
    """
    unknown = sorted(set(replacements) - set(dict(model.named_children())))
    if unknown:
        raise KeyError(f"{type(model).__name__} has no children {unknown}")
    new = copy.copy(model)
    for key, value in vars(model).items():
        if isinstance(value, (dict, set)):  # nn.Module's registries: the copy gets its own
            new.__dict__[key] = copy.copy(value)
    for name, child in replacements.items():
        new._modules[name] = child
    return new


def check_cache_config(cache: CacheConfig, table_rows: dict[str, int], *, sharding: str) -> None:
    """Raise :class:`PicassoBlockError` naming the key when ``cache`` cannot serve tables of these sizes.

    ``table_rows``: rows per cached module (its fields' vocab sizes summed).

    Example::

        >>> check_cache_config(CacheConfig(rows=10**6), {"embeddings": 5200}, sharding="data_parallel")
        Traceback (most recent call last):
        ...
        picasso_ops.block.PicassoBlockError: picasso.cache.rows = 1000000 is larger than ...
    """
    if cache.store == "ps":
        raise PicassoBlockError(
            'picasso.cache.store = "ps": the parameter-server store keeps rows on gba_engine\'s servers, which only '
            "a gba block starts; add a gba block (the rec job then puts the cache in front of the servers) or use "
            '"memory" or "mmap"')
    if sharding != "data_parallel":
        raise PicassoBlockError(
            f'picasso.cache with picasso.sharding = "{sharding}": the cache serves data-parallel tables (every rank '
            'holds every row); drop the cache block or use sharding "data_parallel"')
    for name, rows in table_rows.items():
        if cache.rows > rows:
            raise PicassoBlockError(
                f"picasso.cache.rows = {cache.rows} is larger than the table it caches: {name!r} packs its fields "
                f"into {rows} rows (their vocab sizes summed), so the cache would hold the whole table; use at most "
                f"{rows}, or drop the cache block")


def _store_factory(cache: CacheConfig, name: str, workdir: Optional[Path], rank: int):
    """``(rows, dim, state_dims) -> RowStore`` for the configured store kind."""
    if cache.store == "memory":
        return lambda n, d, sd: HostRowStore(n, d, sd)
    if workdir is None:
        raise PicassoBlockError('picasso.cache.store = "mmap" needs a folder for the table files (workdir)')
    folder = Path(workdir) / "picasso_cache" / f"rank{rank}"

    def make(n: int, d: int, sd: dict[str, int]) -> RowStore:
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"{name}.rows"
        logger.info("picasso cache: %s rows of %s in %s", n, name, path)
        return MmapRowStore(path, n, d, sd, create=True)  # a fresh file: the rows come from the model (or a checkpoint)

    return make


_STORE_NAMES = {"emb": "embeddings"}  # packed_wide_and_deep's table prefixes -> its module (and store file) names


def cached_field_embeddings(block: PicassoConfig, *, workdir: Optional[Path] = None, rank: int = 0
                            ) -> Callable[..., CachedFieldEmbeddings]:
    """A ``field_embeddings`` factory for ``packed_wide_and_deep`` (``packed_deepfm``, ``packed_dcn_v2``) that
    builds each module straight into the block's cache store (``CachedFieldEmbeddings.from_init``): the tables
    are never all in memory at once.

    Gives the same model, bit for bit, as building the packed tables and :func:`apply_picasso_block`.

    Example::

        >>> block = PicassoConfig(cache={"rows": 1000})
        >>> model = packed_wide_and_deep(WideAndDeepArgs([500] * 4, 3), SparseArgs(),
        ...                              field_embeddings=cached_field_embeddings(block))  # doctest: +SKIP
    """
    cache = block.cache
    if cache is None:
        raise PicassoBlockError("cached_field_embeddings needs a picasso.cache block")

    def make(vocab_sizes, dim, pooling, sparse, init_std, prefix) -> CachedFieldEmbeddings:
        name = _STORE_NAMES.get(prefix, prefix)
        check_cache_config(cache, {name: sum(int(v) for v in vocab_sizes)}, sharding=block.table_placement)
        return CachedFieldEmbeddings.from_init(
            vocab_sizes, dim, pooling, sparse, init_std, prefix, capacity=cache.rows, policy=cache.policy,
            prefetch=cache.prefetch, store_factory=_store_factory(cache, name, workdir, rank),
            capacity_key="picasso.cache.rows")

    return make


def apply_picasso_block(model: nn.Module, block: PicassoConfig, *, workdir: Optional[Path] = None,
                        rank: int = 0) -> nn.Module:
    """A new model: ``model`` with the block's cache and interleaving (a wrapper when ``micro_batches > 1``).

    ``model`` is a packed model (``packed_wide_and_deep`` / ``packed_dlrm``) built from the same block;
    modules already built into the cache (:func:`cached_field_embeddings`) are kept as they are.
    ``model`` itself is not changed: with a cache the result is a copy whose packed field
    embeddings are replaced by cached ones (:func:`with_children`; the dense layers are shared),
    so rebind the name (``model = apply_picasso_block(model, ...)``) to let the packed tables go.

    Example::

        >>> from picasso_ops.models import SparseArgs, WideAndDeepArgs, packed_wide_and_deep
        >>> model = packed_wide_and_deep(WideAndDeepArgs([500] * 4, 3), SparseArgs())
        >>> model = apply_picasso_block(model, PicassoConfig(cache={"rows": 1000}, interleave={"micro_batches": 2}))
        >>> type(model).__name__, type(model.embeddings).__name__
        ('InterleavedForward', 'CachedFieldEmbeddings')
    """
    set_bounds_check(model, block)
    if block.cache is not None:
        cache = block.cache
        children = _packed_children(model)
        built = {name: sum(m.vocab_sizes) for name, m in cached_modules(model)}  # cached_field_embeddings did it
        if not children and not built:
            raise PicassoBlockError(f"picasso.cache: {type(model).__name__} has no packed field embeddings to cache")
        rows = {**built, **{name: sum(s.num_embeddings for s in m.collection.specs) for name, m in children}}
        check_cache_config(cache, rows, sharding=block.table_placement)
        replacements: dict[str, nn.Module] = {}
        for name, packed in children:
            if not isinstance(packed.collection, DataParallelEmbeddingCollection):
                raise PicassoBlockError(f"picasso.cache: {name!r} is not a data-parallel packed collection")
            replacements[name] = CachedFieldEmbeddings.from_packed(
                packed, capacity=cache.rows, policy=cache.policy, prefetch=cache.prefetch,
                store_factory=_store_factory(cache, name, workdir, rank), capacity_key="picasso.cache.rows")
        if replacements:  # their rows now live in the stores
            model = with_children(model, replacements)
        if rank == 0:
            logger.info("picasso cache: %s rows per table of %s, policy %s, store %s, prefetch %s", cache.rows,
                        rows, cache.policy, cache.store, cache.prefetch)
        if cache.prefetch and block.interleave.micro_batches == 1 and rank == 0:
            logger.info("picasso.cache.prefetch reads the next micro-batch's rows ahead; with "
                        "interleave.micro_batches = 1 there is none inside a step, so it does nothing")
    if block.interleave.micro_batches > 1:
        model = InterleavedForward(model, block.interleave.micro_batches)
        if rank == 0:
            logger.info("picasso interleave: %d micro-batches per batch", block.interleave.micro_batches)
    return model


def scheduled_sparse_lr(block: Any) -> float | None:
    """The packed tables' peak lr for ``engine_step`` when they follow DeepSpeed's schedule, else ``None``.

    ``picasso.optimizer.lr_schedule`` ``"deepspeed"``: the tables' lr at each step
    is ``picasso.optimizer.lr`` x DeepSpeed's lr of that step / its schedule's
    peak; ``"constant"`` (or no picasso block): ``None``, the block's lr throughout.

    Example::

        >>> scheduled_sparse_lr(PicassoConfig.model_validate({"optimizer": {"type": "adam", "lr": 0.001}}))
        0.001
    """
    if block is None or block.optimizer.lr_schedule != "deepspeed":
        return None
    return float(block.optimizer.lr)


def set_bounds_check(model: nn.Module, block: PicassoConfig) -> int:
    """Give every packed collection of ``model`` the block's ``bounds_check`` mode; returns how many.

    "warn" and "clamp" replace ids in the packed data-parallel lookup; a cache or row-wise tables
    check ids on their own path (fatally), so those combinations are refused, naming the keys.

    Example::

        >>> set_bounds_check(nn.Linear(2, 2), PicassoConfig())
        0
    """
    if block.bounds_check != "fatal" and (block.cache is not None or block.table_placement != "data_parallel"):
        where = "picasso.cache" if block.cache is not None else f'picasso.sharding = "{block.sharding}"'
        raise PicassoBlockError(
            f'picasso.bounds_check = "{block.bounds_check}" with {where}: out-of-range ids are replaced in the '
            'packed data-parallel lookup only (a cache or row-wise tables check ids on their own path and stop '
            'at a bad one); use bounds_check "fatal", or drop the cache / use sharding "data_parallel"')
    found = [m for m in model.modules() if isinstance(m, PackedEmbeddingCollection)]
    for m in found:
        m.bounds_check = block.bounds_check
    return len(found)


def bounds_check_summary(model: nn.Module) -> dict[str, Any] | None:
    """The mode and this process's out-of-range ids by table of a model whose collections warn or clamp, else None.

    Example::

        >>> bounds_check_summary(nn.Linear(2, 2)) is None
        True
    """
    found = [m for m in model.modules() if isinstance(m, PackedEmbeddingCollection) and m.bounds_check != "fatal"]
    if not found:
        return None
    counts: dict[str, int] = {}
    for m in found:
        for table, n in m.bounds_check_counts().items():
            counts[table] = counts.get(table, 0) + n
    return {"mode": found[0].bounds_check, "out_of_range_ids": sum(counts.values()), "by_table": counts}


def cached_modules(model: nn.Module) -> list[tuple[str, CachedFieldEmbeddings]]:
    """``(name, module)`` of every cached field-embedding module in ``model``.

    Example::

        >>> [name for name, _ in cached_modules(model)]  # doctest: +SKIP
        ['embeddings', 'wide']
    """
    return [(name, m) for name, m in model.named_modules() if isinstance(m, CachedFieldEmbeddings)]


def flush_caches(model: nn.Module) -> int:
    """Write every cache's dirty rows back to its store (before a checkpoint or evaluation); returns how many caches.

    Example::

        >>> flush_caches(nn.Linear(2, 2))
        0
    """
    mods = cached_modules(model)
    for _, m in mods:
        m.flush()
    return len(mods)


def picasso_summary(model: nn.Module) -> dict[str, Any]:
    """The cache's statistics since the model was built (all caches together and per module) and the micro-batches.

    Example::

        >>> picasso_summary(nn.Linear(2, 2))
        {'interleave_micro_batches': 1}
    """
    k = model.micro_batches if isinstance(model, InterleavedForward) else 1
    out: dict[str, Any] = {"interleave_micro_batches": k}
    bounds = bounds_check_summary(model)
    if bounds is not None:  # ids that bounds_check "warn" / "clamp" replaced on this rank
        out["bounds_check"] = bounds
    mods = cached_modules(model)
    if not mods:
        return out
    per = {}
    hits = misses = 0
    for name, m in mods:
        s = m.stats
        hits, misses = hits + s.hits, misses + s.misses
        per[name] = {"hit_rate": s.hit_rate, "hits": s.hits, "misses": s.misses, "prefetched": s.prefetched,
                     "evictions": s.evictions, "writebacks": s.writebacks, "capacity": m.cache.capacity,
                     "table_rows": m.row_starts[-1]}
    out["cache_hit_rate"] = hits / (hits + misses) if hits + misses else 0.0
    out["cache"] = per
    return out


def monitor_events(model: nn.Module, step: int) -> list[tuple[str, float, int]]:
    """``(name, value, step)`` events of the cache statistics for ``engine.monitor.write_events`` ([] without a cache).

    Example::

        >>> monitor_events(nn.Linear(2, 2), 0)
        []
    """
    summary = picasso_summary(model)
    if "cache" not in summary:
        return []
    events = [("picasso/cache_hit_rate", float(summary["cache_hit_rate"]), step)]
    for name, s in summary["cache"].items():
        events += [(f"picasso/{name}/{k}", float(s[k]), step) for k in ("hit_rate", "evictions", "prefetched")]
    return events
