"""A wide-and-deep CTR model with an FM pairwise term, over one ``nn.EmbeddingBag`` per field.

    >>> model = WideAndDeep(WideAndDeepArgs(vocab_sizes=[1000] * 26, num_dense=13))
    >>> logits = model(batch.dense, batch.values, batch.lengths)   # [B]

The per-field embeddings are the plain baseline (what torchrec's unsharded
EmbeddingBagCollection does); picasso_ops' packed collection replaces them.
"""
from __future__ import annotations

import dataclasses

import torch
from torch import nn


@dataclasses.dataclass(frozen=True)
class WideAndDeepArgs:
    vocab_sizes: list[int]
    num_dense: int
    embedding_dim: int = 16
    hidden: tuple[int, ...] = (256, 128)
    pooling: str = "mean"  # of a multi-hot field's rows
    fm: bool = True  # the factorisation-machine pairwise term over field embeddings


class FieldEmbeddings(nn.Module):
    """One EmbeddingBag per field; ``forward`` returns pooled rows ``[B, F, dim]``."""

    def __init__(self, vocab_sizes: list[int], dim: int, pooling: str, init_std: float):
        super().__init__()
        self.bags = nn.ModuleList(nn.EmbeddingBag(v, dim, mode=pooling) for v in vocab_sizes)
        for bag in self.bags:
            nn.init.normal_(bag.weight, std=init_std)

    def forward(self, values: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        num_fields, batch = lengths.shape
        flat = lengths.reshape(-1)
        starts = torch.zeros(flat.numel() + 1, dtype=torch.long, device=flat.device)
        torch.cumsum(flat, 0, out=starts[1:])
        pooled = []
        for f, bag in enumerate(self.bags):
            lo = starts[f * batch]
            offsets = starts[f * batch:(f + 1) * batch] - lo
            hi = starts[(f + 1) * batch]
            pooled.append(bag(values[lo:hi], offsets))
        return torch.stack(pooled, dim=1)


class WideAndDeep(nn.Module):
    """logit = wide (per-id weights + linear dense) + FM pairwise term + MLP(embeddings, dense)."""

    def __init__(self, args: WideAndDeepArgs, embeddings: nn.Module | None = None, wide: nn.Module | None = None):
        super().__init__()
        self.args = args
        num_fields = len(args.vocab_sizes)
        self.embeddings = embeddings or FieldEmbeddings(args.vocab_sizes, args.embedding_dim, args.pooling, 0.01)
        self.wide = wide or FieldEmbeddings(args.vocab_sizes, 1, args.pooling, 0.0)
        self.wide_dense = nn.Linear(args.num_dense, 1)
        layers: list[nn.Module] = []
        width = num_fields * args.embedding_dim + args.num_dense
        for h in args.hidden:
            layers += [nn.Linear(width, h), nn.ReLU()]
            width = h
        layers.append(nn.Linear(width, 1))
        self.mlp = nn.Sequential(*layers)

    def forward(self, dense: torch.Tensor, values: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        emb = self.embeddings(values, lengths)  # [B, F, D]
        logit = self.wide(values, lengths).sum(dim=(1, 2)) + self.wide_dense(dense).squeeze(-1)
        if self.args.fm:
            # sum_{i<j} <e_i, e_j> = ((sum e)^2 - sum e^2) / 2, per sample
            logit = logit + 0.5 * (emb.sum(1).pow(2) - emb.pow(2).sum(1)).sum(-1)
        deep_in = torch.cat([emb.flatten(1), dense], dim=1)
        return logit + self.mlp(deep_in).squeeze(-1)
