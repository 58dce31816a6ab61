"""The MoE tower in the rec models (sparse_scale.rec.moe_tower): shapes, aux loss, refusals, ep=2 and gba on real ranks.

In-process: the tower's state names and aux loss, the models' default MLPs unchanged, the
pipeline stages with a tower, replicated experts hidden from DeepSpeed, the refusals. On gloo
ranks: train_rec with a moe_proto block on 2 ranks at ep_size 1 and 2 (same training, read back
from the topology-free checkpoints, and an exact resume at ep_size 2), and on 2 workers + 1
parameter server in gba mode with the experts replicated.
"""
import functools
import json
from pathlib import Path

import pytest
import torch

from moe_proto.config import MoEProtoConfig
from picasso_ops.data.batch import CTRBatch
from picasso_ops.models import DLRM, DLRMArgs, WideAndDeep, WideAndDeepArgs
from sparse_scale.multiproc import run_distributed
from moe_proto.param_groups import has_moe_layers
from moe_proto.replicated import ReplicatedMoE
from sparse_scale.rec.moe_tower import MoETower, moe_layer_indices, plus_aux_loss, towers_of

ROOT = Path(__file__).resolve().parents[3]
BLOCK = {"num_experts": 4, "num_prototypes": 2, "capacity_factor": 1.0, "min_capacity": 2}
STEPS = 20  # of the expert-parallel runs
LR = 0.02  # their peak lr: the planted teacher shows within STEPS steps


def _batch(n=32, fields=4, vocab=50, dense=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.ones(fields, n, dtype=torch.long)
    return CTRBatch(torch.randn(n, dense, generator=g), torch.randint(0, vocab, (fields * n,), generator=g), lengths,
                    torch.zeros(n))


def _tower(replicated=False, **block):
    return functools.partial(MoETower, hidden=(16, 8), block=MoEProtoConfig(**{**BLOCK, **block}),
                             replicated=replicated)


def test_default_mlps_keep_their_modules_and_names():
    torch.manual_seed(0)
    wd = WideAndDeep(WideAndDeepArgs([50] * 4, 3))
    torch.manual_seed(0)
    dl = DLRM(DLRMArgs([50] * 4, 3))
    assert [n for n, _ in wd.named_parameters() if n.startswith("mlp.")] == [
        "mlp.0.weight", "mlp.0.bias", "mlp.2.weight", "mlp.2.bias", "mlp.4.weight", "mlp.4.bias"]
    assert [n for n, _ in dl.named_parameters() if n.startswith("top.")][:2] == ["top.0.weight", "top.0.bias"]
    torch.manual_seed(0)
    # the injected tower is built where the MLP is: everything before it draws the same init
    moe = WideAndDeep(WideAndDeepArgs([50] * 4, 3), deep_tower=_tower())
    assert torch.equal(moe.embeddings.bags[0].weight, wd.embeddings.bags[0].weight)
    assert [n for n, _ in moe.named_parameters() if n.startswith("mlp.moe")] == [
        "mlp.moe.1.gate.weight", "mlp.moe.1.experts.w1", "mlp.moe.1.experts.w2"]


@pytest.mark.parametrize("model", ["wide_deep", "dlrm"])
def test_tower_trains_in_both_models_and_splits_into_stages(model):
    torch.manual_seed(0)
    net = (WideAndDeep(WideAndDeepArgs([50] * 4, 3), deep_tower=_tower()) if model == "wide_deep"
           else DLRM(DLRMArgs([50] * 4, 3), top_mlp=_tower()))
    b = _batch()
    towers = towers_of(net)
    assert len(towers) == 1 and has_moe_layers(net)
    logits = net(b.dense, b.values, b.lengths)
    bce = torch.nn.functional.binary_cross_entropy_with_logits(logits, b.labels)
    aux = towers[0][1].take_aux_loss()
    assert aux is not None and float(aux.detach()) > 0  # 0.01 x the load-balancing loss of the step's forward
    assert towers[0][1].take_aux_loss() is None  # taken once per forward
    net(b.dense, b.values, b.lengths)
    loss = plus_aux_loss(bce.detach() + 0, towers)
    assert loss.item() == pytest.approx(bce.item() + aux.item(), rel=1e-6)
    logits = net(b.dense, b.values, b.lengths)
    plus_aux_loss(logits.sum(), towers).backward()
    gate = towers[0][1].moe["1"].gate.weight
    assert gate.grad is not None and float(gate.grad.abs().sum()) > 0  # the router learns from the aux loss too
    load = towers[0][1].expert_load()["moe.1"]
    assert int(load.routed_per_expert.sum()) == 3 * 32 * 2  # 3 training forwards x 32 rows x 2 prototypes
    assert 0.0 <= load.dropped_fraction < 1.0 and load.load_max >= 1.0
    net.eval()
    stages = net.pipeline_stages()  # the interleave cut holds whatever the tower
    assert torch.allclose(stages.dense(b, stages.lookup(b)), net(b.dense, b.values, b.lengths))
    assert int(towers[0][1].expert_load()["moe.1"].routed_per_expert.sum()) == 3 * 32 * 2  # eval is not counted


def test_interleaved_micro_batches_average_their_aux_losses():
    tower = _tower()(12)
    x = torch.randn(16, 12)
    tower(x[:8])
    tower(x[8:])
    first, second = tower._pending_aux
    assert tower.take_aux_loss().item() == pytest.approx(0.01 * (first.item() + second.item()) / 2)


def test_replicated_experts_are_dense_parameters_deepspeed_does_not_see():
    torch.manual_seed(0)
    net = WideAndDeep(WideAndDeepArgs([50] * 4, 3), deep_tower=_tower(replicated=True))
    torch.manual_seed(0)
    parallel = WideAndDeep(WideAndDeepArgs([50] * 4, 3), deep_tower=_tower())
    assert not has_moe_layers(net) and isinstance(net.mlp.moe["1"], ReplicatedMoE)
    assert net.state_dict().keys() == parallel.state_dict().keys()
    assert all(getattr(p, "allreduce", True) for p in net.parameters())  # reduced (or pushed) like the rest
    b = _batch()
    assert torch.allclose(net(b.dense, b.values, b.lengths), parallel(b.dense, b.values, b.lengths))
    net.eval()
    assert not net.mlp.moe["1"].layer.training  # eval capacity in eval mode
    with pytest.raises(ValueError, match="replicated experts need moe_proto.ep_size 1"):
        _tower(replicated=True, ep_size=2)(12)


def test_expert_load_goes_to_the_summary_and_the_monitor():
    from types import SimpleNamespace

    from sparse_scale.rec.moe_tower import expert_load_summary, load_events
    from sparse_scale.rec.summary import RecSummary, summary_rows

    torch.manual_seed(0)
    net = WideAndDeep(WideAndDeepArgs([50] * 4, 3), deep_tower=_tower())
    for seed in range(3):
        b = _batch(seed=seed)
        net(b.dense, b.values, b.lengths)
    load = towers_of(net)[0][1].expert_load()["moe.1"]
    one_process = SimpleNamespace(module=net, gathers_live=False, worker_group=None)  # no collective to sum over
    moe = expert_load_summary(one_process, MoEProtoConfig(**BLOCK))
    layer = moe["layers"]["mlp.moe.1"]
    assert layer["routed_per_expert"] == load.routed_per_expert.tolist() and sum(layer["routed_per_expert"]) == 192
    assert layer["tokens_per_expert"] == load.tokens_per_expert.tolist()
    assert layer["dropped_fraction"] == pytest.approx(1 - sum(layer["tokens_per_expert"]) / 192)
    assert moe["experts"] == "expert-parallel" and moe["num_experts"] == 4 and moe["ep_size"] == 1
    assert expert_load_summary(one_process, None) is None  # no moe_proto block, no moe part
    summary = RecSummary(model="wide_deep", world_size=1, launcher="single", steps=3, samples=96, samples_per_s=1.0,
                         train_time_s=1.0, local_samples=96, metrics={"auc": 0.5, "log_loss": 0.7, "eval_samples": 8},
                         checkpoint="x", wandb_mode=None, wandb_dir=None, eval_history=[], moe=moe).to_dict()
    rows = dict(summary_rows(summary))
    assert summary["moe"] is moe and rows["moe experts"].startswith("4 (2 prototype(s) x top-1)")
    assert rows["  mlp.moe.1 rows per expert"] == ", ".join(str(n) for n in layer["tokens_per_expert"])
    events = {name: value for name, value, _ in load_events(towers_of(net), x=96)}
    assert events["moe/mlp.moe.1/dropped_fraction"] == pytest.approx(layer["dropped_fraction"])
    assert sum(events[f"moe/mlp.moe.1/load/e{e}"] for e in range(4)) == pytest.approx(1.0)


def test_moe_every_maps_to_the_towers_hidden_layers():
    assert moe_layer_indices(2, 1) == [0, 1] and moe_layer_indices(2, 2) == [1] and moe_layer_indices(2, 3) == []
    assert sorted(_tower(moe_every=1)(12).moe) == ["0", "1"]
    with pytest.raises(ValueError, match="get no MoE layer"):
        _tower(moe_every=3)(12)


def _rec_config(tmp_path: Path, name: str, base: str = "demo_cpu.json", **moe) -> str:
    cfg = json.loads((ROOT / "ds_configs" / base).read_text())
    cfg["train_micro_batch_size_per_gpu"] = 32 if base == "gba_cpu.json" else 64
    cfg["wandb"] = {"enabled": False}
    cfg["moe_proto"] = {**BLOCK, **moe}
    if "picasso" in cfg:
        cfg["picasso"]["cache"]["rows"] = 2000  # of the 26 x 500 rows of --vocab 500
    if "scheduler" in cfg:  # a short warmup, and a fixed length: "auto" would follow --steps, which a resume halves
        cfg["scheduler"]["params"].update(warmup_num_steps=3, total_num_steps=STEPS, warmup_max_lr=LR)
        cfg["optimizer"]["params"]["lr"] = LR
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(cfg))
    return str(path)


def test_refusals_name_their_reason(tmp_path):
    from sparse_scale.rec import RecJobConfig
    from sparse_scale.rec.combinations import CombinationError, check_combinations
    from sparse_scale.rec.config import RecJobError
    from sparse_scale.rec.job import RecJob
    from sparse_scale.rec.moe_tower import tower_factory

    gba = _rec_config(tmp_path, "gba", base="gba_cpu.json", ep_size=2)
    with pytest.raises(CombinationError, match="all-to-all, which needs the workers in lockstep") as err:
        check_combinations(RecJobConfig(config=gba))
    assert err.value.rule == "gba+moe-expert-parallel"
    check_combinations(RecJobConfig(config=_rec_config(tmp_path, "gba1", base="gba_cpu.json")))  # ep 1: replicated
    lm = json.loads(Path(_rec_config(tmp_path, "lm")).read_text())
    lm["moe_model"] = {"num_layers": 2, "d_model": 32, "num_heads": 2, "ffn_hidden_size": 64}
    (tmp_path / "lm.json").write_text(json.dumps(lm))
    with pytest.raises(CombinationError, match="moe_model block shapes the MoE language model"):
        check_combinations(RecJobConfig(config=str(tmp_path / "lm.json")))
    deep = RecJob.build(RecJobConfig(config=_rec_config(tmp_path, "every", moe_every=3)), rank=0, world_size=1)
    with pytest.raises(RecJobError, match="moe_every=3: --model wide_deep's tower has 2 hidden layers"):
        tower_factory(deep)
    uneven = RecJob.build(RecJobConfig(config=_rec_config(tmp_path, "ep2", ep_size=2), eval_samples=3 * 64),
                          rank=0, world_size=2)
    with pytest.raises(RecJobError, match="3 held-out batches .* do not split evenly over 2 workers"):
        tower_factory(uneven)


SMALL = ["--eval-samples", "1024", "--vocab", "500", "--threads", "1"]


def _full_params(ckpt: Path) -> dict:
    """Every parameter at its full (all-experts) shape from a moe_proto checkpoint, whatever ep_size wrote it."""
    folder = ckpt / "moe_proto"
    out = {k: v["param"] for k, v in torch.load(folder / "dense.pt", weights_only=False)["params"].items()}
    parts = sorted(folder.glob("experts_*.pt"))
    saved = [torch.load(p, weights_only=False)["params"] for p in parts]
    for name in saved[0]:
        out[name] = torch.cat([s[name]["param"] for s in saved])
    return out


def _ep_runs(rank, world_size, tmp: str, configs: list):
    import os

    from tests.e2e.test_train_rec import _train_rec

    os.environ["WANDB_MODE"] = "offline"
    train_rec = _train_rec()
    out = {}
    for name, folder, argv in configs:  # one launch, jobs one after the other (a launch costs ~10 s here)
        summary = train_rec.train(train_rec.parse_args([*argv, "--out", str(Path(tmp) / folder)]))
        out[name] = {k: summary[k] for k in ("auc", "log_loss", "bayes_auc", "samples", "checkpoint")}
    return out


@pytest.fixture(scope="module")
def expert_parallel(tmp_path_factory):
    """One 2-rank launch, five jobs one after the other (a launch plus DeepSpeed's start cost ~10 s here)."""
    tmp = tmp_path_factory.mktemp("ep")
    ep1, ep2 = _rec_config(tmp, "ep1"), _rec_config(tmp, "ep2", ep_size=2)
    # packed tables behind a hot-row cache, 2 interleaved micro-batches: the tower runs twice per forward
    picasso = _rec_config(tmp, "picasso", base="rec_picasso_cpu.json", ep_size=2)
    steps = str(STEPS)
    configs = [("ep1", "ep1", [*SMALL, "--steps", steps, "--config", ep1]),
               ("ep2", "ep2", [*SMALL, "--steps", steps, "--config", ep2]),
               ("half", "half", [*SMALL, "--steps", str(STEPS // 2), "--config", ep2]),
               ("resumed", "half", [*SMALL, "--steps", steps, "--config", ep2, "--resume"]),
               ("picasso", "picasso", [*SMALL, "--steps", steps, "--config", picasso])]
    return run_distributed(_ep_runs, 2, args=(str(tmp), configs), timeout_s=55, init_process_group=False)[0]


@pytest.mark.slow
@pytest.mark.soak
def test_expert_parallel_ep2_trains_like_ep1(expert_parallel):
    a, b = expert_parallel["ep1"], expert_parallel["ep2"]
    assert a["samples"] == b["samples"] == STEPS * 64 * 2
    assert b["auc"] == pytest.approx(a["auc"], abs=1e-4) and b["log_loss"] == pytest.approx(a["log_loss"], abs=1e-5)
    assert b["auc"] > 0.5 and b["bayes_auc"] > 0.7  # it learns the planted teacher
    full1, full2 = _full_params(Path(a["checkpoint"])), _full_params(Path(b["checkpoint"]))
    assert full1.keys() == full2.keys() and full1["mlp.moe.1.experts.w1"].shape[0] == 4
    for name in full1:
        # Adam's normalised step lifts the rounding of another summation order (rows with tiny gradients)
        assert torch.allclose(full1[name], full2[name], atol=1e-4), name
    experts = sorted(p.name for p in (Path(b["checkpoint"]) / "moe_proto").glob("experts_*.pt"))
    assert experts == ["experts_000000-000002.pt", "experts_000002-000004.pt"]  # each EP rank wrote its two


@pytest.mark.slow
@pytest.mark.soak
def test_expert_parallel_resumes_exactly(expert_parallel):
    r, b = expert_parallel["resumed"], expert_parallel["ep2"]
    assert r["samples"] == b["samples"] == STEPS * 64 * 2
    assert r["log_loss"] == pytest.approx(b["log_loss"], abs=1e-6) and r["auc"] == pytest.approx(b["auc"], abs=1e-6)


@pytest.mark.slow
@pytest.mark.soak
def test_expert_parallel_over_a_picasso_cache_trains(expert_parallel):
    got = expert_parallel["picasso"]
    assert got["auc"] > 0.5 and got["samples"] == STEPS * 64 * 2


def _gba_run(rank, world_size, argv):
    import os

    from sparse_scale.rec import RecJobConfig, runner
    from sparse_scale.rec.cli import job_config, parse_args
    from sparse_scale.rec.model import build_model
    from sparse_scale.rec.moe_tower import towers_of

    os.environ["WANDB_MODE"] = "offline"
    built = {}

    def keep(job):  # the run's model, to read its experts after training
        built["model"] = build_model(job)
        built["start"] = {k: v.detach().clone() for k, v in built["model"].state_dict().items() if "moe" in k}
        return built["model"]

    config: RecJobConfig = job_config(parse_args(argv))
    summary = runner.run(config, model_factory=keep)
    if summary.is_server:
        return {"server": True}
    tower = towers_of(built["model"])[0][1]
    moved = {k: float((built["model"].state_dict()[k] - v).abs().max()) for k, v in built["start"].items()}
    return {"auc": summary.metrics["auc"], "steps": summary.steps, "moved": moved,
            "routed": int(tower.expert_load()["moe.1"].routed_per_expert.sum()),
            "experts": built["model"].state_dict()["mlp.moe.1.experts.w1"].numpy()}


@pytest.mark.slow
def test_gba_mode_trains_replicated_experts_through_the_servers(tmp_path):
    cfg = json.loads(Path(_rec_config(tmp_path, "gba", base="gba_cpu.json")).read_text())
    cfg["gba"].update(mode="gba", timeout_s=20, heartbeat_s=0.5, max_lead=None)
    path = tmp_path / "gba.json"
    path.write_text(json.dumps(cfg))
    argv = [*SMALL, "--steps", "8", "--vocab", "200", "--config", str(path), "--out", str(tmp_path / "out")]
    w0, w1, server = run_distributed(_gba_run, 3, args=(argv,), timeout_s=110, init_process_group=False)
    assert server == {"server": True}
    assert w0["steps"] + w1["steps"] == 16 and 0.0 < w0["auc"] < 1.0 and w0["auc"] == w1["auc"]
    for w in (w0, w1):
        assert all(v > 0 for v in w["moved"].values()), w["moved"]  # gate and experts took the servers' updates
        assert w["routed"] == w["steps"] * 32 * 2  # every training row routed to 2 prototypes' experts
