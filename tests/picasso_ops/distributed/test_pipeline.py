"""The sparse-dist pipeline on 2 real gloo ranks: bit-equal to the unpipelined steps, errors named, clean ends.

Tables are the sharded-tables tests' (two fields sharing a table, a mean table, a table smaller than the
world, a second pack); each placement (data-parallel, row-wise, mixed) trains the same batches with and
without the pipeline, with an evaluation forward between steps, and the full tables must be equal bit for bit.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

from picasso_ops.distributed import sparse_step
from picasso_ops.distributed.mixed import MixedEmbeddingCollection
from picasso_ops.distributed.pipeline import PipelineError, SparseDistPipeline, pipelined_tables
from sparse_scale.multiproc import run_distributed
from tests.picasso_ops.distributed.test_sharded_tables import KEYS, _global_batch, _loss, _slice, _specs

PLACEMENTS = {
    "data_parallel": dict.fromkeys(("t0", "t1", "t2", "t3"), "data_parallel"),
    "row_wise": dict.fromkeys(("t0", "t1", "t2", "t3"), "row_wise"),
    "mixed": {"t0": "row_wise", "t1": "data_parallel", "t2": "row_wise", "t3": "data_parallel"},
}


class _Fields(nn.Module):
    """A field-embedding module as the pipeline finds them: ``keys`` and a ``collection``."""

    def __init__(self, placement: dict[str, str]) -> None:
        super().__init__()
        self.keys = KEYS
        self.collection = MixedEmbeddingCollection(_specs("rowwise_adagrad"), placement)

    def forward(self, batch):
        return self.collection(batch).values


class _Stream:
    """A rank's batches; ``peek`` reads the next one ahead (the pipeline's thread), ``take`` hands it out."""

    def __init__(self, batches: list, fail_at: int | None = None) -> None:
        self.batches, self.pos, self.fail_at = batches, 0, fail_at

    def peek(self):
        if self.fail_at is not None and self.pos == self.fail_at:
            raise OSError(f"cannot read batch {self.pos}")
        return self.batches[self.pos] if self.pos < len(self.batches) else None

    def take(self):
        item = self.batches[self.pos] if self.pos < len(self.batches) else None
        self.pos += 1
        return item


def _train(rank: int, world: int, placement: str, pipelined: bool, gas: int, steps: int = 6) -> dict:
    torch.manual_seed(0)
    model = _Fields(PLACEMENTS[placement])
    stream = _Stream([_slice(_global_batch(s, 8, s % 2 == 1), rank, world) for s in range(steps)])
    pipe = SparseDistPipeline(model, stream.peek, lambda b: (b.values, b.lengths, b.weights), timeout_s=30) if pipelined else None
    losses, evals = [], []
    for micro in range(steps + 1):
        batch = pipe.next_item(stream.take) if pipe else stream.take()
        if batch is None:
            break
        if pipe:
            pipe.submit()
            pipe.arm()
        loss = _loss(model(batch), micro)
        loss.backward()
        losses.append(float(loss))
        if (micro + 1) % gas == 0:
            sparse_step(model)
        if pipe:
            pipe.release()
        if micro == 2:  # an evaluation between steps while the thread prepares the next batch
            with torch.no_grad():
                evals.append(model(_slice(_global_batch(99, 8, False), rank, world)).clone())
    stats = None
    if pipe:
        pipe.close()
        stats = dict(pipe.stats)
    dp = model.collection.data_parallel
    return {"state": model.collection.full_state_dict(), "losses": losses, "evals": evals, "stats": stats,
            "dp_prepared": dp.prepared_steps if dp is not None else None}


def _both(rank: int, world: int, placement: str, gas: int) -> tuple[dict, dict]:
    return _train(rank, world, placement, False, gas), _train(rank, world, placement, True, gas)


@pytest.mark.parametrize("placement", [pytest.param("data_parallel", marks=pytest.mark.soak), "mixed",
                                       pytest.param("row_wise", marks=pytest.mark.soak)])
def test_the_pipeline_equals_the_unpipelined_steps_bit_for_bit(placement):
    for want, got in run_distributed(_both, 2, args=(placement, 1), timeout_s=50):
        assert got["losses"] == want["losses"]
        assert all(torch.equal(a, b) for a, b in zip(got["evals"], want["evals"]))
        assert got["state"].keys() == want["state"].keys()
        for key in want["state"]:
            assert torch.equal(got["state"][key], want["state"][key]), key
        # the first batch runs unprepared; the 6 rounds after it: 5 prepared batches, then the end of the data
        assert got["stats"] == {"rounds": 6, "void": 1, "unprepared": 1}
        if want["dp_prepared"] is not None:  # each prepared step of a data-parallel pack skipped the dedup
            assert got["dp_prepared"] == 5 * 2 and want["dp_prepared"] == 0  # two data-parallel packs


@pytest.mark.soak
def test_the_pipeline_with_gradient_accumulation_equals_the_unpipelined_steps():
    for want, got in run_distributed(_both, 2, args=("mixed", 2), timeout_s=50):
        assert got["losses"] == want["losses"]
        for key in want["state"]:
            assert torch.equal(got["state"][key], want["state"][key]), key
        assert got["dp_prepared"] == 0  # two forwards per step: the step dedups the gathered rows itself


def _failing(rank: int, world: int) -> str:
    torch.manual_seed(0)
    model = _Fields(PLACEMENTS["mixed"])
    stream = _Stream([_slice(_global_batch(s, 8, False), rank, world) for s in range(6)],
                     fail_at=3 if rank == 1 else None)
    pipe = SparseDistPipeline(model, stream.peek, lambda b: (b.values, b.lengths, b.weights), timeout_s=5)
    try:
        for micro in range(6):
            batch = pipe.next_item(stream.take)
            pipe.submit()
            pipe.arm()
            _loss(model(batch), micro).backward()
            sparse_step(model)
            pipe.release()
        message = "no error"
    except Exception as exc:  # noqa: BLE001  (rank 0: its partner left, whichever collective saw it first)
        message = f"{type(exc).__name__}: {exc}"
    try:
        pipe.close()  # stops the thread; raises the thread's error again (already reported)
    except PipelineError:
        pass
    assert not pipe._thread.is_alive()
    return message


def test_an_error_on_the_thread_surfaces_on_the_callers_thread_with_the_rank_never_a_hang():
    messages = run_distributed(_failing, 2, timeout_s=50)
    assert messages[1].startswith("PipelineError: rank 1:") and "OSError: cannot read batch 3" in messages[1]
    assert messages[0] != "no error"  # its partner left: an error (the pipeline's or a collective's), not a hang


def test_a_model_without_packed_tables_is_refused_and_tables_are_found_in_a_mixed_collection():
    with pytest.raises(ValueError, match="no data-parallel or row-sharded packed tables"):
        SparseDistPipeline(nn.Linear(2, 2), lambda: None, lambda b: b)
    parts = [type(t.tables).__name__ for t in pipelined_tables(_Fields(PLACEMENTS["mixed"]))]
    assert parts == ["DataParallelEmbeddingCollection", "RowShardedEmbeddingCollection"]
    only = [type(t.tables).__name__ for t in pipelined_tables(_Fields(PLACEMENTS["mixed"]), data_parallel=False)]
    assert only == ["RowShardedEmbeddingCollection"]
    with pytest.raises(ValueError, match="no row-sharded packed tables"):
        SparseDistPipeline(_Fields(PLACEMENTS["data_parallel"]), lambda: None, lambda b: b, data_parallel=False)
