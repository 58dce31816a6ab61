"""Expert parallelism over real gloo processes against a single-process reference.

One launch of 4 ranks runs every case (spawning costs ~10 s on this machine): ep=2 and
ep=4, dropless top-2, capacity top-1 (variable splits) and prototypes P=2 with fixed
splits, plus the mismatch errors. Each rank rebuilds the full ep=1 model from a fixed
seed, slices its experts, and compares against that model run on the same tokens.
"""
import pytest
import torch
import torch.distributed as dist

from moe_proto import MoE
from moe_proto.checkpoint import load_full_state_dict
from moe_proto.parallel import ExpertParallelMismatch, plan_exchange
from sparse_scale.multiproc import run_distributed

D, FFN, E, S = 16, 32, 8, 24
CASES = {
    "dropless_top2": dict(k=2, dropless=True),
    "capacity_top1": dict(k=1, capacity_factor=1.0),
    "proto2_fixed_splits": dict(k=1, num_prototypes=2, capacity_factor=0.75, ep_fixed_splits=True),
}


def _build(case, ep_size):
    kwargs = dict(CASES[case])
    kwargs.setdefault("ep_fixed_splits", False)
    if ep_size == 1:
        kwargs.pop("ep_fixed_splits")
    torch.manual_seed(0)
    moe = MoE(D, num_experts=E, ep_size=ep_size, ffn_hidden_size=FFN, use_rts=False,
              top2_2nd_expert_sampling=False, min_capacity=0, **kwargs)
    with torch.no_grad():
        moe.gate.weight.mul_(4)  # spread the router so that experts overflow and drops happen
    return moe


def _tokens(rank, n=S):
    return torch.randn(n, D, generator=torch.Generator().manual_seed(100 + rank))


def _run_case(rank, world, case, ep_size, group):
    full = _build(case, 1)
    moe = _build(case, ep_size)
    moe.set_expert_parallel_group(group)
    load_full_state_dict(moe, full.state_dict())
    x = _tokens(rank)
    out, l_aux, counts = moe(x)
    (out.square().sum() + l_aux).backward()

    # Reference: own tokens for output and gate grad; expert grads sum every EP-group member's loss.
    ref_out, ref_aux, ref_counts = full(x)
    members = [r for r in range(world) if r // ep_size == rank // ep_size]
    for r in members:
        o, a, _ = full(_tokens(r))
        (o.square().sum() + a).backward()
    o, a, _ = full(x)
    gate_ref = torch.autograd.grad(o.square().sum() + a, [full.gate.weight])[0]
    first, last = moe.expert_range
    errs = {
        "out": (out - ref_out).abs().max().item(),
        "aux": (l_aux - ref_aux).abs().item(),
        "counts": int((counts != ref_counts).sum()),
        "gate_grad": (moe.gate.weight.grad - gate_ref).abs().max().item(),
    }
    for name, p in moe.experts.named_parameters():
        ref = dict(full.experts.named_parameters())[name].grad[first:last]
        errs[f"grad_{name}"] = (p.grad - ref).abs().max().item()
    errs["drops"] = float(moe.last_stats.drop_rate)
    return errs


def _mismatch_cases(rank, world, group):
    """Each scenario must raise ExpertParallelMismatch on every rank of the group."""
    caught = {}
    # Capacity differs (rank 1 has fewer tokens) under fixed splits: DeepSpeed #6809's hang.
    moe = _build("proto2_fixed_splits", world)
    moe.set_expert_parallel_group(group)
    try:
        moe(_tokens(rank, n=S if rank != 1 else S // 2))
    except ExpertParallelMismatch as err:
        caught["capacity"] = str(err)
    # Dtype differs on the last rank.
    counts = torch.full((E, ), 1, dtype=torch.int64)
    dtype = torch.float64 if rank == world - 1 else torch.float32
    try:
        plan_exchange(counts, group, hidden_size=D, dtype=dtype)
    except ExpertParallelMismatch as err:
        caught["dtype"] = str(err)
    # Variable splits tolerate different token counts per rank (capacities differ, nothing hangs).
    moe = _build("capacity_top1", world)
    moe.set_expert_parallel_group(group)
    out, _, _ = moe(_tokens(rank, n=S + 4 * rank))
    caught["uneven_ok"] = tuple(out.shape)
    return caught


def _launch(rank, world):
    torch.set_num_threads(1)
    groups = {}
    for ep in (2, 4):  # every rank creates every group, in the same order
        for start in range(0, world, ep):
            g = dist.new_group(list(range(start, start + ep)))
            if start <= rank < start + ep:
                groups[ep] = g
    results = {}
    for ep in (2, 4):
        for case in CASES:
            results[(case, ep)] = _run_case(rank, world, case, ep, groups[ep])
    results["mismatch"] = _mismatch_cases(rank, world, groups[4])
    return results


@pytest.fixture(scope="module")
def launch():
    return run_distributed(_launch, world_size=4, timeout_s=90)


@pytest.mark.parametrize("ep", [2, 4])
@pytest.mark.parametrize("case", list(CASES))
def test_expert_parallel_matches_single_process(launch, case, ep):
    for rank, results in enumerate(launch):
        errs = results[(case, ep)]
        assert errs["counts"] == 0, (rank, errs)
        for key, err in errs.items():
            if key not in ("counts", "drops"):
                assert err < 1e-4, (rank, key, errs)


def test_capacity_cases_really_drop(launch):
    assert any(r[("capacity_top1", 2)]["drops"] > 0 for r in launch)
    assert any(r[("proto2_fixed_splits", 4)]["drops"] > 0 for r in launch)
    assert all(r[("dropless_top2", 4)]["drops"] == 0 for r in launch)


def test_shape_mismatch_raises_on_every_rank_instead_of_hanging(launch):
    for rank, results in enumerate(launch):
        caught = results["mismatch"]
        assert "capacity" in caught["capacity"] and "Capacity depends on the local token count" in caught["capacity"]
        assert "dtype_code" in caught["dtype"] and "ep rank 3: magic" in caught["dtype"]
        assert caught["uneven_ok"] == (S + 4 * rank, D)
