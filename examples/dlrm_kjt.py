"""A DLRM on packed embedding tables, fed torchrec KeyedJaggedTensors, on 2 ranks.

Run it (CPU or GPU; ``--num_gpus`` is the rank count)::

    deepspeed --num_gpus 2 examples/dlrm_kjt.py --steps 200 --out runs/dlrm_kjt

The data is synthetic with a learnable signal: every id of every field has a hidden weight, and a
click is likely when the weights of a sample's ids (plus one dense feature) add up high. The script
trains through ``engine.pipeline`` (with ``--sharding row_wise`` the next batch's ids are exchanged
on a thread while one trains; the config's data-parallel tables get their batches as they are),
then reports the held-out AUC and checks that the two ranks' table replicas agree (an all_gather of
a checksum of the table weights; row-wise shards differ per rank by design). Rank 0 writes
``<out>/result.json``; the exit code is non-zero when the AUC misses ``--auc-bar`` or the replicas differ.
"""
import argparse
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

import sparse_scale
from picasso_ops.data.metrics import auc  # exact ROC AUC, ties as one half

FIELDS, VOCAB, DENSE = 4, 200, 4
KEYS = [f"f{i}" for i in range(FIELDS)]
HIDDEN = torch.randn(FIELDS, VOCAB, generator=torch.Generator().manual_seed(1234))  # the signal to learn


def make_batch(seed: int, batch: int):
    """``(dense [B, DENSE], kjt, labels [B])``: 1-3 ids per field and sample."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 4, (FIELDS, batch), generator=g)  # key-major, as KeyedJaggedTensor wants
    values = torch.cat([torch.randint(0, VOCAB, (int(n),), generator=g) for n in lengths.sum(1)])
    kjt = KeyedJaggedTensor(keys=KEYS, values=values, lengths=lengths.flatten())
    dense = torch.randn(batch, DENSE, generator=g)
    field = torch.repeat_interleave(torch.arange(FIELDS), lengths.sum(1))
    sample = torch.cat([torch.repeat_interleave(torch.arange(batch), n) for n in lengths])
    score = torch.zeros(batch).index_add_(0, sample, HIDDEN[field, values]) + dense[:, 0]
    labels = (score + 0.5 * torch.randn(batch, generator=g) > 0).float()
    return dense, kjt, labels


class DLRM(nn.Module):
    """Bottom MLP for the dense features, tables for the sparse ones, pairwise dot interactions, top MLP."""

    def __init__(self, tables: nn.Module, dim: int) -> None:
        super().__init__()
        self.tables = tables
        self.bottom = nn.Sequential(nn.Linear(DENSE, 16), nn.ReLU(), nn.Linear(16, dim))
        pairs = (FIELDS + 1) * FIELDS // 2
        self.top = nn.Sequential(nn.Linear(dim + pairs, 32), nn.ReLU(), nn.Linear(32, 1))

    def interact(self, dense: torch.Tensor, kjt: KeyedJaggedTensor) -> torch.Tensor:
        """The top MLP's input: the bottom MLP's output and the pairwise dots of it and the F pooled fields."""
        pooled = self.tables(kjt.values(), kjt.lengths().view(len(kjt.keys()), -1))  # [B, F, dim]
        x = self.bottom(dense)
        feats = torch.cat([x.unsqueeze(1), pooled], dim=1)  # [B, F + 1, dim]
        dots = feats @ feats.transpose(1, 2)
        i, j = torch.triu_indices(FIELDS + 1, FIELDS + 1, offset=1)
        return torch.cat([x, dots[:, i, j]], dim=1)

    def forward(self, dense: torch.Tensor, kjt: KeyedJaggedTensor) -> torch.Tensor:
        return self.top(self.interact(dense, kjt)).squeeze(-1)  # click logits [B]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default=str(Path(__file__).with_suffix(".json")))
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--out", default="runs/dlrm_kjt")
    p.add_argument("--eval-samples", type=int, default=4096)
    p.add_argument("--auc-bar", type=float, default=0.75)
    p.add_argument("--sharding", choices=["data_parallel", "row_wise"], default=None, help="override picasso.sharding")
    p.add_argument("--local_rank", type=int, default=-1)  # passed by the deepspeed launcher
    args = p.parse_args()

    config = json.loads(Path(args.config).read_text())
    if args.sharding:
        config["picasso"]["sharding"] = args.sharding
    batch, dim = config["train_micro_batch_size_per_gpu"], config["picasso"]["embedding_dim"]
    torch.manual_seed(0)
    tables = sparse_scale.tables_from_block(config, vocab_sizes=[VOCAB] * FIELDS)  # starts torch.distributed
    engine, _, _, _ = sparse_scale.initialize(model=DLRM(tables, dim), config=config)
    rank, world = dist.get_rank(), dist.get_world_size()

    losses = []
    batches = (make_batch(seed=step * world + rank, batch=batch) for step in range(args.steps))
    loader = engine.pipeline(batches)  # row-wise tables: the next batch's ids are exchanged while one trains
    for dense, kjt, labels in loader:
        loss = F.binary_cross_entropy_with_logits(engine(dense, kjt), labels)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    read_ahead = loader.stats["rounds"] if hasattr(loader, "stats") else 0  # batches prepared on the thread

    engine.eval()
    with torch.no_grad():  # the same held-out samples on every rank (seeds no training batch uses)
        dense, kjt, labels = make_batch(seed=10**6, batch=args.eval_samples)
        held_out_auc = auc(engine(dense, kjt).float(), labels)

    table_state = engine.module.tables.state_dict()
    mine = torch.tensor([sum(float(v.double().sum()) for v in table_state.values())], dtype=torch.float64)
    sums = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(sums, mine)
    checksums = [float(s) for s in sums]
    replicated = config["picasso"].get("sharding", "data_parallel") == "data_parallel"
    agree = all(c == checksums[0] for c in checksums) if replicated else None  # row-wise: each rank its shards
    learned = held_out_auc >= args.auc_bar

    if rank == 0:
        k = max(1, len(losses) // 10)
        result = {"example": "dlrm_kjt", "world_size": world, "steps": args.steps, "auc": held_out_auc,
                  "auc_bar": args.auc_bar, "learned": learned, "table_checksums": checksums, "replicas_agree": agree,
                  "sharding": "data_parallel" if replicated else config["picasso"]["sharding"], "read_ahead": read_ahead,
                  "loss_first": sum(losses[:k]) / k, "loss_last": sum(losses[-k:]) / k}
        os.makedirs(args.out, exist_ok=True)
        Path(args.out, "result.json").write_text(json.dumps(result, indent=1))
        tables = {True: "table replicas agree", False: "table replicas DIFFER", None: "row-wise shards"}[agree]
        print(f"dlrm_kjt: {world} ranks, {args.steps} steps, held-out AUC {held_out_auc:.4f} (bar {args.auc_bar}), "
              f"{tables}: {checksums}; {read_ahead} batches prepared ahead")
    return 0 if learned and agree is not False else 1


if __name__ == "__main__":
    code = main()
    sparse_scale.shutdown_distributed()  # destroy the process groups before the interpreter exits
    raise SystemExit(code)
