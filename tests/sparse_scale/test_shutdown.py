"""``sparse_scale.shutdown_distributed``: a run that succeeded exits with its own code, on real gloo ranks.

The abort it prevents (found in CI, reproduced with 5 plain gloo ranks, see sparse_scale/shutdown.py): a gloo
worker drops a finished collective's tensors after the interpreter began finalizing and SIGABRTs the process.
Its timing is a race, so these tests check what the function guarantees instead: collectives still in flight
are finished by ``flush=True``, every group is destroyed, and the ranks exit 0.
"""
from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

from sparse_scale.multiproc import free_port

REPO = Path(__file__).resolve().parents[2]
DEADLINE_S = 45.0

RANK = textwrap.dedent("""
    import sys, torch, torch.distributed as dist
    sys.path.insert(0, {repo!r})
    from sparse_scale import shutdown_distributed
    from sparse_scale.shutdown import _flush

    rank, mode = int(sys.argv[1]), sys.argv[2]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    sub = dist.new_group([0, 1])          # held here, as DeepSpeed holds its expert and data-parallel groups
    x = torch.full((4,), float(rank))
    dist.all_reduce(x, group=sub)
    assert x.tolist() == [1.0] * 4, x
    if mode == "in_flight":               # an async_op collective the script never waits for
        work = dist.all_reduce(torch.ones(4_000_000), group=sub, async_op=True)
        released = _flush(sub, 1)
        print("IN_FLIGHT_DONE", rank, work.is_completed(), released, flush=True)
    shutdown_distributed(flush=(mode != "local"))
    print("END", rank, dist.is_initialized(), flush=True)
""")


def _run_two_ranks(tmp_path: Path, mode: str) -> list[str]:
    script = tmp_path / f"rank_{mode}.py"
    script.write_text(RANK.format(repo=str(REPO), port=free_port()))
    procs = [subprocess.Popen([sys.executable, str(script), str(r), mode], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin"})
             for r in range(2)]
    outs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=DEADLINE_S)
            outs.append(out)
    finally:
        for p in procs:
            p.kill()
    for rank, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"rank {rank} exited {p.returncode}:\n{out[-3000:]}"
        assert f"END {rank} False" in out, f"rank {rank} still had a process group:\n{out[-3000:]}"
    return outs


def test_local_shutdown_destroys_every_group_and_both_ranks_exit_0(tmp_path):
    _run_two_ranks(tmp_path, "local")


def test_flush_finishes_a_collective_never_waited_for(tmp_path):
    outs = _run_two_ranks(tmp_path, "in_flight")
    for rank, out in enumerate(outs):
        assert f"IN_FLIGHT_DONE {rank} True True" in out, out[-3000:]


def test_without_a_process_group_it_does_nothing():
    import torch.distributed as dist

    from sparse_scale import shutdown_distributed

    assert not dist.is_initialized()
    shutdown_distributed(flush=True)
    assert not dist.is_initialized()


def _flush_alone(rank: int, world: int) -> str:
    import time

    from sparse_scale.shutdown import ShutdownError, shutdown_distributed

    if rank == 1:  # never comes to the flush, as a rank that failed or skipped the call
        time.sleep(3)
        return "absent"
    try:
        shutdown_distributed(flush=True, flush_timeout_s=1)
    except ShutdownError as exc:
        return str(exc)
    return "no error"


def test_flush_names_the_group_a_rank_never_joins_within_its_deadline():
    from sparse_scale.multiproc import run_distributed

    message, absent = run_distributed(_flush_alone, 2, timeout_s=40)
    assert absent == "absent"
    assert "rank 0: the barrier of gloo group 0 (ranks [0, 1]) did not finish within 1 s" in message, message


def test_bad_arguments_are_refused():
    import pytest

    from sparse_scale import shutdown_distributed

    with pytest.raises(ValueError, match="settle_s=-1"):
        shutdown_distributed(settle_s=-1)
    with pytest.raises(ValueError, match="flush_timeout_s=0"):
        shutdown_distributed(flush=True, flush_timeout_s=0)
