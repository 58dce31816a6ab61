"""DeepSpeed's layer flags moe_proto.MoE once refused: enable_expert_tensor_parallelism and use_tutel.

DeepSpeed reads ``enable_expert_tensor_parallelism`` only with a tensor-parallel ``groups.mpu``;
without one, training with it must equal training without it. Under a tensor-parallel mpu
moe_proto.MoE trains (tests/moe_proto/test_tensor_parallel.py); the ZeRO-3 layer refuses the mpu
when bound (every rank raises: the mpu is everyone's). ``use_tutel=True`` warns and
falls back, as DeepSpeed does without Tutel installed.
"""
import pytest
import torch
from torch import nn

from moe_proto import MoE
from sparse_scale.multiproc import run_distributed

D, E = 8, 4


class Net(nn.Module):
    def __init__(self, **flags):
        super().__init__()
        self.inp = nn.Linear(D, D)
        self.moe = MoE(D, nn.Sequential(nn.Linear(D, 16), nn.GELU(), nn.Linear(16, D)), num_experts=E, ep_size=2,
                       k=1, use_rts=False, min_capacity=0, **flags)

    def forward(self, x):
        out, aux, _ = self.moe(torch.tanh(self.inp(x)))
        return out.square().mean() + 0.01 * aux


def train(rank, world_size):
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    losses = {}
    for flag in (False, True):
        torch.manual_seed(0)
        model = Net(enable_expert_tensor_parallelism=flag)
        engine, *_ = deepspeed.initialize(model=model, model_parameters=list(model.parameters()), config={
            "train_micro_batch_size_per_gpu": 8, "zero_optimization": {"stage": 1}, "steps_per_print": 10**6,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}}})
        losses[flag] = []
        for step in range(3):
            loss = engine(torch.randn(8, D, generator=torch.Generator().manual_seed(10 * step + rank)))
            engine.backward(loss)
            engine.step()
            losses[flag].append(float(loss))
    return losses


def test_expert_tensor_parallelism_without_a_tensor_parallel_mpu_trains_as_without_it():
    for losses in run_distributed(train, 2, timeout_s=40):
        assert losses[True] == losses[False]


def test_the_zero3_layer_refuses_a_tensor_parallel_mpu_with_its_reason():
    """moe_proto.MoE trains under one (tests/moe_proto/test_tensor_parallel.py); ZeRO3MoE is not tested there."""
    from deepspeed.utils import groups

    from moe_proto import ZeRO3MoE

    class TensorParallel2:
        def get_tensor_model_parallel_world_size(self):
            return 2

        def get_tensor_model_parallel_rank(self):
            return 0

        def get_tensor_model_parallel_group(self):
            return None

    layer = ZeRO3MoE(D, None, num_experts=E, ffn_hidden_size=16, enable_expert_tensor_parallelism=True)
    saved, groups.mpu = groups.mpu, TensorParallel2()
    try:
        with pytest.raises(ValueError, match=r"ZeRO3MoE under a tensor-parallel mpu \(size 2\): not supported"):
            layer.set_deepspeed_parallelism()
    finally:
        groups.mpu = saved


def test_use_tutel_warns_and_falls_back(caplog):
    torch.manual_seed(0)
    plain = MoE(D, None, num_experts=E, ffn_hidden_size=16, use_rts=False)
    torch.manual_seed(0)
    with caplog.at_level("WARNING", logger="moe_proto.layer"):
        tutel = MoE(D, None, num_experts=E, ffn_hidden_size=16, use_rts=False, use_tutel=True)
    assert "use_tutel=True" in caplog.text and "proceeding without it" in caplog.text
    x = torch.randn(12, D)
    assert torch.equal(plain(x)[0], tutel(x)[0])
