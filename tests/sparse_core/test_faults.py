"""sparse_core.faults: the one fault injector behind the rec job's --straggler/--crash and the GBA chaos plans."""
import json

import pytest

from sparse_core.faults import CHAOS_EXIT_CODE, CRASH_EXIT_CODE, Fault, FaultInjector, Straggler


class _Recorder:
    def __init__(self):
        self.sleeps, self.exits, self.freezes, self.events = [], [], [], []

    def kwargs(self):
        return dict(sleep=self.sleeps.append, exit=lambda code: (self.exits.append(code), self.events.append("kill")),
                    freeze=lambda s: (self.freezes.append(s), self.events.append("freeze")))


def test_a_freeze_then_a_kill_at_one_step_in_that_order_with_records(tmp_path):
    rec = _Recorder()
    faults = [Fault(1, 0, 4, "kill"), Fault(1, 0, 4, "freeze", 0.5), Fault(1, 1, 2), Fault(0, 0, 2)]
    injector = FaultInjector(1, faults, record=tmp_path / "chaos", **rec.kwargs())
    for step in range(1, 4):
        injector.after_step(step, batch=10 + step)
    assert rec.events == []  # rank 0's fault and incarnation 1's are not this process's
    injector.after_step(4, batch=14)
    assert rec.events == ["freeze", "kill"] and rec.freezes == [0.5] and rec.exits == [CHAOS_EXIT_CODE]
    lines = [json.loads(line) for line in (tmp_path / "chaos" / "faults-1.jsonl").read_text().splitlines()]
    assert [(r["kind"], r["step"], r["incarnation"]) for r in lines] == [("freeze", 4, 0), ("kill", 4, 0)]
    assert lines[1]["trained"] == [11, 12, 13, 14] and lines[1]["exit_code"] == CHAOS_EXIT_CODE


def test_a_fault_planned_before_a_resumed_step_is_dropped():
    rec = _Recorder()
    injector = FaultInjector(0, [Fault(0, 0, 3, exit_code=CRASH_EXIT_CODE), Fault(0, 0, 9, exit_code=5)],
                             **rec.kwargs())
    injector.after_step(5)  # resumed at step 5: the step-3 kill never happens
    assert rec.exits == [] and [f.step for f in injector.pending] == [9]
    injector.after_step(9)
    assert rec.exits == [5]


def test_stragglers_sleep_after_calibration_inside_their_window():
    rec = _Recorder()
    injector = FaultInjector(2, stragglers=[Straggler(2, 3.0, start=2, end=4), Straggler(1, 9.0)], **rec.kwargs())
    for s in (0.2, 0.4, 0.3):
        assert injector.before_backward(2) == 0.0
        injector.after_backward(s)
    assert injector.calibrated
    assert injector.before_backward(1) == 0.0 and injector.before_backward(4) == 0.0
    assert injector.before_backward(3) == pytest.approx(0.6) and rec.sleeps == [pytest.approx(0.6)]


@pytest.mark.parametrize("bad", [dict(rank=-1, incarnation=0, step=1), dict(rank=0, incarnation=0, step=0),
                                 dict(rank=0, incarnation=0, step=2, kind="freeze"),
                                 dict(rank=0, incarnation=0, step=2, kind="explode")])
def test_a_malformed_fault_is_refused(bad):
    with pytest.raises(ValueError):
        Fault(**bad)


def test_the_rec_flags_and_the_chaos_plans_use_this_injector():
    from gba_engine.chaos import ChaosInjector, ChaosPlan
    from sparse_scale.rec import faults as rec_faults

    crash = rec_faults.FaultInjector(1, [rec_faults.parse_straggler("1:2")], rec_faults.parse_crash("1:3"))
    assert isinstance(crash, FaultInjector) and rec_faults.Straggler is Straggler
    assert [(f.step, f.exit_code) for f in crash.pending] == [(3, CRASH_EXIT_CODE)]
    chaos = ChaosInjector(ChaosPlan().fail_at(1, 2).freeze_at(1, 1, 0.2), rank=1, incarnation=0)
    assert isinstance(chaos, FaultInjector)
    assert [(f.kind, f.step, f.exit_code) for f in chaos.pending] == [("freeze", 1, CHAOS_EXIT_CODE),
                                                                     ("kill", 2, CHAOS_EXIT_CODE)]
    chaos._freeze = lambda s: None
    chaos.after_step(batch=7)
    assert chaos.steps == 1 and chaos.trained == [7] and [f.kind for f in chaos.pending] == ["kill"]
