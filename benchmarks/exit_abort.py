"""How often gloo ranks abort at exit after a run that succeeded, by how the script ends.

Each run starts RANKS plain gloo processes (no DeepSpeed, none of our training code) that do an all_gather on
the world and an all_reduce on a subgroup they keep referenced (as DeepSpeed keeps its groups), then end in
one of four ways: nothing (the anchor), ``destroy_process_group()``, ``sparse_scale.shutdown_distributed()``
(local) and ``shutdown_distributed(flush=True)``. The "unwaited" scenario ends right after an ``async_op=True``
all_reduce of 16 MB nobody waits for. A run counts as aborted when any of its processes dies of SIGABRT
("terminate called without an active exception"). Ways alternate run by run.

    .venv/bin/python benchmarks/exit_abort.py --runs 30
"""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from planner import report  # benchmarks/planner.py beside it: one RESULTS section writer
from sparse_scale.multiproc import free_port

REPO = Path(__file__).resolve().parents[1]
WAYS = ("none", "destroy", "local", "flush")
RANK = textwrap.dedent("""
    import sys, torch, torch.distributed as dist
    sys.path.insert(0, {repo!r})
    rank, world, way, scenario, port = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{{port}}", rank=rank, world_size=world)
    x = torch.tensor([float(rank)]); out = [torch.empty(1) for _ in range(world)]
    dist.all_gather(out, x)
    sub = dist.new_group([0, 1])
    dist.all_reduce(x, group=sub)
    if scenario == "unwaited":
        dist.all_reduce(torch.ones(4_000_000), group=sub, async_op=True)
    if way == "destroy":
        dist.destroy_process_group()
    elif way in ("local", "flush"):
        from sparse_scale import shutdown_distributed
        shutdown_distributed(flush=way == "flush")
""")


def one_run(script: Path, ranks: int, way: str, scenario: str) -> int:
    """Processes of one run that died of SIGABRT."""
    port = str(free_port())
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, str(script), str(r), str(ranks), way, scenario, port], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for r in range(ranks)]
    codes = []
    for p in procs:
        try:
            codes.append(p.wait(timeout=120))
        except subprocess.TimeoutExpired:
            p.kill()
            codes.append(p.wait())
    return sum(c == -signal.SIGABRT for c in codes)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=30, help="runs per way and scenario")
    p.add_argument("--ranks", type=int, default=5)
    p.add_argument("--scenarios", nargs="+", default=["waited", "unwaited"], choices=["waited", "unwaited"])
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args()
    script = Path(os.environ.get("TMPDIR", "/tmp")) / f"exit_abort_rank_{os.getpid()}.py"
    script.write_text(RANK.format(repo=str(REPO)))
    load_before = os.getloadavg()
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    rows = []
    try:
        for scenario in args.scenarios:
            runs = {w: 0 for w in WAYS}
            procs = {w: 0 for w in WAYS}
            for _ in range(args.runs):
                for way in WAYS:
                    dead = one_run(script, args.ranks, way, scenario)
                    runs[way] += dead > 0
                    procs[way] += dead
            for way in WAYS:
                rows.append(f"| {scenario} | {way}{' (anchor)' if way == 'none' else ''} | {runs[way]} of "
                            f"{args.runs} | {procs[way]} of {args.runs * args.ranks} |")
                print(rows[-1], flush=True)
    finally:
        script.unlink(missing_ok=True)
    report(f"Gloo ranks aborting at exit, by how the script ends ({started})", "exit_abort.py", load_before,
           f"{args.ranks} plain gloo processes per run, 1 torch thread each (module docstring); ways alternated run "
           "by run.", ["scenario", "end of the script", "runs with an abort", "processes aborted"], rows,
           write=not args.no_write)


if __name__ == "__main__":
    main()
