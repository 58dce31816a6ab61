"""The whole-step clock behind auto mode's detector (gba_engine/step_clock.py): pure unit tests, no processes."""
from __future__ import annotations

import threading
import time

import pytest

from gba_engine.step_clock import PeerWaits, StepClock


class _Backend:
    """Stands in for deepspeed.comm's backend object: blocking collectives as methods."""

    def all_reduce(self, t, wait_s: float = 0.0):
        time.sleep(wait_s)
        return t

    def barrier(self, fail: bool = False):
        if fail:
            raise RuntimeError("Connection reset by peer")


def test_a_step_is_its_wall_time_minus_the_blocked_time(monkeypatch):
    now = [100.0]
    monkeypatch.setattr("gba_engine.step_clock.time.perf_counter", lambda: now[0])
    clock = StepClock()
    now[0] += 0.05  # own work
    with clock.blocked():
        now[0] += 0.2  # waiting on a peer
    clock.add_blocked(-1.0)  # a negative wait is ignored
    now[0] += 0.01
    assert clock.lap() == pytest.approx(0.06)
    clock.restart()
    assert clock.blocked_s == 0.0 and clock.lap() == 0.0


def test_peer_waits_time_the_training_threads_collectives_only_and_give_the_methods_back():
    backend, clock, errors = _Backend(), StepClock(), []
    waits = PeerWaits(clock, backend, on_error=lambda name, exc: errors.append((name, str(exc))))
    for name in ("all_reduce", "barrier"):
        setattr(backend, name, waits._timed(name, getattr(backend, name)))
    waits._wrapped = ["all_reduce", "barrier"]
    assert backend.all_reduce(3, wait_s=0.05) == 3
    assert clock.blocked_s >= 0.05  # at least the sleep, whatever the load
    before = clock.blocked_s
    other = threading.Thread(target=backend.all_reduce, args=(1,), kwargs={"wait_s": 0.05})
    other.start(), other.join()
    assert clock.blocked_s == before  # another thread's collective is not this step's wait
    with pytest.raises(RuntimeError, match="reset"):
        backend.barrier(fail=True)
    assert errors == [("barrier", "Connection reset by peer")]  # the hook saw it before the error went up
    waits.detach()
    assert "all_reduce" not in vars(backend) and "barrier" not in vars(backend)


def test_attach_without_a_deepspeed_backend_is_a_no_op():
    from deepspeed.comm import comm as ds_comm

    saved, ds_comm.cdb = ds_comm.cdb, None
    try:
        assert PeerWaits.attach(StepClock()) is None
    finally:
        ds_comm.cdb = saved
