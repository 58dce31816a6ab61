"""The DeepSpeed engine the moe_proto checkpoint tests train: AdamW, no schedule, one ZeRO stage."""
from __future__ import annotations

from torch import nn


def adamw_engine(model: nn.Module, *, stage: int, lr: float, batch_size: int):
    """``deepspeed.initialize`` of ``model`` with plain AdamW at ``lr`` under ZeRO ``stage``; the engine."""
    import deepspeed

    config = {"train_micro_batch_size_per_gpu": batch_size, "steps_per_print": 10**6,
              "zero_optimization": {"stage": stage},
              "optimizer": {"type": "AdamW", "params": {"lr": lr, "weight_decay": 0.0, "torch_adam": True}}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=list(model.parameters()), config=config)
    return engine
