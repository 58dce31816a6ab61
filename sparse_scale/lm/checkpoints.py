"""The LM job's checkpoints: moe_proto's topology-free checkpoint plus the job's progress.

    ckpt_dir = Path("runs/lm/checkpoints")
    path = save_job_checkpoint(engine, ckpt_dir, Progress(step=100, micro_batches=100, tokens=102400), rank)
    path, progress = load_job_checkpoint(engine, ckpt_dir)     # the one ``latest`` names

Layout: ``<ckpt_dir>/step<N>/moe_proto/...`` (reloads at another ep_size),
``<ckpt_dir>/step<N>/progress.json`` and ``<ckpt_dir>/latest`` (the tag, written last).
Saves are staged and committed with a manifest (``sparse_scale.atomic_checkpoint``); a
resume verifies it and falls back to the newest intact checkpoint with a warning.
"""
from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any

import torch.distributed as dist

from sparse_scale import atomic_checkpoint as atomic

logger = logging.getLogger(__name__)


class NoCheckpointError(FileNotFoundError):
    """A resume was asked for, but the checkpoint folder has no complete checkpoint."""


# How far a job is (step, micro-batches, tokens): the one record of both jobs, imported here for old imports.
from sparse_scale.progress import Progress  # noqa: E402


def save_job_checkpoint(engine: Any, ckpt_dir: Path, progress: Progress, rank: int) -> str:
    """Save the engine and ``progress`` under tag ``step<N>`` (collective); returns the checkpoint folder.

    Example::

        save_job_checkpoint(engine, Path("out/checkpoints"), progress, rank)   # "out/checkpoints/step100"
    """
    tag = f"step{progress.step}"
    last = atomic.agree(lambda: atomic.select(ckpt_dir, repair=False).tag if (ckpt_dir / "latest").is_file() else None)
    # about as large as the last one; the first: weights, fp32 master copies and Adam's two moments
    need = atomic.folder_bytes(ckpt_dir / last) if last else sum(
        p.numel() * p.element_size() * 4 for p in engine.module.parameters())
    need = need * 6 // 5

    def progress_file(folder: Path) -> None:
        (folder / "progress.json").write_text(json.dumps(dataclasses.asdict(progress)))

    # staged, then a manifest, fsync and rename; ``latest`` moves last
    final = atomic.staged_save(ckpt_dir, tag, lambda save_dir: engine.save_checkpoint(str(save_dir), tag=tag), need,
                               rank=rank, before_commit=progress_file)
    return str(final)


def load_job_checkpoint(engine: Any, ckpt_dir: Path) -> tuple[str, Progress]:
    """Load the latest checkpoint of ``ckpt_dir`` into ``engine`` (collective); ``(its folder, its progress)``.

    Raises :class:`NoCheckpointError` when there is none. Example::

        path, progress = load_job_checkpoint(engine, Path("out/checkpoints"))
    """
    choice = atomic.agree(lambda: atomic.select(ckpt_dir))  # NoIntactCheckpointError names the broken files
    if choice.tag is None:
        raise NoCheckpointError(f"no checkpoint found in {ckpt_dir}")
    if not dist.is_initialized() or dist.get_rank() == 0:
        for line in choice.warnings:
            logger.warning("--resume: %s", line)
    tag = choice.tag
    engine.load_checkpoint(str(ckpt_dir), tag=tag)
    progress_file = ckpt_dir / tag / "progress.json"
    return str(ckpt_dir / tag), Progress.from_dict(json.loads(progress_file.read_text()), str(progress_file))
