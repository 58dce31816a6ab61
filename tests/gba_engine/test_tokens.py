"""Token control and the global-batch buffer as pure units (no processes)."""
import heapq

import pytest
import torch

from gba_engine.decay import StalenessDecay
from gba_engine.tokens import GlobalBatchBuffer, TokenControl, grads_per_update


def test_grads_per_update():
    assert grads_per_update(2048, 512) == 4
    assert grads_per_update(8, 8) == 1
    with pytest.raises(ValueError, match="not a multiple"):
        grads_per_update(1000, 512)
    with pytest.raises(ValueError, match="positive integer"):
        grads_per_update(0, 1)
    with pytest.raises(ValueError, match="positive integer"):
        grads_per_update(8, 2.0)


def test_exactly_m_gradients_make_an_update_and_versions_increment():
    tc = TokenControl(grads_per_update=3, decay=StalenessDecay("drop", threshold=4))
    assert [tc.admit(0).ready for _ in range(3)] == [False, False, True]
    with pytest.raises(RuntimeError, match="already admitted"):
        tc.admit(0)
    assert tc.commit() == 1 and tc.version == 1 and tc.pending == 0
    with pytest.raises(RuntimeError, match="exactly M=3"):
        tc.commit()
    assert tc.admit(1).tau == 0 and tc.admit(0).tau == 1


def test_dropped_gradients_are_tallied_but_do_not_count_toward_m():
    tc = TokenControl(grads_per_update=2, decay=StalenessDecay("drop", threshold=1), version=5)
    a = tc.admit(3)  # tau 2 > 1: dropped
    assert (a.tau, a.weight, a.counted, a.ready) == (2, 0.0, False, False)
    assert tc.pending == 0
    assert tc.admit(4).counted and tc.pending == 1  # tau 1 == threshold: full weight
    assert tc.admit(5).ready
    assert tc.stats.as_dict() == {"received": 3, "counted": 2, "dropped": 1, "decayed": 0, "rejected": 0,
                                  "staleness": {0: 1, 1: 1, 2: 1}}


def test_decayed_gradients_count_with_their_weight():
    tc = TokenControl(grads_per_update=2, decay=StalenessDecay("inverse", threshold=1), version=4)
    a = tc.admit(1)  # tau 3, excess 2 -> 1/3
    assert a.counted and a.weight == pytest.approx(1 / 3) and not a.ready
    assert tc.admit(4).ready
    assert tc.stats.decayed == 1 and tc.stats.counted == 2


def test_future_token_is_rejected():
    tc = TokenControl(grads_per_update=1, decay=StalenessDecay())
    with pytest.raises(ValueError, match="newer than the model version 0"):
        tc.admit(1)
    assert tc.stats.rejected == 1 and tc.pending == 0


def test_bad_m():
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="positive integer"):
            TokenControl(grads_per_update=bad, decay=StalenessDecay())


def _simulate(periods, m, until, decay):
    """Event simulation of non-blocking workers: each pulls (token = version), computes for its period, pushes."""
    tc = TokenControl(grads_per_update=m, decay=decay)
    events = [(p, w, 0) for w, p in enumerate(periods)]  # (time the push arrives, worker, token)
    heapq.heapify(events)
    pushes, taus, counted_per_update, counted = [0] * len(periods), [[] for _ in periods], [], 0
    while tc.version < until:
        t, w, token = heapq.heappop(events)
        a = tc.admit(token)
        pushes[w] += 1
        taus[w].append(a.tau)
        counted += a.counted
        if a.ready:
            counted_per_update.append(counted)
            counted = 0
            tc.commit()
        heapq.heappush(events, (t + periods[w], w, tc.version))  # pulls right after pushing
    return tc, pushes, taus, counted_per_update


def test_simulated_straggler_fast_workers_push_more_and_every_update_has_m():
    tc, pushes, taus, per_update = _simulate([1.0, 1.1, 5.0], m=3, until=30,
                                             decay=StalenessDecay("drop", threshold=2))
    assert per_update == [3] * 30
    assert pushes[0] > pushes[1] > pushes[2]
    assert max(taus[2]) > 2 and tc.stats.dropped > 0  # the straggler's gradients are stale and get dropped
    assert max(taus[0]) <= 2


def test_equal_speeds_without_a_barrier_see_staleness_at_most_one():
    # the first of two simultaneous pushers pulls before the update lands: tau 1, never more. (The
    # tuning-free schedule removes even that by pulling with min_version; see test_ps.py.)
    tc, pushes, taus, per_update = _simulate([1.0, 1.0], m=2, until=10, decay=StalenessDecay())
    assert pushes == [10, 10] and per_update == [2] * 10
    assert set(tc.stats.staleness) <= {0, 1}


def test_buffer_mean_equals_plain_average_for_equal_batches():
    torch.manual_seed(0)
    g1, g2 = torch.randn(5), torch.randn(5)
    buf = GlobalBatchBuffer(5, {"t": 3})
    r1, r2 = torch.randn(2, 3), torch.randn(2, 3)
    buf.add(1.0, 8, g1, {"t": torch.tensor([1, 4])}, {"t": r1})
    buf.add(1.0, 8, g2, {"t": torch.tensor([4, 7])}, {"t": r2})
    out = buf.mean()
    torch.testing.assert_close(out.dense, (g1 + g2) / 2)
    assert out.ids["t"].tolist() == [1, 4, 7]
    torch.testing.assert_close(out.rows["t"], torch.stack([r1[0] / 2, (r1[1] + r2[0]) / 2, r2[1] / 2]))
    assert (out.num_samples, out.count) == (16, 2)


def test_buffer_weights_samples_and_decay():
    buf = GlobalBatchBuffer(2, {})
    buf.add(1.0, 3, torch.tensor([1.0, 0.0]), {}, {})
    buf.add(0.5, 1, torch.tensor([0.0, 4.0]), {}, {})
    # sum w_i n_i g_i / sum n_i: the decay shrinks the numerator only
    torch.testing.assert_close(buf.mean().dense, torch.tensor([3.0, 2.0]) / 4)


def test_buffer_does_not_modify_inputs_and_clears():
    buf = GlobalBatchBuffer(3, {"t": 2})
    g, ids, rows = torch.ones(3), torch.tensor([2]), torch.ones(1, 2)
    buf.add(0.5, 4, g, {"t": ids}, {"t": rows})
    buf.mean()
    assert g.tolist() == [1.0, 1.0, 1.0] and rows.tolist() == [[1.0, 1.0]] and ids.tolist() == [2]
    buf.clear()
    assert buf.count == 0
    with pytest.raises(RuntimeError, match="no gradient"):
        buf.mean()
    buf.add(1.0, 1, g, {"t": torch.empty(0, dtype=torch.int64)}, {"t": torch.empty(0, 2)})
    assert buf.mean().rows["t"].shape == (0, 2)


def test_buffer_shape_errors():
    buf = GlobalBatchBuffer(3, {"t": 2})
    with pytest.raises(ValueError, match=r"shape \(3,\)"):
        buf.add(1.0, 1, torch.ones(4), {}, {})
    with pytest.raises(ValueError, match="rows shape"):
        buf.add(1.0, 1, torch.ones(3), {"t": torch.tensor([1])}, {"t": torch.ones(1, 3)})
    with pytest.raises(ValueError, match="do not match"):
        buf.add(1.0, 1, torch.ones(3), {"u": torch.tensor([1])}, {"u": torch.ones(1, 2)})
    with pytest.raises(ValueError, match=r"weight must be in \(0, 1\]"):
        buf.add(0.0, 1, torch.ones(3), {}, {})
    with pytest.raises(ValueError, match="num_samples"):
        buf.add(1.0, 0, torch.ones(3), {}, {})
