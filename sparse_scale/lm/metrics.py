"""What the LM job measures: held-out loss and bits per byte, and the MoE layers' routing load.

    metrics = evaluate(engine, corpus, seq_len=128, micro_batch=8, rank=0, world=1, max_tokens=200_000)
    metrics["eval_bits_per_byte"]
    routing_events(model)           # [("moe/layer0/drop_rate", 0.01), ("moe/layer0/max_over_mean_load", 1.3), ...]
"""
from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from moe_proto.data import ByteCorpus
from moe_proto.models import MoETransformerLM


def evaluate(engine: Any, corpus: ByteCorpus, seq_len: int, micro_batch: int, rank: int, world: int,
             max_tokens: int) -> dict[str, float]:
    """Held-out loss (nats/token) and bits per byte over the same tokens on any number of ranks.

    A collective when ``world > 1`` (the sums are all-reduced); the engine is back in train mode after.

    Example::

        evaluate(engine, corpus, 128, 8, rank, world, 200_000)   # {"eval_loss": ..., "eval_bits_per_byte": ...}
    """
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


def routing_events(model: MoETransformerLM) -> list[tuple[str, float]]:
    """Per-layer drop rate and load imbalance (max/mean routed tokens) of the last forward.

    Example::

        routing_events(model)       # [] for a dense model or before the first forward
    """
    events = []
    for i, layer in enumerate(model.moe_layers()):
        st = layer.last_stats
        if st is None:
            continue
        load = st.routed_per_expert.float()
        events += [(f"moe/layer{i}/drop_rate", float(st.drop_rate)),
                   (f"moe/layer{i}/max_over_mean_load", float(load.max() / load.mean().clamp_min(1e-9)))]
    return events
