"""Faults in a sync phase are named: a lost server stops an auto job, a lost worker is named on every survivor.

Real processes (2 workers + 1 server, gloo on 127.0.0.1, ``timeout_s`` 6, ``heartbeat_s`` 0.2), an auto
job with no straggler, so it trains in its sync phase throughout (the servers hold its fallback only):

* the server is SIGKILLed once worker 0 trained a few steps: both workers must raise ``ServerLostError``
  naming server rank 2 while still in sync, long before their step budget runs out (before issue 28 they
  trained to the end with rc 0 and the job had silently lost its fallback);
* worker 1 exits at step 5: worker 0 must raise ``WorkerLostError`` naming rank 1 and its host instead of
  gloo's "Connection reset by peer", and the server must end with the same error (before: exit 0, no word).
"""
from __future__ import annotations

import os
import signal
import socket
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from sparse_scale.multiproc import run_distributed

STEPS = 600  # step budget: far more than the lease and the deadline need (0.02 s a step)


def _config() -> dict:
    return {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
            "optimizer": {"type": "SGD", "params": {"lr": 0.05}}, "zero_optimization": {"stage": 0},
            "steps_per_print": 10 ** 6, "gradient_clipping": 0.0,
            "gba": {"mode": "auto", "num_servers": 1, "timeout_s": 6, "heartbeat_s": 0.2}}


def _kill_self_when(flag: Path) -> None:
    def watch():
        while not flag.exists():
            time.sleep(0.02)
        os.kill(os.getpid(), signal.SIGKILL)
    threading.Thread(target=watch, daemon=True).start()


def _rank(rank: int, world_size: int, tmp: str, fault: str) -> dict:
    import gba_engine

    flag = Path(tmp, f"{fault}_trained")
    if rank == 2 and fault == "server":
        _kill_self_when(flag)
    try:
        torch.manual_seed(0)
        engine = gba_engine.initialize(model=nn.Linear(3, 1), config=_config())
    except Exception as exc:  # a server ends inside initialize
        return {"error": type(exc).__name__, "message": str(exc), "worker": getattr(exc, "worker", None),
                "host": getattr(exc, "host", None)}
    if engine.is_server:
        return {"error": None, "stats": engine.server_stats}
    out = {"error": None, "steps": 0, "mode": None}
    g = torch.Generator().manual_seed(rank)
    try:
        for step in range(STEPS):
            x = torch.randn(4, 3, generator=g)
            loss = F.mse_loss(engine(x), x[:, :1])
            engine.backward(loss)
            engine.step()
            out["steps"], out["mode"] = step + 1, engine.mode
            if step == 5 and rank == 0:
                flag.write_text("1")
            if step == 5 and rank == 1 and fault == "worker":
                os._exit(17)
            time.sleep(0.02)
    except Exception as exc:
        out.update(error=type(exc).__name__, message=str(exc), worker=getattr(exc, "worker", None),
                   host=getattr(exc, "host", None))
    engine.close()
    return out


@pytest.mark.soak
def test_a_server_lost_in_a_sync_phase_stops_the_auto_job_with_its_name(tmp_path):
    res = run_distributed(_rank, world_size=3, args=(str(tmp_path), "server"), timeout_s=55, expect_exit={2: -9})
    for w in (0, 1):
        r = res[w]
        assert r["error"] == "ServerLostError", r
        assert "parameter server rank 2" in r["message"] and r["mode"] == "sync", r
        assert r["steps"] < STEPS, r  # noticed, not trained to the end


@pytest.mark.soak
def test_a_worker_lost_in_a_sync_phase_is_named_on_every_survivor(tmp_path):
    res = run_distributed(_rank, world_size=3, args=(str(tmp_path), "worker"), timeout_s=55, expect_exit={1: 17})
    host = socket.gethostname()
    w0, server = res[0], res[2]
    for r in (w0, server):
        assert r["error"] == "WorkerLostError", r
        assert f"worker rank 1 (host {host}) is gone" in r["message"] and r["worker"] == 1 and r["host"] == host, r
    assert "Connection reset" not in w0["message"] and w0["steps"] >= 6, w0
    assert server["message"].startswith("server rank 2: the job stopped:"), server
