"""The DLRM of dlrm_kjt.py under a ``gba`` block in auto mode: 2 workers + 1 parameter server, one worker slowed.

Run it (3 ranks: the last one is the parameter server)::

    deepspeed --num_gpus 3 examples/dlrm_gba.py --steps 200 --slow-rank 1 --slow-factor 4 --slow-steps 30-80 \\
        --out runs/dlrm_gba

The job starts in sync (DeepSpeed's all-reduce over the workers). ``--slow-rank`` sleeps in each of its
steps ``slow-factor - 1`` times its own measured step time during ``--slow-steps`` (job steps); the
engine's straggler detector moves the job to gba (the servers aggregate the workers' gradients; the fast
worker takes more batches) and back to sync once the worker recovers. The tables live on the server.
Rank 0 writes ``<out>/result.json`` with the held-out AUC and the mode switches; the exit code is non-zero
when the AUC misses ``--auc-bar``.
"""
import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

import sparse_scale
from picasso_ops.data.metrics import auc
from dlrm_kjt import DLRM, FIELDS, VOCAB, make_batch  # the same model and data, beside this file


def parse_args(script: str, doc: str) -> argparse.Namespace:
    """The flags of a gba example (this one and all_blocks.py): its config beside it, steps, the slowdown."""
    p = argparse.ArgumentParser(description=doc.split("\n")[0])
    p.add_argument("--config", default=str(Path(script).with_suffix(".json")))
    p.add_argument("--steps", type=int, default=200, help="job steps: steps x workers batches in all")
    p.add_argument("--out", default=f"runs/{Path(script).stem}")
    p.add_argument("--slow-rank", type=int, default=1)
    p.add_argument("--slow-factor", type=float, default=4.0)
    p.add_argument("--slow-steps", default="30-80", help="FIRST-LAST job steps of the slowdown")
    p.add_argument("--eval-samples", type=int, default=4096)
    p.add_argument("--auc-bar", type=float, default=0.75)
    p.add_argument("--local_rank", type=int, default=-1)  # passed by the deepspeed launcher
    return p.parse_args()


def main() -> int:
    args = parse_args(__file__, __doc__)
    first, last = (int(s) for s in args.slow_steps.split("-"))

    config = json.loads(Path(args.config).read_text())
    batch, dim = config["train_micro_batch_size_per_gpu"], config["picasso"]["embedding_dim"]
    torch.manual_seed(0)
    tables = sparse_scale.tables_from_block(config, vocab_sizes=[VOCAB] * FIELDS)  # rows on the server
    engine, _, _, _ = sparse_scale.initialize(model=DLRM(tables, dim), config=config)
    if engine.is_server:
        return 0  # the server served the whole job inside initialize
    rank, workers = dist.get_rank(), engine.num_workers

    losses, step_times = [], []
    for index in engine.claim_batches(total=args.steps * workers):  # lockstep in sync, first come in gba
        t0 = time.perf_counter()
        if len(step_times) == 8 and rank == args.slow_rank and first <= index // workers <= last:
            time.sleep((args.slow_factor - 1) * statistics.median(step_times[3:]))  # counted as this worker's work
        dense, kjt, labels = make_batch(seed=index, batch=batch)
        loss = F.binary_cross_entropy_with_logits(engine(dense, kjt), labels)
        engine.backward(loss)
        engine.step()
        if len(step_times) < 8:
            step_times.append(time.perf_counter() - t0)  # whole steps, before anybody is slowed
        losses.append(float(loss.detach()))

    engine.eval()  # in a gba phase: pull the servers' latest parameters
    with torch.no_grad():
        dense, kjt, labels = make_batch(seed=10**6, batch=args.eval_samples)
        held_out_auc = auc(engine(dense, kjt).float(), labels)
    summary = engine.summary()
    engine.close()  # leave the job: the server stops once every worker has closed

    learned = held_out_auc >= args.auc_bar
    if rank == 0:
        switches = [f"step {s['step']}: {s['src']} -> {s['dst']} ({s['reason']})" for s in summary["switches"]]
        k = max(1, len(losses) // 10)
        result = {"example": "dlrm_gba", "workers": workers, "steps": args.steps, "batches_trained": len(losses),
                  "auc": held_out_auc, "auc_bar": args.auc_bar, "learned": learned,
                  "loss_first": sum(losses[:k]) / k, "loss_last": sum(losses[-k:]) / k, "mode": summary["mode"],
                  "steps_per_mode": summary["steps_per_mode"], "switches": summary["switches"],
                  "samples_per_s": summary["samples_per_s"]}
        os.makedirs(args.out, exist_ok=True)
        Path(args.out, "result.json").write_text(json.dumps(result, indent=1))
        print(f"dlrm_gba: {workers} workers + server, {args.steps} job steps, held-out AUC {held_out_auc:.4f} "
              f"(bar {args.auc_bar}), steps per mode {summary['steps_per_mode']}, switches:",
              *switches or ["none"], sep="\n  ")
    return 0 if learned else 1


if __name__ == "__main__":
    code = main()
    sparse_scale.shutdown_distributed()  # destroy the process groups before the interpreter exits
    raise SystemExit(code)
