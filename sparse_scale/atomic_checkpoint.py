"""Checkpoints that survive crashes and full disks: staged writes, a manifest, verified resumes.

A save writes into ``<ckpt_dir>/.partial/<tag>`` (the engine's own ``latest`` lands there too),
then :func:`commit` writes ``MANIFEST.json`` (every file's size and crc32) last, fsyncs, renames
the folder to ``<ckpt_dir>/<tag>`` and only then replaces ``<ckpt_dir>/latest`` (write, fsync,
rename). :func:`select` verifies what ``latest`` names and falls back to the newest intact folder,
repairing a dangling or broken ``latest``. Rank coordination is the caller's (:func:`agree`).

Example::

    staging = begin(ckpt_dir, "step40")                          # rank 0, before the engine writes
    engine.save_checkpoint(str(staging), tag="step40")           # every rank
    final = commit(ckpt_dir, "step40")                           # rank 0: manifest, fsync, rename, latest
    choice = select(ckpt_dir)                                    # on resume: Choice(tag="step40", warnings=[])
"""
from __future__ import annotations

import dataclasses
import errno
import json
import logging
import os
import shutil
import time
import zlib
from pathlib import Path
from typing import Any, Callable, TypeVar

import torch.distributed as dist

logger = logging.getLogger(__name__)
MANIFEST = "MANIFEST.json"
STAGING = ".partial"
_CHUNK = 1 << 22  # crc32 read size
T = TypeVar("T")


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written or read; the message names the folder and file."""


class NoSpaceError(CheckpointError):
    """The checkpoint's filesystem is full; the previous checkpoint, if any, is left as it was."""


class NoIntactCheckpointError(CheckpointError):
    """A resume found checkpoint folders, but none that passes its manifest."""


@dataclasses.dataclass(frozen=True)
class Choice:
    """The checkpoint a resume loads: its tag (None: there is no checkpoint at all) and what was wrong on the way."""

    tag: str | None
    warnings: list[str]


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def crc32_of(path: Path) -> str:
    """The file's crc32 as 8 hex digits (``crc32_of(Path("a.pt"))`` -> ``"1c291ca3"``)."""
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return f"{crc & 0xFFFFFFFF:08x}"


def staging_dir(ckpt_dir: Path) -> Path:
    """The folder engines save into (``save_dir``); :func:`commit` moves ``<it>/<tag>`` up one level."""
    return Path(ckpt_dir) / STAGING


def begin(ckpt_dir: Path, tag: str) -> Path:
    """Clear what a crashed save of ``tag`` left in the staging folder; returns the ``save_dir`` to pass the engine."""
    staging = staging_dir(ckpt_dir)
    shutil.rmtree(staging / tag, ignore_errors=True)
    staging.mkdir(parents=True, exist_ok=True)
    return staging


def abort(ckpt_dir: Path, tag: str) -> None:
    """Remove a failed save's staging folder (frees the space a full disk needs back)."""
    shutil.rmtree(staging_dir(ckpt_dir) / tag, ignore_errors=True)


def write_latest(ckpt_dir: Path, tag: str) -> None:
    """Point ``<ckpt_dir>/latest`` at ``tag`` atomically (a crash leaves the old or the new one, never half)."""
    tmp = Path(ckpt_dir) / "latest.tmp"
    with open(tmp, "w") as f:
        f.write(tag)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, Path(ckpt_dir) / "latest")
    _fsync_path(Path(ckpt_dir))


def commit(ckpt_dir: Path, tag: str) -> Path:
    """Manifest, fsync and rename the staged ``tag`` into ``ckpt_dir``, then move ``latest``; returns its folder."""
    ckpt_dir = Path(ckpt_dir)
    staged, final = staging_dir(ckpt_dir) / tag, ckpt_dir / tag
    if not staged.is_dir():
        raise CheckpointError(f"checkpoint {tag}: the engine wrote nothing to {staged}")
    files: dict[str, dict[str, Any]] = {}
    for path in sorted(p for p in staged.rglob("*") if p.is_file()):
        _fsync_path(path)
        files[path.relative_to(staged).as_posix()] = {"bytes": path.stat().st_size, "crc32": crc32_of(path)}
    manifest = {"format": 1, "tag": tag, "saved_at": time.time(), "files": files,
                "total_bytes": sum(f["bytes"] for f in files.values())}
    with open(staged / MANIFEST, "w") as f:  # last: a folder without it was never finished
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    for folder in {staged, *(p for p in staged.rglob("*") if p.is_dir())}:
        _fsync_path(folder)
    old = ckpt_dir / f"{STAGING}/{tag}.replaced"
    if final.exists():  # the same tag saved again (a resume that trained no further): keep one, the new one
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
    os.rename(staged, final)
    _fsync_path(ckpt_dir)
    write_latest(ckpt_dir, tag)
    shutil.rmtree(old, ignore_errors=True)
    (staging_dir(ckpt_dir) / "latest").unlink(missing_ok=True)  # the engine's own pointer into the staging folder
    for extra in staging_dir(ckpt_dir).iterdir():  # DeepSpeed's zero_to_fp32.py and friends: where users look
        if extra.is_file() and extra.name != "latest":
            os.replace(extra, ckpt_dir / extra.name)
    try:
        staging_dir(ckpt_dir).rmdir()  # empty unless another save is staged
    except OSError:
        pass
    logger.info("checkpoint %s committed (%d files, %d bytes)", final, len(files), manifest["total_bytes"])
    return final


def read_manifest(folder: Path) -> dict[str, Any]:
    """The folder's manifest; a :class:`CheckpointError` naming the file when it is missing or unreadable."""
    path = Path(folder) / MANIFEST
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing (the save never finished)") from None
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path} is unreadable: {exc}") from None


def verify(folder: Path) -> None:
    """Check every file the manifest lists (present, size, crc32); raises a :class:`CheckpointError` naming the first bad one."""
    folder = Path(folder)
    if not folder.is_dir():
        raise CheckpointError(f"checkpoint folder {folder} does not exist")
    for name, want in read_manifest(folder)["files"].items():
        path = folder / name
        if not path.is_file():
            raise CheckpointError(f"{path} is missing")
        size = path.stat().st_size
        if size != want["bytes"]:
            raise CheckpointError(f"{path} has {size} bytes, the manifest says {want['bytes']} (truncated?)")
        if crc32_of(path) != want["crc32"]:
            raise CheckpointError(f"{path} is corrupt (crc32 differs from the manifest)")


def _saved_at(folder: Path) -> float:
    try:
        return float(read_manifest(folder)["saved_at"])
    except (CheckpointError, KeyError, TypeError, ValueError):
        return float("-inf")


def select(ckpt_dir: Path, repair: bool = True) -> Choice:
    """The checkpoint to resume from: ``latest`` if intact, else the newest intact folder (``latest`` repaired).

    Raises :class:`NoIntactCheckpointError` (naming every broken file) when folders exist but none is intact.
    """
    ckpt_dir = Path(ckpt_dir)
    latest_file = ckpt_dir / "latest"
    latest = latest_file.read_text().strip() if latest_file.is_file() else None
    folders = [p for p in ckpt_dir.iterdir() if p.is_dir() and not p.name.startswith(".")] if ckpt_dir.is_dir() else []
    if latest is None and not folders:
        return Choice(None, [])
    order = sorted(folders, key=lambda p: (_saved_at(p), p.name), reverse=True)
    if latest is not None:
        order = [ckpt_dir / latest] + [p for p in order if p.name != latest]
    problems: list[str] = []
    for folder in order:
        try:
            verify(folder)
        except CheckpointError as exc:
            problems.append(str(exc))
            continue
        warnings: list[str] = []
        if latest != folder.name:
            said = f"'latest' names {latest!r}" if latest is not None else f"{latest_file} is missing"
            warnings = [*problems, f"{said}; resuming from the newest intact checkpoint {folder} instead"]
            if repair:
                write_latest(ckpt_dir, folder.name)
                warnings.append(f"{latest_file} repaired: now names {folder.name!r}")
        return Choice(folder.name, warnings)
    raise NoIntactCheckpointError(f"no intact checkpoint in {ckpt_dir}: " + "; ".join(problems))


def latest_checkpoint(ckpt_dir: Path) -> Path | None:
    """The committed checkpoint a resume starts from, unverified: the folder ``latest`` names, else the newest
    folder with a manifest; None when no checkpoint was committed (``latest_checkpoint(Path("ck"))`` -> ``ck/step40``).
    """
    ckpt_dir = Path(ckpt_dir)
    latest_file = ckpt_dir / "latest"
    latest = latest_file.read_text().strip() if latest_file.is_file() else ""
    if latest and (ckpt_dir / latest).is_dir():
        return ckpt_dir / latest
    folders = [p for p in ckpt_dir.iterdir() if p.is_dir() and not p.name.startswith(".")] if ckpt_dir.is_dir() else []
    finished = [p for p in folders if (p / MANIFEST).is_file()]
    return max(finished, key=lambda p: (_saved_at(p), p.name)) if finished else None


def folder_bytes(folder: Path) -> int:
    """Bytes of the files under ``folder`` (0 when it does not exist)."""
    return sum(p.stat().st_size for p in Path(folder).rglob("*") if p.is_file()) if Path(folder).exists() else 0


def check_space(ckpt_dir: Path, need_bytes: int) -> None:
    """Raise :class:`NoSpaceError` when ``ckpt_dir``'s filesystem has less than ``need_bytes`` free."""
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(ckpt_dir).free
    if free < need_bytes:
        raise NoSpaceError(no_space_message(ckpt_dir, need_bytes, free))


def no_space_message(ckpt_dir: Path, need_bytes: int, free: int | None = None) -> str:
    """``"no space left on <path>: need ~X MB ..."``, the words a full disk is reported in.

    Names the checkpoint left as it was (:func:`latest_checkpoint`), or says that none was written yet.
    """
    if free is None:
        free = shutil.disk_usage(ckpt_dir).free if Path(ckpt_dir).exists() else 0
    last = latest_checkpoint(ckpt_dir)
    kept = (f"the previous checkpoint {last} is intact" if last is not None
            else "no checkpoint was written yet, so there is nothing to resume from")
    return (f"no space left on {ckpt_dir}: need ~{need_bytes / 1e6:.1f} MB for the checkpoint, "
            f"{free / 1e6:.1f} MB free; {kept} (free space or pick another --out)")


def is_no_space(exc: BaseException) -> bool:
    """Whether ``exc`` (or what it was raised from) is ENOSPC; torch reports it as "iostream error" or "file write failed"."""
    while exc is not None:
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        text = str(exc)
        if isinstance(exc, RuntimeError) and ("iostream" in text or "file write failed" in text
                                               or "No space left" in text):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def staged_save(ckpt_dir: Path, tag: str, write: Callable[[Path], None], need_bytes: int, group: Any = None,
                lockstep: bool = True, rank: int | None = None,
                before_commit: Callable[[Path], None] | None = None) -> Path:
    """The whole save on every rank: check space, stage, ``write(save_dir)``, commit (rank 0); returns the folder.

    ``before_commit(staged_folder)`` runs on rank 0 just before :func:`commit` (extra files of the job).
    A full disk anywhere is a :class:`NoSpaceError` and the staged folder is removed.

    Example::

        staged_save(Path("ckpt"), "step4", lambda d: engine.save_checkpoint(str(d), tag="step4"), 10**6)
    """
    ckpt_dir = Path(ckpt_dir)
    first = (rank if rank is not None else (dist.get_rank() if dist.is_available() and dist.is_initialized() else 0)) == 0

    def prepare() -> None:
        check_space(ckpt_dir, need_bytes)
        begin(ckpt_dir, tag)

    def finish() -> Path:
        if before_commit is not None:
            before_commit(staging_dir(ckpt_dir) / tag)
        return commit(ckpt_dir, tag)

    agree(prepare, group, lockstep, rank)
    try:
        write(staging_dir(ckpt_dir))
        final = agree(finish, group, lockstep, rank)
    except Exception as exc:
        if first:
            abort(ckpt_dir, tag)
        if is_no_space(exc):
            raise NoSpaceError(no_space_message(ckpt_dir, need_bytes)) from exc
        raise
    return final if final is not None else ckpt_dir / tag


def agree(fn: Callable[[], T], group: Any = None, lockstep: bool = True, rank: int | None = None) -> T:
    """Run ``fn`` on the group's first rank and hand every rank its result, or the same error.

    ``lockstep`` False (ranks not in step, e.g. gba mode) or no process group: a caller runs ``fn``
    only when it is rank 0 of the job (else returns None). ``rank``: the job's rank of this process
    (default: torch.distributed's; a restarted gba worker has none of its own there).
    """
    active = lockstep and dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1
    if rank is None:
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    first = dist.get_global_rank(group, 0) if active and group is not None else 0
    if not active:
        return fn() if rank == first else None  # type: ignore[return-value]
    box: list[Any] = [None]
    failure: BaseException | None = None
    if rank == first:
        try:
            box[0] = ("ok", fn())
        except Exception as exc:  # noqa: BLE001  (every rank must leave the broadcast; rank 0 re-raises its own)
            failure, box[0] = exc, ("error", type(exc).__name__, str(exc))
    dist.broadcast_object_list(box, src=first, group=group)
    if failure is not None:
        raise failure
    if box[0][0] == "error":
        kinds = {c.__name__: c for c in (NoSpaceError, NoIntactCheckpointError)}
        raise kinds.get(box[0][1], CheckpointError)(f"on rank {first}: {box[0][2]}")
    return box[0][1]
