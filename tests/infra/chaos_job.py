"""A chaos run of a gba job: workers killed, restarted and frozen by a seeded plan (used by a test and a benchmark).

2 workers + 1 parameter server over gloo on 127.0.0.1 train ``total`` numbered batches of a small
model with a server table. A :class:`gba_engine.chaos.ChaosPlan` kills worker processes (both
launched workers and replacements) and freezes one. For each planned kill a spare interpreter is
started ahead (standing in for a supervisor that restarts crashed processes, warm so the job is not
idle for an import: the first spare of each worker at launch, the next once its predecessor trains);
it waits for its predecessor's death and replaces it with ``gba_engine.rejoin``. The other worker
waits (bounded) while a slot is down, so every planned kill happens before the data runs out
whatever the machine's load.

Example::

    outcome = run_chaos("/tmp/chaos", default_plan(), total=300)
    failed_checks(outcome, total=300)        # [] when nothing hung, was lost silently or diverged
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from gba_engine.chaos import CHAOS_EXIT_CODE, ChaosInjector, ChaosPlan
from sparse_scale.multiproc import run_distributed

ROWS = 64
ROOT = Path(__file__).resolve().parents[2]
HEARTBEAT_S = 0.2  # lease 5 x 0.2 s: a freeze shorter than that is a pause, not a death
FREEZE_MARGIN_S = 0.5  # a thawed worker's time to take its next batch before the other worker goes on


def default_plan(kills: int = 5, seed: int = 11, freeze_s: float = 0.4) -> ChaosPlan:
    """``kills`` kills over both workers (mean life 25 steps) and a freeze halfway through the longest-lived process."""
    plan = ChaosPlan.random_kills(ranks=[0, 1], kills=kills, mtbf_steps=25, seed=seed)
    longest = max(plan.faults, key=lambda f: (f.step, -f.rank, -f.incarnation))
    return plan.freeze_at(longest.rank, max(1, longest.step // 2), freeze_s, longest.incarnation)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        from gba_engine import ServerEmbeddingBagCollection
        from gba_engine.ps.sharding import ServerTableSpec

        torch.manual_seed(3)
        self.emb = ServerEmbeddingBagCollection([ServerTableSpec("item", ROWS, 4, init_std=0.3, seed=2)])
        self.mlp = nn.Sequential(nn.Linear(4 + 6, 8), nn.Tanh(), nn.Linear(8, 1))

    def forward(self, x, ids, offsets):
        return self.mlp(torch.cat([self.emb(ids, offsets)["item"], x], dim=1))


def _config(tmp: str) -> dict:
    return {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.0, "torch_adam": True}},
            "zero_optimization": {"stage": 0}, "steps_per_print": 10 ** 6, "gradient_clipping": 0.0,
            "gba": {"mode": "gba", "num_servers": 1, "timeout_s": 15, "heartbeat_s": HEARTBEAT_S,
                    "control_file": os.path.join(tmp, "control_plane")}}


def _step(engine, index: int) -> float:
    g = torch.Generator().manual_seed(5000 + index)
    x = torch.randn(8, 6, generator=g)
    ids = torch.randint(0, ROWS, (16,), generator=g)
    loss = F.mse_loss(engine(x, {"item": ids}, {"item": torch.arange(0, 16, 2)}), x[:, :1] * 0.3)
    engine.backward(loss)
    engine.step()
    return loss.item()


def fault_records(tmp: str) -> list[dict]:
    """Every fault a process recorded before it happened (kills and freezes), from ``tmp/chaos``."""
    out = []
    for path in sorted(Path(tmp, "chaos").glob("faults-*.jsonl")):  # the workers' faults (server.jsonl: its own)
        out += [json.loads(line) for line in path.read_text().splitlines()]
    return out


def _kills(tmp: str) -> list[dict]:
    return [r for r in fault_records(tmp) if r["kind"] == "kill"]


def _wait_while_a_slot_is_down(tmp: str, me: int) -> None:
    """Pace the job: while another slot's process is dead (until its replacement trains) or frozen, wait (bounded).

    Waiting out a freeze too keeps a fast machine from training every batch while the frozen worker is
    stopped, which would leave that worker no step to reach its planned kill at (seen on a 2-core Xeon).
    """
    deadline = time.monotonic() + 40
    while True:
        records = fault_records(tmp)
        down = [(k["rank"], k["incarnation"]) for k in records if k["kind"] == "kill" and k["rank"] != me
                and not Path(tmp, f"joined-{k['rank']}-{k['incarnation'] + 1}").exists()]
        down += [(f["rank"], f["incarnation"]) for f in records if f["kind"] == "freeze" and f["rank"] != me
                 and time.time() < f["at"] + f["seconds"] + FREEZE_MARGIN_S]
        if not down:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"worker slots {down} stayed down for 40 s")
        time.sleep(0.05)


def _kill_server(tmp: str, index: int) -> None:
    """The fault of the server: SIGKILL the (only) server process after batch ``index``, recorded first."""
    pid = int(Path(tmp, "server.pid").read_text())
    record = {"rank": "server", "kind": "kill", "after_batch": index, "pid": pid, "at": time.time()}
    Path(tmp, "chaos").mkdir(parents=True, exist_ok=True)
    with open(Path(tmp, "chaos", "server.jsonl"), "a") as f:
        f.write(json.dumps(record) + "\n")
    os.kill(pid, signal.SIGKILL)


def _train(engine, tmp: str, plan: ChaosPlan, total: int, rank: int, incarnation: int,
           kill_server_at: int | None) -> dict:
    from gba_engine import ServerLostError

    injector = ChaosInjector(plan, rank, incarnation, record=Path(tmp, "chaos"))
    losses = []
    out = {"rank": rank, "incarnation": incarnation, "trained": injector.trained, "losses": losses}
    try:
        for index in engine.claim_batches(total):
            losses.append(_step(engine, index))
            if incarnation and injector.steps == 0:
                Path(tmp, f"joined-{rank}-{incarnation}").write_text("1")
            if index == kill_server_at:
                _kill_server(tmp, index)
            injector.after_step(index)  # may kill or freeze this process
            _wait_while_a_slot_is_down(tmp, rank)
        out.update(dense=engine.client.pull(dense=True).dense, rows=engine.table_rows("item", torch.arange(ROWS)))
    except ServerLostError as exc:  # the job stops: what this process trained is kept, with the reason
        out.update(error=str(exc), error_server=exc.server, error_at=time.time())
    return out


def _launch(rank: int, world_size: int, tmp: str, plan: ChaosPlan, total: int,
            kill_server_at: int | None) -> dict | None:
    import gba_engine

    if rank == world_size - 1:  # the server (the last rank): its pid for the server fault
        Path(tmp, "server.pid").write_text(str(os.getpid()))
    engine = gba_engine.initialize(model=Net(), config=_config(tmp))
    if engine.is_server:
        return {"server": engine.server_stats}
    out = _train(engine, tmp, plan, total, rank, 0, kill_server_at)  # a plan that kills every launched worker
    engine.close()                                                    # never gets here
    return out


def spare_main(tmp: str, rank: int, incarnation: int, plan: ChaosPlan, total: int,
               kill_server_at: int | None = None, join_delay_s: float = 0.0) -> None:
    """The warm replacement of worker ``rank``'s process ``incarnation - 1`` (run in a fresh interpreter).

    ``join_delay_s``: it rejoins that long after the death (a supervisor slow to restart, a loaded machine)."""
    threading.Timer(100, lambda: os._exit(3)).start()  # a hard deadline of its own
    import gba_engine

    deadline = time.monotonic() + 90
    while not any((k["rank"], k["incarnation"]) == (rank, incarnation - 1) for k in _kills(tmp)):
        if time.monotonic() > deadline:
            os._exit(4)
        time.sleep(0.05)
    time.sleep(join_delay_s)
    engine = gba_engine.rejoin(model=Net(), config=_config(tmp), worker=rank)
    if engine.rt.incarnation != incarnation:
        raise RuntimeError(f"expected incarnation {incarnation}, the job gave {engine.rt.incarnation}")
    out = _train(engine, tmp, plan, total, rank, incarnation, kill_server_at)
    if "error" not in out:  # after a lost server there is nobody to say goodbye to
        engine.close()
    torch.save(out, os.path.join(tmp, f"final-{rank}.pt"))
    os._exit(0)  # the watchdog timer thread must not keep the process alive


def run_chaos(tmp: str, plan: ChaosPlan, total: int, timeout_s: float = 110,
              kill_server_at: int | None = None, join_delay_s: float = 0.0) -> dict:
    """Run the job under ``plan`` (every worker must be killed at least once); returns what each process left.

    ``kill_server_at``: the worker that trains that batch number SIGKILLs the server after it; the
    job must then stop (a replacement server is not supported) with every last process naming it.
    ``join_delay_s``: each replacement rejoins that long after the death it replaces.
    """
    if any(plan.kills_of(r) == 0 for r in (0, 1)):
        raise ValueError("the chaos job needs a kill of each launched worker (its last processes are replacements)")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    spares: dict[tuple[int, int], subprocess.Popen] = {}
    logs = []

    def start_spare(rank: int, incarnation: int) -> None:
        log = open(os.path.join(tmp, f"spare-{rank}-{incarnation}.log"), "w")
        logs.append(log)
        code = (f"import tests.infra.chaos_job as c; from gba_engine.chaos import ChaosPlan, Fault; "
                f"c.spare_main({tmp!r}, {rank}, {incarnation}, {plan!r}, {total}, {kill_server_at!r}, {join_delay_s!r})")
        spares[rank, incarnation] = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=env,
                                                     stdout=log, stderr=subprocess.STDOUT)

    def start_later_spares(stop: threading.Event) -> None:
        # spare i + 1 warms up while process i trains: fewer interpreters importing at once on a small machine
        for rank in (0, 1):
            start_spare(rank, 1)
        todo = [(r, i) for r in (0, 1) for i in range(2, plan.kills_of(r) + 1)]
        while todo and not stop.wait(0.05):
            for rank, incarnation in [k for k in todo if Path(tmp, f"joined-{k[0]}-{k[1] - 1}").exists()]:
                start_spare(rank, incarnation)
                todo.remove((rank, incarnation))

    stop = threading.Event()
    starter = threading.Thread(target=start_later_spares, args=(stop,), daemon=True)
    t0 = time.monotonic()
    starter.start()
    try:
        expect = {0: CHAOS_EXIT_CODE, 1: CHAOS_EXIT_CODE, **({2: -signal.SIGKILL} if kill_server_at is not None else {})}
        res = run_distributed(_launch, world_size=3, args=(tmp, plan, total, kill_server_at), timeout_s=timeout_s,
                              expect_exit=expect)
        stop.set()
        starter.join(timeout=5)
        codes = {key: p.wait(timeout=30) for key, p in spares.items()}
    finally:
        stop.set()
        for p in spares.values():
            if p.poll() is None:
                p.kill()
        for log in logs:
            log.close()
    server_kills = [json.loads(line) for line in Path(tmp, "chaos", "server.jsonl").read_text().splitlines()] \
        if kill_server_at is not None else []
    return {"plan": plan, "server": None if kill_server_at is not None else res[2]["server"], "codes": codes,
            "faults": fault_records(tmp), "server_kills": server_kills,
            "kills": _kills(tmp), "tmp": tmp, "seconds": time.monotonic() - t0,
            "final": {r: torch.load(os.path.join(tmp, f"final-{r}.pt"), weights_only=False) for r in (0, 1)}}


def lost_in_flight(outcome: dict) -> dict[int, int]:
    """Per worker: gradients its processes trained that the server never counted (a killed process's last push)."""
    out = {}
    for rank in (0, 1):
        trained = (sum(len(k["trained"]) for k in outcome["kills"] if k["rank"] == rank)
                   + len(outcome["final"][rank]["trained"]))
        out[rank] = trained - outcome["server"]["pushes"].get(str(rank), 0)
    return out


def failed_checks(outcome: dict, total: int) -> list[str]:
    """What the run got wrong, each as a sentence; [] when every check holds."""
    plan, kills, bad = outcome["plan"], outcome["kills"], []
    planned = sorted((f.rank, f.incarnation, f.step) for f in plan.faults if f.kind == "kill")
    if sorted((k["rank"], k["incarnation"], k["step"]) for k in kills) != planned:
        bad.append(f"kills {[(k['rank'], k['incarnation'], k['step']) for k in kills]} differ from the plan {planned}")
    planned_freezes = sorted((f.rank, f.incarnation, f.step) for f in plan.faults if f.kind == "freeze")
    freezes = sorted((r["rank"], r["incarnation"], r["step"]) for r in outcome["faults"] if r["kind"] == "freeze")
    if freezes != planned_freezes:
        bad.append(f"freezes {freezes} differ from the plan {planned_freezes}")
    for (rank, incarnation), code in sorted(outcome["codes"].items()):
        want = 0 if incarnation == plan.kills_of(rank) else CHAOS_EXIT_CODE
        if code != want:
            bad.append(f"replacement {incarnation} of worker {rank} exited {code}, expected {want}")
    trained = [b for k in kills for b in k["trained"]] + [b for f in outcome["final"].values() for b in f["trained"]]
    if len(trained) != len(set(trained)) or set(trained) != set(range(total)):
        bad.append(f"{len(trained)} batches trained ({len(set(trained))} distinct), expected each of {total} once")
    deaths = {r: sum(1 for k in kills if k["rank"] == r) for r in (0, 1)}
    for rank, n in lost_in_flight(outcome).items():
        if not 0 <= n <= deaths[rank]:
            bad.append(f"worker {rank}: {n} gradients unaccounted for, more than its {deaths[rank]} deaths explain")
    server = outcome["server"]
    if server["lost_workers"] or sorted(set(server["rejoined"])) != [0, 1]:
        bad.append(f"server: lost workers {server['lost_workers']}, rejoined {server['rejoined']}")
    a, b = outcome["final"][0], outcome["final"][1]
    if not (torch.equal(a["dense"], b["dense"]) and torch.equal(a["rows"], b["rows"])):
        bad.append("the last processes of the two workers hold different parameters")
    if not torch.isfinite(a["dense"]).all():
        bad.append("the final dense parameters are not finite")
    return bad


def failed_server_checks(outcome: dict) -> list[str]:
    """For a run whose server was killed: what went wrong, each as a sentence; [] when every check holds.

    The job must stop (no replacement server): every last process ends with a ServerLostError
    naming the server, every planned worker fault happened before, and no batch was trained twice.
    """
    plan, kills, bad = outcome["plan"], outcome["kills"], []
    planned = sorted((f.rank, f.incarnation, f.step) for f in plan.faults if f.kind == "kill")
    if sorted((k["rank"], k["incarnation"], k["step"]) for k in kills) != planned:
        bad.append(f"kills {[(k['rank'], k['incarnation'], k['step']) for k in kills]} differ from the plan {planned}")
    if len(outcome["server_kills"]) != 1:
        bad.append(f"{len(outcome['server_kills'])} server kills recorded, expected 1")
    for rank, fin in sorted(outcome["final"].items()):
        if fin.get("error_server") != 2 or "rank 2" not in fin.get("error", ""):
            bad.append(f"worker {rank}'s last process ended without an error naming server rank 2: "
                       f"{fin.get('error', 'no error')[:200]}")
    for (rank, incarnation), code in sorted(outcome["codes"].items()):
        want = 0 if incarnation == plan.kills_of(rank) else CHAOS_EXIT_CODE
        if code != want:
            bad.append(f"replacement {incarnation} of worker {rank} exited {code}, expected {want}")
    trained = [b for k in kills for b in k["trained"]] + [b for f in outcome["final"].values() for b in f["trained"]]
    if len(trained) != len(set(trained)):
        bad.append(f"{len(trained) - len(set(trained))} batches trained twice")
    if outcome["server_kills"] and outcome["server_kills"][0]["after_batch"] not in trained:
        bad.append("the batch after which the server was killed is not among the trained ones")
    return bad


def stop_seconds(outcome: dict) -> dict[int, float]:
    """Per worker: seconds from the server's kill to its last process's ServerLostError."""
    t0 = outcome["server_kills"][0]["at"]
    return {r: f["error_at"] - t0 for r, f in sorted(outcome["final"].items()) if "error_at" in f}
