"""How large is the global-batch gradient of benchmarks/gba.py's task? (Does gradient_clipping act on it?)

One process trains the benchmark's model (wide-and-deep, 26 fields x 50 ids, AdamW lr 0.003, no
weight decay) on its synthetic task with the benchmark's global batch (4 workers x 128) and prints
the distribution of the global-batch gradient's L2 norm, the quantity DeepSpeed (sync) and the
parameter servers (gba) clip to ``gradient_clipping``.

    .venv/bin/python benchmarks/gba_grad_norm.py --steps 1500 --seed 1
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from picasso_ops.data.synthetic import SyntheticConfig, SyntheticCTRStream
from picasso_ops.models import WideAndDeep, WideAndDeepArgs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--global-batch", type=int, default=512)
    p.add_argument("--clip", type=float, default=1.0, help="report how many steps exceed this norm")
    a = p.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(a.seed)
    cfg = SyntheticConfig(num_fields=26, vocab_sizes=50, zipf_exponent=1.1, max_ids_per_field=3, num_dense=13,
                          seed=a.seed)
    model = WideAndDeep(WideAndDeepArgs(vocab_sizes=cfg.field_vocab_sizes(), num_dense=13, embedding_dim=16))
    opt = torch.optim.AdamW(model.parameters(), lr=0.003, weight_decay=0.0)
    norms = []
    for batch in SyntheticCTRStream(cfg, a.global_batch, split="train", num_batches=a.steps):
        logits = model(batch.dense, batch.values, batch.lengths).squeeze(-1)
        loss = F.binary_cross_entropy_with_logits(logits, batch.labels.float())
        opt.zero_grad()
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))))
        opt.step()
    t = torch.tensor(norms)
    q = torch.quantile(t, torch.tensor([0.5, 0.9, 0.99]))
    print(f"steps {len(norms)}  global batch {a.global_batch}  grad norm: median {q[0]:.3f}  p90 {q[1]:.3f}  "
          f"p99 {q[2]:.3f}  max {t.max():.3f}  steps above {a.clip}: {int((t > a.clip).sum())}")


if __name__ == "__main__":
    main()
