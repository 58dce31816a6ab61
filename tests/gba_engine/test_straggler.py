"""The straggler detector behind ``mode: auto``: pure unit tests (no processes)."""
from __future__ import annotations

import math
import random

import pytest

from gba_engine.config import GBAConfig
from gba_engine.straggler import StragglerDetector


def _run(det: StragglerDetector, rows) -> list:
    return [det.observe(r) for r in rows]


def test_flags_a_4x_slow_worker_after_the_window_and_dwell():
    det = StragglerDetector(num_workers=4, slow_ratio=1.5, recover_ratio=1.2, window=8, min_dwell_steps=10)
    rng = random.Random(0)
    rows = [[0.1 * rng.uniform(0.95, 1.05) for _ in range(3)] + [0.4 * rng.uniform(0.95, 1.05)] for _ in range(30)]
    out = _run(det, rows)
    first = next(d for d in out if d.switched)
    assert first.mode == "gba" and first.slow == frozenset({3})
    # its median is over the bar from step 4 (half a window of times) and confirmed 8 steps later, which is
    # past min_dwell_steps 10: the dwell from the start holds nothing back here
    assert first.step == 11
    assert 3.5 < first.ratios[3] < 4.5 and all(0.9 < r < 1.1 for r in first.ratios[:3])
    assert sum(d.switched for d in out) == 1  # no flapping


def test_two_workers_one_slow_is_found_against_the_lower_median():
    det = StragglerDetector(num_workers=2, window=4, min_dwell_steps=1)
    out = _run(det, [[0.1, 0.4]] * 6)
    assert out[-1].mode == "gba" and out[-1].slow == frozenset({1})


def test_ignores_noise_and_single_spikes():
    det = StragglerDetector(num_workers=4, slow_ratio=1.5, recover_ratio=1.2, window=8, min_dwell_steps=1)
    rng = random.Random(1)
    rows = []
    for step in range(300):
        row = [0.1 * rng.lognormvariate(0, 0.15) for _ in range(4)]
        if step % 10 == 3:
            row[step % 4] *= 6  # an occasional GC pause / page fault: one slow step
        rows.append(row)
    out = _run(det, rows)
    assert all(d.mode == "sync" and not d.slow for d in out)


def test_noisy_worker_is_not_flagged_when_its_gap_is_within_its_jitter():
    det = StragglerDetector(num_workers=2, slow_ratio=1.5, recover_ratio=1.2, window=8, min_dwell_steps=1)
    # worker 1's median is 1.6x but it jumps between 0.05 and 0.3: the gap is noise, not slowness
    out = _run(det, [[0.1, t] for t in [0.05, 0.3, 0.05, 0.3, 0.16, 0.3, 0.05, 0.3] * 4])
    assert not any(d.slow for d in out)


def test_hysteresis_keeps_a_worker_slow_between_recover_and_slow_ratio():
    det = StragglerDetector(num_workers=2, slow_ratio=2.0, recover_ratio=1.2, window=3, min_dwell_steps=1)
    out = _run(det, [[0.1, 0.4]] * 5)
    assert out[-1].slow == frozenset({1})
    out = _run(det, [[0.1, 0.15]] * 6)  # 1.5x: below slow_ratio, above recover_ratio: still slow
    assert all(d.slow == frozenset({1}) and d.mode == "gba" for d in out)
    out = _run(det, [[0.1, 0.105]] * 6)  # below recover_ratio: recovered
    assert out[-1].slow == frozenset() and out[-1].mode == "sync"
    # and a worker at 1.5x that was never slow is not flagged
    fresh = StragglerDetector(num_workers=2, slow_ratio=2.0, recover_ratio=1.2, window=3, min_dwell_steps=1)
    assert not any(d.slow for d in _run(fresh, [[0.1, 0.15]] * 10))


def test_minimum_dwell_between_switches_both_ways():
    det = StragglerDetector(num_workers=2, slow_ratio=1.5, recover_ratio=1.2, window=2, min_dwell_steps=20)
    rows = [[0.1, 0.4]] * 25 + [[0.1, 0.1]] * 5 + [[0.1, 0.4]] * 30
    out = _run(det, rows)
    switches = [d.step for d in out if d.switched]
    assert switches[0] == 20  # the first switch waits for min_dwell_steps
    # recovered at ~27 but the dwell holds gba until step 40; by then the worker is slow again: no switch
    assert switches == [20]
    assert all(d.mode == "gba" for d in out[20:])


def test_switches_back_when_the_straggler_recovers():
    det = StragglerDetector(num_workers=3, window=4, min_dwell_steps=5)
    out = _run(det, [[0.1, 0.1, 0.5]] * 10 + [[0.1, 0.1, 0.1]] * 10)
    switches = [(d.step, d.mode) for d in out if d.switched]
    assert [m for _, m in switches] == ["gba", "sync"]
    assert switches[1][0] - switches[0][0] >= 5


def test_missing_times_and_config_and_errors():
    det = StragglerDetector.from_config(GBAConfig(mode="auto").switch, num_workers=2)
    assert det.window == 8 and det.min_dwell_steps == 20
    d = det.observe([0.1, math.nan])
    assert math.isnan(d.ratios[1]) and d.mode == "sync"
    with pytest.raises(ValueError, match="need 2 step times"):
        det.observe([0.1])
    with pytest.raises(ValueError, match="recover_ratio"):
        StragglerDetector(2, slow_ratio=1.2, recover_ratio=1.5)
    with pytest.raises(ValueError, match="negative"):
        det.observe([0.1, -1.0])
    det.force("gba")
    assert det.mode == "gba" and det.last_switch_step == det.step


def test_a_straggler_carried_into_gba_stays_slow_while_it_reports_rarely():
    # in gba mode the first worker reads times from the store; a slow worker has a fresh one every
    # 12th step only. A fresh detector does not fill its window and calls everyone recovered (the benchmark's
    # early switch back); carrying the slow set over keeps it flagged until its own times recover.
    rows = [[0.1, 0.1, 0.1, 0.4 if i % 12 == 11 else math.nan] for i in range(40)]
    fresh = _run(StragglerDetector(4, window=4, min_dwell_steps=10, mode="gba"), rows)
    assert any(d.switched and d.mode == "sync" for d in fresh)
    carried = _run(StragglerDetector(4, window=4, min_dwell_steps=10, mode="gba", slow={3}), rows)
    assert all(d.mode == "gba" and d.slow == {3} for d in carried)
    back = _run(StragglerDetector(4, window=4, min_dwell_steps=10, mode="gba", slow={3}), rows + [[0.1] * 4] * 12)
    assert back[-1].mode == "sync" and not back[-1].slow
    with pytest.raises(ValueError, match="slow workers"):
        StragglerDetector(2, slow={5})


def _jittery_rows(workers: int, steps: int, seed: int, slow: frozenset = frozenset(), start: int = 0) -> list:
    # lognormal jitter with sigma 0.38, the cycle-time spread fitted to this machine's real gba runs
    rng = random.Random(seed)
    return [[0.04 * rng.lognormvariate(0, 0.38) * (4.0 if w in slow and step >= start else 1.0)
             for w in range(workers)] for step in range(steps)]


@pytest.mark.parametrize("workers", [256, 1024])
def test_many_jittery_workers_without_a_straggler_are_never_flagged(workers):
    # benchmarks/gba_sim.py: with one fixed bar, some of 1,024 such workers passed it by chance every few
    # steps and auto mode went to gba with no straggler; the bar over the peers' spread grows with N
    det = StragglerDetector(num_workers=workers, window=8, min_dwell_steps=20)
    flagged = [d.step for d in _run(det, _jittery_rows(workers, 150, seed=workers)) if d.slow]
    assert flagged == [], flagged[:5]


def test_many_jittery_workers_find_their_few_4x_stragglers_within_a_window():
    slow = frozenset({5, 700, 1000})
    det = StragglerDetector(num_workers=1024, window=8, min_dwell_steps=20)
    out = _run(det, _jittery_rows(1024, 60, seed=3, slow=slow, start=30))
    assert all(not d.slow for d in out[:30])
    first = next(d for d in out if d.slow == slow)
    assert first.step <= 30 + 2 * 8 and out[-1].mode == "gba"  # half a window to move the median, one to confirm


def test_contention_that_passes_before_the_confirmation_makes_no_switch():
    # a competing process slows worker 1 to 2x for 8 steps: its median (of 8) passes slow_ratio for 7
    # consecutive steps, fewer than `window`, so it is not a straggler; the old rule (confirm_steps 1) switched
    rows = [[0.1, 0.1]] * 20 + [[0.1, 0.2]] * 8 + [[0.1, 0.1]] * 30
    new = _run(StragglerDetector(2, window=8, min_dwell_steps=1), rows)
    assert not any(d.switched for d in new) and not any(d.slow for d in new)
    old = _run(StragglerDetector(2, window=8, min_dwell_steps=1, confirm_steps=1), rows)
    assert [d.mode for d in old if d.switched] == ["gba", "sync"]


def test_confirmation_counts_consecutive_fresh_steps_and_a_dip_restarts_it():
    det = StragglerDetector(2, window=4, min_dwell_steps=1)
    assert det.confirm_steps == 4 and det.recover_steps == 2
    # over the bar from step 2 (half a window); a missing time (nan) neither counts nor breaks the streak
    out = _run(det, [[0.1, 0.4]] * 3 + [[0.1, math.nan]] + [[0.1, 0.4]] * 2)
    assert not out[-2].slow and out[-1].slow == frozenset({1})
    # a dip under the bar restarts it (window 1: the median is the last time)
    det = StragglerDetector(2, window=1, min_dwell_steps=1, confirm_steps=3)
    out = _run(det, [[0.1, 0.4]] * 2 + [[0.1, 0.1]] * 2 + [[0.1, 0.4]] * 3)
    assert [bool(d.slow) for d in out] == [False] * 5 + [False, True]
    with pytest.raises(ValueError, match="confirm_steps"):
        StragglerDetector(2, confirm_steps=0)


def test_recovery_is_confirmed_over_half_the_confirmation():
    det = StragglerDetector(2, window=2, min_dwell_steps=1, mode="gba", slow={1}, confirm_steps=4)
    out = _run(det, [[0.1, 0.1]] * 4)
    # under recover_ratio from step 1 (half a window of times): twice (recover_steps 2) at step 2
    assert [bool(d.slow) for d in out] == [True, False, False, False]
    det = StragglerDetector(2, window=1, min_dwell_steps=1, mode="gba", slow={1}, confirm_steps=4)
    out = _run(det, [[0.1, 0.1], [0.1, 0.4], [0.1, 0.1], [0.1, 0.1]])  # a slow step in between restarts it
    assert [bool(d.slow) for d in out] == [True, True, True, False]
