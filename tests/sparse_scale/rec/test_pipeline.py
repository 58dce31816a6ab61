"""picasso.pipeline in the rec job: the stream's read-ahead, and whole runs on 2 gloo ranks against the switch off.

The runs (marked soak: a rec job on 2 ranks takes 15-20 s here) train a mixed plan (two fields' tables
row-wise, the rest data-parallel) with an evaluation every 2 steps and saves; with the pipeline on, the
weights, the evaluations and a resumed run equal the run with it off bit for bit.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

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


def _file_runs(rank: int, world: int, cfg_off: str, cfg_on: str, base: dict) -> tuple[dict, dict]:
    from tests.sparse_scale.rec.test_epochs import _recorded_run

    off = _recorded_run(rank, world, cfg_off, {**base, "out": base["out"] + "_off"}, 2)
    return off, _recorded_run(rank, world, cfg_on, {**base, "out": base["out"] + "_on"}, 2)


@pytest.mark.soak
def test_two_epochs_of_files_on_two_ranks_train_the_same_batches_and_weights_through_the_pipeline(tmp_path):
    """The ranks' shards end at different rows in each epoch: the rounds read ahead there are skipped alike."""
    import json

    from tests.picasso_ops.data.test_files import random_rows, write_tsv
    from tests.sparse_scale.rec.test_epochs import SIZES, _ds_config

    files, first = [], 0
    for k, n in enumerate(SIZES):
        files.append(str(write_tsv(tmp_path / f"part{k}.tsv", random_rows(n, seed=10 + k, first_id=first))))
        first += n
    evalf = write_tsv(tmp_path / "eval.tsv", random_rows(24, seed=30, first_id=100))
    configs = []
    for mode in ("off", "row_wise"):
        (tmp_path / mode).mkdir()
        path = Path(_ds_config(tmp_path / mode, micro=4))
        cfg = json.loads(path.read_text())
        cfg["picasso"] = {"embedding_dim": 8, "sharding": "row_wise", "pipeline": mode}
        path.write_text(json.dumps(cfg))
        configs.append(str(path))
    base = dict(data="criteo", train_files=tuple(files), eval_files=(str(evalf),), epochs=2, steps=40, vocab=64,
                threads=1, model="dlrm", out=str(tmp_path / "run"))
    for off, on in run_distributed(_file_runs, 2, args=(*configs, base), timeout_s=55, init_process_group=False):
        assert on["trained"] == off["trained"] and len(off["trained"]) >= 8
        assert on["params"].keys() == off["params"].keys()
        assert all(torch.equal(on["params"][k], off["params"][k]) for k in off["params"])
        assert on["summary"]["eval_history"] == off["summary"]["eval_history"]
        assert [h["epoch"] for h in off["summary"]["eval_history"]] == [0, 1]
