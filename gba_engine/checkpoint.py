"""Parameter-server checkpoints: one file per server shard with parameters, optimizer state and version.

A shard file restores bit for bit: the dense range, every per-element optimizer tensor,
the optimizer step and the model version (the token clock), so a restored server hands
out the same tokens and takes the same next update as the one that wrote it.

Layout inside a checkpoint folder ``DIR/TAG``::

    gba_server_0_of_2.pt, gba_server_1_of_2.pt      (this module)
    gba_worker_state.pt                             (sync: the workers' full state, written by the first worker)
    gba_meta.json                                   (mode, where the truth lives, version, tables)
    client_state.pt                                 (the caller's client_state)

Every file is written to a temporary name, fsynced and renamed, and a file that cannot be read
is an error naming it. (The job layer stages whole folders and adds a manifest on top:
``sparse_scale.atomic_checkpoint``.)

Example::

    save_shard(state, "ckpt/step100", server=0, num_servers=1)
    state2 = load_shard("ckpt/step100", server=0, num_servers=1)
    assert state2.equal(state)
"""
from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch

from .switch import TrainState

logger = logging.getLogger(__name__)


def _save_synced(obj: Any, path: Path) -> None:
    """``torch.save`` to a temporary name, fsync, rename: a crash never leaves half a file under ``path``."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _load(path: Path, weights_only: bool = True) -> Any:
    """``torch.load`` whose errors name the file (a truncated file otherwise says only "PytorchStreamReader failed")."""
    if not path.is_file():
        raise FileNotFoundError(f"GBA checkpoint file {path} is missing")
    try:
        return torch.load(path, weights_only=weights_only)
    except (RuntimeError, EOFError, OSError, ValueError) as exc:
        raise ValueError(f"GBA checkpoint file {path} is unreadable (truncated or corrupt?): {exc}") from exc


def shard_path(folder: str | os.PathLike, server: int, num_servers: int) -> Path:
    """Where server ``server`` of ``num_servers`` keeps its shard in ``folder``."""
    return Path(folder) / f"gba_server_{server}_of_{num_servers}.pt"


def save_shard(state: TrainState, folder: str | os.PathLike, server: int, num_servers: int,
               tables: Mapping[str, dict] | None = None) -> Path:
    """Write one shard atomically (a temporary file renamed into place: a crash never leaves half a file).

    ``tables`` is the server's :meth:`~gba_engine.ps.ParameterServer.export_tables` (rows it owns, their
    optimizer state and step counts); absent when the job keeps no tables on the servers.
    """
    path = shard_path(folder, server, num_servers)
    path.parent.mkdir(parents=True, exist_ok=True)
    _save_synced({"params": state.params, "moments": state.moments, "step": state.step, "version": state.version,
                  "server": server, "num_servers": num_servers, "tables": dict(tables or {})}, path)
    logger.info("server %d saved version %d to %s", server, state.version, path)
    return path


def load_shard(folder: str | os.PathLike, server: int, num_servers: int) -> TrainState:
    """Read one shard's dense state; a missing file or a different number of servers is a clear error."""
    return TrainState(*_read(folder, server, num_servers)[:4])


def load_tables(folder: str | os.PathLike, server: int, num_servers: int) -> dict[str, dict]:
    """Read one shard's tables (``{}`` for a job without tables on the servers)."""
    return _read(folder, server, num_servers)[4]


def _read(folder: str | os.PathLike, server: int, num_servers: int) -> tuple:
    path = shard_path(folder, server, num_servers)
    if not path.exists():
        found = sorted(p.name for p in Path(folder).glob("gba_server_*.pt")) if Path(folder).is_dir() else []
        raise FileNotFoundError(f"no parameter-server shard {path.name} in {folder} (found {found}); "
                                f"a checkpoint restores with the num_servers it was written with")
    raw = _load(path)
    return raw["params"], dict(raw["moments"]), int(raw["step"]), int(raw["version"]), dict(raw.get("tables", {}))


def save_worker_state(state: TrainState, folder: str | os.PathLike) -> None:
    """The workers' full state (the sync truth) as ``gba_worker_state.pt`` in ``folder`` (created).

    Example::

        save_worker_state(state_from_deepspeed(ds_engine, spec, version), "ckpt/global_step10")
    """
    Path(folder).mkdir(parents=True, exist_ok=True)
    _save_synced({"params": state.params, "moments": state.moments, "step": state.step, "version": state.version},
                 Path(folder) / "gba_worker_state.pt")


def load_worker_state(folder: str | os.PathLike) -> TrainState:
    """Read :func:`save_worker_state`'s file."""
    raw = _load(Path(folder) / "gba_worker_state.pt")
    return TrainState(raw["params"], dict(raw["moments"]), int(raw["step"]), int(raw["version"]))


def save_meta(save_dir: str | os.PathLike, tag: str, *, truth: str, mode: str, version: int, num_servers: int,
              tables: Sequence[str], client_state: Mapping[str, Any] | None) -> None:
    """Write ``gba_meta.json`` and ``client_state.pt`` into ``save_dir/tag``, then point ``save_dir/latest`` at it.

    Example::

        save_meta("ckpt", "global_step10", truth="servers", mode="gba", version=10, num_servers=1, tables=[],
                  client_state={"epoch": 1})
    """
    folder = Path(save_dir) / tag
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "gba_meta.json").write_text(json.dumps({"truth": truth, "mode": mode, "version": version,
                                                      "num_servers": num_servers, "tables": list(tables)}))
    _save_synced(client_state or {}, folder / "client_state.pt")
    (Path(save_dir) / "latest").write_text(tag)  # the job layer commits the folder and moves its own latest


def find_checkpoint(load_dir: str | os.PathLike, tag: str | None) -> tuple[Path | None, dict]:
    """The folder of ``tag`` (default: ``latest``) and its meta; ``(None, {})`` when there is no latest.

    Example::

        folder, meta = find_checkpoint("ckpt", None)       # ckpt/global_step10, {"truth": "servers", ...}
    """
    latest = Path(load_dir) / "latest"
    if tag is None:
        if not latest.exists():
            return None, {}
        tag = latest.read_text().strip()
    folder = Path(load_dir) / tag
    meta = folder / "gba_meta.json"
    if not meta.is_file():
        raise FileNotFoundError(f"GBA checkpoint {folder}: {meta.name} is missing ('latest' names {tag!r}; "
                                f"a save that never finished, or a folder removed)")
    try:
        return folder, json.loads(meta.read_text())
    except ValueError as exc:
        raise ValueError(f"GBA checkpoint file {meta} is unreadable: {exc}") from exc


def load_client_state(folder: str | os.PathLike) -> dict:
    """The ``client_state`` saved with the checkpoint."""
    return _load(Path(folder) / "client_state.pt", weights_only=False)
