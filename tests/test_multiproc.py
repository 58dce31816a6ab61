import os
import time

import pytest
import torch
import torch.distributed as dist

from sparse_scale.multiproc import DistributedRunError, free_port, run_distributed


def _allreduce_rank(rank, world_size, scale):
    t = torch.tensor([float(rank) * scale])
    dist.all_reduce(t)
    return t.item(), os.environ["MASTER_ADDR"], os.environ["GLOO_SOCKET_IFNAME"]


def _fail_on_rank1(rank, world_size):
    if rank == 1:
        raise ValueError("boom on purpose")
    dist.barrier()  # rank 0 would wait forever for rank 1: the harness must kill it


def _hang(rank, world_size):
    time.sleep(600)


def _die_silently(rank, world_size):
    if rank == 0:
        os._exit(3)
    time.sleep(600)


def test_allreduce_over_real_processes():
    out = run_distributed(_allreduce_rank, world_size=3, args=(2.0,), timeout_s=40)
    assert [o[0] for o in out] == [6.0, 6.0, 6.0]
    assert out[0][1:] == ("127.0.0.1", "lo")


def test_first_failure_propagates_with_traceback():
    t0 = time.monotonic()
    with pytest.raises(DistributedRunError, match=r"rank 1 of 2 failed:[\s\S]*ValueError: boom on purpose"):
        run_distributed(_fail_on_rank1, world_size=2, timeout_s=40)
    assert time.monotonic() - t0 < 30


def test_deadline_kills_hanging_ranks():
    t0 = time.monotonic()
    with pytest.raises(DistributedRunError, match=r"deadline of 5s passed; ranks \[0, 1\]"):
        run_distributed(_hang, world_size=2, timeout_s=5, init_process_group=False)
    assert time.monotonic() - t0 < 20


def test_silent_death_is_reported():
    with pytest.raises(DistributedRunError, match="rank 0 of 2 exited with code 3"):
        run_distributed(_die_silently, world_size=2, timeout_s=30, init_process_group=False)


def test_free_port_is_bindable():
    import socket

    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


def test_bad_world_size():
    with pytest.raises(ValueError, match="world_size must be >= 1"):
        run_distributed(_hang, world_size=0)


def _rank1_exits(rank, world_size):
    if rank == 1:
        os._exit(17)
    return rank * 10


def test_expected_exit_is_accepted_and_checked():
    assert run_distributed(_rank1_exits, 2, timeout_s=30, init_process_group=False, expect_exit={1: 17}) == [0, None]
    with pytest.raises(DistributedRunError, match="rank 1 was expected to exit with code 5, got 17"):
        run_distributed(_rank1_exits, 2, timeout_s=30, init_process_group=False, expect_exit={1: 5})
    with pytest.raises(DistributedRunError, match="rank 0 was expected to exit with code 3 but returned 0"):
        run_distributed(_rank1_exits, 2, timeout_s=30, init_process_group=False, expect_exit={0: 3, 1: 17})


def test_stale_lock_detection(tmp_path):
    from sparse_scale.prebuild import stale_locks

    (tmp_path / "op_a").mkdir()
    (tmp_path / "op_b").mkdir()
    old, fresh = tmp_path / "op_a" / "lock", tmp_path / "op_b" / "lock"
    old.touch()
    fresh.touch()
    os.utime(old, (time.time() - 3600, time.time() - 3600))
    assert stale_locks(tmp_path) == [old]
