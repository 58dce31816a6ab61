"""The LM job's checkpoints: moe_proto's topology-free checkpoint plus the job's progress.

    ckpt_dir = Path("runs/lm/checkpoints")
    path = save_job_checkpoint(engine, ckpt_dir, Progress(step=100, micro_batches=100, tokens=102400), rank)
    path, progress = load_job_checkpoint(engine, ckpt_dir)     # the one ``latest`` names

Layout: ``<ckpt_dir>/step<N>/moe_proto/...`` (reloads at another ep_size),
``<ckpt_dir>/step<N>/progress.json`` and ``<ckpt_dir>/latest`` (the tag, written last).
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from moe_proto.checkpoint import load_checkpoint, save_checkpoint


class NoCheckpointError(FileNotFoundError):
    """A resume was asked for, but the checkpoint folder has no complete checkpoint."""


@dataclasses.dataclass(frozen=True)
class Progress:
    """How far a job is: what a resume needs to continue exactly."""

    step: int = 0  # optimizer steps done
    micro_batches: int = 0  # micro-batches consumed by each rank (ranks run in lockstep)
    tokens: int = 0  # global training tokens


def save_job_checkpoint(engine: Any, ckpt_dir: Path, progress: Progress, rank: int) -> str:
    """Save the engine and ``progress`` under tag ``step<N>`` (collective); returns the checkpoint folder.

    Example::

        save_job_checkpoint(engine, Path("out/checkpoints"), progress, rank)   # "out/checkpoints/step100"
    """
    tag = f"step{progress.step}"
    save_checkpoint(engine, str(ckpt_dir), tag)
    if rank == 0:
        (ckpt_dir / tag / "progress.json").write_text(json.dumps(dataclasses.asdict(progress)))
        (ckpt_dir / "latest").write_text(tag)  # written last: a half-written checkpoint is never "latest"
    return str(ckpt_dir / tag)


def load_job_checkpoint(engine: Any, ckpt_dir: Path) -> tuple[str, Progress]:
    """Load the latest checkpoint of ``ckpt_dir`` into ``engine`` (collective); ``(its folder, its progress)``.

    Raises :class:`NoCheckpointError` when there is none. Example::

        path, progress = load_job_checkpoint(engine, Path("out/checkpoints"))
    """
    latest = ckpt_dir / "latest"
    if not latest.is_file():
        raise NoCheckpointError(f"no checkpoint found in {ckpt_dir}")
    tag = latest.read_text().strip()
    load_checkpoint(engine, str(ckpt_dir), tag)
    return str(ckpt_dir / tag), Progress(**json.loads((ckpt_dir / tag / "progress.json").read_text()))
