"""Quality at equal compute: dense, top-1, top-k and expert prototyping (k top-1) on real text, over seeds and sizes.

Trains the byte-level LM of :mod:`moe_proto.models` once per (corpus, size, variant, seed)
with plain torch AdamW in single-threaded worker processes (a pool of ``--workers``), so a
run's result depends on its seed alone, not on scheduling. Every variant of a size sees the
same tokens in the same order for a given seed (the seed sets both the init and the data
order) and has the same number of experts. ``P=k`` (k prototypes, top-1 in each) routes k
times per token, the expert FLOPs of ``top-k``; the table states routes and expert FLOPs
per token. Held-out bits/byte are measured on files that training never sees
(:class:`moe_proto.data.ByteCorpus` splits by file), on windows spread evenly over the
whole held-out stream. Per-run results go to ``moe_quality_results.json`` (runs already
there with the same settings are reused), so ``--from-json`` rebuilds the tables without
training.

    python benchmarks/moe_quality.py --steps 300 --seeds 1 2 3 --workers 2 --no-write   # trains what is missing
    python benchmarks/moe_quality.py --steps 300 --seeds 1 2 3 --from-json   # tables to RESULTS.md, no training
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import dataclasses
import json
import math
import multiprocessing as mp
import os
import shlex
import statistics
import sys
import sysconfig
import time
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

import moe_proto
from moe_proto.data import ByteCorpus
from moe_proto.models import MoETransformerArgs, MoETransformerLM

HERE = Path(__file__).resolve().parent
AUX_FREE_RATE = 1e-3  # the expert-bias step of aux-loss-free balancing

VARIANTS: Dict[str, dict] = {  # name -> MoE overrides of the size's base args (experts set from --experts)
    "dense": dict(num_experts=0),
    "top-1": dict(num_prototypes=1, top_k=1),
    "top-2": dict(num_prototypes=1, top_k=2),
    "top-4": dict(num_prototypes=1, top_k=4),
    "P=2": dict(num_prototypes=2, top_k=1),
    "P=4": dict(num_prototypes=4, top_k=1),
    # Aux-loss-free: per-expert routing biases nudged toward balance after each step, no aux loss.
    "P=2 aux-free": dict(num_prototypes=2, top_k=1, expert_bias_update_rate=AUX_FREE_RATE, aux_loss_coef=0.0),
}
PAIRS = [("P=2", "top-2"), ("P=4", "top-4"), ("P=2 aux-free", "P=2"), ("top-1", "dense")]  # (a, b): a - b
DEFAULT_SIZES = ["small=2x64x256", "large=4x96x384"]  # NAME=LAYERSxD_MODELxFFN (each expert as wide as the FFN)


def default_corpora() -> List[str]:
    """English prose (Vim's help files) and source code (this interpreter's stdlib, top level)."""
    return ["vim-docs=/usr/share/vim/vim90/doc:*.txt", f"python-stdlib={sysconfig.get_paths()['stdlib']}:*.py"]


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """Everything that determines one run's result (its identity in the results file)."""

    corpus: str
    corpus_path: str
    glob: str
    size: str
    layers: int
    d_model: int
    ffn: int
    variant: str
    seed: int
    steps: int
    micro_batch: int
    seq_len: int
    lr: float
    experts: int
    eval_tokens: int
    heldout_fraction: float

    def key(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    def model_args(self) -> MoETransformerArgs:
        base = MoETransformerArgs(num_layers=self.layers, d_model=self.d_model, num_heads=max(1, self.d_model // 32),
                                  ffn_hidden_size=self.ffn, max_seq_len=self.seq_len, moe_every=2,
                                  num_experts=self.experts, capacity_factor=1.25, eval_capacity_factor=2.0,
                                  aux_loss_coef=0.01)
        return base.replace(**VARIANTS[self.variant])


def _named(entries: Sequence[str], what: str) -> Dict[str, str]:
    """``["a=x", "b=y"]`` -> ``{"a": "x", "b": "y"}``, with an error naming a malformed entry."""
    out = {}
    for entry in entries:
        name, sep, value = entry.partition("=")
        if not sep or not name or not value:
            raise SystemExit(f"{what} entry {entry!r} is not NAME=VALUE")
        out[name] = value
    return out


def parse_sizes(entries: Sequence[str]) -> Dict[str, Tuple[int, int, int]]:
    """``["small=2x64x256"]`` -> ``{"small": (layers, d_model, ffn)}``."""
    sizes = {}
    for name, value in _named(entries, "--sizes").items():
        parts = value.split("x")
        if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise SystemExit(f"--sizes {name}={value}: expected LAYERSxD_MODELxFFN, e.g. 4x128x512")
        sizes[name] = tuple(int(p) for p in parts)
    return sizes


def parse_steps(entries: Sequence[str], sizes: Sequence[str]) -> Dict[str, int]:
    """``["300"]`` (every size) or ``["small=600", "large=300"]`` -> steps per size."""
    if len(entries) == 1 and entries[0].isdigit():
        return {s: int(entries[0]) for s in sizes}
    steps = {k: v for k, v in _named(entries, "--steps").items()}
    missing = [s for s in sizes if s not in steps]
    unknown = [s for s in steps if s not in sizes]
    if missing or unknown or not all(v.isdigit() and int(v) > 0 for v in steps.values()):
        raise SystemExit(f"--steps {' '.join(entries)}: need a positive NAME=STEPS for each size {list(sizes)}"
                         f"{f', unknown {unknown}' if unknown else ''}")
    return {s: int(steps[s]) for s in sizes}


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--corpora", nargs="+", default=default_corpora(), help="NAME=FOLDER:GLOB entries")
    p.add_argument("--sizes", nargs="+", default=DEFAULT_SIZES, help="NAME=LAYERSxD_MODELxFFN entries")
    p.add_argument("--steps", nargs="+", default=["300"], help="STEPS for all sizes or NAME=STEPS per size")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3])
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--eval-tokens", type=int, default=65_536, help="held-out tokens, in windows spread evenly")
    p.add_argument("--heldout-fraction", type=float, default=0.1, help="share of files held out (by path hash)")
    p.add_argument("--workers", type=int, default=2, help="worker processes, one intra-op thread each")
    p.add_argument("--json", default=str(HERE / "moe_quality_results.json"))
    p.add_argument("--from-json", action="store_true", help="build the tables from --json, train nothing")
    p.add_argument("--results", default=str(HERE / "RESULTS.md"))
    p.add_argument("--no-write", action="store_true", help="print the tables, leave RESULTS.md alone")
    return p.parse_args(argv)


def build_specs(ns: argparse.Namespace) -> List[RunSpec]:
    sizes = parse_sizes(ns.sizes)
    steps = parse_steps(ns.steps, list(sizes))
    specs = []
    for cname, value in _named(ns.corpora, "--corpora").items():
        folder, sep, glob = value.rpartition(":")
        if not sep or not folder or not glob:
            raise SystemExit(f"--corpora {cname}={value}: expected NAME=FOLDER:GLOB")
        for sname, (layers, d_model, ffn) in sizes.items():
            for variant in ns.variants:
                for seed in ns.seeds:
                    specs.append(RunSpec(cname, folder, glob, sname, layers, d_model, ffn, variant, seed,
                                         steps[sname], ns.micro_batch, ns.seq_len, ns.lr, ns.experts,
                                         ns.eval_tokens, ns.heldout_fraction))
    return specs


_CORPORA: Dict[Tuple[str, str, float], ByteCorpus] = {}  # per worker process: each corpus is read once


def load_corpus(path: str, glob: str, heldout_fraction: float) -> ByteCorpus:
    key = (path, glob, heldout_fraction)
    if key not in _CORPORA:
        _CORPORA[key] = ByteCorpus.from_folder(path, glob, heldout_fraction=heldout_fraction)
    return _CORPORA[key]


def spread_eval_batches(heldout: torch.Tensor, seq_len: int, micro_batch: int,
                        max_tokens: int) -> Iterator[Tuple[torch.Tensor, torch.Tensor]]:
    """Full ``seq_len`` windows spread evenly over the held-out stream, at most ``max_tokens`` predicted tokens.

    Evenly spread so the score covers every held-out file, not only the first one.
    """
    windows = (heldout.numel() - 1) // seq_len
    if windows < 1:
        raise ValueError(f"held-out split has {heldout.numel()} tokens, fewer than one window of {seq_len + 1}")
    n = max(1, min(windows, max_tokens // seq_len))
    starts = torch.tensor([(i * windows // n) * seq_len for i in range(n)])
    offsets = torch.arange(seq_len + 1)
    for i in range(0, n, micro_batch):
        rows = heldout[starts[i:i + micro_batch, None] + offsets].long()
        yield rows[:, :-1], rows[:, 1:]


def evaluate(model: MoETransformerLM, batches: Iterator[Tuple[torch.Tensor, torch.Tensor]]) -> Dict[str, float]:
    """Held-out loss (nats/token) and, for MoE, the eval drop rate and load balance (max / mean expert load)."""
    model.eval()
    total, count = 0.0, 0
    layers = model.moe_layers()
    routed = [torch.zeros(model.args.num_experts, dtype=torch.float64) for _ in layers]
    kept = [0.0 for _ in layers]
    with torch.no_grad():
        for tokens, targets in batches:
            logits = model(tokens).logits.float()
            total += F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1), reduction="sum").item()
            count += targets.numel()
            for i, m in enumerate(layers):
                routed[i] += m.last_stats.routed_per_expert.double()
                kept[i] += float(m.last_stats.tokens_per_expert.sum())
    model.train()
    out = {"eval_loss": total / count}
    if layers:
        out["eval_drop_rate"] = statistics.fmean(1.0 - k / float(r.sum()) for k, r in zip(kept, routed))
        out["eval_load_max_over_mean"] = [float(r.max() / r.mean()) for r in routed]
    return out


def ffn_flops_per_token(args: MoETransformerArgs) -> int:
    """Forward FLOPs per token of the FFNs in the MoE positions (every ``moe_every``-th block), routers excluded."""
    mats = 3 if args.activation == "swiglu" else 2
    moe_positions = sum((i + 1) % args.moe_every == 0 for i in range(args.num_layers))
    routes = args.num_prototypes * args.top_k if args.num_experts else 1
    width = args.expert_ffn if args.num_experts else args.ffn_hidden_size
    return moe_positions * routes * mats * 2 * args.d_model * width


def machine() -> str:
    """The CPU model (lscpu's "Model name", from /proc/cpuinfo) and the core count."""
    info = Path("/proc/cpuinfo")
    lines = info.read_text().splitlines() if info.exists() else []
    model = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), "unknown CPU")
    return f"{model}, {os.cpu_count()} cores"


def run_one(spec: RunSpec) -> dict:
    """Train and evaluate one run in this process (one intra-op thread); deterministic per spec."""
    torch.set_num_threads(1)
    cpu0, wall0 = time.process_time(), time.perf_counter()
    corpus = load_corpus(spec.corpus_path, spec.glob, spec.heldout_fraction)
    args = spec.model_args()
    aux_free = getattr(args, "expert_bias_update_rate", 0.0) > 0
    torch.manual_seed(spec.seed)
    model = MoETransformerLM(args)
    opt = torch.optim.AdamW(model.parameters(), lr=spec.lr, betas=(0.9, 0.95), weight_decay=0.0)
    warmup = max(1, spec.steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, spec.steps) / spec.steps)))
    batches = corpus.train_batches(spec.seq_len, spec.micro_batch, seed=spec.seed)
    layers = model.moe_layers()
    curve, drops = [], []
    for step in range(spec.steps):
        tokens, targets = next(batches)
        out = model(tokens, targets)
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if aux_free:
            moe_proto.update_expert_biases(model)
        sched.step()
        if layers and step >= spec.steps * 4 // 5:  # the drop rate once routing has settled: last 20% of steps
            drops.append(statistics.fmean(float(m.last_stats.drop_rate) for m in layers))
        if (step + 1) % max(1, spec.steps // 10) == 0:
            curve.append([step + 1, out.ce_loss.item()])
    result = evaluate(model, spread_eval_batches(corpus.heldout, spec.seq_len, spec.micro_batch, spec.eval_tokens))
    expert_params = sum(p.numel() for m in layers for p in m.experts.parameters())
    result.update(
        bpb=result["eval_loss"] / math.log(2), params=sum(p.numel() for p in model.parameters()),
        expert_params=expert_params, routes_per_token=args.num_prototypes * args.top_k if layers else 0,
        ffn_flops_per_token=ffn_flops_per_token(args), train_curve=curve,
        train_drop_rate=statistics.fmean(drops) if drops else 0.0,
        eval_windows_tokens=sum(1 for _ in spread_eval_batches(corpus.heldout, spec.seq_len, 1, spec.eval_tokens))
        * spec.seq_len,
        corpus_bytes={"train": corpus.train.numel(), "heldout": corpus.heldout.numel(),
                      "train_files": len(corpus.train_files), "heldout_files": len(corpus.heldout_files)},
        cpu_s=time.process_time() - cpu0, wall_s=time.perf_counter() - wall0, machine=machine())
    return result


def load_results(path: Path) -> dict:
    if not path.exists():
        return {"runs": {}, "commands": []}
    data = json.loads(path.read_text())
    if not isinstance(data, dict) or not isinstance(data.get("runs"), dict):
        raise SystemExit(f"{path} is not a moe_quality results file (expected an object with a 'runs' object)")
    data.setdefault("commands", [])
    return data


def save_results(path: Path, data: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    tmp.replace(path)  # atomic: an interrupted save never leaves half a file


def run_all(specs: Sequence[RunSpec], data: dict, path: Path, workers: int) -> None:
    """Run the specs missing from ``data`` on ``workers`` spawned processes, saving after each run."""
    todo = [s for s in specs if s.key() not in data["runs"]]
    print(f"{len(specs) - len(todo)} of {len(specs)} runs already in {path}; {len(todo)} to run", flush=True)
    # Expensive runs first so the pool's two queues finish close together.
    todo.sort(key=lambda s: -s.steps * s.layers * s.d_model * s.ffn * max(1, VARIANTS[s.variant].get("top_k", 1)
                                                                          * VARIANTS[s.variant].get("num_prototypes", 1)))
    if not todo:
        return
    with cf.ProcessPoolExecutor(max_workers=workers, mp_context=mp.get_context("spawn")) as pool:
        futures = {pool.submit(run_one, s): s for s in todo}
        for done, fut in enumerate(cf.as_completed(futures), 1):
            spec = futures[fut]
            result = fut.result()
            data["runs"][spec.key()] = {"spec": dataclasses.asdict(spec), "result": result}
            save_results(path, data)
            print(f"[{done}/{len(todo)}] {spec.corpus} {spec.size} {spec.variant} seed {spec.seed}: "
                  f"{result['bpb']:.4f} bits/byte, {result['cpu_s']:.0f} s CPU", flush=True)


def mean_se(values: Sequence[float]) -> Tuple[float, float]:
    """Mean and standard error (sample standard deviation / sqrt(n); 0 for one value)."""
    mean = statistics.fmean(values)
    return mean, (statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else 0.0)


def verdict(mean: float, se: float) -> str:
    """The reading of a difference: distinguishable only beyond 2 standard errors (the ratio is shown)."""
    ratio = f"{abs(mean) / se:.1f} s.e." if se > 0 else "no spread"
    if se > 0 and abs(mean) <= 2 * se:
        return f"not distinguishable (within 2 s.e.: {ratio})"
    return f"{'lower (better)' if mean < 0 else 'higher (worse)'}, {ratio}"


def format_tables(specs: Sequence[RunSpec], data: dict) -> str:
    """The per-(corpus, size) quality tables and the paired-difference table."""
    groups: Dict[Tuple[str, str], Dict[str, Dict[int, dict]]] = {}
    for s in specs:
        groups.setdefault((s.corpus, s.size), {}).setdefault(s.variant, {})[s.seed] = data["runs"][s.key()]["result"]
    out = []
    for (corpus, size), variants in groups.items():
        first = next(iter(next(iter(variants.values())).values()))
        spec0 = next(s for s in specs if s.corpus == corpus and s.size == size)
        cb = first["corpus_bytes"]
        cpu = sum(r["cpu_s"] for v in variants.values() for r in v.values())
        out.append(f"**{corpus}, {size}** ({spec0.layers} layers, d_model {spec0.d_model}, ffn {spec0.ffn}; "
                   f"{spec0.steps} steps x {spec0.micro_batch} x {spec0.seq_len} = "
                   f"{spec0.steps * spec0.micro_batch * spec0.seq_len:,} training tokens per run; training split "
                   f"{cb['train_files']} files / {cb['train']:,} bytes, held-out {cb['heldout_files']} files / "
                   f"{cb['heldout']:,} bytes, {first['eval_windows_tokens']:,} held-out tokens scored; "
                   f"{cpu / 60:.1f} min CPU for these runs)\n")
        out.append("| variant | routes/token | FFN MFLOP/token (fwd, MoE positions) | params | expert params "
                   "| held-out bits/byte (mean +- s.e.) | per seed | train drop rate | eval load max/mean |")
        out.append("|---|---:|---:|---:|---:|---:|---|---:|---:|")
        for variant, seeds in variants.items():
            rs = [seeds[k] for k in sorted(seeds)]
            m, se = mean_se([r["bpb"] for r in rs])
            load = (f"{statistics.fmean(statistics.fmean(r['eval_load_max_over_mean']) for r in rs):.2f}"
                    if "eval_load_max_over_mean" in rs[0] else "-")
            drop = f"{statistics.fmean(r['train_drop_rate'] for r in rs):.3f}" if rs[0]["routes_per_token"] else "-"
            per_seed = " / ".join(f"{r['bpb']:.4f}" for r in rs)
            out.append(f"| {variant} | {rs[0]['routes_per_token'] or '1 (dense)'} | "
                       f"{rs[0]['ffn_flops_per_token'] / 1e6:.3f} | {rs[0]['params']:,} | {rs[0]['expert_params']:,} "
                       f"| {m:.4f} +- {se:.4f} | {per_seed} | {drop} | {load} |")
        out.append("")
    out.append("Paired differences in held-out bits/byte (same seed: same init seed and token order), a - b:\n")
    out.append("| corpus | size | a - b | per seed | mean +- s.e. | reading |")
    paired: Dict[Tuple[str, str, str, str], Tuple[float, float]] = {}
    out.append("|---|---|---|---|---:|---|")
    for (corpus, size), variants in groups.items():
        for a, b in PAIRS:
            if a not in variants or b not in variants:
                continue
            seeds = sorted(set(variants[a]) & set(variants[b]))
            diffs = [variants[a][k]["bpb"] - variants[b][k]["bpb"] for k in seeds]
            m, se = mean_se(diffs)
            paired[(corpus, size, a, b)] = (m, se)
            out.append(f"| {corpus} | {size} | {a} - {b} | {' / '.join(f'{d:+.4f}' for d in diffs)} | "
                       f"{m:+.4f} +- {se:.4f} | {verdict(m, se)} |")
    sizes = list(dict.fromkeys(size for _, size in groups))
    if len(sizes) > 1:
        # The paper's "more effective in larger models": does the paired gain grow from the first size to the last?
        out.append(f"\nChange of each paired difference from {sizes[0]} to {sizes[-1]} (negative: a gains more "
                   "over b in the larger model; s.e. combined as independent):\n")
        out.append(f"| corpus | a - b | {sizes[0]} | {sizes[-1]} | {sizes[-1]} - {sizes[0]} | reading |")
        out.append("|---|---|---:|---:|---:|---|")
        for (corpus, size, a, b), (m0, se0) in paired.items():
            if size != sizes[0] or (corpus, sizes[-1], a, b) not in paired:
                continue
            m1, se1 = paired[(corpus, sizes[-1], a, b)]
            d, se = m1 - m0, math.hypot(se0, se1)
            out.append(f"| {corpus} | {a} - {b} | {m0:+.4f} | {m1:+.4f} | {d:+.4f} +- {se:.4f} | {verdict(d, se)} |")
    return "\n".join(out)


def append_results(path: Path, commands: Sequence[str], setup: str, tables: str) -> None:
    """Append a dated section to RESULTS.md, keeping every other section."""
    text = path.read_text() if path.exists() else "# Benchmark results\n"
    cmds = "\n".join(commands)
    section = (f"\n## MoE LM quality at equal compute, 3 seeds x 2 sizes x 2 corpora (benchmarks/moe_quality.py, "
               f"{time.strftime('%Y-%m-%d %H:%M')})\n\n```\n{cmds}\n```\n\n{setup}\n\n{tables}\n")
    path.write_text(text.rstrip("\n") + "\n" + section)


def main(argv: Optional[List[str]] = None) -> None:
    ns = parse_args(argv)
    specs = build_specs(ns)
    path = Path(ns.json)
    data = load_results(path)
    command = "python " + " ".join(shlex.quote(a) for a in [sys.argv[0] if argv is None else "benchmarks/moe_quality.py",
                                                           *(sys.argv[1:] if argv is None else argv)])
    needs_bias = sorted({s.variant for s in specs if "expert_bias_update_rate" in VARIANTS[s.variant]})
    if needs_bias and not ns.from_json and not hasattr(moe_proto, "update_expert_biases"):
        raise SystemExit(f"variants {needs_bias} need moe_proto.update_expert_biases (aux-loss-free balancing), "
                         "which this moe_proto lacks: leave them out of --variants")
    if ns.from_json:
        missing = [s for s in specs if s.key() not in data["runs"]]
        if missing:
            raise SystemExit(f"{len(missing)} of {len(specs)} runs are not in {path}, e.g. {missing[0]}: run "
                             "without --from-json first")
    else:
        if any(s.key() not in data["runs"] for s in specs) and command not in data["commands"]:
            data["commands"].append(command)
        run_all(specs, data, path, ns.workers)
    sizes = parse_sizes(ns.sizes)
    lines = []
    for sname, (layers, d_model, ffn) in sizes.items():
        spec = next(s for s in specs if s.size == sname)
        counts = {v: data["runs"][dataclasses.replace(spec, variant=v).key()]["result"] for v in ns.variants}
        lines.append(f"{sname}: " + ", ".join(f"{v} {r['params']:,} params ({r['expert_params']:,} in experts)"
                                              for v, r in counts.items()))
    runs = [data["runs"][s.key()]["result"] for s in specs]
    setup = (f"Machine: {runs[0]['machine']}; each run in one process with 1 intra-op thread, {ns.workers} at a "
             f"time. {ns.experts} experts in every 2nd block (each as wide as the dense FFN), capacity factor 1.25 "
             f"(eval 2.0), aux loss 0.01 (0 for aux-free, which steps expert biases by {AUX_FREE_RATE}), AdamW lr "
             f"{ns.lr} with 5% warmup and cosine decay, seeds {ns.seeds}. Corpora: "
             + "; ".join(f"{c} = {v}" for c, v in _named(ns.corpora, "--corpora").items())
             + ". Parameters per size: " + "; ".join(lines) + f". {sum(r['cpu_s'] for r in runs) / 60:.1f} min CPU "
             "in all.")
    tables = format_tables(specs, data)
    print(setup)
    print(tables)
    if not ns.no_write:
        append_results(Path(ns.results), data["commands"] + ([command] if ns.from_json else []), setup, tables)
        print(f"appended to {ns.results}")


if __name__ == "__main__":
    main()
