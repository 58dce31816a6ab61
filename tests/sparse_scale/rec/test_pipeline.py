"""picasso.pipeline in the rec job: the stream's read-ahead, and whole runs on 2 gloo ranks against the switch off.

The runs (marked soak: a rec job on 2 ranks takes 15-20 s here) train a mixed plan (two fields' tables
row-wise, the rest data-parallel) with an evaluation every 2 steps and saves; with the pipeline on, the
weights, the evaluations and a resumed run equal the run with it off bit for bit.
"""
from __future__ import annotations

import pytest

from picasso_ops.config import PicassoConfig
from picasso_ops.data.epoch_stream import EPOCH_END
from sparse_scale.multiproc import run_distributed
from sparse_scale.rec.data import RankStream


class _Source:
    """Items with a consumed count as state (what a file stream's state says)."""

    def __init__(self, items: list) -> None:
        self.items, self.read = items, 0

    def __iter__(self):
        for item in self.items:
            self.read += 1
            yield item

    def state(self) -> dict[str, int]:
        return {"read": self.read}


def test_peek_reads_ahead_without_moving_the_streams_state():
    stream = RankStream(_Source(["a", "b", EPOCH_END, "c"]), micro_batch=1, finite=True, epochs=2)
    it = iter(stream)
    assert stream.peek() == "a" and stream.peek() == "a" and stream.state() == {"read": 0}
    assert next(it) == "a" and stream.state() == {"read": 1}
    assert stream.peek() == "b" and stream.state() == {"read": 1}
    assert next(it) == "b"
    assert stream.peek() is None and stream.state() == {"read": 2}  # an epoch's end read ahead: no batch
    assert next(it) is None and stream._at_epoch_end and stream.next_epoch()
    assert stream.peek() == "c" and next(it) == "c"
    assert stream.peek() is None  # the data's end
    with pytest.raises(StopIteration):
        next(it)


def test_a_batch_read_ahead_is_the_first_one_dropped_at_another_ranks_epoch_end():
    stream = RankStream(_Source(["a", "b", "c", EPOCH_END, "d"]), micro_batch=1, finite=True, epochs=2)
    it = iter(stream)
    assert next(it) == "a" and stream.peek() == "b"
    assert stream.next_epoch()  # another rank's shard ended: b and c are dropped, the next epoch starts at d
    assert next(it) == "d"


def test_the_switch_is_a_picasso_field_on_for_row_wise_tables_by_default():
    assert PicassoConfig().pipeline == "row_wise" and PicassoConfig(pipeline="off").pipeline == "off"
    with pytest.raises(ValueError, match="pipeline"):
        PicassoConfig(pipeline="yes")


def _rec(tmp_path, name: str, steps: int, pipeline: str, *extra: str) -> list[dict]:
    from tests.e2e.test_train_rec_picasso import BLOCK, SMALL, _config, _run

    block = {**BLOCK, "sharding": "auto", "table_sharding": {"0": "row_wise", "5": "row_wise"}, "pipeline": pipeline}
    cfg = _config(tmp_path / f"cfg_{name}", block)
    argv = [*SMALL, "--model", "dlrm", "--steps", str(steps), "--config", cfg, "--out", str(tmp_path / name),
            "--save-every", "2", "--eval-every", "2", *extra]
    return run_distributed(_run, 2, args=(argv,), timeout_s=55, init_process_group=False)


def _same(want: list[dict], got: list[dict]) -> None:
    for w, g in zip(want, got):  # each rank: its replicas and its own shards
        assert w["state"].keys() == g["state"].keys()
        assert all((w["state"][k] == g["state"][k]).all() for k in w["state"]), "weights differ"
        assert g["summary"]["auc"] == w["summary"]["auc"] and g["summary"]["log_loss"] == w["summary"]["log_loss"]
        assert g["summary"]["samples"] == w["summary"]["samples"]


@pytest.mark.soak
def test_the_rec_job_with_the_pipeline_equals_it_without_and_resumes_exactly(tmp_path):
    off = _rec(tmp_path, "off", 4, "off")
    _same(off, _rec(tmp_path, "on", 4, "row_wise"))  # trained, evaluated (every 2 steps, at the end) and saved
    _same(off, _rec(tmp_path, "all", 4, "all"))  # the data-parallel tables' unions too
    _rec(tmp_path, "half", 2, "row_wise")
    _same(off, _rec(tmp_path, "half", 4, "row_wise", "--resume"))
