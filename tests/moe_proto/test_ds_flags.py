"""DeepSpeed's layer flags moe_proto.MoE once refused: enable_expert_tensor_parallelism and use_tutel.

DeepSpeed reads ``enable_expert_tensor_parallelism`` only with a tensor-parallel ``groups.mpu``;
without one, training with it must equal training without it. Under a tensor-parallel mpu the
layer refuses the mpu when bound, with the flag or without (DeepSpeed drops the tensor-parallel ranks'
duplicate tokens either way; every rank raises: the mpu is everyone's). ``use_tutel=True`` warns and
falls back, as DeepSpeed does without Tutel installed.
"""
import pytest
import torch
from torch import nn

from moe_proto import MoE
from moe_proto.layer import _check_tensor_parallelism
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


@pytest.mark.parametrize("flag", [True, False])
def test_a_tensor_parallel_mpu_is_refused_with_its_reason(flag):
    """DeepSpeed drops the tensor-parallel ranks' duplicate tokens under such an mpu with or without the flag."""
    from deepspeed.utils import groups

    class TensorParallel:
        def __init__(self, size):
            self.size = size

        def get_tensor_model_parallel_world_size(self):
            return self.size

    layer = MoE(D, None, num_experts=E, ffn_hidden_size=16, enable_expert_tensor_parallelism=flag)
    saved = groups.mpu
    try:
        groups.mpu = TensorParallel(2)
        with pytest.raises(ValueError, match=f"tensor-parallel mpu \\(size 2, enable_expert_tensor_parallelism={flag}"
                                             "\\).*duplicate tokens.*each token 2 times"):
            layer.set_deepspeed_parallelism()
        groups.mpu = TensorParallel(1)  # tensor-parallel size 1: nothing to drop (binding needs a process group)
        _check_tensor_parallelism(layer, groups)
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
