"""GBA vs sync all-reduce vs plain async PS vs bounded staleness (SSP) on the synthetic CTR task.

One launch per (seed, scenario, method) of ``launch/train_rec.py`` with a ``gba`` block on
4 workers + 1 parameter server (real gloo processes through
``sparse_scale.multiproc.run_distributed``), all with the same global batch (4 x micro batch),
the same AdamW and learning rate (``ds_configs/gba_cpu.json``):

* ``sync``  ``mode: sync``: DeepSpeed all-reduce over the 4 workers (the server idles);
* ``gba``   ``mode: gba``, fully asynchronous (``max_lead: null``), M = 4 gradients per update,
  staleness decay as configured (default drop above tau = 4);
* ``async`` plain asynchronous PS: every local gradient applied at once (``grads_per_update: 1``),
  no staleness decay;
* ``ssp``   ``mode: gba`` with ``max_lead: K`` (SSP-style bound: a worker's n-th pull of a phase
  waits for version >= start + n - K), M = 4, no staleness decay.

Scenarios: ``none``; ``slow`` (``--straggler 3:4``: worker 3 four times slower throughout);
``transient`` (several ``--straggler RANK:4:START-END`` windows on ranks and steps drawn from a
seeded RNG; the same windows for every method of a seed).

Every method trains the same ``--steps`` x 4 numbered batches (train_rec hands them out through
the engine's ``claim_batches``: lockstep in sync mode, first come first served in gba mode, so a
fast worker takes more than a slow one, as in the paper). ``samples/s`` = the job's samples / the
slowest worker's training time (the job's wall clock); the per-worker steps show who took what.

Test AUC: every run writes its final parameters (train_rec's end-of-run checkpoint); this
script then evaluates all of a seed's runs on one large held-out set of the same synthetic task
(``--test-samples``) in one process and gives the Hanley-McNeil standard error of each AUC.

    TORCH_EXTENSIONS_DIR=/tmp/gba_ext .venv/bin/python benchmarks/gba.py --seeds 1 2 3 --steps 150

``--auto`` runs one ``mode: auto`` job with a straggler window and prints its switch events.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import platform
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

WORKERS, SERVERS = 4, 1
METHODS = ("sync", "gba", "async", "ssp")
SCENARIOS = ("none", "slow", "transient")
NO_DECAY = 1_000_000  # a staleness threshold no run reaches: every gradient keeps full weight


# ---------------------------------------------------------------------------------------------- per rank
def _train_rec():
    spec = importlib.util.spec_from_file_location("train_rec", ROOT / "launch" / "train_rec.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["train_rec"] = mod  # dataclasses look their module up by name
    spec.loader.exec_module(mod)
    return mod


def _rank_many(rank: int, world_size: int, jobs: list) -> list:
    """Run several train_rec jobs one after another in the same 5 processes (process start-up is
    minutes on the shared 2-core box); every worker writes its numbers to OUT/worker<rank>.json."""
    os.environ["WANDB_MODE"] = "offline"
    train_rec = _train_rec()
    done = []
    for argv in jobs:
        args = train_rec.parse_args(argv)
        t0 = time.perf_counter()
        s = train_rec.train(args)
        if s.get("server"):
            done.append({"server": True})
            continue
        r = {"rank": rank, "steps": s["steps"], "train_time_s": s["train_time_s"], "wall_s": time.perf_counter() - t0,
             "local_samples": s["local_samples"], "job_samples": s["samples"], "job_samples_per_s": s["samples_per_s"],
             "checkpoint": s["checkpoint"], "gba": s.get("gba")}
        (Path(args.out) / f"worker{rank}.json").write_text(json.dumps(r))
        if rank == 0:
            print(f"done {args.out} in {r['wall_s']:.0f}s (train {r['train_time_s']:.1f}s)", flush=True)
        done.append(r)
    return done


# ---------------------------------------------------------------------------------------------- launch
def _config(out: Path, mode: str, micro: int, max_lead, threshold: int | None, switch: dict | None,
            m: int | None = None) -> str:
    cfg = json.loads((ROOT / "ds_configs" / "gba_cpu.json").read_text())
    cfg["train_micro_batch_size_per_gpu"] = micro
    cfg["wandb"] = {"enabled": False}
    g = cfg["gba"]
    g.update(mode=mode, num_servers=SERVERS, max_lead=max_lead, grads_per_update=m, timeout_s=120, heartbeat_s=1.0)
    if threshold is not None:
        g["staleness"] = {**g["staleness"], "threshold": threshold}
    if switch:
        g["switch"] = {**g["switch"], **switch}
    out.mkdir(parents=True, exist_ok=True)
    path = out / "ds_config.json"
    path.write_text(json.dumps(cfg, indent=1))
    return str(path)


def method_setup(method: str, ssp_lead: int) -> dict:
    """mode, max_lead, staleness threshold (None: config default), forced M (None: engine's M = workers)."""
    return {
        "sync": dict(mode="sync", max_lead=None, threshold=None, m=None),
        "gba": dict(mode="gba", max_lead=None, threshold=None, m=None),
        "async": dict(mode="gba", max_lead=None, threshold=NO_DECAY, m=1),
        "ssp": dict(mode="gba", max_lead=ssp_lead, threshold=NO_DECAY, m=None),
    }[method]


def stragglers(scenario: str, seed: int, steps: int, windows: int) -> list[str]:
    if scenario == "none":
        return []
    if scenario == "slow":
        return ["3:4"]
    # one slow worker at a time, at job-wide steps (train_rec reads windows against the job's batch numbers)
    rng = random.Random(1000 + seed)
    seg = steps // windows
    out = []
    for i in range(windows):
        length = rng.randint(max(1, seg // 3), max(1, seg * 2 // 3))
        start = i * seg + rng.randint(0, seg - length - 2)
        out.append(f"{rng.randrange(WORKERS)}:4:{start}-{start + length}")
    return out


def job_argv(out: Path, seed: int, method: str, straggle: list[str], a: argparse.Namespace, steps: int,
             mode: str | None = None, switch: dict | None = None) -> list[str]:
    st = method_setup(method, a.ssp_lead)
    cfg = _config(out, mode or st["mode"], a.micro_batch, st["max_lead"], st["threshold"], switch, st["m"])
    argv = ["--config", cfg, "--steps", str(steps), "--out", str(out), "--seed", str(seed),
            "--fields", str(a.fields), "--vocab", str(a.vocab), "--eval-samples", str(WORKERS * a.micro_batch),
            "--threads", "1"]
    for s in straggle:
        argv += ["--straggler", s]
    return argv


def collect(out: Path, a: argparse.Namespace) -> dict:
    """One job's numbers from the files its workers wrote."""
    workers = [json.loads((out / f"worker{r}.json").read_text()) for r in range(WORKERS)]
    own = [w["local_samples"] / w["train_time_s"] for w in workers]
    return {"samples_per_s": workers[0]["job_samples_per_s"], "job_samples": workers[0]["job_samples"],
            "worker_steps": [w["steps"] for w in workers], "worker_samples_per_s": own,
            "train_time_s": [w["train_time_s"] for w in workers],
            "checkpoint": workers[0]["checkpoint"], "gba": workers[0]["gba"]}


# ---------------------------------------------------------------------------------------------- evaluation
def hanley_mcneil_se(a: float, n_pos: int, n_neg: int) -> float:
    q1, q2 = a / (2 - a), 2 * a * a / (1 + a)
    return math.sqrt((a * (1 - a) + (n_pos - 1) * (q1 - a * a) + (n_neg - 1) * (q2 - a * a)) / (n_pos * n_neg))


class TestSet:
    """One large held-out set of a seed's synthetic task, generated once, scored for many models."""

    def __init__(self, seed: int, a: argparse.Namespace):
        import torch

        from picasso_ops.data.synthetic import SyntheticConfig, SyntheticCTRStream
        from picasso_ops.models import WideAndDeepArgs

        # the same task as train_rec --seed SEED (its defaults for what this script does not set)
        self.cfg = SyntheticConfig(num_fields=a.fields, vocab_sizes=a.vocab, zipf_exponent=1.1, max_ids_per_field=3,
                                   num_dense=13, seed=seed)
        self.args = WideAndDeepArgs(vocab_sizes=self.cfg.field_vocab_sizes(), num_dense=13, embedding_dim=16)
        bs = 8192
        self.batches = list(SyntheticCTRStream(self.cfg, bs, split="eval", num_batches=math.ceil(a.test_samples / bs)))
        self.labels = torch.cat([b.labels for b in self.batches])
        teacher = torch.cat([b.teacher_prob for b in self.batches])
        self.n = self.labels.numel()
        self.n_pos = int(self.labels.sum())
        self.teacher_auc = self.auc(teacher)

    def auc(self, scores) -> float:
        from picasso_ops.data.metrics import auc

        return float(auc(scores, self.labels))

    def score(self, checkpoint: str) -> float:
        import torch
        from torch.nn.utils import vector_to_parameters

        from picasso_ops.models import WideAndDeep

        files = sorted(Path(checkpoint).glob("gba_server_*.pt")) or [Path(checkpoint) / "gba_worker_state.pt"]
        params = torch.cat([torch.load(f, weights_only=True)["params"] for f in files])
        model = WideAndDeep(self.args).eval()
        vector_to_parameters(params, model.parameters())
        with torch.no_grad():
            s = torch.cat([torch.sigmoid(model(b.dense, b.values, b.lengths)).float() for b in self.batches])
        return self.auc(s)


# ---------------------------------------------------------------------------------------------- main
def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    p.add_argument("--scenarios", nargs="+", default=list(SCENARIOS), choices=SCENARIOS)
    p.add_argument("--steps", type=int, default=150, help="local steps per worker")
    p.add_argument("--micro-batch", type=int, default=128)
    p.add_argument("--fields", type=int, default=26)
    p.add_argument("--vocab", type=int, default=50)
    p.add_argument("--ssp-lead", type=int, default=3, help="max_lead of the ssp row")
    p.add_argument("--windows", type=int, default=4, help="straggler windows in the transient scenario")
    p.add_argument("--test-samples", type=int, default=2_000_000)
    p.add_argument("--run-timeout-s", type=float, default=3000)
    p.add_argument("--auto", action="store_true", help="also run the auto-mode job with a straggler window")
    p.add_argument("--auto-only", action="store_true")
    p.add_argument("--auto-steps", type=int, default=240)
    p.add_argument("--out", default="runs/bench_gba")
    return p.parse_args(argv)


def _table(rows: list[dict], a: argparse.Namespace) -> str:
    lines = ["| scenario | method | samples/s | vs sync | steps per worker (seed 1) | test AUC | vs sync AUC | seeds |",
             "|---|---|---:|---:|---|---:|---:|---:|"]
    by = {}
    for r in rows:
        by.setdefault((r["scenario"], r["method"]), []).append(r)
    for sc in a.scenarios:
        sync_auc = sync_rate = None
        if (sc, "sync") in by:
            sync_auc = sum(r["auc"] for r in by[(sc, "sync")]) / len(by[(sc, "sync")])
            sync_rate = sum(r["samples_per_s"] for r in by[(sc, "sync")]) / len(by[(sc, "sync")])
        for m in a.methods:
            rs = by.get((sc, m))
            if not rs:
                continue
            mean = lambda k: sum(r[k] for r in rs) / len(rs)  # noqa: E731
            auc_m = mean("auc")
            diff = f"{auc_m - sync_auc:+.4f}" if sync_auc is not None else ""
            speed = f"{mean('samples_per_s') / sync_rate:.2f}x" if sync_rate else ""
            steps = min(rs, key=lambda r: r["seed"])["worker_steps"]
            lines.append(f"| {sc} | {m} | {mean('samples_per_s'):,.0f} | {speed} | {steps} | {auc_m:.4f} | {diff} | "
                         f"{len(rs)} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    a = parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    results_path = out / "results.json"
    done = json.loads(results_path.read_text()) if results_path.exists() else []
    key = lambda r: (r["seed"], r["scenario"], r["method"])  # noqa: E731
    have = {key(r) for r in done}
    t_all = time.perf_counter()
    jobs, metas = [], []
    if not a.auto_only:
        for seed in a.seeds:
            for sc in a.scenarios:
                for m in a.methods:
                    if (seed, sc, m) in have:
                        continue
                    straggle = stragglers(sc, seed, a.steps, a.windows)
                    d = out / f"s{seed}" / sc / m
                    jobs.append(job_argv(d, seed, m, straggle, a, a.steps))
                    metas.append({"seed": seed, "scenario": sc, "method": m, "stragglers": straggle,
                                  "steps": a.steps, "dir": str(d)})
    if a.auto or a.auto_only:
        win = f"3:4:{a.auto_steps // 4}-{a.auto_steps // 2}"
        d = out / "auto"
        jobs.append(job_argv(d, a.seeds[0], "gba", [win], a, a.auto_steps, mode="auto",
                             switch={"window": 4, "min_dwell_steps": 10}))
        metas.append({"auto": True, "stragglers": [win], "steps": a.auto_steps, "dir": str(d)})
    if jobs:
        from sparse_scale.multiproc import run_distributed

        try:
            run_distributed(_rank_many, WORKERS + SERVERS, args=(jobs,), timeout_s=a.run_timeout_s,
                            init_process_group=False)
        except Exception as exc:  # keep every job that finished
            print(f"launch failed or timed out: {exc!r}"[:2000], flush=True)
    for meta in metas:
        d = Path(meta["dir"])
        if not all((d / f"worker{r}.json").exists() for r in range(WORKERS)):
            print(f"missing: {d}")
            continue
        r = {**meta, **collect(d, a)}
        if meta.get("auto"):
            (out / "auto.json").write_text(json.dumps(r, indent=1))
            g = r["gba"]
            print(f"auto: --straggler {meta['stragglers'][0]}, {meta['steps']} steps, samples/s "
                  f"{r['samples_per_s']:.0f}, steps per mode {g['steps_per_mode']}")
            for e in g["switches"]:
                print(f"  step {e['step']}: {e['src']} -> {e['dst']} in {e['seconds']:.3f}s, "
                      f"{e['nbytes'] / 1e6:.2f} MB ({e['reason']})")
            continue
        done.append(r)
        print(f"seed {r['seed']} {r['scenario']:9s} {r['method']:5s} samples/s {r['samples_per_s']:7.0f} "
              f"steps {r['worker_steps']}", flush=True)
    results_path.write_text(json.dumps(done, indent=1))
    if done:
        # evaluate every run of a seed on that seed's large test set
        for seed in sorted({r["seed"] for r in done}):
            todo = [r for r in done if r["seed"] == seed and "auc" not in r]
            if not todo:
                continue
            t0 = time.perf_counter()
            ts = TestSet(seed, a)
            for r in todo:
                r["auc"] = ts.score(r["checkpoint"])
                r["auc_se"] = hanley_mcneil_se(r["auc"], ts.n_pos, ts.n - ts.n_pos)
                r.update(test_samples=ts.n, test_pos=ts.n_pos, teacher_auc=ts.teacher_auc)
            results_path.write_text(json.dumps(done, indent=1))
            print(f"seed {seed}: test set {ts.n:,} ({ts.n_pos:,} positive), teacher AUC {ts.teacher_auc:.4f}, "
                  f"max SE {max(r['auc_se'] for r in todo):.5f}, eval {time.perf_counter() - t0:.0f}s", flush=True)
        print(_table(done, a))
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, load {os.getloadavg()}, "
          f"total {time.perf_counter() - t_all:.0f}s")


if __name__ == "__main__":
    main()
