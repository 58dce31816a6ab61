"""A chaos run (tests/infra/chaos_job.py): a gba job of 300 batches while 5 worker processes are killed
and restarted and one (the longest-lived) is frozen for less than the heartbeat lease.

Checked: no hang (one deadline for the whole run), every planned fault happened, every batch number
trained exactly once, every gradient counted by the server or lost in flight by a kill (at most
one per death), nobody reported lost for good, and the two last processes end on identical parameters.
A second run kills the server at batch 250: the job stops, every last process naming the server.
"""
from __future__ import annotations

import pytest
import torch

from gba_engine.chaos import CHAOS_EXIT_CODE, ChaosPlan
from tests.infra import chaos_job

TOTAL = 300


@pytest.fixture(scope="module")
def chaos(tmp_path_factory):
    return chaos_job.run_chaos(str(tmp_path_factory.mktemp("gba_chaos")), chaos_job.default_plan(), TOTAL)


@pytest.mark.slow
@pytest.mark.soak
def test_the_plan_kills_five_processes_over_both_workers_and_each_planned_fault_happened(chaos):
    plan, kills = chaos["plan"], chaos["kills"]
    assert len(kills) == 5 and {k["rank"] for k in kills} == {0, 1}
    assert sorted((k["rank"], k["incarnation"], k["step"]) for k in kills) == sorted(
        (f.rank, f.incarnation, f.step) for f in plan.faults if f.kind == "kill")
    assert [(r["rank"], r["incarnation"], r["step"]) for r in chaos["faults"] if r["kind"] == "freeze"] == [
        (f.rank, f.incarnation, f.step) for f in plan.faults if f.kind == "freeze"] == [(0, 2, 19)]
    for (rank, incarnation), code in chaos["codes"].items():  # replacements die by the plan, the last ones finish
        assert code == (0 if incarnation == plan.kills_of(rank) else CHAOS_EXIT_CODE), (rank, incarnation)


@pytest.mark.slow
@pytest.mark.soak
def test_every_batch_is_trained_exactly_once_across_all_processes(chaos):
    trained = [b for k in chaos["kills"] for b in k["trained"]] + [b for f in chaos["final"].values()
                                                                   for b in f["trained"]]
    assert len(trained) == len(set(trained)) == TOTAL and set(trained) == set(range(TOTAL))


@pytest.mark.slow
@pytest.mark.soak
def test_every_gradient_is_counted_by_the_server_or_was_in_flight_when_its_process_was_killed(chaos):
    server = chaos["server"]
    assert server["lost_workers"] == [] and sorted(set(server["rejoined"])) == [0, 1]
    for rank, in_flight in chaos_job.lost_in_flight(chaos).items():
        deaths = sum(1 for k in chaos["kills"] if k["rank"] == rank)
        assert 0 <= in_flight <= deaths, (rank, server["pushes"], deaths)


@pytest.mark.slow
@pytest.mark.soak
def test_the_last_processes_end_on_identical_parameters(chaos):
    a, b = chaos["final"][0], chaos["final"][1]
    torch.testing.assert_close(a["dense"], b["dense"], rtol=0, atol=0)
    torch.testing.assert_close(a["rows"], b["rows"], rtol=0, atol=0)
    assert torch.isfinite(a["dense"]).all()


@pytest.mark.slow
@pytest.mark.soak
def test_the_outcome_checks_find_a_broken_run(chaos):
    # the benchmark's verdict is not a check that cannot fail: a run missing a batch and a kill is reported
    broken = {**chaos, "kills": chaos["kills"][1:]}
    problems = chaos_job.failed_checks(broken, TOTAL)
    assert chaos_job.failed_checks(chaos, TOTAL) == []
    assert any("differ from the plan" in p for p in problems) and any("batches trained" in p for p in problems)


@pytest.mark.parametrize("bad", [dict(rank=-1, incarnation=0, step=1), dict(rank=0, incarnation=0, step=0),
                                 dict(rank=0, incarnation=0, step=2, kind="freeze")])
def test_a_malformed_fault_is_refused(bad):
    from gba_engine.chaos import Fault

    with pytest.raises(ValueError):
        Fault(**bad)


def test_a_process_is_killed_once_and_random_plans_are_seeded():
    with pytest.raises(ValueError, match="killed once"):
        ChaosPlan().fail_at(1, 5).fail_at(1, 9)
    a = ChaosPlan.random_kills([0, 1], kills=5, mtbf_steps=25, seed=4)
    assert a == ChaosPlan.random_kills([0, 1], kills=5, mtbf_steps=25, seed=4)
    assert {f.rank for f in a.faults} == {0, 1} and a.kills_of(0) + a.kills_of(1) == 5
    # each rank's processes die in incarnation order 0, 1, 2, ...
    for r in (0, 1):
        assert sorted(f.incarnation for f in a.faults if f.rank == r) == list(range(a.kills_of(r)))


@pytest.fixture(scope="module")
def server_chaos(tmp_path_factory):
    # the worker faults of the plan happen first (the last one by about batch 130), then batch 250 kills the server
    return chaos_job.run_chaos(str(tmp_path_factory.mktemp("gba_chaos_server")), chaos_job.default_plan(), TOTAL,
                               kill_server_at=250)


@pytest.mark.slow
@pytest.mark.soak
def test_a_killed_server_stops_the_job_and_every_last_process_names_it(server_chaos):
    assert chaos_job.failed_server_checks(server_chaos) == []
    for fin in server_chaos["final"].values():
        assert "server index 0" in fin["error"] and "--resume" in fin["error"]
    assert len({b for f in server_chaos["final"].values() for b in f["trained"]}) < TOTAL  # it did stop early


@pytest.mark.slow
@pytest.mark.soak
def test_both_workers_killed_at_once_are_replaced_and_the_job_goes_on(tmp_path):
    # every worker dead at once and the replacements 3 s late (CI, stop 19: the server ended the job, seeing no
    # worker left): the server gives dead workers timeout_s (15 s here) to be replaced
    total = 60
    outcome = chaos_job.run_chaos(str(tmp_path), ChaosPlan().fail_at(0, 8).fail_at(1, 8), total, join_delay_s=3.0)
    assert chaos_job.failed_checks(outcome, total) == []
    assert sorted(set(outcome["server"]["rejoined"])) == [0, 1] and outcome["server"]["lost_workers"] == []


@pytest.mark.slow
@pytest.mark.soak
def test_a_worker_frozen_past_its_lease_comes_back_and_the_job_ends_intact(tmp_path):
    # SIGSTOP for 2.5 s: past the 1 s heartbeat lease (the server marks it silent), under timeout_s (15 s)
    total = 80
    plan = ChaosPlan().fail_at(0, 20).fail_at(1, 14).freeze_at(1, 8, 2.5)  # the freeze, then its kill
    outcome = chaos_job.run_chaos(str(tmp_path), plan, total)
    assert chaos_job.failed_checks(outcome, total) == []
    assert [(r["rank"], r["step"]) for r in outcome["faults"] if r["kind"] == "freeze"] == [(1, 8)]
