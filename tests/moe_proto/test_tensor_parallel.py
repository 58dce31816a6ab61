"""moe_proto.MoE under a tensor-parallel mpu (Megatron-style: tensor-parallel groups of consecutive ranks),
with and without expert tensor parallelism, against the same model without tensor parallelism; real gloo ranks.

4 ranks, tensor-parallel size 2, data-parallel size 2, ep 2, ZeRO 0, SGD. The tensor-parallel pairs (0, 1)
and (2, 3) take the same batches, so the reference is the model without an mpu on 4 ranks where the pairs take
the same batches too (data parallelism over two distinct batches, each twice). Every run starts from one full
model (seed 0, each global expert perturbed).

* ``enable_expert_tensor_parallelism=False``: full experts; each tensor-parallel rank sends half of the rows and
  the halves are all-gathered after (as DeepSpeed's MOELayer): losses equal the reference's, under ZeRO 0 and 2.
* ``enable_expert_tensor_parallelism=True``: a tensor-parallel expert module (column-parallel first projection,
  row-parallel second, an all-reduce over the tensor-parallel group, as Megatron's ParallelMLP), holding half of
  the reference experts' hidden units; expert-parallel groups of equal tensor-parallel rank: losses equal the
  reference's.

DeepSpeed's own layer cannot be run beside ours here: under a tensor-parallel mpu its gather_tokens
(``all_gather_into_tensor`` on gloo) fails on the CPU ("ProcessGroupGloo::allgather: invalid tensor size").
"""
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from moe_proto import MoE
from moe_proto.checkpoint import load_full_state_dict
from moe_proto.ds_layout import expert_state, stacked_layout
from moe_proto.tensor_parallel import RowSplit
from sparse_scale.multiproc import run_distributed

H, FFN, E, B, STEPS, TP = 8, 16, 4, 12, 3, 2


class MPU:
    """A Megatron-style mpu: tensor-parallel groups of ``tp`` consecutive ranks, data-parallel groups strided."""

    def __init__(self, tp):
        self.rank, self.world, self.tp = dist.get_rank(), dist.get_world_size(), tp
        for first in range(0, self.world, tp):
            group = dist.new_group(list(range(first, first + tp)))
            if first <= self.rank < first + tp:
                self.tp_group = group
        for t in range(tp):
            group = dist.new_group(list(range(t, self.world, tp)))
            if self.rank % tp == t:
                self.dp_group = group

    def get_model_parallel_rank(self):
        return self.rank % self.tp

    def get_model_parallel_world_size(self):
        return self.tp

    def get_model_parallel_group(self):
        return self.tp_group

    def get_data_parallel_rank(self):
        return self.rank // self.tp

    def get_data_parallel_world_size(self):
        return self.world // self.tp

    def get_data_parallel_group(self):
        return self.dp_group


class _CopyToTensorParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTensorParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class TensorParallelFFN(nn.Module):
    """Linear(H, FFN) -> ReLU -> Linear(FFN, H) with the hidden units split over the tensor-parallel group."""

    def __init__(self, tp):
        super().__init__()
        self.w1 = nn.Parameter(torch.zeros(FFN // tp, H))
        self.b1 = nn.Parameter(torch.zeros(FFN // tp))
        self.w2 = nn.Parameter(torch.zeros(H, FFN // tp))
        self.b2 = nn.Parameter(torch.zeros(H))

    def forward(self, x):
        from deepspeed.utils import groups

        group = groups.mpu.get_model_parallel_group()  # looked up, not held: the layer deep-copies the module
        x = _CopyToTensorParallel.apply(x, group)
        hidden = F.relu(F.linear(x, self.w1, self.b1))
        return _ReduceFromTensorParallel.apply(F.linear(hidden, self.w2), group) + self.b2

    def load_shard(self, full, tp_rank):
        """``full``: a reference expert's state (``0.weight`` [FFN, H], ``0.bias``, ``2.weight`` [H, FFN], ``2.bias``)."""
        rows = slice(tp_rank * self.w1.shape[0], (tp_rank + 1) * self.w1.shape[0])
        with torch.no_grad():
            self.w1.copy_(full["0.weight"][rows])
            self.b1.copy_(full["0.bias"][rows])
            self.w2.copy_(full["2.weight"][:, rows])
            self.b2.copy_(full["2.bias"])


class Net(nn.Module):
    def __init__(self, expert, ep_size, expert_tp=False):
        super().__init__()
        self.inp = nn.Linear(H, H)
        self.moe = MoE(H, expert, num_experts=E, ep_size=ep_size, k=1, capacity_factor=1.5, min_capacity=0,
                       use_rts=False, deepspeed_compat=True, enable_expert_tensor_parallelism=expert_tp)
        self.head = nn.Linear(H, 1)

    def forward(self, x, y):
        h = torch.tanh(self.inp(x))
        m, aux, _ = self.moe(h)
        return F.mse_loss(self.head(h + m).squeeze(-1), y) + 0.01 * aux


def ffn():
    return nn.Sequential(nn.Linear(H, FFN), nn.ReLU(), nn.Linear(FFN, H))


def full_model():
    torch.manual_seed(0)
    model = Net(ffn(), 1)
    with torch.no_grad():
        for p in model.moe.experts.parameters():
            p.add_(0.2 * torch.randn_like(p))  # distinct experts
    return model


def batch(step, rank):
    g = torch.Generator().manual_seed(100 * step + rank // TP)  # a tensor-parallel pair shares its batches
    return torch.randn(B, H, generator=g), torch.randn(B, generator=g)


def train(model, rank, mpu=None, stage=0):
    import deepspeed
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    # SGD, not Adam: Adam's step hardly depends on the gradients' scale, and an expert gradient summed over
    # duplicate rows (each token computed tp times) must show. ZeRO 1/2 need the expert parameters in groups.
    groups = split_params_into_different_moe_groups_for_optimizer({"params": list(model.parameters()), "name": "all"})
    optimizer = torch.optim.SGD(groups, lr=0.5)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, mpu=mpu, config={
        "train_micro_batch_size_per_gpu": B, "steps_per_print": 10**6, "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True})
    return engine


def run_steps(engine, rank, before_first=None):
    losses = []
    for step in range(STEPS):
        loss = engine(*batch(step, rank))
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    return losses


def reference_and_tp(rank, world_size):
    import deepspeed
    from deepspeed.utils import groups

    deepspeed.init_distributed(dist_backend="gloo")
    full = full_model()
    with stacked_layout(full):
        state = full.state_dict()
    out = {}
    # The reference: no mpu, ep 2, every rank a data-parallel replica.
    engine = train(Net(ffn(), 2), rank)
    load_full_state_dict(engine.module, state)  # ZeRO 0: the engine trains these very tensors
    out["reference"] = run_steps(engine, rank)
    # A tensor-parallel mpu, full experts: each tensor-parallel rank sends half of the rows.
    engine = train(Net(ffn(), 2), rank, mpu=MPU(TP))
    load_full_state_dict(engine.module, state)
    layer = engine.module.moe
    out["tp_layer"] = (layer.tp_size, layer.tp_rank, layer.expert_tensor_parallel,
                       groups._get_expert_model_parallel_world_size())
    out["tp"] = run_steps(engine, rank)
    # The same under ZeRO 2 (expert and dense gradients partitioned over their data-parallel groups).
    model = Net(ffn(), 2)
    model.moe.set_deepspeed_parallelism()  # groups.mpu is set by now: the full init sliced before ZeRO copies it
    load_full_state_dict(model, state)
    out["tp_zero2"] = run_steps(train(model, rank, mpu=MPU(TP), stage=2), rank)
    return out


def expert_tp(rank, world_size):
    import deepspeed
    from deepspeed.utils import groups

    deepspeed.init_distributed(dist_backend="gloo")
    full = full_model()
    mpu = MPU(TP)
    model = Net(TensorParallelFFN(TP), 2, expert_tp=True)
    engine = train(model, rank, mpu=mpu)
    layer = engine.module.moe
    with torch.no_grad():  # dense weights and the router from the full model, each local expert's shard
        for name in ("inp.weight", "inp.bias", "head.weight", "head.bias"):
            engine.module.get_parameter(name).copy_(full.get_parameter(name))
        layer.gate.weight.copy_(full.moe.gate.weight)
        for i, expert in enumerate(layer.experts.deepspeed_experts):
            expert.load_shard(expert_state(full.moe, layer.ep_rank * layer.num_local_experts + i), mpu.rank % TP)
    ep_ranks = dist.get_process_group_ranks(layer.ep_group)
    return {"layer": (layer.tp_size, layer.expert_tensor_parallel, groups._get_expert_model_parallel_world_size(),
                      ep_ranks), "losses": run_steps(engine, rank)}


@pytest.fixture(scope="module")
def reference_results():
    return run_distributed(reference_and_tp, 4, timeout_s=50)


@pytest.mark.soak
def test_a_tensor_parallel_mpu_sends_each_row_once_and_trains_as_without_it(reference_results):
    for rank, r in enumerate(reference_results):
        assert r["tp_layer"] == (TP, rank % TP, False, 1)
        assert r["tp"] == pytest.approx(r["reference"], rel=1e-5), rank
        assert r["tp_zero2"] == pytest.approx(r["reference"], rel=1e-5), rank
        assert len(set(r["reference"])) == STEPS


@pytest.mark.soak
def test_expert_tensor_parallelism_trains_as_without_tensor_parallelism(reference_results):
    results = run_distributed(expert_tp, 4, timeout_s=50)
    for rank, r in enumerate(results):
        assert r["layer"] == (TP, True, TP, [rank % TP, rank % TP + TP])  # ep groups of equal tensor-parallel rank
        assert r["losses"] == pytest.approx(reference_results[rank]["reference"], rel=1e-5), rank


@pytest.mark.parametrize("counts,tp", [([3, 0, 5, 1], 2), ([7, 2, 0, 4], 3), ([0, 0], 2)])
def test_row_split_shares_every_experts_rows_once_in_near_equal_consecutive_parts(counts, tp):
    counts = torch.tensor(counts)
    split = RowSplit.of(counts, tp, 0)
    assert torch.equal(split.counts.sum(0), counts)
    assert (split.counts.max(0).values - split.counts.min(0).values).le(1).all()
    assert sorted(split.order.tolist()) == list(range(int(counts.sum())))
    expert_of_row = torch.arange(len(counts)).repeat_interleave(counts)
    position = 0
    for t in range(tp):
        for e in range(len(counts)):
            rows = split.order[position:position + int(split.counts[t, e])]
            position += int(split.counts[t, e])
            assert (expert_of_row[rows] == e).all() and (rows.diff() == 1).all()
    with pytest.raises(ValueError, match="tensor-parallel rank 2 of size 2"):
        RowSplit.of(counts, 2, 2)
