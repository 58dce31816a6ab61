"""Checkpoints of a recommender job: the engine's state plus the job's progress and data positions.

Example::

    path = save(engine, Path("runs/x/checkpoints"), progress, stream)     # ".../step40" or ".../batch80"
    progress, data_states = resume(engine, Path("runs/x/checkpoints"))
"""
from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from picasso_ops.block import flush_caches
from sparse_scale.rec.config import RecJobError

if TYPE_CHECKING:  # runtime imports would be circular: streams and engines record Progress
    from sparse_scale.rec.data import TrainStream
    from sparse_scale.rec.engines import RecEngine

notice = logging.getLogger("sparse_scale.rec.notice")


@dataclasses.dataclass(frozen=True)
class Progress:
    """How far the job got; saved in every checkpoint."""

    step: int = 0  # optimizer steps done
    micro_batches: int = 0  # batches consumed by each rank (ranks run in lockstep)
    samples: int = 0  # global samples trained

    def after_step(self, micro_batches: int, samples: int) -> "Progress":
        """The progress one optimizer step of ``micro_batches`` micro-batches and ``samples`` samples later."""
        return Progress(self.step + 1, self.micro_batches + micro_batches, self.samples + samples)


def save(engine: "RecEngine", ckpt_dir: Path, progress: Progress, stream: "TrainStream") -> str:
    """Write a checkpoint tagged by the stream's position; returns its folder."""
    tag = stream.tag(progress)
    states = stream.resume_states(engine.worker_group)
    flush_caches(engine.module)  # picasso cache: dirty rows go to the stores the checkpoint is read from
    engine.save_checkpoint(str(ckpt_dir), tag=tag,
                           client_state={"progress": dataclasses.asdict(progress), "data_states": states})
    return str(ckpt_dir / tag)


def resume(engine: "RecEngine", ckpt_dir: Path, rank: int) -> tuple[Progress, list[dict[str, Any]] | None]:
    """Load the latest checkpoint in ``ckpt_dir`` into ``engine``; returns its progress and data states."""
    path, client = engine.load_checkpoint(str(ckpt_dir))
    if path is None:
        raise RecJobError(f"--resume: no checkpoint found in {ckpt_dir}")
    progress = Progress(**client["progress"])
    if rank == 0:
        notice.info("resumed from %s at step %d (batch %d of each rank)", path, progress.step, progress.micro_batches)
    return progress, client.get("data_states")
