"""End-to-end benchmark (issue 4 item 9): ``launch/train_rec.py`` with the picasso block on vs off.

Both variants train the same wide-and-deep model on the same synthetic stream
(F fields, Zipf ids, same seed, same steps, same micro-batch) with 1 rank and
1 torch thread, each in its own process:

* ``off``: no ``picasso`` block, one ``nn.EmbeddingBag`` per field (deep and
  wide), dense gradients, every parameter (tables included) updated by the
  config's DeepSpeed optimizer (``ds_configs/demo_cpu.json``: AdamW, ZeRO 1,
  warm-up/decay schedule).
* ``on``: the same config plus ``"picasso": {"packing": true, "embedding_dim":
  16, "optimizer": {"type": "rowwise_adagrad", "lr": 0.05}}``: packed tables,
  row-wise Adagrad fused into backward; the dense layers keep AdamW.

wandb is switched off in both temporary configs (it is not what is measured).
``samples_per_s`` and ``auc`` come from each run's ``summary.json``
(samples/s counts the training loop only, synthetic batch generation
included; AUC is exact over the held-out set). Each run's wall time and the
CPU time of its process (``resource.getrusage(RUSAGE_CHILDREN)``, whole
process: start-up, training, eval) are recorded too. ``--repeats`` alternates
off, on, off, on, ...; the table reports medians.

Run::

    .venv/bin/python benchmarks/rec_e2e.py                       # F=200, ~5 min, writes benchmarks/RESULTS.md
    .venv/bin/python benchmarks/rec_e2e.py --steps 20 --no-results   # quick look
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional, Sequence

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

SECTION = "## train_rec picasso on/off (issue 4 item 9)"
RESULTS = Path(__file__).resolve().parent / "RESULTS.md"
PICASSO_BLOCK = {"packing": True, "embedding_dim": 16, "optimizer": {"type": "rowwise_adagrad", "lr": 0.05}}


def write_config(path: Path, picasso: bool, micro_batch: Optional[int] = None,
                 base: Path = ROOT / "ds_configs" / "demo_cpu.json") -> Path:
    """A copy of ``base`` with wandb off, optionally a micro-batch size, and the picasso block when ``picasso``."""
    cfg = json.loads(base.read_text())
    cfg["wandb"] = {"enabled": False}
    if micro_batch is not None:
        cfg["train_micro_batch_size_per_gpu"] = micro_batch
    if picasso:
        cfg["picasso"] = PICASSO_BLOCK
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(cfg, indent=2))
    return path


def train_command(config: Path, out: Path, fields: int, vocab: int, steps: int, eval_samples: int,
                  threads: int = 1, seed: int = 1234, extra: Sequence[str] = ()) -> list[str]:
    return [
        sys.executable, str(ROOT / "launch" / "train_rec.py"), "--config", str(config), "--out", str(out),
        "--fields", str(fields), "--vocab", str(vocab), "--steps", str(steps), "--eval-samples", str(eval_samples),
        "--threads", str(threads), "--seed", str(seed), *extra,
    ]


# train_rec functions whose time is not training: subtracted from the whole train() call for the CPU figure
_OVERHEAD = ("init_distributed", "build_model", "build_engine", "evaluate", "_save", "finish_wandb")


def child(out_json: str, train_argv: list[str]) -> None:
    """Run ``train_rec.train`` in this process, recording the training loop's thread CPU time.

    train_rec's own ``samples_per_s`` (wall clock) is left untouched. The
    training loop's CPU time is the main thread's ``time.thread_time()`` over
    the whole ``train()`` call minus that of start-up (``init_distributed``,
    ``RecJob``, ``build_model``, ``build_engine``, the stream's generator),
    evaluation, checkpointing and wandb shutdown, each wrapped here.
    """
    import importlib.util

    spec = importlib.util.spec_from_file_location("train_rec", ROOT / "launch" / "train_rec.py")
    tr = importlib.util.module_from_spec(spec)
    sys.modules["train_rec"] = tr  # dataclasses look their module up by name
    spec.loader.exec_module(tr)
    spent = {"cpu": 0.0}

    def timed(fn):
        def wrapper(*a, **k):
            c0 = time.thread_time()
            try:
                return fn(*a, **k)
            finally:
                spent["cpu"] += time.thread_time() - c0
        return wrapper

    for name in _OVERHEAD:
        setattr(tr, name, timed(getattr(tr, name)))
    tr.RecJob.__init__ = timed(tr.RecJob.__init__)
    tr.RecJob.train_stream = timed(tr.RecJob.train_stream)  # builds the synthetic generator (teacher calibration)
    tr.logging.basicConfig(level=tr.logging.WARNING)
    c0 = time.thread_time()
    summary = tr.train(tr.parse_args(train_argv))
    total = time.thread_time() - c0
    train_cpu = max(total - spent["cpu"], 1e-9)
    Path(out_json).write_text(json.dumps({"train_cpu_s": train_cpu, "train_call_cpu_s": total,
                                          "samples_per_cpu_s": summary["samples"] / train_cpu}))


def run_variant(name: str, picasso: bool, workdir: Path, *, fields: int = 200, vocab: int = 10_000,
                steps: int = 300, eval_samples: int = 50_000, micro_batch: Optional[int] = None,
                threads: int = 1, seed: int = 1234, timeout_s: float = 1800, extra: Sequence[str] = ()) -> dict[str, Any]:
    """Train one variant in a fresh process; its summary plus wall and process CPU time."""
    config = write_config(workdir / f"{name}.json", picasso, micro_batch)
    out = workdir / name
    cmd = train_command(config, out, fields, vocab, steps, eval_samples, threads, seed, extra)
    cpu_json = workdir / f"{name}_cpu.json"
    child_cmd = [sys.executable, str(Path(__file__).resolve()), "--child", str(cpu_json), "--", *cmd[2:]]
    env = {**os.environ, "WANDB_MODE": "disabled", "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": str(threads)}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run(child_cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise RuntimeError(f"{name}: train_rec exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    summary = json.loads((out / "summary.json").read_text())
    cpu = json.loads(cpu_json.read_text())
    return {
        "variant": name,
        "picasso": picasso,
        "fields": fields,
        "vocab": vocab,
        "steps": summary["steps"],
        "samples": summary["samples"],
        "samples_per_s": summary["samples_per_s"],
        "train_time_s": summary["train_time_s"],
        "train_cpu_s": cpu["train_cpu_s"],
        "samples_per_cpu_s": cpu["samples_per_cpu_s"],
        "auc": summary["auc"],
        "log_loss": summary["log_loss"],
        "bayes_auc": summary.get("bayes_auc"),
        "eval_samples": summary["eval_samples"],
        "process_wall_s": wall,
        "process_cpu_s": (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime),
        "command": " ".join(shlex.quote(c) for c in cmd),
    }


def _median(rows: list[dict[str, Any]], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def format_table(rows: list[dict[str, Any]]) -> str:
    """Markdown: one line per variant (medians over repeats), then the on/off ratio."""
    head = ["picasso", "runs", "steps", "samples/s (wall, median)", "samples/s (each run)",
            "samples per train-loop CPU s (median)", "AUC", "log loss", "teacher AUC", "process wall s",
            "process CPU s"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    by = {v: [r for r in rows if r["variant"] == v] for v in ("off", "on")}
    for v, rs in by.items():
        if not rs:
            continue
        lines.append("| " + " | ".join([
            v, str(len(rs)), str(rs[0]["steps"]), f"{_median(rs, 'samples_per_s'):,.0f}",
            ", ".join(f"{r['samples_per_s']:,.0f}" for r in rs), f"{_median(rs, 'samples_per_cpu_s'):,.0f}",
            " / ".join(f"{r['auc']:.4f}" for r in rs), " / ".join(f"{r['log_loss']:.4f}" for r in rs),
            f"{rs[0]['bayes_auc']:.4f}" if rs[0].get("bayes_auc") is not None else "-",
            f"{_median(rs, 'process_wall_s'):.0f}", f"{_median(rs, 'process_cpu_s'):.0f}",
        ]) + " |")
    if by["off"] and by["on"]:
        speed = _median(by["on"], "samples_per_s") / _median(by["off"], "samples_per_s")
        speed_cpu = _median(by["on"], "samples_per_cpu_s") / _median(by["off"], "samples_per_cpu_s")
        dauc = _median(by["on"], "auc") - _median(by["off"], "auc")
        lines.append("")
        lines.append(f"on/off samples/s: **{speed:.2f}x** wall, **{speed_cpu:.2f}x** per training-loop CPU second "
                     f"(target >= 2x); AUC on - off: {dauc:+.4f}.")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> None:
    raw = list(sys.argv[1:] if argv is None else argv)
    if raw[:1] == ["--child"]:  # internal: one train_rec run with CPU accounting (see run_variant)
        child(raw[1], raw[3:])
        return
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--fields", type=int, default=200)
    p.add_argument("--vocab", type=int, default=10_000)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--eval-samples", type=int, default=50_000)
    p.add_argument("--micro-batch", type=int, default=None, help="default: the config's (256)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=1, help="runs per variant, alternating off/on")
    p.add_argument("--workdir", default=None, help="default: a temporary folder (removed)")
    p.add_argument("--no-results", action="store_true", help="do not write benchmarks/RESULTS.md")
    p.add_argument("--json", default=str(Path(__file__).resolve().parent / "rec_e2e_results.json"))
    args = p.parse_args(argv)
    argv_used = argv if argv is not None else sys.argv[1:]

    tmp = tempfile.TemporaryDirectory(prefix="rec_e2e_") if args.workdir is None else None
    workdir = Path(args.workdir or tmp.name)
    t0 = time.perf_counter()
    rows = []
    try:
        for rep in range(args.repeats):
            for name, picasso in (("off", False), ("on", True)):
                row = run_variant(name, picasso, workdir / f"r{rep}", fields=args.fields, vocab=args.vocab,
                                  steps=args.steps, eval_samples=args.eval_samples, micro_batch=args.micro_batch,
                                  threads=args.threads)
                rows.append(row)
                print(f"{name}: {row['samples_per_s']:,.0f} samples/s, AUC {row['auc']:.4f}, "
                      f"wall {row['process_wall_s']:.0f}s cpu {row['process_cpu_s']:.0f}s", flush=True)
                if args.json:
                    Path(args.json).write_text(json.dumps(rows, indent=1))
    finally:
        if tmp is not None:
            tmp.cleanup()
    total = time.perf_counter() - t0
    table = format_table(rows)
    print(table)
    if args.no_results:
        return
    from embedding import write_section  # benchmarks/embedding.py

    import torch

    micro = args.micro_batch or json.loads((ROOT / "ds_configs" / "demo_cpu.json").read_text())[
        "train_micro_batch_size_per_gpu"]
    cmd = " ".join([".venv/bin/python benchmarks/rec_e2e.py", *argv_used]).strip()
    body = f"""Command: `{cmd}` ({platform.machine()}, torch {torch.__version__}, 1 rank, {args.threads} torch
thread, shared 2-core machine with other jobs running; {total / 60:.1f} min for all runs).

Each run is `launch/train_rec.py --config TMP.json --fields {args.fields} --vocab {args.vocab} --steps {args.steps}
--eval-samples {args.eval_samples} --threads {args.threads} --seed 1234` in a fresh process, TMP.json being
`ds_configs/demo_cpu.json` (AdamW lr 0.003, ZeRO 1, warm-up/decay schedule, micro-batch {micro}) with
wandb off; "on" adds `"picasso": {json.dumps(PICASSO_BLOCK)}`. Off: one `nn.EmbeddingBag` per field (deep,
dim 16, and wide, dim 1), dense gradients, tables updated by DeepSpeed's AdamW with the dense layers. On: packed
tables with row-wise Adagrad fused into backward (applied at the DeepSpeed step boundary); dense layers
AdamW. Synthetic data: Zipf(1.1) ids, 1-3 ids per field, 13 dense features, planted teacher. samples/s is
train_rec's (training loop only, batch generation included); AUC is exact over the held-out set; process
wall/CPU s cover the whole process (start-up and eval included). "samples per train-loop CPU s": train_rec
runs in-process under a wrapper (`rec_e2e.py --child`) that takes the main thread's `time.thread_time()` over
`train()` minus start-up, stream set-up, eval, checkpointing and wandb shutdown (wall samples/s is train_rec's own).
Variants alternate (off, on{', off, on, ...' if args.repeats > 1 else ''}); {args.repeats} run(s) each.

{table}"""
    write_section(RESULTS, SECTION, body)
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
