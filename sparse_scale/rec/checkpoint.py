"""Checkpoints of a recommender job: the engine's state plus the job's progress and data positions.

Saves are staged and committed with a manifest (``sparse_scale.atomic_checkpoint``): a crash
or a full disk never leaves a half-written ``latest``; a resume verifies the manifest and falls
back to the newest intact checkpoint with a warning.

Example::

    path = save(engine, Path("runs/x/checkpoints"), progress, stream)     # ".../step40" or ".../batch80"
    best = save_best(engine, Path("runs/x/best"), progress, stream, rank)  # the one best checkpoint of the run
    progress, data_states = resume(engine, Path("runs/x/checkpoints"))
"""
from __future__ import annotations

import dataclasses
import logging
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from picasso_ops.block import flush_caches
from sparse_scale import atomic_checkpoint as atomic
from sparse_scale.rec.config import RecJobError

if TYPE_CHECKING:  # runtime imports would be circular: streams and engines record Progress
    from sparse_scale.rec.data import TrainStream
    from sparse_scale.rec.engines import RecEngine

logger = logging.getLogger(__name__)
notice = logging.getLogger("sparse_scale.rec.notice")
SPACE_MARGIN = 1.2  # the next checkpoint is assumed this much larger than the last one


# How far the job got, saved in every checkpoint: the one record of both jobs (imported here for old imports).
from sparse_scale.progress import Progress  # noqa: E402


def _lockstep(engine: "RecEngine") -> bool:
    """Whether every worker saves and loads together (not gba mode, where only the first worker saves)."""
    return not engine.gathers_live


def _need_bytes(engine: "RecEngine", ckpt_dir: Path) -> int:
    """About what the next checkpoint takes: the last one's size, or (first save) parameters and Adam moments."""
    choice = atomic.select(ckpt_dir, repair=False) if (ckpt_dir / "latest").is_file() else atomic.Choice(None, [])
    if choice.tag is not None:
        return int(atomic.folder_bytes(ckpt_dir / choice.tag) * SPACE_MARGIN)
    params = sum(p.numel() * p.element_size() for p in engine.module.parameters())
    return int(params * 4 * SPACE_MARGIN)  # weights, ZeRO's fp32 master copy, Adam's two moments


class CheckpointSaveError(RecJobError):
    """A checkpoint could not be written (a full disk: "no space left on <path>: need ~X MB"); the message names
    the previous checkpoint, left intact, or says that none was written yet."""


def save(engine: "RecEngine", ckpt_dir: Path, progress: Progress, stream: "TrainStream", rank: int) -> str:
    """Write a checkpoint tagged by the stream's position (staged, then committed); returns its folder.

    A full disk raises :class:`CheckpointSaveError` ("no space left on <path>: need ~X MB", naming the
    previous checkpoint or saying there is none) and leaves the previous checkpoint and ``latest`` as they
    were. ``rank``: the job's rank (rank 0 commits).
    """
    try:
        return _save(engine, ckpt_dir, progress, stream, rank)
    except atomic.CheckpointError as exc:
        raise CheckpointSaveError(str(exc)) from exc


def _save(engine: "RecEngine", ckpt_dir: Path, progress: Progress, stream: "TrainStream", rank: int) -> str:
    tag = stream.tag(progress)
    states = stream.resume_states(engine.worker_group)
    flush_caches(engine.module)  # picasso cache: dirty rows go to the stores the checkpoint is read from
    lockstep, group = _lockstep(engine), engine.worker_group
    need = atomic.agree(lambda: _need_bytes(engine, ckpt_dir), group, lockstep, rank)
    client_state = {"progress": dataclasses.asdict(progress), "data_states": states}
    final = atomic.staged_save(ckpt_dir, tag, lambda save_dir: engine.save_checkpoint(str(save_dir), tag=tag,
                                                                                     client_state=client_state),
                               need, group, lockstep, rank)
    return str(final)


def save_best(engine: "RecEngine", best_dir: Path, progress: Progress, stream: "TrainStream", rank: int) -> str:
    """Save the best evaluation's state in ``best_dir`` (e.g. ``OUT/best/step40``) and remove the older best.

    A checkpoint like :func:`save`'s (``--resume`` reads it when copied into OUT/checkpoints); only one
    is kept, so ``best_dir`` holds the best of the run so far, never a half-written one.
    """
    final = save(engine, best_dir, progress, stream, rank)
    lockstep, group = _lockstep(engine), engine.worker_group
    atomic.agree(lambda: _drop_others(Path(best_dir), Path(final).name), group, lockstep, rank)
    return final


def _drop_others(best_dir: Path, keep: str) -> None:
    for folder in best_dir.iterdir():
        if folder.is_dir() and not folder.name.startswith(".") and folder.name != keep:
            shutil.rmtree(folder, ignore_errors=True)


def resume(engine: "RecEngine", ckpt_dir: Path, rank: int) -> tuple[Progress, list[dict[str, Any]] | None]:
    """Load the newest intact checkpoint in ``ckpt_dir`` into ``engine``; returns its progress and data states.

    A broken ``latest`` (missing or truncated file, no manifest) falls back to the newest intact
    checkpoint with a warning and ``latest`` is repaired; none intact is a :class:`RecJobError` naming the files.
    """
    try:
        choice = atomic.agree(lambda: atomic.select(ckpt_dir), engine.worker_group, True, rank)
    except atomic.CheckpointError as exc:
        raise RecJobError(f"--resume: {exc}") from None
    if choice.tag is None:
        raise RecJobError(f"--resume: no checkpoint found in {ckpt_dir}")
    if rank == 0:
        for line in choice.warnings:
            logger.warning("--resume: %s", line)
            notice.info("warning: --resume: %s", line)
    path, client = engine.load_checkpoint(str(ckpt_dir))
    if path is None:
        raise RecJobError(f"--resume: no checkpoint found in {ckpt_dir}")
    progress = Progress.from_dict(client["progress"], f"the checkpoint {path}")
    if rank == 0:
        notice.info("resumed from %s at step %d (batch %d of each rank)", path, progress.step, progress.micro_batches)
    return progress, client.get("data_states")
