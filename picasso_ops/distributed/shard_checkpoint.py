"""Row-wise shards in a checkpoint: every rank writes its own rows, a resume reads them back at any world size.

DeepSpeed writes the module state of rank 0 only, which holds every replicated table but only rank
0's shard of a row-wise table. These helpers save each rank's shards (rows and optimizer state)
beside DeepSpeed's files, one file per rank, and load them back: with as many ranks as saved each
rank reloads its own file; with another number of ranks every rank puts each table together from
all files and takes its rows (``id % world_size == rank``).

Example::

    save_row_shards(model, Path("ckpt/step4"), rank)          # every rank, before the checkpoint commits
    skip = row_shard_keys(model)                               # DeepSpeed's module state: load all but these
    load_row_shards(model, Path("ckpt/step4"))                 # every rank, after DeepSpeed's load
"""
from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

import torch
from torch import nn

from picasso_ops.distributed.row_sharded import RowShardedEmbeddingCollection

__all__ = ["SHARD_FILE", "row_sharded_modules", "row_shard_keys", "save_row_shards", "load_row_shards"]

logger = logging.getLogger(__name__)

SHARD_FILE = "row_shards_rank{rank}.pt"
_SHARD_RE = re.compile(r"row_shards_rank(\d+)\.pt$")


def row_sharded_modules(model: nn.Module) -> dict[str, RowShardedEmbeddingCollection]:
    """The model's row-sharded collections by module name (a mixed collection's ``row_wise`` part included).

    Example::

        >>> row_sharded_modules(nn.Linear(2, 2))
        {}
    """
    return {name: m for name, m in model.named_modules() if isinstance(m, RowShardedEmbeddingCollection)}


def row_shard_keys(model: nn.Module) -> set[str]:
    """The keys of ``model.state_dict()`` that hold row-wise shards (they differ per rank: not in rank 0's file).

    Example::

        >>> row_shard_keys(nn.Linear(2, 2))
        set()
    """
    keys: set[str] = set()
    for name, module in row_sharded_modules(model).items():
        prefix = f"{name}." if name else ""
        keys.update(prefix + k for k in module.state_dict())
    return keys


def save_row_shards(model: nn.Module, folder: Path, rank: int) -> Path | None:
    """Write this rank's shards of every row-sharded collection to ``folder/row_shards_rank<rank>.pt``.

    Returns the file, or ``None`` when the model has no row-sharded tables (nothing written). Local:
    the caller's checkpoint commit must follow a barrier (DeepSpeed's ``save_checkpoint`` ends with one).
    """
    modules = row_sharded_modules(model)
    if not modules:
        return None
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / SHARD_FILE.format(rank=rank)
    torch.save({name: m.shard_state() for name, m in modules.items()}, path)
    return path


def load_row_shards(model: nn.Module, folder: Path) -> bool:
    """Load every rank's shard file in ``folder`` into the model's row-sharded collections; ``False``: none to load.

    Raises ``FileNotFoundError`` when the model has row-sharded tables and the folder has no shard
    files (a checkpoint written before shards were saved, or of another model), naming the folder;
    ``ValueError``/``KeyError`` (from :meth:`RowShardedEmbeddingCollection.load_shard_states`) when the
    files do not fit the tables.
    """
    modules = row_sharded_modules(model)
    if not modules:
        return False
    folder = Path(folder)
    files = sorted((int(m.group(1)), p) for p in folder.iterdir() if (m := _SHARD_RE.search(p.name)))
    if not files:
        raise FileNotFoundError(f"{folder}: no row_shards_rank*.pt files, but the model has row-sharded tables "
                                f"({sorted(modules)}); the checkpoint holds only rank 0's shards and cannot be "
                                "resumed exactly")
    saved: list[dict[str, Any]] = [torch.load(p, map_location="cpu", weights_only=True) for _, p in files]
    for name, module in modules.items():
        states = [s[name] for s in saved if name in s]
        if len(states) != len(saved):
            raise KeyError(f"{folder}: the shard files do not all hold module {name!r}")
        module.load_shard_states(states)
    logger.debug("row shards of %s loaded from %d files in %s", sorted(modules), len(files), folder)
    return True
