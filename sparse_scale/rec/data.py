"""The job's training and held-out streams: per-rank streams (synthetic, Criteo TSV, parquet) or claimed batches.

Both kinds of training stream satisfy :class:`TrainStream`, so the training loop, the
checkpoints and the monitor ask the stream instead of testing which kind it is. File data is
read for ``--epochs`` epochs, each in the order of the job's :class:`~picasso_ops.data.epochs.EpochPlan`
(``--seed``): epoch 0 as given, later ones with their file order and windows of batches shuffled.

Example::

    stream = train_stream(job, engine, Progress(), data_states=None)
    for batch in stream: ...
    stream.tag(progress)        # "step40" (per-rank streams) or "batch80" (claimed batches)
"""
from __future__ import annotations

import logging
import math
import threading
from typing import Any, Iterable, Iterator, Protocol, Sequence

import torch
import torch.distributed as dist

from picasso_ops.data.batch import CTRBatch
from picasso_ops.data.epoch_stream import EPOCH_END, EpochFileStream, EpochPosition, EpochRowRanges
from picasso_ops.data.epochs import EpochPlan
from picasso_ops.data.prefetch import Prefetcher
from picasso_ops.data.synthetic import SyntheticCTRGenerator, SyntheticCTRStream
from sparse_scale.rec.checkpoint import Progress
from sparse_scale.rec.config import RecJobError
from sparse_scale.rec.engines import RecEngine
from sparse_scale.rec.job import RecJob

logger = logging.getLogger(__name__)
notice = logging.getLogger("sparse_scale.rec.notice")  # one-line notes for people (the CLI prints them)


class TrainStream(Protocol):
    """What the loop, the checkpoints and the monitor need from a training stream."""

    is_claimed: bool  # batches handed out by number (gba block): the job's total is shared, fast workers take more

    def __iter__(self) -> Iterator[CTRBatch]: ...

    def state(self) -> dict[str, int]:
        """This stream's resume point."""

    def step_samples(self, batch: CTRBatch | None, group: Any) -> int:
        """Samples of this micro-step that count (over all ranks or, claimed, this worker's); 0: the data ended."""

    def job_step(self, progress: Progress) -> int:
        """The optimizer step of the job that ``--straggler`` windows are read against."""

    def tag(self, progress: Progress) -> str:
        """The checkpoint tag of the current position."""

    def mark(self) -> Any:
        """Where a step starts, for :meth:`save_due` (read only when periodic saves need it)."""

    def save_due(self, every: int, progress: Progress, mark: Any) -> bool:
        """Whether the step that began at ``mark`` ends a ``--save-every`` period."""

    def resume_states(self, group: Any) -> list[dict[str, int]]:
        """The data states a checkpoint records (a collective over ``group`` for per-rank streams)."""

    def monitor_x(self, progress: Progress) -> int:
        """The monitor's x-axis: the job's samples."""

    def next_epoch(self) -> bool:
        """After :meth:`step_samples` said the data ended: go on with the next epoch (False: none is left)."""

    def epoch_ends(self, mark: Any) -> list[int]:
        """The epochs (never the job's last) that ended in the step begun at ``mark``: each is evaluated."""

    def finished_epochs(self) -> int:
        """Epochs read to their end so far."""

    def close(self) -> None:
        """Stop reading ahead; :meth:`state` keeps the consumed position."""


class RankStream:
    """This rank's own stream (every rank reads its shard in lockstep), maybe read ahead by a :class:`Prefetcher`.

    ``finite``: file streams can end at different rows on different ranks (and the last batch
    may be short), so they pay one tiny all-reduce per micro-step; the synthetic stream never ends.
    With ``epochs`` > 1 the source (an :class:`EpochFileStream`) marks each epoch's end with
    ``EPOCH_END``, which this stream hands out as ``None``: the data ends for this rank, the
    all-reduce ends it for every rank, and :meth:`next_epoch` moves every rank to the next epoch
    together (a rank that still had a batch of the old epoch drops it, as ``drop_last`` would).
    ``epoch``: the epoch being read (resume: the checkpoint's).
    """

    is_claimed = False

    def __init__(self, source: Iterable[Any], micro_batch: int, finite: bool, epochs: int = 1,
                 epoch: int = 0) -> None:
        self.source, self.micro_batch, self.finite = source, micro_batch, finite
        self.epochs, self.epoch = epochs, epoch
        self._infinite_step: int | None = None  # samples per micro-step of an endless stream (the group is fixed)
        self._items: Iterator[Any] | None = None
        self._at_epoch_end = False  # this rank's source stands right after an EPOCH_END
        self._ended: list[int] = []  # epochs ended since the last epoch_ends()
        self._last_ended = False  # the data of the job's last epoch ended (on every rank)
        self._lock = threading.Lock()  # peek (a pipeline's thread) against state() (a save)
        self._peeked: list[Any] = []  # the item peek() read ahead, handed out by the next __next__
        self._state_before_peek: dict[str, int] | None = None

    def __iter__(self) -> "RankStream":
        self._items = iter(self.source)
        self._peeked = []
        return self

    def _take(self) -> Any:
        """The next raw item: the one read ahead, else the source's (StopIteration at its end)."""
        with self._lock:
            if self._peeked:
                item = self._peeked.pop()
                self._state_before_peek = None
                if item is _END:
                    raise StopIteration
                return item
        if self._items is None:
            self._items = iter(self.source)
        return next(self._items)

    def __next__(self) -> CTRBatch | None:
        item = self._take()
        if item is EPOCH_END:
            self._at_epoch_end = True
            return None  # like the end of the data: step_samples ends the epoch on every rank
        return item

    def peek(self) -> CTRBatch | None:
        """The batch the next ``next()`` returns, read now (``None`` at an epoch's or the data's end).

        The stream's :meth:`state` stays the position of the batches handed out. Safe to call from
        one other thread (a sparse-dist pipeline) while the loop's thread does not read the stream.
        """
        with self._lock:
            if not self._peeked:
                before = self.source.state()
                if self._items is None:
                    self._items = iter(self.source)
                self._peeked.append(next(self._items, _END))
                self._state_before_peek = before
            item = self._peeked[0]
        return None if item is _END or item is EPOCH_END else item

    def state(self) -> dict[str, int]:
        with self._lock:
            return self._state_before_peek if self._state_before_peek is not None else self.source.state()

    def step_samples(self, batch: CTRBatch | None, group: Any) -> int:
        if not self.finite:  # every rank trains micro_batch samples per micro-step: no collective, no query
            if self._infinite_step is None:
                self._infinite_step = self.micro_batch * (dist.get_world_size(group) if dist.is_initialized() else 1)
            return self._infinite_step
        world = dist.get_world_size(group) if dist.is_initialized() else 1
        have_and_size = torch.tensor([0, 0] if batch is None else [1, batch.batch_size])
        if world > 1:
            dist.all_reduce(have_and_size, group=group)
        return int(have_and_size[1]) if int(have_and_size[0]) == world else 0

    def job_step(self, progress: Progress) -> int:
        return progress.step

    def tag(self, progress: Progress) -> str:
        return f"step{progress.step}"

    def mark(self) -> None:
        return None

    def save_due(self, every: int, progress: Progress, mark: Any) -> bool:
        return progress.step % every == 0

    def resume_states(self, group: Any) -> list[dict[str, int]]:
        states: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(states, self.state(), group=group)  # DeepSpeed writes client_state from rank 0 only
        return states

    def monitor_x(self, progress: Progress) -> int:
        return progress.samples

    def next_epoch(self) -> bool:
        if not self.finite:
            return False
        if self.epoch + 1 >= self.epochs:
            self._last_ended = True  # decided by the all-reduce: the same on every rank
            return False
        if not self._at_epoch_end:  # another rank's shard ended first: drop the rest of this rank's epoch
            dropped = 0
            with self._lock:
                ahead, self._peeked, self._state_before_peek = self._peeked, [], None
            # the epoch's end read ahead: nothing left to drop; a batch read ahead is the first one dropped
            rest = () if ahead and ahead[0] is EPOCH_END else (self._items if self._items is not None else ())
            dropped += int(bool(ahead) and ahead[0] is not EPOCH_END and ahead[0] is not _END)
            for item in rest:
                if item is EPOCH_END:
                    break
                dropped += 1
            logger.debug("epoch %d: %d batches of this rank dropped at the epoch's end", self.epoch, dropped + 1)
        self._at_epoch_end = False
        self._ended.append(self.epoch)
        self.epoch += 1
        return True

    def epoch_ends(self, mark: Any) -> list[int]:
        ended, self._ended = self._ended, []
        return ended

    def finished_epochs(self) -> int:
        return min(self.epoch + 1, self.epochs) if self._last_ended else min(self.epoch, self.epochs)

    def close(self) -> None:
        # (if the loop raised: a daemon thread, stopped when the prefetcher is collected or the process exits)
        if isinstance(self.source, Prefetcher):
            self.source.close()


_END = object()  # the source ended (read ahead by RankStream.peek)


class ClaimedBatches:
    """Micro-batches of the batch numbers a GBAEngine hands this worker (fast workers take more).

    Batch number ``i`` is the job's global micro-batches ``i*gas .. i*gas+gas-1``: of the synthetic
    stream (with gas 1 a sync run reads exactly the per-rank streams' batches) or, for files, the
    rows an :class:`EpochRowRanges` gives it (epoch ``i // per_epoch``; in epoch 0 rows
    ``[i*gas*B, (i+1)*gas*B)`` of the files as given). ``index`` is the number being trained;
    ``state()`` the job-wide resume point (the numbering alone fixes the epoch and the position in
    it). Never prefetched: a claim is a job-wide number taken from the engine's store, and claiming
    ahead on a thread would take numbers this worker may never train. ``lockstep_epochs``: the
    workers run in lockstep (gba.mode sync), so an epoch's end can be evaluated by all of them.

    Example::

        for batch in ClaimedBatches(engine, SyntheticCTRGenerator.for_config(cfg), 256, gas=1, total=1000,
                                    workers=2):
            ...
    """

    is_claimed = True

    def __init__(self, engine: RecEngine, source: SyntheticCTRGenerator | EpochRowRanges, micro_batch: int,
                 gas: int, total: int, workers: int, start: int = 0, epochs: int = 1,
                 lockstep_epochs: bool = False) -> None:
        self.engine, self.micro_batch, self.gas, self.total, self.start = engine, micro_batch, gas, total, start
        self.source, self.workers, self.epochs, self.lockstep_epochs = source, workers, epochs, lockstep_epochs
        self.index = -1
        self._saved_period: int | None = None  # gba: the last --save-every period this worker saved (or started in)
        self._ran_out = False  # the claims ended: the job's total was handed out

    def _micro(self, index: int, j: int) -> CTRBatch:
        if isinstance(self.source, EpochRowRanges):
            return self.source.micro(index, j)
        return self.source.batch(self.micro_batch, index * self.gas + j, "train")

    def __iter__(self) -> Iterator[CTRBatch]:
        for index in self.engine.claim_batches(self.total, start=self.start):
            self.index = index
            for j in range(self.gas):
                yield self._micro(index, j)
        self._ran_out = True

    @property
    def per_epoch(self) -> int | None:
        """Numbered batches per epoch of the files (None: synthetic data, no epochs)."""
        return self.source.per_epoch if isinstance(self.source, EpochRowRanges) else None

    def state(self) -> dict[str, int]:
        """The resume point: every batch number below it was handed out (files: and the epoch it is in)."""
        taken = self.engine.batches_taken
        if self.per_epoch:
            return {"batches_taken": taken, "epoch": taken // self.per_epoch}
        return {"batches_taken": taken}

    def step_samples(self, batch: CTRBatch | None, group: Any) -> int:
        # no collective per micro-step: the engine says when the shared total is used up; bad file rows are no samples
        return 0 if batch is None else batch.batch_size

    def job_step(self, progress: Progress) -> int:
        return self.index // self.workers  # windows are job-wide with gba

    def tag(self, progress: Progress) -> str:
        # the job-wide count, the same on every worker whenever a save is collective (sync)
        return f"batch{self.state()['batches_taken']}"

    def mark(self) -> tuple[int, str]:
        return self.state()["batches_taken"], self.engine.mode  # one store read per step

    def save_due(self, every: int, progress: Progress, mark: tuple[int, str]) -> bool:
        taken_before, mode_before = mark
        if mode_before == "gba" and self.engine.mode == "sync":
            return False  # just back from gba: the workers' counts before this step differ, the next period will save
        period = every * self.workers
        now = self.state()["batches_taken"] // period
        if self.engine.mode != "gba":  # sync: lockstep, every worker sees the same crossing in the same step
            return now > taken_before // period
        # gba: the job's count may cross a period during another worker's step, and only the first worker's
        # save writes (the others' return at once), so a period is due until this worker has saved it
        if self._saved_period is None:
            self._saved_period = taken_before // period
        due = now > self._saved_period
        if due:
            self._saved_period = now
        return due

    def resume_states(self, group: Any) -> list[dict[str, int]]:
        return [self.state()]  # one job-wide resume point; no collective (gba-mode saves are the first worker's)

    def monitor_x(self, progress: Progress) -> int:
        return self.engine.version * self.micro_batch * self.gas * self.workers  # updates x global batch

    def next_epoch(self) -> bool:
        return False  # the numbering runs through every epoch: the end of the claims is the end of the job

    def epoch_ends(self, mark: tuple[int, str] | None) -> list[int]:
        # sync: batches_taken is base + steps x workers on every worker, so all see the same crossing
        if not self.lockstep_epochs or not self.per_epoch or mark is None:
            return []
        before, now = mark[0] // self.per_epoch, self.engine.batches_taken // self.per_epoch
        return [e for e in range(before, now) if e < self.epochs - 1]  # the last one: the job's end evaluation

    def finished_epochs(self) -> int:
        if not self.per_epoch:
            return 0
        if self._ran_out and self.total == self.epochs * self.per_epoch:
            return self.epochs  # every epoch handed out (sync drops the last numbers that do not fill a step)
        return min(self.engine.batches_taken // self.per_epoch, self.epochs)

    def close(self) -> None:
        return None


def file_reader(job: RecJob, files: Sequence[str], start_row: int, shard: int | None = None,
                sharded: bool = True) -> Any:
    """A TSV/CSV or parquet reader of ``files`` from ``start_row``: shard ``shard`` (default this rank's) or all.

    The files' columns follow ``--schema`` (default: the Criteo layout).
    """
    if not files:
        raise RecJobError(f"--data {job.config.data} needs --train-files and --eval-files")
    from picasso_ops.data.criteo import CriteoTSVReader
    from picasso_ops.data.parquet import ParquetCTRReader

    cls = CriteoTSVReader if job.config.data == "criteo" else ParquetCTRReader
    rank, world = (job.rank if shard is None else shard, job.workers) if sharded else (0, 1)
    return cls(list(files), job.micro_batch, vocab_sizes=job.config.vocab, rank=rank, world_size=world,
               start_row=start_row, max_bad_fraction=job.config.max_bad_fraction, schema=job.config.data_schema())


def prefetched(stream: Any, depth: int, rank: int) -> Any:
    """``stream``, read ``depth`` batches ahead on a thread when ``depth`` > 0 (its state: the batches consumed)."""
    if depth == 0:
        return stream
    if rank == 0:
        logger.info("picasso interleave: training batches read %d ahead on a thread", depth)
    return Prefetcher(stream, depth, state=stream.state, name=f"train_rec-data-rank{rank}")


def epoch_plan(job: RecJob) -> EpochPlan:
    """The job's epoch plan: file order and shuffled windows from ``--seed`` (the same on every rank)."""
    return EpochPlan(seed=job.config.seed)


def _ordered(files: Sequence[str], order: Sequence[int]) -> list[str]:
    return [files[i] for i in order]


def check_epochs(job: RecJob) -> None:
    """Refuse ``--epochs N`` whose last epoch ``--steps`` can never reach; before the engine starts, alike on every rank.

    ``--steps`` stays an upper bound: the job ends after N epochs or ``--steps`` steps, whichever comes
    first. A ``--steps`` that ends the job before epoch N-1 begins, even if every row were good,
    contradicts ``--epochs`` and is an error that says how many steps the epochs take at most.
    """
    cfg = job.config
    if cfg.epochs == 1:
        return
    rows = file_reader(job, cfg.train_files, 0, sharded=False).total_rows()
    if job.claims_batches:  # numbered batches of micro_batch x gas rows, job-wide
        per_epoch = rows // (job.micro_batch * job.grad_accum)
        before_last, reach = (cfg.epochs - 1) * per_epoch, cfg.steps * job.workers
        most_steps = math.ceil(cfg.epochs * per_epoch / job.workers)
    else:  # each rank's micro-batches: at most this many (bad and blank rows make fewer)
        per_epoch = math.ceil(math.ceil(rows / job.workers) / job.micro_batch)
        before_last, reach = (cfg.epochs - 1) * per_epoch, cfg.steps * job.grad_accum
        most_steps = math.ceil(cfg.epochs * per_epoch / job.grad_accum)
    if reach <= before_last:
        raise RecJobError(f"--epochs {cfg.epochs} with --steps {cfg.steps}: the training files ({rows:,} rows) take "
                          f"at most {most_steps:,} steps for {cfg.epochs} epochs, and --steps {cfg.steps} ends the "
                          f"job before epoch {cfg.epochs - 1} (0-based) begins; --steps is an upper bound, so pass "
                          f"--steps {most_steps} or more, or fewer --epochs")


def claimed_batches(job: RecJob, engine: RecEngine, data_states: list[dict] | None) -> ClaimedBatches:
    """The job's numbered batches for this worker, from where ``data_states`` says the job stopped."""
    start = int(data_states[0]["batches_taken"]) if data_states else 0
    total, epochs = job.config.steps * job.workers, job.config.epochs
    lockstep = job.gba.mode == "sync"  # only then can every worker evaluate an epoch's end together
    if job.synthetic is not None:
        source: SyntheticCTRGenerator | EpochRowRanges = SyntheticCTRGenerator.for_config(job.synthetic)
    else:  # epoch 0's batch k = file rows [k*gas*B, (k+1)*gas*B): each worker reads forward to its numbers
        files = job.config.train_files
        source = EpochRowRanges(lambda order, row: file_reader(job, _ordered(files, order), row, sharded=False),
                                len(files), epoch_plan(job), job.micro_batch, job.grad_accum)
        in_files = source.per_epoch * epochs
        if in_files < total and job.rank == 0:
            notice.info("the training files hold %s whole batches of %d rows%s, fewer than --steps x workers = %s: "
                        "training on those", f"{source.per_epoch:,}", job.micro_batch * job.grad_accum,
                        f" per epoch ({in_files:,} in {epochs} epochs)" if epochs > 1 else "", f"{total:,}")
        total = min(total, in_files)
        if epochs > 1 and not lockstep and job.rank == 0:
            notice.info("--epochs %d with gba.mode %r: the workers run at their own pace, so epochs are not "
                        "evaluated one by one; the end evaluation scores the last one", epochs, job.gba.mode)
    return ClaimedBatches(engine, source, job.micro_batch, job.grad_accum, total=total, workers=job.workers,
                          start=start, epochs=epochs, lockstep_epochs=lockstep)


def rank_stream(job: RecJob, progress: Progress, data_states: list[dict] | None) -> RankStream:
    """This rank's shard of the training data, positioned after what ``progress`` / ``data_states`` say was consumed."""
    if job.synthetic is not None:
        stream: Any = SyntheticCTRStream(job.synthetic, job.micro_batch, rank=job.rank, world_size=job.workers,
                                         split="train", start_batch=progress.micro_batches * job.workers)
        return RankStream(prefetched(stream, job.prefetch_depth, job.rank), job.micro_batch, finite=False)
    start = EpochPosition()
    if data_states:
        if len(data_states) != job.workers:
            raise RecJobError(f"--resume: the checkpoint was written by {len(data_states)} ranks reading files; "
                              f"resume file streams with the same number of ranks, not {job.workers}")
        positions = [EpochPosition.from_state(state) for state in data_states]
        if len({p.epoch for p in positions}) != 1:  # epochs end on every rank together: a damaged checkpoint
            raise RecJobError(f"--resume: the checkpoint's ranks stand in different epochs "
                              f"{[p.epoch for p in positions]}; it was not written by this job")
        start = positions[job.rank]  # exact even when bad rows were skipped
    files, epochs = job.config.train_files, job.config.epochs
    if start.epoch > epochs:
        raise RecJobError(f"--resume: the checkpoint's run already read {start.epoch} epochs, more than --epochs "
                          f"{epochs}: pass --epochs {start.epoch} or more")
    stream = EpochFileStream(lambda order, row: file_reader(job, _ordered(files, order), row), len(files),
                             epoch_plan(job), epochs, start=start)
    return RankStream(prefetched(stream, job.prefetch_depth, job.rank), job.micro_batch, finite=True,
                      epochs=epochs, epoch=start.epoch)


def train_stream(job: RecJob, engine: RecEngine, progress: Progress,
                 data_states: list[dict] | None) -> TrainStream:
    """This rank's training stream: claimed batches with a gba block, else its own shard.

    With ``picasso.interleave.prefetch_batches`` N > 0 the shard is read N batches ahead on a
    thread; its ``state()`` is the position of the batches *consumed*, which is what checkpoints record.
    """
    if job.claims_batches:
        return claimed_batches(job, engine, data_states)
    return rank_stream(job, progress, data_states)


def eval_stream(job: RecJob, shard: int | None = None) -> Iterable[CTRBatch]:
    """The held-out batches of ``shard`` (default: this rank's) of ``job.workers`` shards."""
    shard = job.rank if shard is None else shard
    if job.synthetic is not None:
        total = math.ceil(job.config.eval_samples / job.micro_batch)
        return SyntheticCTRStream(job.synthetic, job.micro_batch, rank=shard, world_size=job.workers,
                                  split="eval", num_batches=total)
    return file_reader(job, job.config.eval_files, 0, shard=shard)
