"""Auto mode sees the whole step: a worker slowed in any of its five places moves the job to gba and back.

Real processes (2 workers + 1 server, gloo on 127.0.0.1). Worker 1 is slowed about 5x for job steps
[ONSET, END) in one place per run: the data wait (before the forward), the forward (a module that
sleeps), the backward (an autograd function that sleeps), between ``backward()`` and ``step()``, and
the optimizer step (inside the engine's step, whichever phase runs it). Each run must switch to gba
within a window and a few steps of the onset, never before it, come back within a window and a few
steps after the end, never before it, and name only worker 1. Step counts, never timings, are asserted;
the injected slowdown (0.15 s on a 0.03 s step) leaves a wide margin on a loaded machine.
"""
from __future__ import annotations

import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from sparse_scale.multiproc import run_distributed

PLACES = ("data", "forward", "backward", "between", "optimizer")
BASE_S, SLOW_S = 0.03, 0.15
ONSET, END, STEPS = 10, 24, 40  # job steps
WINDOW, DWELL = 4, 4
SWITCH = {"window": WINDOW, "min_dwell_steps": DWELL, "slow_ratio": 1.5, "recover_ratio": 1.2}
# the detector needs half a window of slow times before the median moves, then its confirmation (a window),
# then the hand-over; generous: a loaded machine can stretch a few steps
MARGIN = 2 * WINDOW + 6

_slow = {"on": False, "place": None}


def _sleep_if(place: str) -> None:
    if _slow["on"] and _slow["place"] == place:
        time.sleep(SLOW_S)


class _SlowBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        _sleep_if("backward")
        return grad


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(7)
        self.a, self.b = nn.Linear(6, 16), nn.Linear(16, 1)

    def forward(self, x):
        _sleep_if("forward")
        return self.b(torch.tanh(_SlowBackward.apply(self.a(x))))


def _slow_steps() -> None:
    """Worker 1's optimizer step sleeps in either phase (the engine's step runs the phase's)."""
    from gba_engine.phases import GBAPhase, SyncPhase

    for cls in (SyncPhase, GBAPhase):
        original = cls.step

        def step(self, _original=original):
            _sleep_if("optimizer")
            return _original(self)
        cls.step = step


def _run(rank: int, place: str) -> dict:
    import gba_engine

    cfg = {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1,
           "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "torch_adam": True}},
           "zero_optimization": {"stage": 0}, "steps_per_print": 10 ** 6, "gradient_clipping": 0.0,
           "gba": {"mode": "auto", "num_servers": 1, "timeout_s": 20, "heartbeat_s": 0.2, "switch": SWITCH}}
    engine = gba_engine.initialize(model=_Net(), config=cfg)
    if engine.is_server:
        return {}
    _slow["place"] = place
    modes = []
    for index in engine.claim_batches(total=STEPS * engine.num_workers):
        job = index // engine.num_workers
        _slow["on"] = rank == 1 and ONSET <= job < END
        g = torch.Generator().manual_seed(index)
        x = torch.randn(8, 6, generator=g)
        time.sleep(BASE_S)  # the data wait of every step
        _sleep_if("data")
        loss = F.mse_loss(engine(x), x[:, :1])
        engine.backward(loss)
        _sleep_if("between")
        engine.step()
        modes.append((engine.job_step, engine.mode))
    _slow["on"] = False
    out = {"switches": engine.summary()["switches"], "modes": modes}
    engine.close()
    return out


def _launch(rank: int, world_size: int, places: tuple) -> dict:
    _slow_steps()
    return {place: _run(rank, place) for place in places}


@pytest.fixture(scope="module")
def runs():
    out = {}
    for group in (PLACES[:3], PLACES[3:]):  # two launches, each well inside its deadline
        res = run_distributed(_launch, world_size=3, args=(group,), timeout_s=55)
        out.update({place: (res[0][place], res[1][place]) for place in group})
    return out


@pytest.mark.soak
@pytest.mark.parametrize("place", PLACES)
def test_a_worker_slowed_anywhere_in_its_step_moves_the_job_to_gba_and_back(runs, place):
    w0, w1 = runs[place]
    sw = w0["switches"]
    assert [(e["src"], e["dst"]) for e in sw] == [("sync", "gba"), ("gba", "sync")], (place, sw)
    to_gba, back = sw
    assert "slow workers [1]," in to_gba["reason"], to_gba  # worker 1 alone, never the fast worker 0
    assert ONSET <= to_gba["step"] <= ONSET + MARGIN, (place, sw)
    assert END <= back["step"] <= END + MARGIN, (place, sw)
    # both workers trained the straggler's window in gba and the rest in sync
    for modes in (w0["modes"], w1["modes"]):
        assert all(m == "sync" for job, m in modes if job < ONSET), (place, modes)
        assert modes[-1][1] == "sync"
