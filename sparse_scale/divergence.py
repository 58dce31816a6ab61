"""The divergence guard of the training loops: stop on a non-finite loss or gradient norm, too many skipped steps, or
a loss that explodes while staying finite.

DeepSpeed skips an optimizer step whose gradients overflow (ZeRO and fp16 check for inf/NaN)
and goes on: a diverged run then trains nothing, ends with AUC 0.5, saves the garbage and exits 0.
The guard turns that into a :class:`DivergenceError` naming the step, the value and what to try,
raised before any save of the diverged state (the last good checkpoint stays ``latest``); the
message names that checkpoint, which the job tells the guard, or says that none was written yet.

The loss is checked on every micro-step (the loops read it anyway); NaN/inf entering the model
(embeddings, the hidden states entering MoE layers) shows up there. DeepSpeed's skipped-step count
and global gradient norm are the same on every rank, so those are judged locally on every optimizer
step. Only the loss flag and the explosion onset are a rank's own: ranks in lockstep agree on them
through one scalar all-reduce every ``AGREE_EVERY`` optimizer steps (decided by the step number, so
every rank calls it at the same step), folded into :meth:`DivergenceGuard.check_params`' all-reduce
before every save and at the end of training, and forced when DeepSpeed's own checks stop the run.
Nothing is lost in between: a non-finite loss on one rank makes its gradients non-finite, which the
dense all-reduce spreads to every rank, and nothing is saved without an agreement first. The error
names the step a rank first saw the non-finite loss (the earliest over the ranks) and that rank.
Ranks that step on their own (``lockstep=False``, gba workers) decide alone on every step.

A loss can also explode while staying finite (a learning rate far too high: losses of 1e21 that
never overflow fp32). With ``explosion_factor`` F > 0 the guard compares the median of the last
``EXPLOSION_WINDOW`` optimizer steps' mean loss with F x a reference: the larger of the first
optimizer step's loss (the model as it started or resumed) and, when the loop passes it, the loss
of a constant predictor (for BCE the entropy of the label rate seen so far, ln 2 = 0.693 at most).
A healthy run stays below both; the median ignores a single bad batch. The message names the step
the loss first passed the bar and the newest checkpoint saved before it; checkpoints saved after it
are named as suspect, and ``latest`` is moved back to the good one so that --resume starts there.

Example::

    guard = DivergenceGuard(max_skipped_steps=20, group=None, last_checkpoint=latest_checkpoint(ckpt_dir))
    guard.start_step(ds_engine)
    loss = model(batch); guard.loss(loss.item())     # every micro-step
    engine.backward(loss); engine.step()
    guard.end_step(step, ds_engine)                  # raises DivergenceError (ranks: every AGREE_EVERY steps)
    guard.check_params(engine.module, step)          # before each save: the ranks agree here too
    guard.checkpoint_saved(save(...), step)          # after each committed save: the message names it

    guard = DivergenceGuard(explosion_factor=10.0)   # also stop a finite explosion
    guard.loss(loss.item(), baseline=bce_entropy(positives / samples))
"""
from __future__ import annotations

import math
import os
import statistics
from collections import deque
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from sparse_scale.atomic_checkpoint import write_latest

DEFAULT_MAX_SKIPPED_STEPS = 20  # DeepSpeed's fp16 loss-scale warm-up skips a handful in a row; 20 is far past it
DEFAULT_EXPLOSION_FACTOR = 10.0  # a BCE model at 10x the constant predictor's loss is far past any healthy run
EXPLOSION_WINDOW = 5  # optimizer steps whose median loss is judged: one bad batch alone never stops a run
AGREE_EVERY = 16  # optimizer steps between the ranks' agreements on the loss (every rank: the same steps)
_NONE = float("inf")  # "nothing to report" in the agreement's MIN all-reduce
_CODES = (float("nan"), float("inf"), float("-inf"))  # a non-finite loss value, as a number the reduction carries
TRY = ("try a lower learning rate (optimizer.params.lr), gradient_clipping in the DeepSpeed config, a longer "
       "warmup, or bf16/fp32 instead of fp16")


def hint(last_checkpoint: str | os.PathLike | None, suspect: list[str] | None = None) -> str:
    """What to try, and the checkpoint to resume from (or that there is none yet).

    ``suspect``: checkpoints saved after the loss had started to explode (not good to resume from).
    """
    after = ""
    if suspect:
        after = (f"; {', '.join(suspect)} {'was' if len(suspect) == 1 else 'were'} saved after the loss began to "
                 f"explode: do not resume from {'it' if len(suspect) == 1 else 'them'}")
    if last_checkpoint is None:
        return f"{TRY}; no good checkpoint was written yet, so there is nothing to resume from{after}" if suspect \
            else f"{TRY}; no checkpoint was written yet, so there is nothing to resume from"
    how = "" if not suspect else ", and 'latest' points at it again"
    return f"{TRY}; the last good checkpoint {last_checkpoint} is kept{how} (resume from it with --resume){after}"


def bce_entropy(rate: float) -> float:
    """The log loss of a constant predictor at the label rate ``rate`` (nats): the floor a BCE model starts from.

    Example::

        round(bce_entropy(0.5), 4), bce_entropy(0.0)     # (0.6931, 0.0)
    """
    if not 0.0 < rate < 1.0:
        return 0.0
    return -(rate * math.log(rate) + (1.0 - rate) * math.log(1.0 - rate))


class DivergenceError(RuntimeError):
    """Training diverged; the message says at which step, what value, and what to try."""


class DivergenceGuard:
    """Watches losses, DeepSpeed's gradient norm and its skipped steps; see the module docstring.

    ``lockstep``: the ranks of ``group`` step together (DeepSpeed data parallel), so they agree on
    stopping through a scalar all-reduce every ``agree_every`` optimizer steps (and in :meth:`check_params`);
    False (gba workers at their own pace): each rank decides alone on every step.
    ``explosion_factor``: stop when the loss explodes while finite (see the module docstring); 0: off.
    ``agree_every``: optimizer steps between agreements (None: :data:`AGREE_EVERY`); every rank must pass the
    same number.
    """

    def __init__(self, max_skipped_steps: int = DEFAULT_MAX_SKIPPED_STEPS, group: Any = None,
                 lockstep: bool = True, what: str = "loss", last_checkpoint: str | os.PathLike | None = None,
                 explosion_factor: float = 0.0, agree_every: int | None = None) -> None:
        if max_skipped_steps < 1:
            raise ValueError(f"--max-skipped-steps {max_skipped_steps}: must be >= 1")
        if not (math.isfinite(explosion_factor) and (explosion_factor == 0 or explosion_factor > 1)):
            raise ValueError(f"--loss-explosion-factor {explosion_factor}: must be 0 (off) or a finite number > 1")
        agree_every = AGREE_EVERY if agree_every is None else agree_every
        if isinstance(agree_every, bool) or not isinstance(agree_every, int) or agree_every < 1:
            raise ValueError(f"DivergenceGuard(agree_every={agree_every!r}): must be an int >= 1")
        self.agree_every = agree_every
        self._first_bad: tuple[int, float] | None = None  # (step, value) of this rank's first non-finite loss
        # this rank's first explosion: (median, bar, onset, the step it was seen)
        self._detected: tuple[float, float, int, int] | None = None
        self.max_skipped_steps, self.group, self.lockstep, self.what = max_skipped_steps, group, lockstep, what
        self.skipped_in_a_row, self._skipped_before, self._bad_loss = 0, 0, None
        self.last_checkpoint = last_checkpoint  # named in the error as the one to resume from; None: none yet
        self.explosion_factor = explosion_factor
        self._step_sum, self._step_count, self._baseline = 0.0, 0, None
        self._first_loss: float | None = None  # the first optimizer step's mean loss: the run's own early value
        self._recent: deque[tuple[int, float]] = deque(maxlen=EXPLOSION_WINDOW)  # (step, mean loss)
        self._saved: list[tuple[int | None, str]] = []  # (step, folder) of each checkpoint this guard was told of

    def checkpoint_saved(self, folder: str | os.PathLike, step: int | None = None) -> None:
        """Call after each committed save (of optimizer step ``step``): the error names ``folder`` as the last good
        checkpoint, unless the loss had already begun to explode by then."""
        self.last_checkpoint = folder
        self._saved.append((step, str(folder)))

    def start_step(self, ds_engine: Any) -> None:
        """Call before the optimizer step's first micro-step."""
        self._skipped_before = int(getattr(ds_engine, "skipped_steps", 0)) if ds_engine is not None else 0
        self._bad_loss = None

    def loss(self, value: float, baseline: float | None = None) -> None:
        """Record one micro-step's loss (a float the loop already read).

        ``baseline``: the loss of a constant predictor on the data seen so far (BCE: :func:`bce_entropy`
        of the label rate); the explosion bar is at least ``explosion_factor`` times it.
        """
        if self._bad_loss is None and not math.isfinite(value):
            self._bad_loss = value
        if math.isfinite(value):
            self._step_sum, self._step_count = self._step_sum + value, self._step_count + 1
        if baseline is not None and math.isfinite(baseline):
            self._baseline = baseline

    def end_step(self, step: int, ds_engine: Any) -> None:
        """Call after the optimizer step ``step`` (1-based); raises :class:`DivergenceError` when the run diverged.

        In lockstep the loss is judged when ``step`` is a multiple of ``agree_every`` (or DeepSpeed's checks
        stop the run); DeepSpeed's skipped steps and gradient norm on every step.
        """
        exploded = self._explosion(step)
        if self._bad_loss is not None and self._first_bad is None:
            self._first_bad = (step, self._bad_loss)
        if exploded is not None and self._detected is None:
            self._detected = (*exploded, step)
        ds_error = self._deepspeed_error(step, ds_engine)
        if not self._in_lockstep():  # alone: judge every step, as it happens
            if self._bad_loss is not None:
                raise DivergenceError(self._loss_message(step, "this rank", self._bad_loss, step))
            if exploded is not None:
                raise DivergenceError(self._explosion_message(step, exploded, exploded[2]))
            if ds_error is not None:
                raise DivergenceError(ds_error)
            return
        # DeepSpeed's state is the same on every rank: when it stops the run, every rank agrees here first
        if step % self.agree_every == 0 or ds_error is not None:
            self._raise_agreed(self._agree(), step)
        if ds_error is not None:
            raise DivergenceError(ds_error)

    def _deepspeed_error(self, step: int, ds_engine: Any) -> str | None:
        """The message when DeepSpeed skipped too many steps in a row or the gradient norm is non-finite."""
        if ds_engine is None:
            return None
        skipped = int(getattr(ds_engine, "skipped_steps", 0)) > self._skipped_before
        self.skipped_in_a_row = self.skipped_in_a_row + 1 if skipped else 0
        if self.skipped_in_a_row > self.max_skipped_steps:
            return (f"training diverged at step {step}: {self.skipped_in_a_row} optimizer steps in a row were skipped "
                    f"by DeepSpeed's overflow check (inf/NaN gradients; steps {step - self.skipped_in_a_row + 1}-{step},"
                    f" more than --max-skipped-steps {self.max_skipped_steps}); {hint(self.last_checkpoint)}")
        norm = ds_engine.get_global_grad_norm() if not skipped else None
        if norm is not None and not math.isfinite(float(norm)):
            return (f"training diverged at step {step}: the gradient norm is {float(norm)} "
                    f"(non-finite); {hint(self.last_checkpoint)}")
        return None

    def check_params(self, module: torch.nn.Module, step: int) -> None:
        """Refuse to checkpoint non-finite parameters (a diverged state must not replace the last good one).

        In lockstep this is also an agreement on the loss (one all-reduce for both): call it on every rank before
        each save and at the end of training, so that a rank's non-finite or exploding loss stops every rank first.
        """
        bad = next((name for name, p in module.named_parameters() if not bool(torch.isfinite(p.detach()).all())), None)
        if not self._in_lockstep():
            if bad is not None:
                raise DivergenceError(f"training diverged by step {step}: parameter {bad} holds NaN/inf; not saving "
                                      f"it; {hint(self.last_checkpoint)}")
            return
        agreed = self._agree(param_bad=bad is not None)  # expert shards differ between ranks
        self._raise_agreed(agreed, step)
        if agreed[3] != _NONE:
            where = f"parameter {bad}" if bad is not None else f"a parameter on rank {int(agreed[3])}"
            raise DivergenceError(f"training diverged by step {step}: {where} holds NaN/inf; not saving it; "
                                  f"{hint(self.last_checkpoint)}")

    def _in_lockstep(self) -> bool:
        return bool(self.lockstep and dist.is_available() and dist.is_initialized()
                    and dist.get_world_size(self.group) > 1)

    def _agree(self, param_bad: bool = False) -> list[float]:
        """One MIN all-reduce over the ranks of: the first non-finite loss (keyed by step, then rank, then value),
        the earliest explosion onset, the earliest step an explosion was seen, the lowest rank with a non-finite
        parameter; each ``_NONE`` where no rank has one."""
        rank, world = dist.get_rank(), dist.get_world_size()
        loss_key = _NONE
        if self._first_bad is not None:
            first_step, value = self._first_bad
            code = 0 if math.isnan(value) else (1 if value > 0 else 2)
            loss_key = float((first_step * world + rank) * len(_CODES) + code)
        onset, seen = (_NONE, _NONE) if self._detected is None else (float(self._detected[2]), float(self._detected[3]))
        values = torch.tensor([loss_key, onset, seen, float(rank) if param_bad else _NONE], dtype=torch.float64)
        dist.all_reduce(values, op=dist.ReduceOp.MIN, group=self.group)
        return values.tolist()

    def _raise_agreed(self, agreed: list[float], step: int) -> None:
        """Raise what the agreement ``agreed`` (of :meth:`_agree`, at optimizer step ``step``) found, if anything."""
        loss_key, onset, seen = agreed[0], agreed[1], agreed[2]
        if loss_key != _NONE:
            key = int(loss_key)
            code, where = key % len(_CODES), key // len(_CODES)
            first_step, rank = divmod(where, dist.get_world_size())
            raise DivergenceError(self._loss_message(first_step, f"rank {rank}", _CODES[code], step))
        if onset != _NONE:
            mine = self._detected[:3] if self._detected is not None and self._detected[3] == int(seen) else None
            raise DivergenceError(self._explosion_message(int(seen), mine, int(onset)))

    def _loss_message(self, first_step: int, where: str, value: float, step: int) -> str:
        """The error of a non-finite loss first seen at ``first_step`` on ``where``, agreed at ``step``."""
        late = f"; every rank stopped at step {step}, the next agreement" if step != first_step else ""
        return (f"training diverged at step {first_step}: {self.what} is {value} on {where} (non-finite; checked on "
                f"the loss, so NaN/inf in the inputs, the embeddings or the hidden states entering the MoE layers "
                f"show up here too{late}); {hint(self.last_checkpoint)}")

    def _explosion(self, step: int) -> tuple[float, float, int] | None:
        """Close the step's loss record; (median, bar, first step over the bar) when the loss exploded, else None."""
        count, total = self._step_count, self._step_sum
        self._step_sum, self._step_count = 0.0, 0
        if self.explosion_factor == 0 or count == 0:
            return None
        mean = total / count
        if not math.isfinite(mean):  # finite losses whose sum overflows: as exploded as it gets
            mean = float("inf")
        if self._first_loss is None:
            self._first_loss = mean
        self._recent.append((step, mean))
        if len(self._recent) < EXPLOSION_WINDOW:
            return None
        bar = self.explosion_factor * self._reference()
        median = statistics.median(v for _, v in self._recent)
        if not median > bar:
            return None
        onset = next(s for s, v in self._recent if v > bar)
        return median, bar, onset

    def _reference(self) -> float:
        first = self._first_loss if self._first_loss is not None else 0.0
        return max(first, self._baseline or 0.0)

    def _explosion_message(self, step: int, exploded: tuple[float, float, int] | None, onset: int) -> str:
        """The error of a finite explosion first seen at step ``onset`` (on any rank); ``exploded``: this rank's."""
        good = [(s, f) for s, f in self._saved if s is None or s + 1 < onset]  # its weights gave a loss below the bar
        suspect = [f for s, f in self._saved if s is not None and s + 1 >= onset]
        last_good: Any = good[-1][1] if good else (self.last_checkpoint if not self._saved else None)
        if suspect and last_good is not None:
            _point_latest_at(Path(last_good))
        if exploded is None:
            return (f"training diverged at step {step}: the {self.what} exploded on another rank while staying finite "
                    f"(more than {self.explosion_factor:g}x its reference from step {onset} on; "
                    f"--loss-explosion-factor {self.explosion_factor:g}; 0 turns this check off); "
                    f"{hint(last_good, suspect)}")
        median, bar, _ = exploded
        baseline = (f", and the constant predictor's {self._baseline:.4g} (the entropy of the label rate seen so far)"
                    if self._baseline is not None else "")
        first = self._first_loss if self._first_loss is not None else float("nan")
        return (f"training diverged at step {step}: the {self.what} exploded while staying finite: the median of "
                f"the last {EXPLOSION_WINDOW} steps' {self.what} is {median:.4g}, more than {self.explosion_factor:g}x "
                f"the reference {bar / self.explosion_factor:.4g} (the larger of the first step's {first:.4g}"
                f"{baseline}); it first passed {bar:.4g} at step {onset} (--loss-explosion-factor "
                f"{self.explosion_factor:g}; 0 turns this check off); {hint(last_good, suspect)}")


def _point_latest_at(folder: Path) -> None:
    """Move ``latest`` beside ``folder`` back to it (the first rank only), so that --resume starts from it."""
    if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
        return
    if folder.is_dir() and (folder.parent / "latest").is_file():
        write_latest(folder.parent, folder.name)


def deepspeed_engine_of(engine: Any) -> Any:
    """The DeepSpeed engine inside a job's engine wrapper (``.engine`` or a GBA engine's ``.ds_engine``), or None."""
    for candidate in (engine, getattr(engine, "engine", None), getattr(getattr(engine, "engine", None), "ds_engine", None)):
        if candidate is not None and hasattr(candidate, "skipped_steps") and hasattr(candidate, "get_global_grad_norm"):
            return candidate
    return None
