"""Staleness decay functions: values, threshold, monotonicity, vectorised form, bad arguments."""
import math

import pytest
import torch

from gba_engine.config import GBAConfig, StalenessConfig
from gba_engine.decay import DECAY_KINDS, StalenessDecay


def test_full_weight_up_to_threshold_for_every_kind():
    for kind in DECAY_KINDS:
        d = StalenessDecay(kind, threshold=3, rate=0.5)
        assert [d(t) for t in range(4)] == [1.0, 1.0, 1.0, 1.0]


def test_values_above_threshold():
    assert [StalenessDecay("drop", threshold=2)(t) for t in (2, 3, 10)] == [1.0, 0.0, 0.0]
    inv = StalenessDecay("inverse", threshold=2)
    assert [inv(t) for t in (3, 4, 5)] == [0.5, pytest.approx(1 / 3), 0.25]
    exp = StalenessDecay("exponential", threshold=1, rate=0.5)
    assert [exp(t) for t in (2, 3, 4)] == [0.5, 0.25, 0.125]


def test_inverse_with_zero_threshold_is_one_over_one_plus_tau():
    d = StalenessDecay("inverse", threshold=0)
    assert all(math.isclose(d(t), 1 / (1 + t)) for t in range(20))


@pytest.mark.parametrize("kind", DECAY_KINDS)
@pytest.mark.parametrize("threshold", [0, 1, 4])
def test_monotone_non_increasing_and_bounded(kind, threshold):
    d = StalenessDecay(kind, threshold=threshold, rate=0.7)
    ws = [d(t) for t in range(40)]
    assert all(0.0 <= w <= 1.0 for w in ws)
    assert all(a >= b for a, b in zip(ws, ws[1:]))
    assert ws[threshold] == 1.0 and ws[-1] < 1.0


@pytest.mark.parametrize("kind", DECAY_KINDS)
def test_vectorised_weights_match_scalar(kind):
    d = StalenessDecay(kind, threshold=2, rate=0.3)
    taus = torch.arange(0, 15)
    w = d.weights(taus)
    assert w.dtype == torch.float32
    torch.testing.assert_close(w, torch.tensor([d(int(t)) for t in taus], dtype=torch.float32))


def test_default_comes_from_the_config_block():
    assert StalenessDecay.from_config(GBAConfig().staleness) == StalenessDecay("drop", 4, 0.5) == StalenessDecay()
    cfg = StalenessConfig(threshold=1, decay="exponential", rate=0.25)
    assert StalenessDecay.from_config(cfg) == StalenessDecay("exponential", 1, 0.25)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(kind="linear"), "must be one of"),
        (dict(kind="drop", threshold=-1), "integer >= 0"),
        (dict(kind="drop", threshold=1.5), "integer >= 0"),
        (dict(kind="drop", threshold=True), "integer >= 0"),
        (dict(kind="exponential", rate=1.0), "0 < rate < 1"),
        (dict(kind="exponential", rate=0.0), "0 < rate < 1"),
        (dict(kind="exponential", rate=1.5), "0 < rate < 1"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        StalenessDecay(**kwargs)


def test_rate_is_ignored_unless_exponential():
    assert StalenessDecay("inverse", threshold=0, rate=7.0)(1) == 0.5


def test_bad_staleness_values():
    d = StalenessDecay("inverse", threshold=0)
    with pytest.raises(ValueError, match="newer than the model|>= 0"):
        d(-1)
    with pytest.raises(TypeError, match="must be an int"):
        d(1.0)
    with pytest.raises(ValueError, match=">= 0"):
        d.weights(torch.tensor([0, -2]))
    with pytest.raises(TypeError, match="integer tensor"):
        d.weights(torch.tensor([0.5]))
