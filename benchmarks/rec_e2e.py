"""End-to-end benchmark (issue 4 item 9): ``launch/train_rec.py`` with the picasso block on vs off.

Both variants train the same wide-and-deep model on the same synthetic stream
(F fields, Zipf ids, same seed, same steps, same micro-batch) with 1 rank and
1 torch thread, each in its own process:

* ``off``: no ``picasso`` block, one ``nn.EmbeddingBag`` per field (deep and
  wide), dense gradients, every parameter (tables included) updated by the
  config's DeepSpeed optimizer (``ds_configs/demo_cpu.json``: AdamW, ZeRO 1,
  warm-up/decay schedule, gradient clipping).
* ``on``: the same config plus ``"picasso": {"packing": true, "embedding_dim":
  16, "optimizer": {"type": SPARSE_OPT, "lr": SPARSE_LR, "lr_schedule":
  "constant"}}``: packed tables, the
  sparse optimizer fused into backward (by default ``adam``, FBGEMM-style lazy
  Adam, at the dense AdamW's peak lr); the dense layers keep AdamW. The packed
  tables' lr is pinned constant (the recorded runs predate
  ``lr_schedule: "deepspeed"``, now train_rec's default); DeepSpeed's gradient
  clipping only sees the dense parameters.

``--lr`` sets the config's AdamW lr and the schedule's peak (both variants);
the sparse lr defaults to it.

``--optimizer sgd`` is the same-arithmetic comparison: both variants run plain
SGD (DeepSpeed's ``SGD`` on the dense layers, and off's tables; picasso's
fused ``sgd`` on on's tables, following DeepSpeed's schedule), no gradient
clipping, and start from the same weights (the child builds off's model from
the same RNG state and copies it into the packed tables). Dense SGD without
momentum or weight decay leaves untouched rows alone, so on and off compute
the same updates and may differ by float rounding only: their AUCs must agree
within noise, which isolates packing/fusion from the choice of optimizer. wandb is switched off in both temporary configs.
``samples_per_s`` and ``auc`` come from each run's ``summary.json``
(samples/s counts the training loop only, synthetic batch generation
included; AUC is exact over the held-out set). Each run's wall time, the CPU
time of its process and the 1-minute load average (sampled from
``/proc/loadavg`` every 10 s while it runs) are recorded too. The child
process also saves the held-out scores and labels, from which the table gives
the Hanley-McNeil standard error of each AUC and, for on/off pairs of one
seed (same held-out set), DeLong's paired standard error of the AUC
difference. Seeds run in turn, off then on within each seed.

Run::

    .venv/bin/python benchmarks/rec_e2e.py --seeds 1234 1235     # F=200, vocab 1000, 1,500 steps: ~35 min
    .venv/bin/python benchmarks/rec_e2e.py --steps 20 --eval-samples 5000 --no-results   # quick look
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import resource
import shlex
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Optional, Sequence

ROOT = Path(__file__).resolve().parents[1]

SECTION = "## train_rec picasso on/off (issue 4 item 9)"
RESULTS = Path(__file__).resolve().parent / "RESULTS.md"
BASE_CONFIG = ROOT / "ds_configs" / "demo_cpu.json"
SAME_MATH_SECTION = "## train_rec picasso on/off with the same optimizer (issue 4 item 9)"
DEFAULTS = {"fields": 200, "vocab": 1000, "steps": 1500, "eval_samples": 500_000, "lr": 0.0003,
            "sparse_opt": "adam", "optimizer": "adamw"}


def picasso_block(sparse_opt: str = DEFAULTS["sparse_opt"], sparse_lr: float = DEFAULTS["lr"],
                  lr_schedule: str = "constant") -> dict[str, Any]:
    # "constant" for adamw: the recorded runs were measured before the tables could follow DeepSpeed's schedule
    return {"packing": True, "embedding_dim": 16,
            "optimizer": {"type": sparse_opt, "lr": sparse_lr, "lr_schedule": lr_schedule}}


def same_math_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """``cfg`` with plain SGD at its lr instead of AdamW and no gradient clipping (``--optimizer sgd``)."""
    lr = float(cfg["optimizer"]["params"]["lr"])
    return {**cfg, "optimizer": {"type": "SGD", "params": {"lr": lr}}, "gradient_clipping": 0.0,
            "zero_allow_untested_optimizer": True}  # ZeRO 1 wraps torch's SGD as it does AdamW


def job_config(picasso: bool, micro_batch: Optional[int] = None, base: Path = BASE_CONFIG,
               lr: Optional[float] = None, sparse_opt: str = DEFAULTS["sparse_opt"],
               sparse_lr: Optional[float] = None, optimizer: str = DEFAULTS["optimizer"]) -> dict[str, Any]:
    """``base`` with wandb off, optionally a micro-batch size and an lr, and the picasso block when ``picasso``.

    ``lr`` replaces the AdamW lr and the scheduler's peak (``warmup_max_lr``);
    ``sparse_lr`` (default: the resulting AdamW lr) is the picasso tables' lr.
    ``optimizer="sgd"``: plain SGD on both sides, no clipping, tables on DeepSpeed's schedule.
    """
    cfg = json.loads(base.read_text())
    cfg["wandb"] = {"enabled": False}
    if micro_batch is not None:
        cfg["train_micro_batch_size_per_gpu"] = micro_batch
    if lr is not None:
        cfg["optimizer"]["params"]["lr"] = lr
        if "warmup_max_lr" in cfg.get("scheduler", {}).get("params", {}):
            cfg["scheduler"]["params"]["warmup_max_lr"] = lr
    if optimizer == "sgd":
        cfg, sparse_opt = same_math_config(cfg), "sgd"
    if picasso:
        dense_lr = float(cfg["optimizer"]["params"]["lr"])
        schedule = "deepspeed" if optimizer == "sgd" else "constant"
        cfg["picasso"] = picasso_block(sparse_opt, dense_lr if sparse_lr is None else sparse_lr, schedule)
    return cfg


def write_config(path: Path, picasso: bool, micro_batch: Optional[int] = None, **kwargs: Any) -> Path:
    """:func:`job_config` written to ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(job_config(picasso, micro_batch, **kwargs), indent=2))
    return path


def train_command(config: Path, out: Path, fields: int, vocab: int, steps: int, eval_samples: int,
                  threads: int = 1, seed: int = 1234, extra: Sequence[str] = ()) -> list[str]:
    return [
        sys.executable, str(ROOT / "launch" / "train_rec.py"), "--config", str(config), "--out", str(out),
        "--fields", str(fields), "--vocab", str(vocab), "--steps", str(steps), "--eval-samples", str(eval_samples),
        "--threads", str(threads), "--seed", str(seed), *extra,
    ]


# train_rec functions whose time is not training: subtracted from the whole train() call for the CPU figure
_OVERHEAD = ("init_distributed", "build_model", "build_engine", "evaluate", "save", "finish_wandb")


def copy_into_packed(plain: Any, packed: Any) -> None:
    """Copy a plain wide-and-deep's weights into a packed one: tables field by field, dense layers by name.

    Example::

        >>> copy_into_packed(WideAndDeep(args), packed_wide_and_deep(args, SparseArgs(optimizer="sgd")))  # doctest: +SKIP
    """
    import torch

    with torch.no_grad():
        for part, prefix in (("embeddings", "emb"), ("wide", "wide")):
            collection = getattr(packed, part).collection
            for i, bag in enumerate(getattr(plain, part).bags):
                collection.table_weight(f"{prefix}{i}").copy_(bag.weight)
        for name in ("wide_dense", "mlp"):
            getattr(packed, name).load_state_dict(getattr(plain, name).state_dict())


def child(out_json: str, train_argv: list[str], same_init: bool = False) -> None:
    """Run ``train_rec.train`` in this process, recording the training loop's thread CPU time and the eval scores.

    train_rec's own ``samples_per_s`` (wall clock) is left untouched. The
    training loop's CPU time is the main thread's ``time.thread_time()`` over
    the whole ``train()`` call minus that of start-up (``init_distributed``,
    ``RecJob.build``, ``build_model``, ``build_engine``, the stream's generator),
    evaluation, checkpointing and wandb shutdown, each wrapped here. The
    final evaluation's scores, labels and teacher probabilities (the
    arguments of train_rec's two ``auc`` calls) go to ``OUT_JSON`` with
    ``.npz`` for the standard errors. ``same_init``: see ``--optimizer sgd``.
    """
    import logging

    import numpy as np

    from picasso_ops.models import WideAndDeep
    from sparse_scale.rec import checkpoint, cli, data, engines, evaluate as evaluation, model, runner
    from sparse_scale.rec.job import RecJob
    spent = {"cpu": 0.0}
    auc_calls: list[tuple[Any, Any]] = []

    def timed(fn):
        def wrapper(*a, **k):
            c0 = time.thread_time()
            try:
                return fn(*a, **k)
            finally:
                spent["cpu"] += time.thread_time() - c0
        return wrapper

    def evaluate(*a, **k):
        auc_calls.clear()  # keep the last evaluation's (the final one's) arguments only
        return evaluate_inner(*a, **k)

    def recording_auc(scores, labels):
        auc_calls.append((scores.detach().float().cpu().numpy(), labels.detach().cpu().numpy()))
        return auc_fn(scores, labels)

    if same_init:  # the packed model starts from the weights the plain one gets from the same RNG state
        import torch

        build = model.build_model

        def build_same_init(job):
            before = torch.get_rng_state()
            net = build(job)
            if job.picasso is not None:
                after = torch.get_rng_state()
                torch.set_rng_state(before)
                copy_into_packed(WideAndDeep(job.model_args), net)
                torch.set_rng_state(after)
            return net

        model.build_model = build_same_init
    auc_fn = evaluation.auc
    evaluation.auc = recording_auc
    owners = {"init_distributed": runner, "build_model": model, "build_engine": engines, "evaluate": evaluation,
              "save": checkpoint, "finish_wandb": cli}
    for name in _OVERHEAD:
        setattr(owners[name], name, timed(getattr(owners[name], name)))
    evaluate_inner = evaluation.evaluate
    evaluation.evaluate = evaluate
    RecJob.build = classmethod(timed(RecJob.build.__func__))
    data.train_stream = timed(data.train_stream)  # builds the synthetic generator (teacher calibration)
    logging.basicConfig(level=logging.WARNING)
    c0 = time.thread_time()
    summary = cli.train(cli.parse_args(train_argv))
    total = time.thread_time() - c0
    train_cpu = max(total - spent["cpu"], 1e-9)
    if auc_calls:
        arrays = {"scores": auc_calls[0][0], "labels": auc_calls[0][1]}
        if len(auc_calls) > 1:
            arrays["teacher"] = auc_calls[1][0]
        np.savez(Path(out_json).with_suffix(".npz"), **arrays)
    Path(out_json).write_text(json.dumps({"train_cpu_s": train_cpu, "train_call_cpu_s": total,
                                          "samples_per_cpu_s": summary["samples"] / train_cpu}))


class LoadSampler:
    """Samples the 1-minute load average from ``/proc/loadavg`` every ``every_s`` seconds on a thread."""

    def __init__(self, every_s: float = 10.0):
        self.every_s, self.samples = every_s, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def read() -> Optional[float]:
        try:
            return float(Path("/proc/loadavg").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None

    def _run(self) -> None:
        while True:
            v = self.read()
            if v is not None:
                self.samples.append(v)
            if self._stop.wait(self.every_s):
                return

    def __enter__(self) -> "LoadSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        v = self.read()
        if v is not None:
            self.samples.append(v)

    def summary(self) -> dict[str, Optional[float]]:
        if not self.samples:
            return {"load_min": None, "load_mean": None, "load_max": None}
        return {"load_min": min(self.samples), "load_mean": statistics.fmean(self.samples),
                "load_max": max(self.samples)}


def hanley_mcneil_se(auc: float, n_pos: int, n_neg: int) -> float:
    """Hanley & McNeil (1982) standard error of an AUC over ``n_pos`` positives and ``n_neg`` negatives."""
    if n_pos < 1 or n_neg < 1:
        return float("nan")
    q1, q2 = auc / (2 - auc), 2 * auc * auc / (1 + auc)
    var = (auc * (1 - auc) + (n_pos - 1) * (q1 - auc * auc) + (n_neg - 1) * (q2 - auc * auc)) / (n_pos * n_neg)
    return math.sqrt(max(var, 0.0))


def _midrank(x):
    import numpy as np

    _, inverse, counts = np.unique(x, return_inverse=True, return_counts=True)
    ends = np.cumsum(counts)
    return (ends - (counts - 1) / 2.0)[inverse]


def delong(scores: Sequence[Any], labels: Any) -> tuple[list[float], Any]:
    """AUCs of several scorers on one labelled set and DeLong's covariance matrix of them (fast DeLong, midranks)."""
    import numpy as np

    y = np.asarray(labels).astype(bool).ravel()
    m, n = int(y.sum()), int((~y).sum())
    aucs, v01, v10 = [], [], []
    for s in scores:
        s = np.asarray(s, dtype=np.float64).ravel()
        pos, neg = s[y], s[~y]
        tz = _midrank(np.concatenate([pos, neg]))
        tx, ty = _midrank(pos), _midrank(neg)
        aucs.append(float((tz[:m].sum() - m * (m + 1) / 2.0) / (m * n)))
        v01.append((tz[:m] - tx) / n)
        v10.append(1.0 - (tz[m:] - ty) / m)
    cov = np.atleast_2d(np.cov(np.vstack(v01))) / m + np.atleast_2d(np.cov(np.vstack(v10))) / n
    return aucs, cov


def run_variant(name: str, picasso: bool, workdir: Path, *, fields: int = DEFAULTS["fields"],
                vocab: int = DEFAULTS["vocab"], steps: int = DEFAULTS["steps"],
                eval_samples: int = DEFAULTS["eval_samples"], micro_batch: Optional[int] = None,
                threads: int = 1, seed: int = 1234, timeout_s: float = 3600, lr: Optional[float] = None,
                sparse_opt: str = DEFAULTS["sparse_opt"], sparse_lr: Optional[float] = None,
                optimizer: str = DEFAULTS["optimizer"], extra: Sequence[str] = ()) -> dict[str, Any]:
    """Train one variant in a fresh process; its summary plus wall and process CPU time, load and AUC SE."""
    import numpy as np

    config = write_config(workdir / f"{name}.json", picasso, micro_batch, lr=lr, sparse_opt=sparse_opt,
                          sparse_lr=sparse_lr, optimizer=optimizer)
    cfg = json.loads(config.read_text())
    out = workdir / name
    cmd = train_command(config, out, fields, vocab, steps, eval_samples, threads, seed, extra)
    cpu_json = workdir / f"{name}_cpu.json"
    child_cmd = [sys.executable, str(Path(__file__).resolve()), "--child", str(cpu_json),
                 *(["--same-init"] if optimizer == "sgd" else []), "--", *cmd[2:]]
    env = {**os.environ, "WANDB_MODE": "disabled", "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": str(threads)}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    with LoadSampler() as load:
        proc = subprocess.run(child_cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise RuntimeError(f"{name}: train_rec exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    summary = json.loads((out / "summary.json").read_text())
    cpu = json.loads(cpu_json.read_text())
    scores_path = cpu_json.with_suffix(".npz")
    n_pos = n_neg = None
    if scores_path.exists():
        labels = np.load(scores_path)["labels"]
        n_pos = int((labels > 0.5).sum())
        n_neg = int(labels.size - n_pos)
    se = (lambda a: hanley_mcneil_se(a, n_pos, n_neg) if n_pos is not None and a is not None else None)
    return {
        "variant": name,
        "picasso": picasso,
        "seed": seed,
        "fields": fields,
        "vocab": vocab,
        "dense_optimizer": cfg["optimizer"]["type"],
        "dense_lr": float(cfg["optimizer"]["params"]["lr"]),
        "sparse_optimizer": cfg.get("picasso", {}).get("optimizer"),
        "steps": summary["steps"],
        "samples": summary["samples"],
        "samples_per_s": summary["samples_per_s"],
        "train_time_s": summary["train_time_s"],
        "train_cpu_s": cpu["train_cpu_s"],
        "samples_per_cpu_s": cpu["samples_per_cpu_s"],
        "auc": summary["auc"],
        "auc_se": se(summary["auc"]),
        "log_loss": summary["log_loss"],
        "bayes_auc": summary.get("bayes_auc"),
        "bayes_auc_se": se(summary.get("bayes_auc")),
        "bayes_log_loss": summary.get("bayes_log_loss"),
        "eval_samples": summary["eval_samples"],
        "eval_positives": n_pos,
        "scores": str(scores_path) if scores_path.exists() else None,
        "process_wall_s": wall,
        "process_cpu_s": (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime),
        **load.summary(),
        "command": " ".join(shlex.quote(c) for c in cmd),
    }


def paired(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per seed with both variants: on/off speed and the AUC difference with DeLong's paired SE (same held-out set)."""
    import numpy as np

    out = []
    for seed in dict.fromkeys(r["seed"] for r in rows):
        off = [r for r in rows if r["seed"] == seed and r["variant"] == "off"]
        on = [r for r in rows if r["seed"] == seed and r["variant"] == "on"]
        if not off or not on:
            continue
        off, on = off[0], on[0]
        pair = {"seed": seed, "speed": on["samples_per_s"] / off["samples_per_s"],
                "speed_cpu": on["samples_per_cpu_s"] / off["samples_per_cpu_s"],
                "auc_diff": on["auc"] - off["auc"], "auc_diff_se": None}
        if off.get("scores") and on.get("scores") and Path(off["scores"]).exists() and Path(on["scores"]).exists():
            a, b = np.load(off["scores"]), np.load(on["scores"])
            if np.array_equal(a["labels"], b["labels"]):  # same seed: the same held-out samples
                aucs, cov = delong([b["scores"], a["scores"]], a["labels"])
                pair["auc_diff_se"] = float(math.sqrt(max(cov[0, 0] + cov[1, 1] - 2 * cov[0, 1], 0.0)))
                pair["auc_diff"] = aucs[0] - aucs[1]
        out.append(pair)
    return out


def _median(rows: list[dict[str, Any]], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def _f(v: Optional[float], fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def _diff(v: Optional[float], sign: str = "+") -> str:
    """An AUC difference or SE: 4 decimals, or 2 significant digits when it is below 1e-4 (same-arithmetic runs)."""
    if v is None:
        return "-"
    return format(v, f"{sign}.4f") if v == 0 or abs(v) >= 1e-4 else format(v, f"{sign}.1e")


def format_table(rows: list[dict[str, Any]], pairs: Optional[list[dict[str, Any]]] = None) -> str:
    """Markdown: one line per variant (medians over runs), one per run, one per seed pair, then the verdict."""
    head = ["picasso", "runs", "steps", "samples/s (wall, median)", "samples/s (each run)",
            "samples per train-loop CPU s (median)", "AUC (each run)", "log loss (each run)",
            "teacher AUC (each run)", "process wall s (median)", "process CPU s (median)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    by = {v: [r for r in rows if r["variant"] == v] for v in ("off", "on")}
    for v, rs in by.items():
        if not rs:
            continue
        lines.append("| " + " | ".join([
            v, str(len(rs)), str(rs[0]["steps"]), f"{_median(rs, 'samples_per_s'):,.0f}",
            ", ".join(f"{r['samples_per_s']:,.0f}" for r in rs), f"{_median(rs, 'samples_per_cpu_s'):,.0f}",
            " / ".join(f"{r['auc']:.4f}" for r in rs), " / ".join(f"{r['log_loss']:.4f}" for r in rs),
            " / ".join(_f(r.get("bayes_auc"), ".4f") for r in rs),
            f"{_median(rs, 'process_wall_s'):.0f}", f"{_median(rs, 'process_cpu_s'):.0f}",
        ]) + " |")
    head2 = ["picasso", "seed", "samples/s", "samples per train-loop CPU s", "AUC", "AUC SE (H-M)", "log loss",
             "teacher AUC", "teacher log loss", "eval samples (positives)", "load avg min-mean-max",
             "process wall s"]
    lines += ["", "| " + " | ".join(head2) + " |", "|" + "---|" * len(head2)]
    for r in rows:
        load = (f"{r['load_min']:.1f}-{r['load_mean']:.1f}-{r['load_max']:.1f}"
                if r.get("load_mean") is not None else "-")
        lines.append("| " + " | ".join([
            r["variant"], str(r["seed"]), f"{r['samples_per_s']:,.0f}", f"{r['samples_per_cpu_s']:,.0f}",
            f"{r['auc']:.4f}", _f(r.get("auc_se"), ".4f"), f"{r['log_loss']:.4f}", _f(r.get("bayes_auc"), ".4f"),
            _f(r.get("bayes_log_loss"), ".4f"),
            f"{r['eval_samples']:,.0f} ({r['eval_positives']:,})" if r.get("eval_positives") is not None
            else f"{r['eval_samples']:,.0f}",
            load, f"{r['process_wall_s']:.0f}",
        ]) + " |")
    if pairs is None:
        pairs = paired(rows)
    if pairs:
        head3 = ["seed", "on/off samples/s", "on/off per train-loop CPU s", "AUC on - off", "paired SE (DeLong)",
                 "within noise: abs(diff) <= max(2 SE, 0.001)"]
        lines += ["", "| " + " | ".join(head3) + " |", "|" + "---|" * len(head3)]
        for p in pairs:
            se = p.get("auc_diff_se")
            ok = "-" if se is None else ("yes" if abs(p["auc_diff"]) <= max(2 * se, 0.001) else "no")
            lines.append("| " + " | ".join([str(p["seed"]), f"{p['speed']:.2f}x", f"{p['speed_cpu']:.2f}x",
                                            _diff(p["auc_diff"]), _diff(se, ""), ok]) + " |")
    if by["off"] and by["on"]:
        speed = _median(by["on"], "samples_per_s") / _median(by["off"], "samples_per_s")
        speed_cpu = _median(by["on"], "samples_per_cpu_s") / _median(by["off"], "samples_per_cpu_s")
        dauc = statistics.fmean(p["auc_diff"] for p in pairs) if pairs else \
            _median(by["on"], "auc") - _median(by["off"], "auc")
        lines.append("")
        lines.append(f"on/off samples/s: **{speed:.2f}x** wall, **{speed_cpu:.2f}x** per training-loop CPU second "
                     f"(target >= 2x; medians); AUC on - off: {_diff(dauc)} (mean over seeds).")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> None:
    raw = list(sys.argv[1:] if argv is None else argv)
    if raw[:1] == ["--child"]:  # internal: --child OUT_JSON [--same-init] -- TRAIN_REC_ARGS (see run_variant)
        same_init = raw[2] == "--same-init"
        child(raw[1], raw[raw.index("--") + 1:], same_init=same_init)
        return
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--fields", type=int, default=DEFAULTS["fields"])
    p.add_argument("--vocab", type=int, default=DEFAULTS["vocab"], help="rows per field")
    p.add_argument("--steps", type=int, default=DEFAULTS["steps"])
    p.add_argument("--eval-samples", type=int, default=DEFAULTS["eval_samples"])
    p.add_argument("--micro-batch", type=int, default=None, help="default: the config's (256)")
    p.add_argument("--lr", type=float, default=DEFAULTS["lr"],
                   help="AdamW lr and schedule peak of ds_configs/demo_cpu.json for both variants (its own: 0.003)")
    p.add_argument("--sparse-opt", default=DEFAULTS["sparse_opt"], choices=["sgd", "rowwise_adagrad", "adam"],
                   help="the picasso tables' fused optimizer (on)")
    p.add_argument("--sparse-lr", type=float, default=None, help="the picasso tables' lr (default: --lr)")
    p.add_argument("--optimizer", default=DEFAULTS["optimizer"], choices=["adamw", "sgd"],
                   help="adamw: each side its own optimizer (dense AdamW vs --sparse-opt); sgd: plain SGD on both "
                        "sides, no clipping, same initial weights (the same-arithmetic comparison)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seeds", type=int, nargs="+", default=[1234], help="one off/on pair per seed, in turn")
    p.add_argument("--only", choices=["off", "on"], default=None, help="run one variant only")
    p.add_argument("--workdir", default=None, help="default: a temporary folder (removed)")
    p.add_argument("--no-results", action="store_true", help="do not write benchmarks/RESULTS.md")
    p.add_argument("--json", default=str(Path(__file__).resolve().parent / "rec_e2e_results.json"))
    args = p.parse_args(argv)
    argv_used = argv if argv is not None else sys.argv[1:]

    tmp = tempfile.TemporaryDirectory(prefix="rec_e2e_") if args.workdir is None else None
    workdir = Path(args.workdir or tmp.name)
    variants = [(n, pc) for n, pc in (("off", False), ("on", True)) if args.only in (None, n)]
    meta = {"argv": argv_used, "machine": platform.machine(), "cpus": os.cpu_count(),
            "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    t0 = time.perf_counter()
    rows: list[dict[str, Any]] = []
    pairs: list[dict[str, Any]] = []

    def dump() -> None:
        if args.json:
            Path(args.json).write_text(json.dumps({"meta": meta, "runs": rows, "pairs": pairs}, indent=1))

    try:
        with LoadSampler(every_s=30.0) as load:
            for seed in args.seeds:
                for name, picasso in variants:
                    row = run_variant(name, picasso, workdir / f"seed{seed}", fields=args.fields, vocab=args.vocab,
                                      steps=args.steps, eval_samples=args.eval_samples,
                                      micro_batch=args.micro_batch, threads=args.threads, seed=seed, lr=args.lr,
                                      sparse_opt=args.sparse_opt, sparse_lr=args.sparse_lr,
                                      optimizer=args.optimizer)
                    rows.append(row)
                    print(f"seed {seed} {name}: {row['samples_per_s']:,.0f} samples/s, AUC {row['auc']:.4f} "
                          f"(SE {_f(row['auc_se'], '.4f')}, teacher {_f(row['bayes_auc'], '.4f')}), log loss "
                          f"{row['log_loss']:.4f}, wall {row['process_wall_s']:.0f}s cpu {row['process_cpu_s']:.0f}s, "
                          f"load {_f(row['load_mean'], '.1f')}", flush=True)
                    pairs[:] = paired(rows)
                    dump()
        meta.update(total_s=time.perf_counter() - t0, finished=time.strftime("%Y-%m-%d %H:%M:%S"),
                    **{f"bench_{k}": v for k, v in load.summary().items()})
        for r in rows:
            r.pop("scores", None)  # temporary files
        dump()
    finally:
        if tmp is not None:
            tmp.cleanup()
    table = format_table(rows, pairs)
    print(table)
    if args.no_results:
        return
    from embedding import write_section  # benchmarks/embedding.py

    import torch

    micro = args.micro_batch or json.loads(BASE_CONFIG.read_text())["train_micro_batch_size_per_gpu"]
    on_cfg = job_config(True, args.micro_batch, lr=args.lr, sparse_opt=args.sparse_opt, sparse_lr=args.sparse_lr,
                        optimizer=args.optimizer)
    cmd = " ".join([".venv/bin/python benchmarks/rec_e2e.py", *argv_used]).strip()
    if args.optimizer == "sgd":
        setup = f"""`ds_configs/demo_cpu.json` (ZeRO 1, linear warm-up over 100 steps then linear decay to 0 at the last
step, micro-batch {micro}) with wandb off, its AdamW replaced by `{json.dumps(on_cfg["optimizer"])}`, gradient
clipping 0 and the schedule peak {args.lr:g}; "on" adds `"picasso": {json.dumps(on_cfg["picasso"])}`. Off: one
`nn.EmbeddingBag` per field (deep, dim 16, and wide, dim 1), dense gradients, every parameter updated by
DeepSpeed's SGD. On: packed tables with picasso's fused SGD at DeepSpeed's lr of each step; dense layers
the same DeepSpeed SGD. Both start from the same weights (the benchmark's child builds off's model from the
same RNG state and copies it into the packed tables). Plain SGD moves only the rows a batch touches, so the
two variants compute the same updates and differ by float rounding order only: this isolates packing and
the fused kernels from the choice of optimizer."""
        section = SAME_MATH_SECTION
    else:
        setup = f"""`ds_configs/demo_cpu.json` (AdamW, ZeRO 1, gradient clipping 1.0, linear warm-up over 100 steps then
linear decay to 0 at the last step, micro-batch {micro}) with wandb off and the AdamW lr and schedule peak set
to {args.lr:g}; "on" adds `"picasso": {json.dumps(on_cfg["picasso"])}`. Off: one `nn.EmbeddingBag` per field
(deep, dim 16, and wide, dim 1), dense gradients, tables updated by DeepSpeed's AdamW with the dense layers.
On: packed tables with the fused sparse optimizer (applied at the DeepSpeed step boundary, constant lr:
DeepSpeed's schedule and clipping cover the dense layers only); dense layers AdamW."""
        section = SECTION
    body = f"""Command: `{cmd}` ({platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, 1 rank,
{args.threads} torch thread; {meta['started']} to {meta['finished']}, {meta['total_s'] / 60:.1f} min
for all runs; 1-minute load average over the whole benchmark min {_f(meta['bench_load_min'], '.1f')}, mean
{_f(meta['bench_load_mean'], '.1f')}, max {_f(meta['bench_load_max'], '.1f')}, per run in the second table).

Each run is `launch/train_rec.py --config TMP.json --fields {args.fields} --vocab {args.vocab} --steps {args.steps}
--eval-samples {args.eval_samples} --threads {args.threads} --seed SEED` in a fresh process, TMP.json being
{setup} Synthetic data: Zipf(1.1) ids, 1-3 ids per field, 13 dense features, planted teacher (its own draw
per seed); one seed gives both variants the same training stream and the same held-out set. samples/s is
train_rec's (training loop only, batch generation included); AUC is exact over the held-out set; "AUC SE
(H-M)" is Hanley-McNeil's; the paired SE of on - off is DeLong's over the two runs' scores on that set.
"samples per train-loop CPU s": train_rec runs in-process under a wrapper (`rec_e2e.py --child`) that takes
the main thread's `time.thread_time()` over `train()` minus start-up, stream set-up, eval, checkpointing
and wandb shutdown. Seeds run in turn, off then on.

{table}"""
    write_section(RESULTS, section, body, title=f"{meta['started'][:16]}, benchmarks/rec_e2e.py")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
