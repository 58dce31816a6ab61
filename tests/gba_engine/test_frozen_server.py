"""A parameter server that freezes (SIGSTOP) or dies (SIGKILL) mid-training stops the whole job within timeout_s.

Each launch runs every rank as its own fresh interpreter on 127.0.0.1 (gloo), so the test sees the
real exit codes, including the atexit clean-up of a rank whose training raised. Once both workers
trained a few gba steps, the test freezes or kills the first server, the rank whose process used
to host the control-plane store (a frozen host froze every store operation of every rank before
the store got a process of its own). Then every worker must raise ``ServerLostError`` naming
that server, the other server must stop too, every rank must exit non-zero by itself, and the
store process must exit once the job is over. A hard deadline ends every launch.
"""
from __future__ import annotations

import datetime
import itertools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from sparse_scale.multiproc import free_port, loopback_env

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 6.0
HEARTBEAT_S = 0.2
START_S = 90.0  # hard deadline for the ranks to start and train their first steps (a loaded 2-core machine)
SLACK_S = 25.0  # what the ranks may take after timeout_s to exit (python exit, the loaded machine)


def _config() -> dict:
    return {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
            "optimizer": {"type": "SGD", "params": {"lr": 0.05}}, "zero_optimization": {"stage": 0},
            "steps_per_print": 10 ** 6, "gradient_clipping": 0.0,
            "gba": {"mode": "gba", "num_servers": 1, "timeout_s": TIMEOUT_S, "heartbeat_s": HEARTBEAT_S}}


def _rank_main(rank: int, world: int, servers: int, port: int, tmp: str) -> None:
    """One rank of the launch, in its own interpreter; writes what it raised to ``error<rank>.json``, re-raises."""
    os.environ.update(loopback_env(rank, world, port))
    import torch.distributed as dist

    import gba_engine

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    cfg = _config()
    cfg["gba"]["num_servers"] = servers
    try:
        torch.manual_seed(0)
        engine = gba_engine.initialize(model=nn.Linear(3, 1), config=cfg)
        if engine.is_server:
            return  # served the whole job: not expected here, the test stops a server first
        g = torch.Generator().manual_seed(rank)
        for step in itertools.count():
            x = torch.randn(4, 3, generator=g)
            loss = F.mse_loss(engine(x), x[:, :1])
            engine.backward(loss)
            engine.step()
            if step == 3:
                Path(tmp, f"trained{rank}").write_text("1")
            time.sleep(0.02)
    except Exception as exc:
        Path(tmp, f"error{rank}.json").write_text(json.dumps({
            "mro": [c.__name__ for c in type(exc).__mro__], "message": str(exc), "cause": repr(exc.__cause__),
            "at": time.time()}))
        raise


def _state(pid: int) -> str | None:
    """The process state letter of ``pid`` (R, S, T: stopped, Z: zombie), or None when it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return None


def _store_host_of(parent: int, deadline: float) -> int:
    """The pid of the control-plane store process the first server ``parent`` started."""
    while time.monotonic() < deadline:
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                cmd = (entry / "cmdline").read_bytes()
            except (OSError, IndexError, ValueError):
                continue
            if ppid == parent and b"gba_engine.ps.store_host" in cmd:
                return int(entry.name)
        time.sleep(0.1)
    raise TimeoutError(f"no store process started by rank pid {parent}")


def _gone(pid: int, timeout_s: float) -> bool:
    """Whether ``pid`` exits (is gone or a zombie) within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while _state(pid) not in (None, "Z"):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def _run_job(tmp: Path, fault: signal.Signals, servers: int) -> dict:
    world = 2 + servers
    port = free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    logs = [open(tmp / f"rank{r}.log", "w") for r in range(world)]
    procs = [subprocess.Popen([sys.executable, "-c", f"import tests.gba_engine.test_frozen_server as t; "
                               f"t._rank_main({r}, {world}, {servers}, {port}, {str(tmp)!r})"],
                              cwd=ROOT, env=env, stdout=logs[r], stderr=subprocess.STDOUT) for r in range(world)]
    victim = procs[2]  # the first server: the old host of the control-plane store
    out: dict = {"fault": fault}
    try:
        deadline = time.monotonic() + START_S
        while not all((tmp / f"trained{r}").exists() for r in (0, 1)):
            dead = [(r, p.returncode) for r, p in enumerate(procs) if p.poll() is not None]
            assert not dead and time.monotonic() < deadline, f"the job did not train (exited: {dead}):\n" + \
                "\n".join((tmp / f"rank{r}.log").read_text()[-3000:] for r in range(world))
            time.sleep(0.05)
        out["store_host"] = _store_host_of(victim.pid, deadline)
        out["fault_at"] = time.time()
        os.kill(victim.pid, fault)
        end = time.monotonic() + TIMEOUT_S + SLACK_S
        for r, p in enumerate(procs):
            if p is not victim:
                try:
                    p.wait(timeout=max(end - time.monotonic(), 0.1))
                except subprocess.TimeoutExpired:
                    pass
        out["codes"] = {r: p.poll() for r, p in enumerate(procs) if p is not victim}
        out["victim_state"] = _state(victim.pid)  # "T": still frozen when the others were done
        out["store_host_gone"] = _gone(out["store_host"], 15.0)  # before the test touches the frozen server
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()  # SIGKILL also ends a stopped process
            p.wait(timeout=10)
        for f in logs:
            f.close()
    out["errors"] = {r: json.loads((tmp / f"error{r}.json").read_text()) for r in range(world)
                     if (tmp / f"error{r}.json").exists()}
    out["logs"] = {r: (tmp / f"rank{r}.log").read_text() for r in range(world)}
    return out


@pytest.fixture(scope="module", params=[("stop", 2), ("kill", 1)], ids=["sigstop-2-servers", "sigkill-1-server"])
def job(request, tmp_path_factory):
    fault, servers = request.param
    return _run_job(tmp_path_factory.mktemp(f"frozen_{fault}"), signal.SIGSTOP if fault == "stop" else signal.SIGKILL,
                    servers)


def _explain(job: dict) -> str:
    return "\n".join(f"--- rank {r}:\n{text[-2500:]}" for r, text in job["logs"].items())


@pytest.mark.slow
@pytest.mark.soak
def test_every_rank_exits_non_zero_by_itself(job):
    codes = job["codes"]
    assert all(c is not None for c in codes.values()), f"ranks still running past the deadline: {codes}\n{_explain(job)}"
    assert all(c != 0 for c in codes.values()), codes
    if job["fault"] == signal.SIGSTOP:
        assert job["victim_state"] == "T"  # the server was frozen, not dead, the whole time


@pytest.mark.slow
@pytest.mark.soak
def test_every_worker_raises_server_lost_naming_the_server(job):
    errors = job["errors"]
    for w in (0, 1):
        assert w in errors, f"worker {w} raised nothing\n{_explain(job)}"
        e = errors[w]
        assert "ServerLostError" in e["mro"] and "PSConnectionError" in e["mro"], e
        assert "parameter server rank 2 (server index 0)" in e["message"], e["message"]
        assert "waited for" in e["message"] and " since " in e["message"], e["message"]
        assert "--resume" in e["message"] and "replacement server is not supported" in e["message"]
    first_hand = [errors[w]["message"] for w in (0, 1) if "found a parameter server lost" not in errors[w]["message"]]
    assert first_hand, [errors[w]["message"] for w in (0, 1)]  # at least one worker saw it itself
    if job["fault"] == signal.SIGSTOP:
        assert any("stopped heartbeating (dead, frozen or cut off)" in m for m in first_hand), first_hand


@pytest.mark.slow
@pytest.mark.soak
def test_a_dead_server_is_named_not_only_gloo_text(job):
    if job["fault"] != signal.SIGKILL:
        assert "Connection reset by peer" not in job["errors"][0]["message"].split("(", 1)[0]
        return
    for w in (0, 1):
        message = job["errors"][w]["message"]
        assert message.startswith(f"rank {w}: ") and "parameter server rank 2" in message, message


@pytest.mark.slow
@pytest.mark.soak
def test_the_other_server_stops_with_the_same_reason(job):
    if job["fault"] != signal.SIGSTOP:
        assert set(job["codes"]) == {0, 1}
        return
    e = job["errors"].get(3)
    assert e is not None, _explain(job)
    assert "ServerLostError" in e["mro"] and "parameter server rank 2 (server index 0)" in e["message"], e
    assert "found a parameter server lost" in e["message"]


@pytest.mark.slow
@pytest.mark.soak
def test_the_store_process_does_not_outlive_the_job(job):
    assert job["store_host_gone"], f"store process {job['store_host']} still runs after every rank exited"


def test_config_rejects_a_lease_not_below_the_timeout():
    from pydantic import ValidationError

    from gba_engine.config import GBAConfig
    from gba_engine.startup import load_config

    with pytest.raises(ValidationError, match=r"lease of 5 x 2 = 10s.*below timeout_s=8"):
        GBAConfig(timeout_s=8)  # the default heartbeat_s=2
    with pytest.raises(ValidationError, match="lease"):
        GBAConfig(timeout_s=5, heartbeat_s=1)  # equal is not enough: lost must be found before the deadline
    with pytest.raises(ValueError, match=r"<dict>.*gba.*lease"):
        load_config({"gba": {"mode": "gba", "timeout_s": 1, "heartbeat_s": 0.5}})
    assert GBAConfig(timeout_s=6, heartbeat_s=0.2).timeout_s == 6
    for path in sorted((ROOT / "ds_configs").glob("*.json")):  # every shipped config still validates
        load_config(path)


def test_store_process_exits_when_every_rank_closed():
    from torch.distributed import TCPStore

    from gba_engine.protocol import FLAG, closed_key, heartbeat_key
    from gba_engine.ps.store_host import start_store_host

    host = start_store_host("127.0.0.1", world_size=2, timeout_s=5.0, heartbeat_s=0.1)
    try:
        store = TCPStore("127.0.0.1", host.port, is_master=False, timeout=datetime.timedelta(seconds=5))
        store.set(closed_key(0), FLAG)
        for _ in range(10):  # rank 1 heartbeats: the job is not over
            store.add(heartbeat_key(1), 1)
            time.sleep(0.1)
        assert host.process.poll() is None
        store.set(closed_key(1), FLAG)
        assert host.process.wait(timeout=15) == 0
    finally:
        if host.process.poll() is None:
            host.process.kill()


def _runtime(store, port: int, rank: int, timeout_s: float = 1.5, heartbeat_s: float = 0.1):
    from gba_engine.ps.runtime import PSRuntime, layout

    return PSRuntime(rank=rank, layout=layout(3, 1), ps_group=None, worker_group=None, store=store,
                     store_host="127.0.0.1", store_port=port, timeout_s=timeout_s, heartbeat_s=heartbeat_s)


def test_command_wait_names_a_silent_server_and_aborts_every_rank():
    from torch.distributed import TCPStore

    from gba_engine.commands import ServerCommands
    from gba_engine.protocol import Serve, heartbeat_key
    from gba_engine.ps import Liveness, ServerLostError

    master = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=5))
    first = _runtime(master, master.port, rank=0)
    master.add(heartbeat_key(2), 1)  # the server beat once, then froze
    commands = ServerCommands(first)
    seq = commands.send(Serve(m=2))
    with pytest.raises(ServerLostError, match=r"rank 0: parameter server rank 2 \(server index 0\) stopped "
                                              r"heartbeating.*acknowledgement of command #0 \(serve\)") as got:
        commands.wait_acks(seq)
    assert (got.value.server, got.value.index, got.value.by) == (2, 0, 0)
    other = _runtime(TCPStore("127.0.0.1", master.port, is_master=False), master.port, rank=1)
    with pytest.raises(ServerLostError, match="rank 1: the job stops because rank 0 found a parameter server lost: "
                                              "parameter server rank 2") as seen:
        Liveness(other, [0]).poll()  # any wait loop of any rank
    assert seen.value.by == 0 and other.aborted


def test_command_wait_tells_a_slow_server_from_a_frozen_one():
    import threading

    from torch.distributed import TCPStore

    from gba_engine.commands import ServerCommands
    from gba_engine.protocol import Serve, heartbeat_key
    from gba_engine.ps import ServerLostError

    master = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=5))
    rt = _runtime(master, master.port, rank=0)
    beating, stop = TCPStore("127.0.0.1", master.port, is_master=False), threading.Event()

    def beat():  # the server is alive: its heartbeat moves, it just never acknowledges
        while not stop.wait(0.05):
            beating.add(heartbeat_key(2), 1)

    thread = threading.Thread(target=beat, daemon=True)
    thread.start()
    try:
        commands = ServerCommands(rt)
        with pytest.raises(ServerLostError, match=r"is alive \(its heartbeat moves\) but did not answer within "
                                                  r"timeout_s=1.5s"):
            commands.wait_acks(commands.send(Serve(m=2)))
    finally:
        stop.set()
        thread.join()
