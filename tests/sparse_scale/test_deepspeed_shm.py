"""DeepSpeed's CPU shm all-reduce segments are released once mapped: a run leaves nothing in /dev/shm.

Real gloo ranks started as the deepspeed launcher starts them on one node (LOCAL_SIZE = world size).
"""
from __future__ import annotations

import os

import torch

from sparse_scale.deepspeed_shm import release_shm_segment, segment_path
from sparse_scale.multiproc import run_distributed


def _shm_sum(rank: int) -> float:
    import deepspeed.comm as ds_dist

    t = torch.full((8,), float(rank + 1))
    ds_dist.inference_all_reduce(t)  # DeepSpeed's shm path: reads every rank's mapped segment
    return float(t[0])


def _plain_deepspeed(rank: int, world: int) -> dict:
    import deepspeed

    os.environ["LOCAL_SIZE"] = str(world)
    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
    path = segment_path(rank)
    made = path.exists()
    released = release_shm_segment()
    again = release_shm_segment()
    return {"made": made, "released": released, "again": again, "left": path.exists(), "sum": _shm_sum(rank)}


def _through_sparse_scale(rank: int, world: int) -> dict:
    import sparse_scale

    sparse_scale.init_distributed()
    return {"left": segment_path(rank).exists(), "sum": _shm_sum(rank)}


def test_plain_deepspeed_leaves_its_segment_until_released_and_the_all_reduce_still_works():
    for r in run_distributed(_plain_deepspeed, 2, timeout_s=45, init_process_group=False):
        assert r["made"], "DeepSpeed's CPU shm all-reduce made no segment: the condition this module mirrors changed"
        assert r["released"] and not r["again"] and not r["left"], r
        assert r["sum"] == 3.0, r  # 1 + 2, through the unlinked but still mapped segments


def test_sparse_scale_init_distributed_leaves_no_segment_behind():
    for r in run_distributed(_through_sparse_scale, 2, timeout_s=45, init_process_group=False):
        assert not r["left"] and r["sum"] == 3.0, r


def test_without_torch_distributed_nothing_is_released():
    assert release_shm_segment() is False
    assert segment_path(3, {"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}).name == \
        f"deepspeed_allreduce_buffer_{os.getuid()}_10.0.0.1_29500_3"
