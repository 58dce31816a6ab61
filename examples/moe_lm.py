"""A small byte-level transformer LM with moe_proto MoE layers at ep_size 2, saved and reloaded, on 2 ranks.

Run it (CPU or GPU; ``--num_gpus`` is the rank count)::

    deepspeed --num_gpus 2 examples/moe_lm.py --steps 100 --out runs/moe_lm

Every block's feed-forward is an MoE layer built from the config's ``moe_proto`` block (4 experts, 2
per rank). It trains on the bytes of the repository's README.md (the last tenth held out), saves with
``engine.save_checkpoint``, then builds a fresh model from another seed, reloads it with
``engine.load_checkpoint`` and checks that it gives the same held-out loss. Rank 0 writes
``<out>/result.json``; the exit code is non-zero when the held-out loss did not fall below
``--loss-ratio`` x its value before training, or the reloaded model's loss differs.
"""
import argparse
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import sparse_scale

D_MODEL, HEADS, LAYERS, SEQ = 32, 4, 2, 64
TEXT = torch.tensor(list((Path(__file__).resolve().parents[1] / "README.md").read_bytes()), dtype=torch.long)
TRAIN, HELD_OUT = TEXT[: len(TEXT) * 9 // 10], TEXT[len(TEXT) * 9 // 10:]


def windows(data: torch.Tensor, starts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and next-byte targets ``[B, SEQ]`` from the windows starting at ``starts``."""
    idx = starts[:, None] + torch.arange(SEQ + 1)
    chunk = data[idx]
    return chunk[:, :-1], chunk[:, 1:]


class Block(nn.Module):
    def __init__(self, config: dict) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(D_MODEL), nn.LayerNorm(D_MODEL)
        self.qkv, self.proj = nn.Linear(D_MODEL, 3 * D_MODEL), nn.Linear(D_MODEL, D_MODEL)
        self.moe = sparse_scale.moe_from_block(config, hidden_size=D_MODEL, ffn_hidden_size=2 * D_MODEL)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, t, _ = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, HEADS, -1).permute(2, 0, 3, 1, 4)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, D_MODEL))
        out, l_aux, _ = self.moe(self.ln2(x))
        return x + out, self.moe.aux_loss_coef * l_aux


class MoELM(nn.Module):
    def __init__(self, config: dict) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(256, D_MODEL), nn.Embedding(SEQ, D_MODEL)
        self.blocks = nn.ModuleList(Block(config) for _ in range(LAYERS))
        self.ln, self.head = nn.LayerNorm(D_MODEL), nn.Linear(D_MODEL, 256)

    def forward(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.tok(tokens) + self.pos(torch.arange(tokens.shape[1]))
        aux = x.new_zeros(())
        for block in self.blocks:
            x, a = block(x)
            aux = aux + a
        return self.head(self.ln(x)), aux


def build(config: dict, seed: int):
    torch.manual_seed(seed)
    engine, _, _, _ = sparse_scale.initialize(model=MoELM(config), config=config)
    return engine


def eval_loss(engine, n: int = 16) -> float:
    """Mean next-byte cross-entropy on ``n`` fixed held-out windows (every rank runs it: the experts are split)."""
    engine.eval()
    with torch.no_grad():
        x, y = windows(HELD_OUT, torch.linspace(0, len(HELD_OUT) - SEQ - 2, n).long())
        logits, _ = engine(x)
        loss = F.cross_entropy(logits.reshape(-1, 256), y.reshape(-1)).reshape(1).double()
    dist.all_reduce(loss)
    engine.train()
    return float(loss) / dist.get_world_size()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default=str(Path(__file__).with_suffix(".json")))
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--out", default="runs/moe_lm")
    p.add_argument("--loss-ratio", type=float, default=0.75)
    p.add_argument("--local_rank", type=int, default=-1)  # passed by the deepspeed launcher
    args = p.parse_args()

    config = json.loads(Path(args.config).read_text())
    batch = config["train_micro_batch_size_per_gpu"]
    engine = build(config, seed=0)
    rank, world = dist.get_rank(), dist.get_world_size()
    before = eval_loss(engine)
    for step in range(args.steps):
        g = torch.Generator().manual_seed(step * world + rank)
        x, y = windows(TRAIN, torch.randint(0, len(TRAIN) - SEQ - 1, (batch,), generator=g))
        logits, aux = engine(x)
        engine.backward(F.cross_entropy(logits.reshape(-1, 256), y.reshape(-1)) + aux)
        engine.step()
    after = eval_loss(engine)
    ckpt = os.path.join(args.out, "checkpoint")
    engine.save_checkpoint(ckpt)

    fresh = build(config, seed=1)  # other initial weights, so the reload has to restore them
    fresh_loss = eval_loss(fresh)
    path, _ = fresh.load_checkpoint(ckpt)
    reloaded = eval_loss(fresh)

    learned = after <= args.loss_ratio * before
    same = path is not None and abs(reloaded - after) <= 1e-5
    if rank == 0:
        result = {"example": "moe_lm", "world_size": world, "steps": args.steps, "eval_loss_before": before,
                  "eval_loss": after, "loss_ratio": args.loss_ratio, "learned": learned, "checkpoint": path,
                  "fresh_eval_loss": fresh_loss, "reloaded_eval_loss": reloaded, "reload_matches": same}
        Path(args.out, "result.json").write_text(json.dumps(result, indent=1))
        print(f"moe_lm: {world} ranks, {args.steps} steps, held-out loss {before:.3f} -> {after:.3f} (bar "
              f"{args.loss_ratio * before:.3f}); reloaded {reloaded:.6f} vs {after:.6f}: "
              f"{'same' if same else 'DIFFERENT'}")
    return 0 if learned and same else 1


if __name__ == "__main__":
    code = main()
    sparse_scale.shutdown_distributed()  # destroy the process groups before the interpreter exits
    raise SystemExit(code)
