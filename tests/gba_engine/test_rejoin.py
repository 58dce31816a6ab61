"""A worker whose process died rejoins a running job (2 workers + 1 server, gloo on 127.0.0.1).

Three launches: mode ``gba`` where worker 1 dies; mode ``auto``, where worker 1 straggles so that
the job moves to gba (and stays: a switch back to sync before the death would leave no phase to
rejoin) and then worker 1 dies (the first worker pins the job to gba); and ``auto``
where worker 0, the coordinator of auto mode, dies (the other pins it). The dead worker trains a
few numbered batches in gba, then dies (``os._exit``). A fresh interpreter that the
test starts beforehand (standing in for a supervisor that restarts crashed processes) waits for
the death, checks two bad rejoins (a server's rank, a live worker), then replaces the dead one with
``gba_engine.rejoin``: it continues the job's batch numbers and pushes under token control, with
rows of a server table and the dense layers. The survivor waits (bounded) until the new process has
trained once, so the rejoin happens before the data runs out whatever the machine's load.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from sparse_scale.multiproc import run_distributed

TOTAL = 40
DIE_AFTER = 4
ROWS = 50
ROOT = Path(__file__).resolve().parents[2]


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        from gba_engine import ServerEmbeddingBagCollection
        from gba_engine.ps.sharding import ServerTableSpec

        torch.manual_seed(7)
        self.emb = ServerEmbeddingBagCollection([ServerTableSpec("item", ROWS, 4, init_std=0.3, seed=1)])
        self.mlp = nn.Sequential(nn.Linear(4 + 6, 8), nn.Tanh(), nn.Linear(8, 1))

    def forward(self, x, ids, offsets):
        return self.mlp(torch.cat([self.emb(ids, offsets)["item"], x], dim=1))


def _batch(index: int):
    g = torch.Generator().manual_seed(1000 + index)
    x = torch.randn(8, 6, generator=g)
    ids = torch.randint(0, ROWS, (16,), generator=g)
    return x, {"item": ids}, {"item": torch.arange(0, 16, 2)}, x[:, :1] * 0.5 - x[:, 1:2] * 0.2


def _config(tmp: str, mode: str = "gba") -> dict:
    return {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": 0.02, "weight_decay": 0.0, "torch_adam": True}},
            "zero_optimization": {"stage": 0}, "steps_per_print": 10 ** 6, "gradient_clipping": 0.0,
            "gba": {"mode": mode, "num_servers": 1, "timeout_s": 15, "heartbeat_s": 0.2,
                    "control_file": os.path.join(tmp, "control_plane"),
                    "switch": {"window": 2, "min_dwell_steps": 2, "slow_ratio": 1.5, "recover_ratio": 1.2}}}


def _step(engine, index: int) -> float:
    x, ids, offsets, y = _batch(index)
    loss = F.mse_loss(engine(x, ids, offsets), y)
    engine.backward(loss)
    engine.step()
    return loss.item()


def _final(engine) -> dict:
    return {"dense": engine.client.pull(dense=True).dense, "rows": engine.table_rows("item", torch.arange(ROWS)),
            "summary": engine.summary()}


def _wait_file(path: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {timeout_s}s")
        time.sleep(0.05)


def _launch(rank: int, world_size: int, tmp: str, mode: str, dead: int) -> dict:
    import gba_engine
    from gba_engine.protocol import joinable_key

    engine = gba_engine.initialize(model=Net(), config=_config(tmp, mode))
    if engine.is_server:
        return {"server": engine.server_stats}
    taken, losses, modes, waited = [], [], [], False
    for index in engine.claim_batches(TOTAL):
        modes.append(engine.mode)  # the mode this step trains in (a switch happens after the step)
        if rank == 1 and mode == "auto":
            time.sleep(0.3)  # a straggler throughout: auto moves the job to gba and, never recovering, stays there
        losses.append(_step(engine, index))
        taken.append(index)
        if rank == dead and modes.count("gba") == DIE_AFTER:
            Path(tmp, "dead.json").write_text(json.dumps({"taken": taken, "version": engine.version}))
            os._exit(17)  # a crash: no goodbye, its gloo pairs close, its heartbeat stops
        if rank != dead:
            time.sleep(0.1)
            # once the job takes restarted workers (auto: after this worker saw the death), wait until one trained
            if len(taken) >= 8 and not waited and engine.rt.store.check([joinable_key()]):
                _wait_file(os.path.join(tmp, "joined"), 60)
                waited = True
    out = {"taken": taken, "losses": losses, "sync_steps": modes.count("sync"), **_final(engine)}
    engine.close()
    return out


def _rejoiner_main(tmp: str, mode: str, dead: int) -> None:
    """The replacement process of worker ``dead`` (run by the test in a fresh interpreter)."""
    threading.Timer(90, lambda: os._exit(3)).start()  # a hard deadline of its own: never outlives the test
    import gba_engine

    _wait_file(os.path.join(tmp, "dead.json"), 80)
    out: dict = {"errors": {}}
    for worker in (2, 1 - dead):  # a server's rank; the other worker, which is alive
        try:
            gba_engine.rejoin(model=Net(), config=_config(tmp, mode), worker=worker)
        except ValueError as exc:
            out["errors"][worker] = str(exc)
    t0 = time.monotonic()
    engine = gba_engine.rejoin(model=Net(), config=_config(tmp, mode), worker=dead)
    out["join_s"] = time.monotonic() - t0
    out["rejoined"], out["mode"], out["rt_incarnation"] = engine.rejoined, engine.mode, engine.rt.incarnation
    taken, losses, tokens = [], [], []
    for index in engine.claim_batches(TOTAL, start=0):
        losses.append(_step(engine, index))
        tokens.append(engine.version)
        taken.append(index)
        if len(taken) == 1:
            Path(tmp, "joined").write_text("1")
    out.update(taken=taken, losses=losses, tokens=tokens, **_final(engine))
    engine.close()
    torch.save(out, os.path.join(tmp, "rejoiner.pt"))
    os._exit(0)  # the watchdog timer thread must not keep the process alive


@pytest.fixture(scope="module", params=[("gba", 1), ("auto", 1), ("auto", 0)], ids=["gba", "auto", "auto-first"])
def job(request, tmp_path_factory):
    mode, dead = request.param
    tmp = str(tmp_path_factory.mktemp(f"gba_rejoin_{mode}_{dead}"))
    log = open(os.path.join(tmp, "rejoiner.log"), "w")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-c", f"import tests.gba_engine.test_rejoin as t; t._rejoiner_main({tmp!r}, {mode!r}, {dead})"],
                            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        res = run_distributed(_launch, world_size=3, args=(tmp, mode, dead), timeout_s=150, expect_exit={dead: 17})
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()
    text = Path(tmp, "rejoiner.log").read_text()
    assert proc.returncode == 0, f"the rejoining process failed (exit {proc.returncode}):\n{text[-4000:]}"
    return {"mode": mode, "dead_rank": dead, "w0": res[1 - dead], "server": res[2]["server"],
            "dead": json.loads(Path(tmp, "dead.json").read_text()),
            "new": torch.load(os.path.join(tmp, "rejoiner.pt"), weights_only=False)}


@pytest.mark.soak
def test_restarted_worker_rejoins_and_takes_batches(job):
    new, server = job["new"], job["server"]
    assert new["rejoined"] and new["mode"] == "gba" and new["rt_incarnation"] == 1
    assert len(new["taken"]) >= 1 and all(torch.isfinite(torch.tensor(new["losses"])))
    dead = job["dead_rank"]
    assert server["rejoined"] == [dead] and server["lost_workers"] == []  # back in the job, not counted as lost
    assert job["w0"]["summary"]["rejoined_workers"] == [dead]  # the console/wandb summary says so while the job runs
    assert server["pushes"].get(str(dead), 0) >= len(new["taken"])  # the server counted the new process's gradients


@pytest.mark.soak
def test_auto_mode_moved_to_gba_before_the_death(job):
    assert job["w0"]["sync_steps"] == 0 if job["mode"] == "gba" else job["w0"]["sync_steps"] >= 2


@pytest.mark.soak
def test_every_batch_is_trained_once_across_the_dead_and_the_new_process(job):
    w0, dead, new = job["w0"]["taken"], job["dead"]["taken"], job["new"]["taken"]
    everything = w0 + dead + new
    assert len(everything) == len(set(everything)) == TOTAL and set(everything) == set(range(TOTAL))


@pytest.mark.soak
def test_new_process_starts_from_the_current_model_version(job):
    # its first token is at least the version the dead process last saw: it never trains an older model
    assert job["new"]["tokens"][0] >= job["dead"]["version"] >= 1


@pytest.mark.soak
def test_all_workers_end_on_the_same_parameters(job):
    w0, new, server = job["w0"], job["new"], job["server"]
    torch.testing.assert_close(new["dense"], w0["dense"], rtol=0, atol=0)
    torch.testing.assert_close(new["rows"], w0["rows"], rtol=0, atol=0)
    # M = 2: every full global batch of the gba phase was applied, after the sync steps (auto mode)
    assert server["version"] == w0["sync_steps"] + server["counted"] // 2
    # gba-phase pushes: every batch but the sync steps' (2 workers each), less at most the dead process's last push
    assert server["received"] >= TOTAL - 2 * w0["sync_steps"] - 1


@pytest.mark.soak
def test_bad_rejoins_fail_with_clear_errors(job):
    errors = job["new"]["errors"]
    assert "rank 2 is not a worker" in errors[2] and "only a worker can rejoin" in errors[2]
    alive = 1 - job["dead_rank"]
    assert f"worker {alive}" in errors[alive] and "is alive" in errors[alive]


def test_rejoin_refuses_sync_mode_and_a_missing_control_plane():
    import gba_engine

    cfg = _config("/nonexistent")
    with pytest.raises(ValueError, match="sync.*fixed at launch"):
        gba_engine.rejoin(model=nn.Linear(2, 1), config={**cfg, "gba": {**cfg["gba"], "mode": "sync"}}, worker=0)
    no_file = {k: v for k, v in cfg["gba"].items() if k != "control_file"}
    with pytest.raises(ValueError, match="control_file"):
        gba_engine.rejoin(model=nn.Linear(2, 1), config={**cfg, "gba": no_file}, worker=0)
    with pytest.raises(ValueError, match="neither HOST:PORT nor a file"):
        gba_engine.rejoin(model=nn.Linear(2, 1), config=cfg, worker=0)

