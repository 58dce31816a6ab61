"""Which table modules of a model would drift apart across data-parallel ranks: a check to run before step 1.

A module that updates its rows inside ``loss.backward()`` on each rank alone
keeps one independent copy per rank. Under data parallelism every rank sees
other samples, so those copies diverge step by step while nothing fails.
:func:`replica_problems` names every such module, so an entry point can refuse
the model (or wrap its tables) before training starts:

* a plain :class:`~picasso_ops.embedding.PackedEmbeddingCollection` in fused
  mode (its backward applies the sparse optimizer to this rank's buffer);
* a :class:`~picasso_ops.cache.CachedEmbeddingTable` or a
  :class:`~picasso_ops.vocab.DynamicEmbeddingTable` registered in the model
  (their backward updates this rank's rows).

Not listed: modules with a sparse step (:class:`~picasso_ops.contracts.SparseStepModule`:
``DataParallelEmbeddingCollection``, ``RowShardedEmbeddingCollection``,
``CachedFieldEmbeddings``, whose ``sparse_step`` all-gathers the row gradients
of every rank) and everything inside them; modules whose ``rank_local``
attribute is ``True`` (differing per rank on purpose); ``mode="autograd"``
collections and dense embeddings (their ``.grad`` is all-reduced by
DeepSpeed / DDP).

Example::

    >>> from picasso_ops.distributed import replica_problems
    >>> problems = replica_problems(model, world_size=2)  # doctest: +SKIP
    >>> if problems:  # doctest: +SKIP
    ...     raise ValueError("tables would diverge across ranks:\\n" + "\\n".join(problems))
"""
from __future__ import annotations

from typing import Optional

from torch import nn

from picasso_ops.contracts import SparseStepModule
from picasso_ops.embedding.packed import REPLICA_ADVICE, PackedEmbeddingCollection

__all__ = ["replica_problems"]

_CACHE_ADVICE = ("use picasso_ops.cache.CachedFieldEmbeddings (data-parallel, stepped by engine_step) or set its "
                 "rank_local = True if the rows are meant to differ per rank")


def _tables(names: list[str]) -> str:
    return f"{names[:4]}{' and %d more' % (len(names) - 4) if len(names) > 4 else ''}"


def _rank_local_update(module: nn.Module) -> Optional[str]:
    """What ``module`` updates on each rank alone, with the fix; ``None`` when it keeps ranks in sync."""
    from picasso_ops.cache.cached_table import CachedEmbeddingTable  # lazily: picasso_ops.cache imports this package
    from picasso_ops.vocab.dynamic_table import DynamicEmbeddingTable

    if isinstance(module, PackedEmbeddingCollection):
        if module.mode != "fused":
            return None  # autograd mode: its .grad is all-reduced with the dense gradients
        return (f"PackedEmbeddingCollection (tables {_tables([s.name for s in module.specs])}) updates each rank's "
                f"copy alone in its fused backward; {REPLICA_ADVICE}")
    if isinstance(module, CachedEmbeddingTable):
        return f"CachedEmbeddingTable ({module.store.num_rows} rows) updates each rank's rows alone in its backward; " \
               + _CACHE_ADVICE
    if isinstance(module, DynamicEmbeddingTable):
        return (f"DynamicEmbeddingTable (capacity {module.capacity}) admits and updates each rank's rows alone in its "
                "backward; set its rank_local = True if the rows are meant to differ per rank")
    return None


def replica_problems(model: nn.Module, world_size: int) -> list[str]:
    """One line per table module of ``model`` whose replicas would diverge over ``world_size`` data-parallel ranks.

    Each line starts with the module's path in ``model`` (``emb``, ``tower.tables``; the model itself is
    ``<model>``), then says what it updates alone and what to use instead. Empty when ``world_size`` is 1
    or every table keeps its ranks in sync. Pure: reads the modules, changes nothing, no collective.

    Example::

        >>> from picasso_ops.embedding import PackedEmbeddingCollection, TableSpec
        >>> from picasso_ops.distributed import DataParallelEmbeddingCollection
        >>> model = nn.ModuleDict({"emb": PackedEmbeddingCollection([TableSpec("a", 10, 4)]),
        ...                        "ok": DataParallelEmbeddingCollection([TableSpec("b", 10, 4)])})
        >>> [line.split(":")[0] for line in replica_problems(model, world_size=2)]
        ['emb']
        >>> replica_problems(model, world_size=1)
        []
    """
    if world_size <= 1:
        return []
    covered: set[int] = set()  # modules inside a sparse-step module, a rank-local one or one already listed
    problems = []
    for name, module in model.named_modules():  # a parent comes before its children
        if id(module) in covered:
            continue
        if isinstance(module, SparseStepModule) or getattr(module, "rank_local", False) is True:
            covered.update(id(m) for m in module.modules())
            continue
        reason = _rank_local_update(module)
        if reason is not None:
            problems.append(f"{name or '<model>'}: {reason}; its {world_size} replicas would diverge")
            covered.update(id(m) for m in module.modules())
    return problems
