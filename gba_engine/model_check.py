"""Which modules of a model cannot train under a ``gba`` block: refused before anything waits on another rank.

Under a gba block the last ``num_servers`` ranks serve the whole job inside ``gba_engine.initialize``:
they never run the user's loop and never join a collective. Embedding rows train correctly only where
the servers aggregate them (per id over the global batch, under the dense part's token control). Two
kinds of modules break that, and :func:`check_gba_model` refuses both, naming each module's path in the
model, its class, why, and what to use instead:

* modules that run collectives in their forward or sparse step (picasso's data-parallel and row-sharded
  packed collections, the cached field embeddings, anything of ``picasso_ops.distributed``, and any other
  module with picasso's ``SparseStepModule`` contract, whose ``sparse_step`` gba_engine never calls):
  their collectives run over groups that include the server ranks (default: the world), so every worker
  would wait for the servers forever;
* tables whose rows live and are updated on each worker alone (a plain ``PackedEmbeddingCollection``,
  whose fused optimizer runs inside backward, a ``CachedEmbeddingTable``, a ``DynamicEmbeddingTable``):
  the servers never see their rows, so the workers' replicas drift apart.

The replacement is :class:`gba_engine.packed_tables.ServerPackedFieldEmbeddings` (picasso's packed
layout and sparse optimizer, the rows on the servers), which ``sparse_scale.tables_from_block(...)``
builds from the picasso block; per-field ``ServerFieldEmbeddings`` / ``ServerEmbeddingBagCollection``
(``gba_engine.tables``) work too.

The check reads the model only (no torch.distributed, no store): every rank sees the same model, so
every rank decides alike and raises before the first wait. ``gba_engine.initialize`` and
``gba_engine.rejoin`` call it first; another entry point with a gba block should too.

Example::

    >>> import torch
    >>> from gba_engine.model_check import check_gba_model, gba_refusals
    >>> gba_refusals(torch.nn.Linear(2, 2))
    []
    >>> check_gba_model(torch.nn.Linear(2, 2))      # nothing to refuse: returns None
"""
from __future__ import annotations

import dataclasses
from typing import Iterator

from torch import nn

__all__ = ["GBAModelError", "Refusal", "check_gba_model", "gba_refusals", "REPLACEMENT"]

REPLACEMENT = ("use gba_engine.packed_tables.ServerPackedFieldEmbeddings instead (picasso's packed layout and sparse "
               "optimizer with the rows on the parameter servers; sparse_scale.tables_from_block(...) builds it from "
               "the picasso block), or gba_engine.tables.ServerFieldEmbeddings / ServerEmbeddingBagCollection")

_SERVERS_NEVER_JOIN = ("the parameter-server ranks; they serve the job inside gba_engine.initialize and never join a "
                       "collective, so the workers would wait for them until the job is killed")
_LOCAL_ROWS = ("the servers never aggregate its rows over the global batch, so each worker trains its own replica and "
               "the replicas drift apart (and gba's staleness control never sees them)")

# (module, class) of picasso_ops classes -> why; matched along the MRO: a subclass is refused for its base's reason
_KNOWN: dict[tuple[str, str], str] = {
    ("picasso_ops.distributed.data_parallel", "DataParallelEmbeddingCollection"):
        "its sparse_step() all-gathers the row gradients over its process group (default: the world, which includes "
        f"{_SERVERS_NEVER_JOIN}); and {_LOCAL_ROWS}",
    ("picasso_ops.distributed.row_sharded", "RowShardedEmbeddingCollection"):
        "its forward and sparse_step() exchange rows (all_to_all) with every rank of its process group (default: the "
        f"world, which includes {_SERVERS_NEVER_JOIN}); the servers already spread the rows of server tables",
    ("picasso_ops.cache.fields", "CachedFieldEmbeddings"):
        "its sparse_step() all-gathers the row gradients over its process group (default: the world, which includes "
        f"{_SERVERS_NEVER_JOIN}); and its rows live in a store on each worker: {_LOCAL_ROWS}",
    ("picasso_ops.embedding.packed", "PackedEmbeddingCollection"):
        f"it updates its rows on each worker alone, inside backward with its own fused optimizer: {_LOCAL_ROWS}",
    ("picasso_ops.cache.cached_table", "CachedEmbeddingTable"):
        f"its rows live and are updated in a cache and a store on each worker: {_LOCAL_ROWS}",
    ("picasso_ops.vocab.dynamic_table", "DynamicEmbeddingTable"):
        f"it updates its rows on each worker alone, inside backward with its own optimizer: {_LOCAL_ROWS}",
}
_DISTRIBUTED_PACKAGE = "picasso_ops.distributed"
_SPARSE_STEP = ("it has picasso's SparseStepModule contract (sparse_step / discard_pending): its rows take their "
                "optimizer step outside the engine, which gba_engine never runs; a distributed sparse_step is a "
                f"collective over groups that include {_SERVERS_NEVER_JOIN}; and {_LOCAL_ROWS}")
# gba_engine's own table modules hold no rows on the workers: nothing below them to check
_SERVER_SIDE = ("gba_engine.tables", "gba_engine.packed_tables")


class GBAModelError(ValueError):
    """The model holds modules that cannot train under a gba block; ``refusals`` lists each with its reason.

    Example::

        try:
            gba_engine.initialize(model=model, config=cfg)
        except GBAModelError as exc:
            [r.path for r in exc.refusals]          # ['model.emb']
    """

    def __init__(self, message: str, refusals: list["Refusal"]) -> None:
        super().__init__(message)
        self.refusals = refusals

    def __reduce__(self):  # picklable with its refusals (multiprocessing reports it)
        return (type(self), (str(self), self.refusals))


@dataclasses.dataclass(frozen=True)
class Refusal:
    """One refused module: its path in the model (``model.emb``), its class (``module.Class``) and why."""

    path: str
    cls: str
    reason: str
    inside: str = ""  # the enclosing module unless it is the root, e.g. "model.embeddings (PackedFieldEmbeddings)"

    def describe(self) -> str:
        where = f", inside {self.inside}" if self.inside else ""
        return f"{self.path} ({self.cls}{where}): {self.reason}"


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _reason(module: nn.Module) -> str | None:
    """Why ``module`` cannot train under gba, or None."""
    for cls in type(module).__mro__:
        known = _KNOWN.get((cls.__module__, cls.__name__))
        if known is not None:
            return known
    for cls in type(module).__mro__:
        if cls.__module__ == _DISTRIBUTED_PACKAGE or cls.__module__.startswith(_DISTRIBUTED_PACKAGE + "."):
            return (f"it is a module of {_DISTRIBUTED_PACKAGE}, whose modules run collectives over groups that "
                    f"include {_SERVERS_NEVER_JOIN}")
    if callable(getattr(module, "sparse_step", None)) and callable(getattr(module, "discard_pending", None)):
        return _SPARSE_STEP  # picasso_ops.contracts.SparseStepModule, checked structurally as its isinstance does
    return None


def _walk(module: nn.Module, path: str, parent: str, seen: set[int]) -> Iterator[Refusal]:
    if id(module) in seen:
        return
    seen.add(id(module))
    if type(module).__module__ in _SERVER_SIDE:
        return
    reason = _reason(module)
    if reason is not None:
        yield Refusal(path, _qualname(type(module)), reason, parent)
        return  # its children are its own business (a collection's pack kernels)
    here = f"{path} ({type(module).__name__})"
    for name, child in module.named_children():
        if child is not None:
            yield from _walk(child, f"{path}.{name}", here if "." in path else "", seen)


def gba_refusals(model: nn.Module, name: str = "model") -> list[Refusal]:
    """Every module of ``model`` that cannot train under a gba block (outermost first; ``[]`` when none).

    ``name`` is the root's name in the paths (``model.emb``, ``model.tower.tables``).

    Example::

        >>> gba_refusals(nn.Sequential(nn.Linear(2, 2)))
        []
    """
    return list(_walk(model, name, "", set()))


def check_gba_model(model: nn.Module, name: str = "model", entry: str = "gba_engine.initialize") -> None:
    """Raise :class:`GBAModelError` naming every module of ``model`` that cannot train under a gba block.

    Call it on every rank before anything waits on another rank (it reads the model only, so every rank
    decides alike). ``entry`` names the caller in the message.

    Example::

        check_gba_model(model)     # GBAModelError: ... model.emb (picasso_ops...DataParallelEmbeddingCollection): ...
    """
    refusals = gba_refusals(model, name)
    if not refusals:
        return
    lines = "\n".join(f"  - {r.describe()}" for r in refusals)
    noun = "module" if len(refusals) == 1 else "modules"
    raise GBAModelError(f"{entry}: the model has {len(refusals)} {noun} that cannot train under a gba block (the "
                        f"last gba.num_servers ranks serve the job and train no module themselves):\n{lines}\n"
                        f"{REPLACEMENT[0].upper()}{REPLACEMENT[1:]}.", refusals)
