"""moe_proto.MoE under deepspeed.initialize (ZeRO 0/1/2, ep 1/2/4) against a single-process reference.

One 4-rank launch trains every (stage, ep_size) config for a few steps (each spawn plus
DeepSpeed init costs ~10 s here). Every rank builds the full model from one seed and
slices its experts, so the reference - one process, the same AdamW, the global batch
as 4 chunks (one per rank, since capacity is per rank) with the chunk losses averaged,
torch's clip_grad_norm_ - is exact. Also checked: gradient clipping counts every expert
once (DeepSpeed #8475), the ZeRO-3 refusal, and the stats logged through the monitor.
"""
import csv
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from moe_proto import MoE
from moe_proto.checkpoint import full_state_dict, load_full_state_dict
from moe_proto.clipping import bind_expert_aware_clipping, global_grad_norm
from moe_proto.stats import MoEStatsLogger, collect_moe_stats, stats_events
from sparse_scale.multiproc import run_distributed

D, FFN, E, B, STEPS, LR, MAX_NORM = 8, 16, 8, 16, 3, 1e-2, 0.05
WORLD = 4


class Net(nn.Module):
    def __init__(self, ep_size):
        super().__init__()
        self.inp = nn.Linear(D, D)
        self.moe = MoE(D, num_experts=E, ep_size=ep_size, k=1, num_prototypes=2, capacity_factor=1.0,
                       min_capacity=0, use_rts=False, ffn_hidden_size=FFN, z_loss_coef=0.1)
        self.head = nn.Linear(D, 1)

    def forward(self, x, y):
        h = torch.tanh(self.inp(x))
        m, aux, _ = self.moe(h)
        return F.mse_loss(self.head(h + m).squeeze(-1), y) + 0.01 * aux


def build(ep_size):
    torch.manual_seed(0)
    full = Net(1)
    model = Net(ep_size)
    return full, model


def batch(step, rank):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(B, D, generator=g), torch.randn(B, generator=g)


def ds_config(stage, extra=None):
    cfg = {"train_micro_batch_size_per_gpu": B, "gradient_accumulation_steps": 1,
           "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0, "torch_adam": True}},
           "gradient_clipping": MAX_NORM, "zero_optimization": {"stage": stage}, "steps_per_print": 10**6}
    cfg.update(extra or {})
    return cfg


def reference_run():
    """Single process: per step the mean of the 4 chunk losses, torch clipping, torch AdamW."""
    torch.manual_seed(0)
    model = Net(1)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    losses, norms = [], []
    for step in range(STEPS):
        loss = sum(model(*batch(step, r)) for r in range(WORLD)) / WORLD
        opt.zero_grad()
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        opt.step()
        losses.append(float(loss))
    return losses, norms, {k: v.detach().clone() for k, v in model.named_parameters()}


def train(rank, stage, ep_size, stats_dir=None):
    import deepspeed
    from deepspeed.runtime.utils import clip_grad_norm_ as ds_clip_grad_norm_

    deepspeed.init_distributed(dist_backend="gloo")  # wraps the harness's process group
    full, model = build(ep_size)
    if ep_size > 1:
        model.moe.set_deepspeed_parallelism()  # groups first, so the full init can be sliced by EP rank
    load_full_state_dict(model, full.state_dict())
    extra = None
    if stats_dir:
        extra = {"csv_monitor": {"enabled": True, "output_path": stats_dir, "job_name": "moe"}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=list(model.parameters()),
                                      config=ds_config(stage, extra))
    assert bind_expert_aware_clipping(engine) == (stage == 0)  # ZeRO 1/2 clip correctly themselves
    stats_logger = MoEStatsLogger(engine, interval=2) if stats_dir else None
    losses, norms, ds_norms, ours_prestep, stats = [], [], [], [], []
    for step in range(STEPS):
        loss = engine(*batch(step, rank))
        engine.backward(loss)
        if stage == 0:
            # After the DP all-reduce, before the step: the correct norm and DeepSpeed's own fp32 formula.
            params = list(engine.module.parameters())
            ours_prestep.append(float(global_grad_norm(params)))
            ds_norms.append(float(ds_clip_grad_norm_(params, max_norm=1e30)))
        engine.step()
        norm = engine.get_global_grad_norm()
        norms.append(None if norm is None else float(norm))
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(float(mean) / WORLD)
        if stats_logger is not None:
            events = stats_logger.step()
            # What every rank's record says, summed by hand for the check.
            s = engine.module.moe.last_stats
            parts = [torch.empty(2 * E + 2, dtype=torch.float64) for _ in range(WORLD)]
            mine = torch.cat([s.routed_per_expert.double(), s.tokens_per_expert.double(),
                              torch.stack([s.aux_loss.double(), s.z_loss.double()])])
            dist.all_gather(parts, mine)
            stats.append((engine.global_steps, events, torch.stack(parts).numpy()))
    # numpy, not tensors: torch pickles tensors through shared memory that dies with the process.
    state = {k: v.numpy() for k, v in full_state_dict(engine.module).items()}
    return {"losses": losses, "norms": norms, "ds_norms": ds_norms, "ours_prestep": ours_prestep,
            "params": state if rank == 0 else None, "stats": stats}


def zero3_refusal(rank):
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    _, model = build(2)
    try:
        deepspeed.initialize(model=model, model_parameters=list(model.parameters()), config=ds_config(3))
    except AssertionError as err:
        return str(err)
    return None


CONFIGS = [(stage, ep) for ep in (1, 2, 4) for stage in (0, 1, 2)]


def _launch(rank, world, stats_dir):
    torch.set_num_threads(1)
    out = {}
    for stage, ep in CONFIGS:
        out[(stage, ep)] = train(rank, stage, ep, stats_dir if (stage, ep) == (1, 2) else None)
    out["zero3"] = zero3_refusal(rank)
    return out


@pytest.fixture(scope="module")
def launch(tmp_path_factory):
    stats_dir = str(tmp_path_factory.mktemp("csv"))
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    results = run_distributed(_launch, world_size=WORLD, args=(stats_dir, ), timeout_s=240)
    return results, stats_dir


@pytest.fixture(scope="module")
def reference():
    return reference_run()


@pytest.mark.parametrize("stage,ep", CONFIGS)
def test_training_matches_single_process_reference(launch, reference, stage, ep):
    results, _ = launch
    ref_losses, ref_norms, ref_params = reference
    got = results[0][(stage, ep)]
    assert got["losses"] == pytest.approx(ref_losses, rel=1e-5, abs=1e-6)
    for name, ref in ref_params.items():
        value = torch.from_numpy(got["params"][name])
        assert value.shape == ref.shape, name
        assert torch.allclose(value, ref, atol=2e-6, rtol=1e-5), (name, stage, ep)


@pytest.mark.parametrize("stage,ep", CONFIGS)
def test_clipped_norm_counts_every_expert_once(launch, reference, stage, ep):
    results, _ = launch
    ref_norms = reference[1]
    assert min(ref_norms) > MAX_NORM  # clipping really acts
    for rank_results in results:
        got = rank_results[(stage, ep)]
        assert got["norms"] == pytest.approx(ref_norms, rel=1e-5)
        if stage == 0:
            assert got["ours_prestep"] == pytest.approx(ref_norms, rel=1e-5)


def test_deepspeed_fp32_clip_formula_is_wrong_under_expert_parallelism(launch, reference):
    """Documents DeepSpeed #8475: runtime.utils.clip_grad_norm_ averages local norms over DP ranks."""
    results, _ = launch
    ref_norms = reference[1]
    assert results[0][(0, 1)]["ds_norms"] == pytest.approx(ref_norms, rel=1e-5)  # no EP: replicas agree
    assert results[0][(0, 4)]["ds_norms"] != pytest.approx(ref_norms, rel=1e-3)


def test_zero3_is_refused_by_deepspeed_with_its_reason(launch):
    results, _ = launch
    for r in results:
        assert r["zero3"] is not None and "Native DeepSpeed MoE is not supported with ZeRO Stage 3" in r["zero3"]


def test_stats_logged_through_monitor_match_routing_records(launch):
    results, stats_dir = launch
    stats = results[0][(1, 2)]["stats"]
    logged_steps = [step for step, events, _ in stats if events is not None]
    assert logged_steps == [2]  # interval 2 over global steps 1..3
    step, events, table = next(s for s in stats if s[1] is not None)
    table = torch.from_numpy(table)
    routed, kept = table[:, :E].sum(0), table[:, E:2 * E].sum(0)
    values = {name: value for name, value, _ in events}
    assert values["moe/moe/drop_rate"] == pytest.approx(float(1 - kept.sum() / routed.sum()))
    assert float(1 - kept.sum() / routed.sum()) > 0
    assert values["moe/moe/aux_loss"] == pytest.approx(float(table[:, 2 * E].mean()))
    assert values["moe/moe/z_loss"] == pytest.approx(float(table[:, 2 * E + 1].mean()))
    for e in range(E):
        assert values[f"moe/moe/load/e{e}"] == pytest.approx(float(routed[e] / routed.sum()))
    with open(os.path.join(stats_dir, "moe", "moe_moe_drop_rate.csv")) as f:
        rows = list(csv.reader(f))
    assert rows[1] == ["2", str(values["moe/moe/drop_rate"])] or float(rows[1][1]) == pytest.approx(
        values["moe/moe/drop_rate"])


def test_collect_stats_single_process_matches_record():
    torch.manual_seed(0)
    moe = MoE(D, num_experts=E, num_prototypes=2, capacity_factor=0.5, min_capacity=0, use_rts=False,
              ffn_hidden_size=FFN)
    x = torch.randn(64, D)
    record = moe.route(x)
    moe(x)
    s = collect_moe_stats(moe)["moe"]
    assert torch.equal(s.routed_per_expert, record.routed_per_expert.double())
    assert torch.equal(s.tokens_per_expert, record.tokens_per_expert.double())
    assert s.drop_rate == pytest.approx(1 - float(record.keep.float().mean()))
    assert s.drop_rate > 0
    assert s.aux_loss == pytest.approx(float(record.aux_loss)) and s.z_loss == pytest.approx(float(record.z_loss))

    class FakeEngine:
        module, global_steps = moe, 0
        written = []
        monitor = type("M", (), {"write_events": lambda self, ev: FakeEngine.written.extend(ev)})()

    logger_ = MoEStatsLogger(FakeEngine, interval=3, reduce=False)
    for step in range(1, 7):
        FakeEngine.global_steps = step
        logger_.step()
    assert sorted({st for _, _, st in FakeEngine.written}) == [3, 6]
    assert len(FakeEngine.written) == 2 * len(stats_events({"moe": s}, 0))
