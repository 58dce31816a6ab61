"""The buffer pool under deepspeed.initialize: ZeRO 0 and 2 with ep=2 train the same with the pool as without it.

Two gloo ranks; every MoE buffer is pooled (min_bytes=0), so the experts' saved tensors and the
weight gradients DeepSpeed reduces, copies and frees all come from reused storages. Losses and final
parameters must be bit-identical to a run whose pool is off.
"""
import torch
import torch.nn.functional as F
from torch import nn

from moe_proto import MoE
from moe_proto.buffer_pool import HostBufferPool, use_buffer_pool
from moe_proto.checkpoint import full_state_dict, load_full_state_dict
from sparse_scale.multiproc import run_distributed

D, FFN, E, B, STEPS = 8, 16, 4, 12, 4


class Net(nn.Module):
    def __init__(self, ep_size):
        super().__init__()
        self.inp = nn.Linear(D, D)
        self.moe = MoE(D, num_experts=E, ep_size=ep_size, k=2, capacity_factor=1.5, min_capacity=0, use_rts=False,
                       top2_2nd_expert_sampling=False, ffn_hidden_size=FFN)
        self.head = nn.Linear(D, 1)

    def forward(self, x, y):
        h = torch.tanh(self.inp(x))
        m, aux, _ = self.moe(h)
        return F.mse_loss(self.head(h + m).squeeze(-1), y) + 0.01 * aux


def _train(rank, stage, pooled):
    import deepspeed

    torch.manual_seed(0)
    full = Net(1)
    model = Net(2)
    model.moe.set_deepspeed_parallelism()
    load_full_state_dict(model, full.state_dict())
    pool = HostBufferPool(max_bytes=1 << 26, min_bytes=0) if pooled else HostBufferPool(max_bytes=0)
    use_buffer_pool(model, pool)
    config = {"train_micro_batch_size_per_gpu": B, "steps_per_print": 10 ** 6, "zero_optimization": {"stage": stage},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.0, "torch_adam": True}}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=list(model.parameters()), config=config)
    losses = []
    for step in range(STEPS):
        g = torch.Generator().manual_seed(100 * step + rank)
        loss = engine(torch.randn(B, D, generator=g), torch.randn(B, generator=g))
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
    stats = pool.stats()
    return {"losses": losses, "params": {k: v.numpy() for k, v in full_state_dict(engine.module).items()},
            "hits": stats.hits}


def _launch(rank, world):
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    return {(stage, pooled): _train(rank, stage, pooled) for stage in (0, 2) for pooled in (True, False)}


def test_zero_0_and_2_with_expert_parallelism_train_the_same_with_and_without_the_pool():
    results = run_distributed(_launch, world_size=2, timeout_s=50)
    for rank_result in results:
        for stage in (0, 2):
            pooled, plain = rank_result[stage, True], rank_result[stage, False]
            assert pooled["hits"] > 0  # the pooled run did reuse buffers
            assert pooled["losses"] == plain["losses"], f"stage {stage}"
            for name, value in plain["params"].items():
                assert (pooled["params"][name] == value).all(), f"stage {stage}: {name}"
