"""Train the byte-level MoE transformer LM with DeepSpeed on any folder of text files.

Runs unchanged under the deepspeed launcher, mpirun, srun or as one plain process:

    TRAIN_SCRIPT=launch/train_moe_lm.py bash launch/run_deepspeed.sh ds_configs/moe_lm_cpu.json --data DIR
    deepspeed --num_gpus 2 launch/train_moe_lm.py --config ds_configs/moe_lm_cpu.json --data DIR --steps 300
    python launch/train_moe_lm.py --config ds_configs/moe_lm_cpu.json --data DIR --glob '*.py' --steps 50

The config needs a ``moe_model`` block (the shape); without a ``moe_proto`` block the model is
dense. Rank 0 prints a progress bar and a summary table (held-out loss, bits per byte,
tokens/s) and writes OUT/summary.json; checkpoints go to OUT/checkpoints (``--resume``).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

# Entry scripts live beside their launch helpers; library code never imports from here.
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from sparse_scale.distenv import init_distributed  # noqa: E402
from sparse_scale.reporting import finish_wandb, print_table, setup_wandb_env, wandb_dir  # noqa: E402
from moe_proto.data import ByteCorpus  # noqa: E402
from moe_proto.models import MoETransformerArgs, MoETransformerLM  # noqa: E402
from sparse_scale.config import ConfigError, load_config  # noqa: E402

logger = logging.getLogger("train_moe_lm")

LOG_EVERY = 10  # steps between wandb/progress-bar loss updates


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True, help="DeepSpeed JSON/hjson with a moe_model and optional moe_proto block")
    p.add_argument("--data", required=True, help="folder of text files (searched recursively, see --glob)")
    p.add_argument("--glob", default="**/*", help="which files of --data to read (default: all, binary files skipped)")
    p.add_argument("--heldout-fraction", type=float, default=0.05, help="share of files held out for evaluation")
    p.add_argument("--eval-tokens", type=int, default=200_000, help="held-out tokens to evaluate (all ranks together)")
    p.add_argument("--steps", type=int, default=300, help="optimizer steps to train (in total, across resumes)")
    p.add_argument("--out", default="runs/train_moe_lm", help="folder for checkpoints, wandb and summary.json")
    p.add_argument("--save-every", type=int, default=0, help="checkpoint every N steps (0: only at the end)")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in OUT/checkpoints")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--threads", type=int, default=0, help="torch threads per rank (0: cores / local ranks)")
    p.add_argument("--local_rank", type=int, default=-1, help=argparse.SUPPRESS)  # set by the deepspeed launcher
    return p.parse_args(argv)


@dataclasses.dataclass
class Progress:
    step: int = 0  # optimizer steps done
    micro_batches: int = 0  # micro-batches consumed by each rank (ranks run in lockstep)
    tokens: int = 0  # global training tokens


def model_args_from_config(path: str) -> tuple[MoETransformerArgs, dict[str, Any]]:
    """``(model args, DeepSpeed dict)`` from a config file; a missing ``moe_model`` block is an error."""
    job = load_config(path)
    model_cfg = job.blocks.get("moe_model")
    if model_cfg is None:
        raise ConfigError(f"{path}: no 'moe_model' block (num_layers, d_model, num_heads, ffn_hidden_size, ...)")
    return MoETransformerArgs.from_configs(model_cfg, job.blocks.get("moe_proto")), dict(job.ds)


def optimizer_param_groups(model: torch.nn.Module) -> list[dict[str, Any]]:
    """Parameter groups with the experts apart (``moe: True``), as DeepSpeed's ZeRO 1/2 require for MoE models."""
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    return split_params_into_different_moe_groups_for_optimizer(
        {"params": list(model.parameters()), "name": "parameters"})



def evaluate(engine, corpus: ByteCorpus, seq_len: int, micro_batch: int, rank: int, world: int,
             max_tokens: int) -> dict[str, float]:
    """Held-out loss (nats/token) and bits per byte over the same tokens on any number of ranks."""
    engine.eval()
    sums = torch.zeros(2, dtype=torch.float64)
    with torch.no_grad():
        for tokens, targets in corpus.eval_batches(seq_len, micro_batch, rank, world, max_tokens):
            logits = engine(tokens).logits.float()
            loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1), reduction="sum",
                                   ignore_index=-100)
            sums += torch.tensor([loss.item(), float((targets != -100).sum())], dtype=torch.float64)
    engine.train()
    if dist.is_initialized() and world > 1:
        dist.all_reduce(sums)
    loss = (sums[0] / sums[1]).item()
    return {"eval_loss": loss, "eval_bits_per_byte": loss / math.log(2), "eval_tokens": float(sums[1])}


def _moe_stats(model: MoETransformerLM) -> list[tuple[str, float]]:
    """Per-layer drop rate and load imbalance (max/mean routed tokens) of the last forward."""
    events = []
    for i, layer in enumerate(model.moe_layers()):
        st = layer.last_stats
        if st is None:
            continue
        load = st.routed_per_expert.float()
        events += [(f"moe/layer{i}/drop_rate", float(st.drop_rate)),
                   (f"moe/layer{i}/max_over_mean_load", float(load.max() / load.mean().clamp_min(1e-9)))]
    return events


def train(args: argparse.Namespace) -> dict[str, Any]:
    out = Path(args.out)
    wandb_mode = setup_wandb_env(out)
    model_args, ds = model_args_from_config(args.config)
    ctx = init_distributed()
    rank, world = ctx.rank, ctx.world_size
    threads = args.threads or max(1, (os.cpu_count() or 1) // max(1, ctx.local_world_size or ctx.world_size))
    torch.set_num_threads(threads)
    torch.manual_seed(args.seed)  # same initial weights on every rank (DeepSpeed broadcasts them anyway)
    import deepspeed
    from tqdm import tqdm

    corpus = ByteCorpus.from_folder(args.data, args.glob, args.heldout_fraction)
    seq_len = model_args.max_seq_len
    micro_batch = int(ds.get("train_micro_batch_size_per_gpu", 8))
    grad_accum = int(ds.get("gradient_accumulation_steps", 1))
    model = MoETransformerLM(model_args)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=optimizer_param_groups(model), config=ds)

    ckpt_dir = out / "checkpoints"
    progress = Progress()
    if args.resume:
        path, progress = _load(engine, ckpt_dir)
        if rank == 0:
            print(f"resumed from {path} at step {progress.step}")
    batches = corpus.train_batches(seq_len, micro_batch, rank, world, args.seed, progress.micro_batches)
    bar = tqdm(total=args.steps, initial=progress.step, desc="train", unit="step", disable=rank != 0,
               dynamic_ncols=True, mininterval=1.0)
    train_time, tokens_this_run, last_ckpt = 0.0, 0, None
    running = torch.zeros(3)  # ce loss sum, aux loss sum, count
    step_tokens = micro_batch * seq_len * world * grad_accum
    while progress.step < args.steps:
        t0 = time.perf_counter()
        for _ in range(grad_accum):
            tokens, targets = next(batches)
            result = engine(tokens, targets)
            engine.backward(result.loss)
            engine.step()
            progress.micro_batches += 1
            running += torch.tensor([result.ce_loss.item(), result.aux_loss.item(), 1.0])
        progress.step += 1
        progress.tokens += step_tokens
        tokens_this_run += step_tokens
        train_time += time.perf_counter() - t0
        bar.update(1)
        if progress.step % LOG_EVERY == 0 or progress.step == args.steps:
            ce, aux = (running[:2] / running[2]).tolist()
            running.zero_()
            bar.set_postfix(loss=f"{ce:.3f}", bpb=f"{ce / math.log(2):.3f}")
            events = [("train/loss", ce, progress.tokens), ("train/aux_loss", aux, progress.tokens),
                      ("train/tokens_per_s", tokens_this_run / max(train_time, 1e-9), progress.tokens)]
            events += [(name, value, progress.tokens) for name, value in _moe_stats(model)]
            engine.monitor.write_events(events)
        if args.save_every and progress.step % args.save_every == 0:
            last_ckpt = _save(engine, ckpt_dir, progress, rank)
    bar.close()

    metrics = evaluate(engine, corpus, seq_len, micro_batch, rank, world, args.eval_tokens)
    engine.monitor.write_events([(f"eval/{k}", v, progress.tokens) for k, v in metrics.items()])
    if last_ckpt is None or not last_ckpt.endswith(f"step{progress.step}"):
        last_ckpt = _save(engine, ckpt_dir, progress, rank)
    n_params = sum(p.numel() for p in model.parameters())
    summary = {
        "world_size": world,
        "launcher": ctx.launcher,
        "steps": progress.step,
        "tokens": progress.tokens,
        "tokens_per_s": tokens_this_run / max(train_time, 1e-9),
        "train_time_s": train_time,
        "params": n_params,
        "num_experts": model_args.num_experts,
        "num_prototypes": model_args.num_prototypes,
        "top_k": model_args.top_k,
        "train_files": len(corpus.train_files),
        "heldout_files": len(corpus.heldout_files),
        **metrics,
        "checkpoint": last_ckpt,
        "wandb_mode": wandb_mode,
        "wandb_dir": wandb_dir(rank),
    }
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        (out / "summary.json").write_text(json.dumps(summary, indent=2))
        _print_summary(summary)
    finish_wandb(rank)
    return summary


def _save(engine, ckpt_dir: Path, progress: Progress, rank: int) -> str:
    """moe_proto's topology-free checkpoint (reloads at another ep_size) plus this job's progress."""
    from moe_proto.checkpoint import save_checkpoint

    tag = f"step{progress.step}"
    save_checkpoint(engine, str(ckpt_dir), tag)
    if rank == 0:
        (ckpt_dir / tag / "progress.json").write_text(json.dumps(dataclasses.asdict(progress)))
        (ckpt_dir / "latest").write_text(tag)  # written last: a half-written checkpoint is never "latest"
    return str(ckpt_dir / tag)


def _load(engine, ckpt_dir: Path) -> tuple[str, Progress]:
    from moe_proto.checkpoint import load_checkpoint

    latest = ckpt_dir / "latest"
    if not latest.is_file():
        raise SystemExit(f"--resume: no checkpoint found in {ckpt_dir}")
    tag = latest.read_text().strip()
    load_checkpoint(engine, str(ckpt_dir), tag)
    return str(ckpt_dir / tag), Progress(**json.loads((ckpt_dir / tag / "progress.json").read_text()))




def _print_summary(s: dict[str, Any]) -> None:
    routing = "dense" if not s["num_experts"] else (
        f"{s['num_experts']} experts, {s['num_prototypes']} prototype(s) x top-{s['top_k']}")
    rows = [
        ("ranks", f"{s['world_size']} ({s['launcher']})"),
        ("model", f"{s['params']:,} params, {routing}"),
        ("data", f"{s['train_files']} train / {s['heldout_files']} held-out files"),
        ("steps / tokens", f"{s['steps']} / {s['tokens']:,}"),
        ("tokens/s (this run)", f"{s['tokens_per_s']:,.0f}"),
        ("held-out tokens", f"{int(s['eval_tokens']):,}"),
        ("held-out loss", f"{s['eval_loss']:.4f} nats/token"),
        ("bits per byte", f"{s['eval_bits_per_byte']:.4f}"),
        ("checkpoint", s["checkpoint"]),
        ("wandb", f"{s['wandb_dir']} ({s['wandb_mode']})"),
    ]
    print_table(rows)


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    train(parse_args(argv))


if __name__ == "__main__":
    main()
