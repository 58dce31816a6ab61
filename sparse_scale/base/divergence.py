"""The divergence guard of the training loops: stop on a non-finite loss or gradient norm, or too many skipped steps.

DeepSpeed skips an optimizer step whose gradients overflow (ZeRO and fp16 check for inf/NaN)
and goes on: a diverged run then trains nothing, ends with AUC 0.5, saves the garbage and exits 0.
The guard turns that into a :class:`DivergenceError` naming the step, the value and what to try,
raised before any save of the diverged state (the last good checkpoint stays ``latest``); the
message names that checkpoint, which the job tells the guard, or says that none was written yet.

The loss is checked on every micro-step (the loops read it anyway); NaN/inf entering the model
(embeddings, the hidden states entering MoE layers) shows up there. Ranks agree through one
scalar all-reduce per optimizer step so that all of them stop together.

Example::

    guard = DivergenceGuard(max_skipped_steps=20, group=None, last_checkpoint=latest_checkpoint(ckpt_dir))
    guard.start_step(ds_engine)
    loss = model(batch); guard.loss(loss.item())     # every micro-step
    engine.backward(loss); engine.step()
    guard.end_step(step, ds_engine)                  # raises DivergenceError
    guard.checkpoint_saved(save(...))                # after each committed save: the message names it
"""
from __future__ import annotations

import math
import os
from typing import Any

import torch
import torch.distributed as dist

DEFAULT_MAX_SKIPPED_STEPS = 20  # DeepSpeed's fp16 loss-scale warm-up skips a handful in a row; 20 is far past it
TRY = ("try a lower learning rate (optimizer.params.lr), gradient_clipping in the DeepSpeed config, a longer "
       "warmup, or bf16/fp32 instead of fp16")


def hint(last_checkpoint: str | os.PathLike | None) -> str:
    """What to try, and the checkpoint to resume from (or that there is none yet)."""
    if last_checkpoint is None:
        return f"{TRY}; no checkpoint was written yet, so there is nothing to resume from"
    return f"{TRY}; the last good checkpoint {last_checkpoint} is kept (resume from it with --resume)"


class DivergenceError(RuntimeError):
    """Training diverged; the message says at which step, what value, and what to try."""


class DivergenceGuard:
    """Watches losses, DeepSpeed's gradient norm and its skipped steps; see the module docstring.

    ``lockstep``: the ranks of ``group`` step together (DeepSpeed data parallel), so they agree on
    stopping through a scalar all-reduce; False (gba workers at their own pace): each rank decides alone.
    """

    def __init__(self, max_skipped_steps: int = DEFAULT_MAX_SKIPPED_STEPS, group: Any = None,
                 lockstep: bool = True, what: str = "loss", last_checkpoint: str | os.PathLike | None = None) -> None:
        if max_skipped_steps < 1:
            raise ValueError(f"--max-skipped-steps {max_skipped_steps}: must be >= 1")
        self.max_skipped_steps, self.group, self.lockstep, self.what = max_skipped_steps, group, lockstep, what
        self.skipped_in_a_row, self._skipped_before, self._bad_loss = 0, 0, None
        self.last_checkpoint = last_checkpoint  # named in the error as the one to resume from; None: none yet

    def checkpoint_saved(self, folder: str | os.PathLike) -> None:
        """Call after each committed save: the error names ``folder`` as the last good checkpoint."""
        self.last_checkpoint = folder

    def start_step(self, ds_engine: Any) -> None:
        """Call before the optimizer step's first micro-step."""
        self._skipped_before = int(getattr(ds_engine, "skipped_steps", 0)) if ds_engine is not None else 0
        self._bad_loss = None

    def loss(self, value: float) -> None:
        """Record one micro-step's loss (a float the loop already read)."""
        if self._bad_loss is None and not math.isfinite(value):
            self._bad_loss = value

    def end_step(self, step: int, ds_engine: Any) -> None:
        """Call after the optimizer step ``step`` (1-based); raises :class:`DivergenceError` when the run diverged."""
        bad = self._agreed_bad_loss()
        if bad is not None:
            raise DivergenceError(
                f"training diverged at step {step}: {self.what} is {bad[1]} on {bad[0]} (non-finite; checked on "
                f"the loss, so NaN/inf in the inputs, the embeddings or the hidden states entering the MoE layers "
                f"show up here too); {hint(self.last_checkpoint)}")
        if ds_engine is None:
            return
        skipped = int(getattr(ds_engine, "skipped_steps", 0)) > self._skipped_before
        self.skipped_in_a_row = self.skipped_in_a_row + 1 if skipped else 0
        if self.skipped_in_a_row > self.max_skipped_steps:
            raise DivergenceError(
                f"training diverged at step {step}: {self.skipped_in_a_row} optimizer steps in a row were skipped "
                f"by DeepSpeed's overflow check (inf/NaN gradients; steps {step - self.skipped_in_a_row + 1}-{step},"
                f" more than --max-skipped-steps {self.max_skipped_steps}); {hint(self.last_checkpoint)}")
        norm = ds_engine.get_global_grad_norm() if not skipped else None
        if norm is not None and not math.isfinite(float(norm)):
            raise DivergenceError(f"training diverged at step {step}: the gradient norm is {float(norm)} "
                                  f"(non-finite); {hint(self.last_checkpoint)}")

    def check_params(self, module: torch.nn.Module, step: int) -> None:
        """Refuse to checkpoint non-finite parameters (a diverged state must not replace the last good one)."""
        bad = next((name for name, p in module.named_parameters() if not bool(torch.isfinite(p.detach()).all())), None)
        flag = torch.tensor([0.0 if bad is None else 1.0])
        if self._in_lockstep():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)  # expert shards differ between ranks
        if flag.item() != 0.0:
            where = f"parameter {bad}" if bad is not None else "a parameter on another rank"
            raise DivergenceError(f"training diverged by step {step}: {where} holds NaN/inf; not saving it; "
                                  f"{hint(self.last_checkpoint)}")

    def _in_lockstep(self) -> bool:
        return bool(self.lockstep and dist.is_available() and dist.is_initialized()
                    and dist.get_world_size(self.group) > 1)

    def _agreed_bad_loss(self) -> tuple[str, float] | None:
        mine = self._bad_loss
        if not self._in_lockstep():
            return ("this rank", mine) if mine is not None else None
        flag = torch.tensor([0.0 if mine is None else 1.0])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        if flag.item() == 0.0:
            return None
        return (f"rank {dist.get_rank()}", mine) if mine is not None else ("another rank", float("nan"))


def deepspeed_engine_of(engine: Any) -> Any:
    """The DeepSpeed engine inside a job's engine wrapper (``.engine`` or a GBA engine's ``.ds_engine``), or None."""
    for candidate in (engine, getattr(engine, "engine", None), getattr(getattr(engine, "engine", None), "ds_engine", None)):
        if candidate is not None and hasattr(candidate, "skipped_steps") and hasattr(candidate, "get_global_grad_norm"):
            return candidate
    return None
