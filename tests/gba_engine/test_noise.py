"""Auto mode cries no wolf: CPU contention alone makes no switch, a 2x and a 4x straggler still do.

Real processes (2 workers + 1 server, gloo on 127.0.0.1) with two CPU-bound processes spinning on the
same cores for the whole launch, the detector at its defaults (``window`` 8, ``min_dwell_steps`` 20,
``slow_ratio`` 1.5, ``recover_ratio`` 1.2). The no-straggler run is 300 compute-bound MLP steps (the
rule before issue 28, without the confirmation, switched 3 times in 400 such steps recorded with
``benchmarks/gba_detector_trace.py``); the straggler runs add a short data wait; worker 1's slowdown is a sleep of (k - 1) x its own median step time, measured over its first
steps under the same load, for job steps [ONSET, END). Asserted: switch counts and the worker named.
"""
from __future__ import annotations

import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from sparse_scale.multiproc import run_distributed

STEPS, ONSET, END = 110, 30, 75  # job steps of the straggler runs
QUIET_STEPS = 300  # the no-straggler run: compute-bound steps (no data wait), the noisiest the load makes them
CALIBRATE = 10


def _run(rank: int, factor: float) -> dict:
    steps, data_s = (QUIET_STEPS, 0.0) if factor == 1.0 else (STEPS, 0.01)
    import statistics

    import gba_engine

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 1))
    cfg = {"train_micro_batch_size_per_gpu": 128, "gradient_accumulation_steps": 1,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
           "zero_optimization": {"stage": 0}, "steps_per_print": 10 ** 6, "gradient_clipping": 0.0,
           "gba": {"mode": "auto", "num_servers": 1, "timeout_s": 20, "heartbeat_s": 0.2}}
    engine = gba_engine.initialize(model=model, config=cfg)
    if engine.is_server:
        return {}
    own, extra = [], 0.0
    for index in engine.claim_batches(total=steps * engine.num_workers):
        job = index // engine.num_workers
        t0 = time.perf_counter()
        g = torch.Generator().manual_seed(index)
        x = torch.randn(128, 64, generator=g)
        time.sleep(data_s)  # the data wait
        if rank == 1 and ONSET <= job < END:
            time.sleep(extra)
        loss = F.mse_loss(engine(x), x[:, :1])
        engine.backward(loss)
        engine.step()
        if len(own) < CALIBRATE:
            own.append(time.perf_counter() - t0)
            extra = (factor - 1.0) * statistics.median(own)
    out = {"switches": engine.summary()["switches"], "mode": engine.mode}
    engine.close()
    return out


def _launch(rank: int, world_size: int, factors: tuple) -> dict:
    return {factor: _run(rank, factor) for factor in factors}


def _spin(stop_at: float) -> None:
    x = 0
    while time.time() < stop_at:
        for i in range(100_000):
            x += i * i


@pytest.fixture(scope="module")
def runs():
    import multiprocessing as mp

    hogs = [mp.get_context("spawn").Process(target=_spin, args=(time.time() + 150,), daemon=True) for _ in range(2)]
    for h in hogs:
        h.start()
    try:
        out = {}
        for factors in ((1.0,), (2.0, 4.0)):  # two launches, each well inside its deadline
            out.update(run_distributed(_launch, world_size=3, args=(factors,), timeout_s=50)[0])
    finally:
        for h in hogs:
            h.terminate()
            h.join(5)
    return out


@pytest.mark.soak
def test_cpu_contention_without_a_straggler_makes_no_switch(runs):
    assert runs[1.0]["switches"] == [] and runs[1.0]["mode"] == "sync", runs[1.0]


@pytest.mark.soak
@pytest.mark.parametrize("factor", [2.0, 4.0])
def test_a_2x_and_a_4x_straggler_under_the_same_load_are_caught(runs, factor):
    sw = runs[factor]["switches"]
    to_gba = [e for e in sw if e["dst"] == "gba"]
    assert to_gba and all("slow workers [1]," in e["reason"] for e in to_gba), sw
    assert ONSET <= to_gba[0]["step"] < END, sw
    assert sw[-1]["dst"] == "sync" and sw[-1]["step"] >= END, sw
