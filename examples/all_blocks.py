"""All three blocks in one own script: packed tables (picasso), an MoE layer in the top MLP (moe_proto), gba auto.

Run it (3 ranks: 2 workers + 1 parameter server)::

    deepspeed --num_gpus 3 examples/all_blocks.py --steps 200 --slow-steps 30-80 --out runs/all_blocks

One config file (all_blocks.json) holds DeepSpeed's keys and the three blocks; one call
(``sparse_scale.initialize``) applies them. The tables come from the ``picasso`` block (their rows live on
the parameter server under ``gba``), the MoE layer from the ``moe_proto`` block (every expert on every
worker under ``gba``). Worker ``--slow-rank`` is slowed during ``--slow-steps`` so that auto mode moves
to gba and back. Rank 0 writes ``<out>/result.json``; the exit code is non-zero when the held-out AUC
misses ``--auc-bar``.
"""
import json
import os
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import sparse_scale
from picasso_ops.data.metrics import auc
from dlrm_gba import parse_args
from dlrm_kjt import DLRM, FIELDS, VOCAB, make_batch  # the data and the DLRM of dlrm_kjt.py


class MoEDLRM(DLRM):
    """dlrm_kjt's DLRM with an MoE layer (residual) between the two layers of its top MLP."""

    def __init__(self, tables: nn.Module, dim: int, config: dict) -> None:
        super().__init__(tables, dim)
        self.moe = sparse_scale.moe_from_block(config, hidden_size=32, ffn_hidden_size=32)

    def forward(self, dense, kjt):
        h = self.top[:2](self.interact(dense, kjt))  # Linear + ReLU: [B, 32]
        out, l_aux, _ = self.moe(h)
        return self.top[2](h + out).squeeze(-1), self.moe.aux_loss_coef * l_aux


def main() -> int:
    args = parse_args(__file__, __doc__)  # dlrm_gba.py's flags: --steps, --out, --slow-rank/-factor/-steps, ...
    first, last = (int(s) for s in args.slow_steps.split("-"))

    config = json.loads(Path(args.config).read_text())
    batch, dim = config["train_micro_batch_size_per_gpu"], config["picasso"]["embedding_dim"]
    torch.manual_seed(0)
    tables = sparse_scale.tables_from_block(config, vocab_sizes=[VOCAB] * FIELDS)
    engine, _, _, _ = sparse_scale.initialize(model=MoEDLRM(tables, dim, config), config=config)
    if engine.is_server:
        return 0  # the server served the whole job inside initialize
    rank, workers = dist.get_rank(), engine.num_workers

    losses, step_times = [], []
    for index in engine.claim_batches(total=args.steps * workers):
        t0 = time.perf_counter()
        if len(step_times) == 8 and rank == args.slow_rank and first <= index // workers <= last:
            time.sleep((args.slow_factor - 1) * statistics.median(step_times[3:]))
        dense, kjt, labels = make_batch(seed=index, batch=batch)
        logits, aux = engine(dense, kjt)
        loss = F.binary_cross_entropy_with_logits(logits, labels) + aux
        engine.backward(loss)
        engine.step()
        if len(step_times) < 8:
            step_times.append(time.perf_counter() - t0)
        losses.append(float(loss.detach()))

    engine.eval()
    with torch.no_grad():
        dense, kjt, labels = make_batch(seed=10**6, batch=args.eval_samples)
        held_out_auc = auc(engine(dense, kjt)[0].float(), labels)
    summary = engine.summary()
    engine.close()

    learned = held_out_auc >= args.auc_bar
    if rank == 0:
        k = max(1, len(losses) // 10)
        result = {"example": "all_blocks", "workers": workers, "steps": args.steps, "batches_trained": len(losses),
                  "auc": held_out_auc, "auc_bar": args.auc_bar, "learned": learned,
                  "loss_first": sum(losses[:k]) / k, "loss_last": sum(losses[-k:]) / k,
                  "tables": type(tables).__name__, "moe": type(engine.module.moe).__name__,
                  "steps_per_mode": summary["steps_per_mode"], "switches": summary["switches"]}
        os.makedirs(args.out, exist_ok=True)
        Path(args.out, "result.json").write_text(json.dumps(result, indent=1))
        print(f"all_blocks: {result['tables']} + {result['moe']} + gba auto, {args.steps} job steps, held-out AUC "
              f"{held_out_auc:.4f} (bar {args.auc_bar}), steps per mode {summary['steps_per_mode']}, switches "
              f"{[(s['step'], s['src'] + '->' + s['dst']) for s in summary['switches']]}")
    return 0 if learned else 1


if __name__ == "__main__":
    code = main()
    sparse_scale.shutdown_distributed()  # destroy the process groups before the interpreter exits
    raise SystemExit(code)
