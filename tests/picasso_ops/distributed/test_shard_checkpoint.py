"""Row-wise shards saved per rank and loaded back: at the same world size and re-sharded at another one."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from picasso_ops.distributed import RowShardedEmbeddingCollection
from picasso_ops.distributed.shard_checkpoint import load_row_shards, row_shard_keys, save_row_shards
from sparse_scale.multiproc import run_distributed
from tests.picasso_ops.distributed.test_sharded_tables import _global_batch, _loss, _slice, _specs


class _Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tables = RowShardedEmbeddingCollection(_specs("adam"))  # weights, two moments and a step counter


def _train_and_save(rank: int, world: int, folder: str) -> dict:
    torch.manual_seed(0)
    model = _Model()
    for step in range(2):
        _loss(model.tables(_slice(_global_batch(step, 8, True), rank, world)).values, step).backward()
        model.tables.sparse_step()
    save_row_shards(model, Path(folder), rank)
    return {k: v.clone() for k, v in model.tables.full_state_dict().items()}


def _load(rank: int, world: int, folder: str) -> dict:
    torch.manual_seed(123)  # other initial rows: the load must replace them all
    model = _Model()
    assert load_row_shards(model, Path(folder))
    return {k: v.clone() for k, v in model.tables.full_state_dict().items()}


def _equal(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k], want[k]), k


def test_shards_saved_on_two_ranks_load_on_two_ranks_and_on_one(tmp_path):
    saved = run_distributed(_train_and_save, 2, args=(str(tmp_path),), timeout_s=45)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["row_shards_rank0.pt", "row_shards_rank1.pt"]
    same = run_distributed(_load, 2, args=(str(tmp_path),), timeout_s=45)
    for r in same:
        _equal(r, saved[0])
    _equal(_load(0, 1, str(tmp_path)), saved[0])  # one process puts the tables together from both shards


def test_shards_saved_by_one_process_load_on_two_ranks(tmp_path):
    full = _train_and_save(0, 1, str(tmp_path))
    for r in run_distributed(_load, 2, args=(str(tmp_path),), timeout_s=45):
        _equal(r, full)


def test_a_checkpoint_without_shard_files_is_refused_by_name(tmp_path):
    model = _Model()
    assert row_shard_keys(model) and all(k.startswith("tables.shard.") for k in row_shard_keys(model))
    with pytest.raises(FileNotFoundError, match="no row_shards_rank"):
        load_row_shards(model, tmp_path)
    assert save_row_shards(torch.nn.Linear(2, 2), tmp_path, 0) is None and not any(tmp_path.iterdir())
