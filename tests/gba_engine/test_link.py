"""The modelled slow link between workers and parameter servers (gba_engine/ps/link.py), over real processes.

A pull is a request and a reply, so under a one-way latency L it takes at least 2 L; under a
bandwidth B a reply of n bytes takes at least n / B on the wire. Only lower bounds are asserted:
how much longer a loaded machine takes is not the link's doing.
"""
from __future__ import annotations

import time

import pytest
import torch

from sparse_scale.multiproc import run_distributed

ROWS, DIM = 4000, 4
LATENCY_MS = 40.0
MBIT = 4.0  # 0.5 MB/s: the 64 KB reply below needs >= 0.128 s on the wire


def _job(rank: int, world_size: int, latency_ms: float, mbit: float) -> dict:
    from gba_engine import GBAConfig, OptimizerSpec, ParameterServer, PSClient, init_runtime
    from gba_engine.ps import ServerTableSpec
    from gba_engine.ps.link import LinkModel

    cfg = GBAConfig(mode="gba", num_servers=1, timeout_s=15, heartbeat_s=0.2)
    spec = ServerTableSpec("user", ROWS, DIM)
    rt = init_runtime(cfg, link=LinkModel(latency_ms=latency_ms, mbit=mbit))
    if rt.is_server:
        ParameterServer(rt, cfg, 0, [spec], OptimizerSpec.of("sgd", lr=0.1)).serve(until_version=None, max_seconds=30)
        rt.close()
        return {}
    client = PSClient(rt, 0, [spec])
    client.pull({"user": torch.tensor([1])}, dense=False)  # the first pull also pays gloo's connection setup
    t0 = time.perf_counter()
    small = client.pull({"user": torch.tensor([3, 7])}, dense=False)
    small_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    big = client.pull({"user": torch.arange(ROWS)}, dense=False)
    big_s = time.perf_counter() - t0
    client.close()
    rt.close()
    return {"small_s": small_s, "big_s": big_s, "small": small.rows["user"], "big": big.rows["user"]}


def test_a_pull_pays_the_latency_both_ways():
    worker, _ = run_distributed(_job, world_size=2, args=(LATENCY_MS, 0.0), timeout_s=40)
    assert worker["small_s"] >= 2 * LATENCY_MS / 1e3, worker["small_s"]
    assert worker["big"].shape == (ROWS, DIM)  # the delayed messages still carry the right data
    torch.testing.assert_close(worker["big"][torch.tensor([3, 7])], worker["small"], rtol=0, atol=0)


def test_a_big_reply_pays_the_bandwidth():
    worker, _ = run_distributed(_job, world_size=2, args=(0.0, MBIT), timeout_s=40)
    reply_bytes = ROWS * DIM * 4
    assert worker["big_s"] >= reply_bytes * 8 / (MBIT * 1e6), worker["big_s"]


def test_link_model_checks_its_numbers():
    from gba_engine.ps.link import LinkModel

    assert not LinkModel().enabled and LinkModel(latency_ms=0.5).enabled
    assert LinkModel(mbit=8.0).transfer_s(1_000_000) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="latency_ms"):
        LinkModel(latency_ms=-1.0)
    with pytest.raises(ValueError, match="mbit"):
        LinkModel(mbit=float("nan"))
