"""How far a training job got: the one ``Progress`` record of both jobs, saved in every checkpoint.

The rec job counts the samples it trained, the MoE LM job the tokens; each leaves the other count
at 0. The counts are keyword-only, so a positional third argument (once ``samples`` in one job and
``tokens`` in the other) is refused instead of landing in the wrong field. Checkpoints written
before the record was shared (rec: ``step``, ``micro_batches``, ``samples``; LM: ``step``,
``micro_batches``, ``tokens``) load with :meth:`Progress.from_dict`.

Example::

    progress = Progress(step=3, micro_batches=6, samples=1536)
    progress.after_step(2, 512)                      # Progress(step=4, micro_batches=8, samples=2048, tokens=0)
    Progress.from_dict({"step": 3, "micro_batches": 3, "tokens": 3072})
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

__all__ = ["Progress"]


@dataclasses.dataclass(frozen=True)
class Progress:
    """How far a job is: what a resume needs to continue exactly (see the module docstring)."""

    step: int = 0  # optimizer steps done
    micro_batches: int = 0  # micro-batches consumed by each rank (ranks run in lockstep)
    _: dataclasses.KW_ONLY
    samples: int = 0  # global samples trained (the rec job)
    tokens: int = 0  # global training tokens (the MoE LM job)

    def after_step(self, micro_batches: int, samples: int = 0, *, tokens: int = 0) -> "Progress":
        """The progress one optimizer step of ``micro_batches`` micro-batches (and ``samples``/``tokens``) later.

        Example::

            Progress().after_step(2, samples=64).step   # 1
        """
        return Progress(self.step + 1, self.micro_batches + micro_batches, samples=self.samples + samples,
                        tokens=self.tokens + tokens)

    @classmethod
    def from_dict(cls, saved: Mapping[str, Any], where: str = "a checkpoint") -> "Progress":
        """The record saved as ``dataclasses.asdict`` (by either job, before or after it was shared).

        A key this record does not have, or a count that is not a whole number, raises a ``ValueError``
        naming ``where`` (the file or checkpoint read).

        Example::

            Progress.from_dict({"step": 2, "micro_batches": 2, "samples": 64}, "runs/x/step2")
        """
        if not isinstance(saved, Mapping):
            raise ValueError(f"the progress record in {where} is not a mapping: {saved!r}")
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(saved) - fields)
        if unknown:
            raise ValueError(f"the progress record in {where} has unknown keys {unknown}; expected some of "
                             f"{sorted(fields)}")
        for key, value in saved.items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"the progress record in {where}: {key} must be a whole number >= 0, got {value!r}")
        return cls(**saved)
