"""Chaos runs of a gba job: the faults a seeded plan injects and what the job made of them.

Runs ``tests/infra/chaos_job.py`` (2 workers + 1 server on gloo, 127.0.0.1; workers killed with
``os._exit`` after a planned step and replaced through ``gba_engine.rejoin``, one frozen with SIGSTOP
for less than the heartbeat lease) for each seed and prints a markdown table per run: the faults,
then the outcome checks. Exits 1 when any check fails.

    PYTHONPATH=. .venv/bin/python benchmarks/gba_chaos.py --seeds 11 12 13 --kills 5 --total 300
    PYTHONPATH=. .venv/bin/python benchmarks/gba_chaos.py --seeds 11 --kill-server-at 250     # then the server
"""
from __future__ import annotations

import argparse
import sys
import tempfile


def _report(outcome: dict, total: int, seed: int) -> tuple[str, list[str]]:
    from tests.infra import chaos_job

    lines = [f"### seed {seed}: {total} batches, {outcome['seconds']:.0f} s wall", "",
             "| worker | process | after its step | fault | batches that process trained |", "|---|---|---|---|---|"]
    trained_by = {(k["rank"], k["incarnation"]): len(k["trained"]) for k in outcome["kills"]}
    for f in sorted(outcome["plan"].faults, key=lambda f: (f.rank, f.incarnation, f.step)):
        what = "kill (os._exit)" if f.kind == "kill" else f"freeze {f.seconds:.1f} s (SIGSTOP)"
        n = trained_by.get((f.rank, f.incarnation), "") if f.kind == "kill" else ""
        lines.append(f"| {f.rank} | {f.incarnation} | {f.step} | {what} | {n} |")
    for r, fin in sorted(outcome["final"].items()):
        lines.append(f"| {r} | {fin['incarnation']} | (finished) | none | {len(fin['trained'])} |")
    bad = chaos_job.failed_checks(outcome, total)
    server = outcome["server"]
    lost = chaos_job.lost_in_flight(outcome)
    lines += ["", f"Outcome: {'every check holds' if not bad else 'FAILED: ' + '; '.join(bad)}. "
              f"Server counted {sum(server['pushes'].values())} gradients, version {server['version']}; "
              f"lost in flight by a kill: worker 0 {lost[0]}, worker 1 {lost[1]}; "
              f"lost workers {server['lost_workers']}, rejoins {len(server['rejoined'])}.", ""]
    return "\n".join(lines), bad


def _server_report(outcome: dict, total: int, seed: int) -> tuple[str, list[str]]:
    from tests.infra import chaos_job

    bad = chaos_job.failed_server_checks(outcome)
    kill = outcome["server_kills"][0]
    trained = {b for k in outcome["kills"] for b in k["trained"]} | {b for f in outcome["final"].values()
                                                                   for b in f["trained"]}
    lines = [f"### seed {seed}, server killed after batch {kill['after_batch']}: {outcome['seconds']:.0f} s wall", "",
             f"Worker faults as planned: {len(outcome['kills'])} kills, "
             f"{sum(1 for f in outcome['faults'] if f['kind'] == 'freeze')} freeze. Batches trained before the job "
             f"stopped: {len(trained)} of {total}, none twice.", "",
             "| worker | seconds from the server's kill to its ServerLostError | message (first 160 characters) |",
             "|---|---|---|"]
    for rank, secs in chaos_job.stop_seconds(outcome).items():
        lines.append(f"| {rank} | {secs:.1f} | {outcome['final'][rank]['error'][:160]} |")
    lines += ["", f"Outcome: {'every check holds' if not bad else 'FAILED: ' + '; '.join(bad)}.", ""]
    return "\n".join(lines), bad


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[11])
    p.add_argument("--kills", type=int, default=5)
    p.add_argument("--total", type=int, default=300)
    p.add_argument("--kill-server-at", type=int, default=None,
                   help="also SIGKILL the server after this batch number: the job must stop, naming it")
    args = p.parse_args(argv)
    if args.kills < 2 or args.total < 10 * args.kills:
        p.error(f"--kills must be >= 2 (one per launched worker) and --total >= 10 x kills, got {args.kills}, "
                f"{args.total}")
    from tests.infra import chaos_job  # not installed: run from the repository root with PYTHONPATH=.

    failed = False
    for seed in args.seeds:
        with tempfile.TemporaryDirectory(prefix="gba_chaos_") as tmp:
            outcome = chaos_job.run_chaos(tmp, chaos_job.default_plan(kills=args.kills, seed=seed), args.total,
                                          kill_server_at=args.kill_server_at)
            text, bad = (_report if args.kill_server_at is None else _server_report)(outcome, args.total, seed)
        print(text, flush=True)
        failed |= bool(bad)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
