"""The GBA discrete-event simulator (benchmarks/gba_sim.py) against hand computations."""
import math
import random

import pytest

from tests.bench.test_smoke import _load

sim = _load("gba_sim")
QUIET = sim.Network(latency_s=0.0, bytes_per_s=1e18, apply_s=0.0, update_s=0.0)


def test_step_time_fit_recovers_a_lognormal():
    rng = random.Random(3)
    truth = sim.StepTimes(0.05, 0.3)
    fitted = sim.StepTimes.fit([truth.sample(rng) for _ in range(4000)])
    assert fitted.median_s == pytest.approx(0.05, rel=0.03) and fitted.sigma == pytest.approx(0.3, rel=0.05)
    with pytest.raises(ValueError, match="at least 2"):
        sim.StepTimes.fit([0.1])


def test_sync_waits_for_the_slowest_worker_and_the_allreduce():
    net = sim.Network(latency_s=1e-3, bytes_per_s=1e9, allreduce_bytes=4_000_000, apply_s=0.0, update_s=0.0)
    times = [sim.StepTimes(0.01, 0.0)] * 3 + [sim.StepTimes(0.03, 0.0)]
    r = sim.simulate("sync", 4, 400, times, net, local_batch=10)
    allreduce = 2 * 3 / 4 * 4e6 / 1e9 + 2 * 2 * 1e-3  # ring bandwidth + 2 log2(4) latencies
    assert r.wall_s == pytest.approx(100 * (0.03 + allreduce))
    assert r.samples_per_s == pytest.approx(4000 / r.wall_s) and r.batches_per_worker == [100] * 4
    assert r.staleness == {} and r.updates == 0


def test_gba_with_equal_workers_and_no_network_is_one_version_behind_at_most():
    r = sim.simulate("gba", 4, 400, [sim.StepTimes(0.01, 0.0)] * 4, QUIET)
    assert r.updates == 100 and r.dropped == 0 and r.batches_per_worker == [100] * 4
    assert set(r.staleness) <= {0, 1} and sum(r.staleness.values()) == 400
    assert r.wall_s == pytest.approx(1.0)


def test_async_applies_every_gradient_and_its_staleness_grows_with_workers():
    r = sim.simulate("async", 8, 800, [sim.StepTimes(0.01, 0.0)] * 8, QUIET)
    assert r.updates == 800 and r.dropped == 0
    mean_tau = sum(t * n for t, n in r.staleness.items()) / 800
    assert 6 <= mean_tau <= 8  # the other 7 workers' gradients land between a pull and its push


def test_a_straggler_takes_fewer_batches_under_gba_and_its_stale_gradients_are_dropped():
    times = [sim.StepTimes(0.01, 0.0)] * 4
    slow = sim.Stragglers(factor=20.0, window=(0.0, 1.0), slow_workers=(3,))
    r = sim.simulate("gba", 4, 2000, times, QUIET, slow, threshold=4)
    assert r.batches_per_worker[3] < r.batches_per_worker[0] / 10
    assert r.dropped == sum(n for t, n in r.staleness.items() if t > 4) > 0  # the real TokenControl drops them
    s = sim.simulate("sync", 4, 2000, times, QUIET, slow)
    assert s.samples_per_s < r.samples_per_s / 3


def test_auto_switches_to_gba_for_the_straggler_window_and_back():
    times = [sim.StepTimes(0.01, 0.02)] * 8
    slow = sim.Stragglers(factor=4.0, window=(0.3, 0.6), slow_workers=(5,))
    r = sim.simulate("auto", 8, 8 * 600, times, QUIET, slow, seed=1, switch_s=0.1, min_dwell_steps=10)
    assert [(a, b) for _, a, b in r.switches] == [("sync", "gba"), ("gba", "sync")]
    first, second = r.switches[0][0], r.switches[1][0]
    assert 0.3 * 4800 <= first < 0.4 * 4800 and 0.6 * 4800 <= second < 0.75 * 4800
    sync = sim.simulate("sync", 8, 8 * 600, times, QUIET, slow, seed=1)
    assert r.samples_per_s > sync.samples_per_s


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="method"):
        sim.simulate("ssp", 4, 40, [sim.StepTimes(0.01)] * 4, QUIET)
    with pytest.raises(ValueError, match="one StepTimes per worker"):
        sim.simulate("gba", 4, 40, [sim.StepTimes(0.01)] * 3, QUIET)
    with pytest.raises(ValueError, match="not one step"):
        sim.simulate("gba", 4, 3, [sim.StepTimes(0.01)] * 4, QUIET)


def test_the_scale_table_has_every_method_per_size():
    rows = sim.scale_table([4], [0.25], 20, sim.StepTimes(0.01, 0.1), QUIET, seed=0)
    assert [r["method"] for r in rows] == list(sim.METHODS)
    assert all(math.isfinite(r["samples_per_s"]) and r["samples_per_s"] > 0 for r in rows)
    assert "| 4 | 25% | gba |" in sim.format_scale(rows)


def test_detector_study_counts_false_switches_and_delays():
    # the confirmation removes the contention's false switches that the old rule (confirm_steps 1) makes
    grid = [(1.5, 1.2, 8, 20, 1), (1.5, 1.2, 8, 20, None)]
    old, new = sim.detector_table(grid, seeds=4, steps=1000)
    assert old["false_per_1000"] > 0 and new["false_per_1000"] < old["false_per_1000"]
    assert new["confirm_steps"] == 8 and new["missed_4x"] < 4 and new["delay_4x"] >= 8
    quiet = sim.detector_table([(1.5, 1.2, 8, 20, None)], seeds=2, steps=1000, sigma=0.05, contention=None)[0]
    assert quiet["false_per_1000"] == 0 and quiet["missed_2x"] == 0 and 8 <= quiet["delay_2x"] <= 20
    assert "| 1.5 | 1.2 | 8 | 20 | 8 |" in sim.format_detector([new], 4, 1000)


def test_a_replayed_trace_keeps_the_recorded_rows_and_adds_the_straggler():
    recorded = [[0.01 * (i + 1), 0.02 * (i + 1)] for i in range(10)]
    rows = sim.replayed_trace(recorded, 25, random.Random(0), straggler=(1, 3.0, 5, 8))
    assert len(rows) == 25
    flat = {round(t, 6) for r in rows for t in r}
    base = {round(t, 6) for r in recorded for t in r}
    assert len(flat - base) > 0 and all(r[0] in base or r[1] in base for r in rows)
    assert sim.detector_table([(1.5, 1.2, 4, 5, None)], seeds=2, steps=100, recorded=recorded)[0]["window"] == 4
