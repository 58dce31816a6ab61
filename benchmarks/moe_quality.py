"""Quality at equal tokens: dense vs top-1 vs top-2 vs expert prototyping (P=2, top-1 each) on real text.

Trains the byte-level LM of :mod:`moe_proto.models` four times from the same seed on the
same token stream (one process, plain torch AdamW, so the comparison has no launcher noise)
and tables held-out loss, bits per byte and training tokens/s. Top-2 and P=2 route every
token to two experts (same expert FLOPs); top-1 and dense have the FLOPs of one FFN.
Appends a section with the command and the table to benchmarks/RESULTS.md.

    python benchmarks/moe_quality.py --data /root/.pyenv/versions/3.11.7/lib/python3.11 --glob '*.py' --steps 600
"""
from __future__ import annotations

import argparse
import math
import shlex
import sys
import time
from pathlib import Path
from typing import Dict, List

import torch
import torch.nn.functional as F

from moe_proto.data import ByteCorpus
from moe_proto.models import MoETransformerArgs, MoETransformerLM

VARIANTS = {  # name -> MoE overrides of the base args
    "dense": dict(num_experts=0),
    "top-1": dict(num_experts=8, num_prototypes=1, top_k=1),
    "top-2": dict(num_experts=8, num_prototypes=1, top_k=2),
    "P=2 (top-1 each)": dict(num_experts=8, num_prototypes=2, top_k=1),
}


def parse_args(argv: List[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", default="/root/.pyenv/versions/3.11.7/lib/python3.11")
    p.add_argument("--glob", default="*.py")
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--ffn", type=int, default=512)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--eval-tokens", type=int, default=60_000)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--variants", nargs="*", default=list(VARIANTS))
    p.add_argument("--results", default=str(Path(__file__).resolve().parent / "RESULTS.md"))
    p.add_argument("--no-write", action="store_true", help="print the table only")
    return p.parse_args(argv)


def evaluate(model: MoETransformerLM, corpus: ByteCorpus, seq_len: int, micro_batch: int, max_tokens: int) -> float:
    """Mean held-out loss in nats per token."""
    model.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for tokens, targets in corpus.eval_batches(seq_len, micro_batch, max_tokens=max_tokens):
            logits = model(tokens).logits.float()
            total += F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1), reduction="sum",
                                     ignore_index=-100).item()
            count += int((targets != -100).sum())
    model.train()
    return total / count


def run_variant(name: str, base: MoETransformerArgs, corpus: ByteCorpus, ns: argparse.Namespace) -> Dict[str, float]:
    torch.manual_seed(ns.seed)
    model = MoETransformerLM(base.replace(**VARIANTS[name]))
    opt = torch.optim.AdamW(model.parameters(), lr=ns.lr, betas=(0.9, 0.95), weight_decay=0.0)
    warmup = max(1, ns.steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, ns.steps) / ns.steps)))
    batches = corpus.train_batches(ns.seq_len, ns.micro_batch, seed=ns.seed)
    train_time, last = 0.0, float("nan")
    for step in range(ns.steps):
        tokens, targets = next(batches)
        t0 = time.perf_counter()
        out = model(tokens, targets)
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        train_time += time.perf_counter() - t0
        last = out.ce_loss.item()
        if (step + 1) % max(1, ns.steps // 5) == 0:
            print(f"  {name}: step {step + 1}/{ns.steps} train loss {last:.3f}", flush=True)
    loss = evaluate(model, corpus, ns.seq_len, ns.micro_batch, ns.eval_tokens)
    drops = [float(m.last_stats.drop_rate) for m in model.moe_layers() if m.last_stats is not None]
    return {"params": sum(p.numel() for p in model.parameters()), "eval_loss": loss,
            "bpb": loss / math.log(2), "tokens_per_s": ns.steps * ns.micro_batch * ns.seq_len / train_time,
            "train_loss": last, "drop_rate": sum(drops) / len(drops) if drops else 0.0}


def format_table(rows: Dict[str, Dict[str, float]]) -> str:
    lines = ["| model | params | held-out loss (nats/byte) | bits/byte | last train loss | eval drop rate | tokens/s |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for name, r in rows.items():
        lines.append(f"| {name} | {r['params']:,} | {r['eval_loss']:.4f} | {r['bpb']:.4f} | {r['train_loss']:.4f} "
                     f"| {r['drop_rate']:.3f} | {r['tokens_per_s']:,.0f} |")
    return "\n".join(lines)


def append_results(path: Path, command: str, setup: str, table: str) -> None:
    """Append this run's section to RESULTS.md, keeping every other section."""
    text = path.read_text() if path.exists() else "# Benchmark results\n"
    section = (f"\n## MoE LM quality at equal tokens (benchmarks/moe_quality.py, {time.strftime('%Y-%m-%d %H:%M')})\n\n"
               f"```\n{command}\n```\n\n{setup}\n\n{table}\n")
    path.write_text(text.rstrip("\n") + "\n" + section)


def main(argv: List[str] | None = None) -> None:
    ns = parse_args(argv)
    torch.set_num_threads(ns.threads)
    corpus = ByteCorpus.from_folder(ns.data, ns.glob)
    base = MoETransformerArgs(num_layers=ns.layers, d_model=ns.d_model, num_heads=max(1, ns.d_model // 32),
                              ffn_hidden_size=ns.ffn, max_seq_len=ns.seq_len, moe_every=2, capacity_factor=1.25,
                              eval_capacity_factor=2.0, aux_loss_coef=0.01)
    tokens = ns.steps * ns.micro_batch * ns.seq_len
    setup = (f"{len(corpus.train_files)} training files ({corpus.train.numel():,} bytes), "
             f"{len(corpus.heldout_files)} held-out files, {min(ns.eval_tokens, corpus.heldout.numel() - 1):,} "
             f"held-out tokens evaluated; {ns.layers} layers, d_model {ns.d_model}, ffn {ns.ffn} (each expert too), "
             f"8 experts in every 2nd layer, capacity factor 1.25 (eval 2.0), aux loss 0.01; {ns.steps} steps x "
             f"{ns.micro_batch} x {ns.seq_len} = {tokens:,} training tokens per model, AdamW lr {ns.lr}, "
             f"seed {ns.seed}, {ns.threads} thread(s), run one after another on a shared machine (tokens/s is noisy).")
    print(setup, flush=True)
    rows = {}
    for name in ns.variants:
        print(f"training {name}", flush=True)
        rows[name] = run_variant(name, base, corpus, ns)
    table = format_table(rows)
    print(table)
    if not ns.no_write:
        command = "python " + " ".join(shlex.quote(a) for a in [sys.argv[0], *(argv if argv is not None else sys.argv[1:])])
        append_results(Path(ns.results), command, setup, table)
        print(f"appended to {ns.results}")


if __name__ == "__main__":
    main()
