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


def _hang_after_saying_so(rank, world_size, marker_dir):
    open(os.path.join(marker_dir, f"started{rank}"), "w").close()
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


@pytest.mark.soak
def test_deadline_kills_hanging_ranks(capfd, tmp_path):
    t0 = time.monotonic()
    with pytest.raises(DistributedRunError, match=r"deadline of 5s passed; ranks \[0, 1\]"):
        run_distributed(_hang_after_saying_so, world_size=2, args=(str(tmp_path),), timeout_s=5,
                        init_process_group=False)
    assert time.monotonic() - t0 < 20
    stacks = capfd.readouterr().err  # the ranks that got to their hang wrote where they were stuck before the kill
    started = list(tmp_path.glob("started*"))
    # the ranks dump at the same moment, so their lines interleave on stderr: look for the frame, not a count
    assert not started or "_hang_after_saying_so" in stacks, stacks
    # forked ranks start in well under the 5 s; spawned ones may still be importing on a loaded box
    assert len(started) == 2 or os.environ.get("SPARSE_SCALE_TEST_SPAWN") == "1"


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


def test_prebuild_removes_a_stale_lock_and_keeps_a_fresh_one(tmp_path, caplog):
    from sparse_scale.prebuild import clear_stale_locks

    for op in ("fused_adam", "building_now"):
        (tmp_path / op).mkdir()
        (tmp_path / op / "lock").touch()
    os.utime(tmp_path / "fused_adam" / "lock", (time.time() - 3600, time.time() - 3600))  # a killed build's
    with caplog.at_level("WARNING"):
        assert clear_stale_locks(tmp_path) == [tmp_path / "fused_adam" / "lock"]
    assert not (tmp_path / "fused_adam" / "lock").exists() and (tmp_path / "building_now" / "lock").exists()
    assert "removing stale build lock" in caplog.text and "fused_adam" in caplog.text


_RUNS_IN_THIS_PROCESS = []


def _report_surroundings(rank, world_size, marker_dir):
    import atexit
    import sys

    _RUNS_IN_THIS_PROCESS.append(rank)
    print(f"rank {rank} says hello on stdout", flush=True)
    print(f"rank {rank} says hello on stderr", file=sys.stderr, flush=True)
    atexit.register(lambda: open(os.path.join(marker_dir, f"atexit{rank}"), "w").close())
    return {"probe": os.environ.get("SPARSE_SCALE_PROBE"), "cwd": os.getcwd(), "runs": len(_RUNS_IN_THIS_PROCESS),
            "rank_env": os.environ["RANK"], "ppid": os.getppid(), "preloaded": "deepspeed" in sys.modules}


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_ranks_see_the_callers_environment_cwd_and_stdio_and_run_atexit(method, tmp_path, monkeypatch, capfd):
    """What a rank inherits is the caller's at the call, for both start methods (the forkserver started earlier)."""
    from sparse_scale import multiproc

    monkeypatch.setitem(multiproc._start, "method", method)
    monkeypatch.setenv("SPARSE_SCALE_PROBE", f"set after the server started, {method}")
    monkeypatch.chdir(tmp_path)
    # forked ranks: a second run starts clean, nothing the first one did is left in them (spawned: fresh by design)
    for attempt in (1, 2) if method == "forkserver" else (1,):
        out = run_distributed(_report_surroundings, 2, args=(str(tmp_path),), timeout_s=40, init_process_group=False)
        assert [o["runs"] for o in out] == [1, 1], attempt
    assert [o["probe"] for o in out] == [f"set after the server started, {method}"] * 2
    assert [o["cwd"] for o in out] == [str(tmp_path)] * 2 and [o["rank_env"] for o in out] == ["0", "1"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["atexit0", "atexit1"]
    captured = capfd.readouterr()
    assert "rank 1 says hello on stdout" in captured.out and "rank 0 says hello on stderr" in captured.err
    # spawned ranks are the caller's children; forked ones the server's, which has imported deepspeed already
    assert [o["ppid"] == os.getpid() for o in out] == [method == "spawn"] * 2
    suite_preloads = os.environ.get("SPARSE_SCALE_TEST_SPAWN") != "1"  # conftest.py set the server's imports
    assert [o["preloaded"] for o in out] == [method == "forkserver" and suite_preloads] * 2


def test_the_suite_starts_ranks_from_the_preloading_forkserver():
    """conftest.py opts the suite in (SPARSE_SCALE_TEST_SPAWN=1 opts out); a rank then starts with deepspeed loaded."""
    from sparse_scale import multiproc

    expected = "spawn" if os.environ.get("SPARSE_SCALE_TEST_SPAWN") == "1" else "forkserver"
    assert multiproc._start["method"] == expected
    with pytest.raises(ValueError, match=r"preload must name modules, got \[''\]"):
        multiproc.start_ranks_from_forkserver(["torch", ""])
    assert multiproc._start["method"] == expected  # a refused call changes nothing
