"""moe_proto's own checkpoint for PR-MoE pyramids and for expert modules holding buffers (2 gloo ranks).

One launch; every engine starts from one full model (``load_full_state_dict`` at its ep sizes) and
every rank takes its own batches, so a resumed step must equal the continuing run's:

* a pyramid (layer 0: 2 per-expert-module experts, layer 1: 4 stacked experts) saved at ep (2, 1)
  under ZeRO 0 and ZeRO 2 after 2 steps: one expert file per writer rank per layer shape; loaded at
  ep (1, 1) ZeRO 2, (1, 2) ZeRO 0 and (2, 2) ZeRO 3, step 3's loss and parameters equal the
  continuing run's;
* experts holding buffers (a running mean and a row counter, updated in training and used in the
  forward) saved at ep 2 load at ep 1 (ZeRO 0 and 3) with every global expert's buffers, and step 3 equals;
* a checkpoint missing one expert file is refused on every rank, also on the one that does not read
  it, before any collective of the load;
* a checkpoint in the single-range layout as written before pyramids were saved (no per-expert buffer
  sections or metadata; the files rebuilt by hand from a real save) loads at another ep size.

DeepSpeed's PR-MoE test model (tests/moe_proto/test_ds_battery.py: 4 experts at ep 2, 8 at ep 4, 4 ranks,
soak) saved under ZeRO 2 resumes at ep (4, 2) ZeRO 1, (1, 1) ZeRO 0 and (2, 2) ZeRO 3.

Through ``sparse_scale.SparseEngine`` (``engine.save_checkpoint`` / ``load_checkpoint``): a pyramid
saves and resumes at other ep sizes (ZeRO 2 -> ZeRO 0 and 3). Per-expert buffers through that engine at
another ep size are an expected failure: the engine's per-rank module state holds them too.
"""
import os
import shutil

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from moe_proto import moe_class
from moe_proto.checkpoint import (expert_buffers, expert_files, full_state_dict, load_checkpoint, load_full_state_dict,
                                  save_checkpoint)
from sparse_scale.multiproc import run_distributed
from tests.moe_proto.engines import adamw_engine

D, B, WORLD, LR = 8, 16, 2, 1e-2
PYRAMID = (2, 4)  # num_experts of layer 0 (per-expert modules) and layer 1 (stacked)
SAVES = {"z0": ((2, 1), 0), "z2": ((2, 1), 2)}  # name: (ep sizes, ZeRO stage)
LOADS = {"z0": [((1, 1), 2)], "z2": [((1, 2), 0), ((2, 2), 3)]}


class RunningCenter(nn.Module):
    """Subtracts a running mean of the rows it saw: per-expert buffers, updated in training like a BatchNorm's."""

    def __init__(self, d: int, momentum: float = 0.5) -> None:
        super().__init__()
        self.momentum = momentum
        self.register_buffer("running_mean", torch.zeros(d))
        self.register_buffer("rows_seen", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        # the stats before this step's update: which rows an expert sees in a step depends on the ep size
        out = x - self.running_mean.clone()
        if self.training and x.shape[0] > 0:
            with torch.no_grad():
                self.running_mean.lerp_(x.mean(0), self.momentum)
                self.rows_seen += x.shape[0]
        return out


class Pyramid(nn.Module):
    def __init__(self, eps, stage, num_experts=PYRAMID, buffered=False):
        super().__init__()
        cls = moe_class(stage)
        expert = nn.Sequential(nn.Linear(D, D), RunningCenter(D)) if buffered else nn.Linear(D, D)
        kw = dict(k=1, capacity_factor=1.0, min_capacity=0, use_rts=False)
        self.inp = nn.Linear(D, D)
        self.moes = nn.ModuleList([cls(D, expert, num_experts=num_experts[0], ep_size=eps[0], **kw),
                                   cls(D, None, num_experts=num_experts[1], ep_size=eps[1], ffn_hidden_size=2 * D,
                                       **kw)])
        self.head = nn.Linear(D, 1)

    def forward(self, x, y):
        h, aux = torch.tanh(self.inp(x)), 0.0
        for moe in self.moes:
            m, l_aux, _ = moe(h)
            h, aux = h + m, aux + l_aux
        return F.mse_loss(self.head(h).squeeze(-1), y) + 0.01 * aux


def full_state(num_experts=PYRAMID, buffered=False):
    """One full (ep 1) init, every global expert distinct, keyed as full_state_dict writes it."""
    torch.manual_seed(0)
    full = Pyramid((1, 1), 0, num_experts, buffered)
    with torch.no_grad():
        for layer in full.moes:  # per-expert modules start as copies of one module
            for p in layer.experts.parameters():
                p.add_(0.1 * torch.randn_like(p))
        for name, buf in full.named_buffers():
            if name.endswith("running_mean"):
                buf.normal_()
    return full_state_dict(full)


def batch(step, rank):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(B, D, generator=g), torch.randn(B, generator=g)


def engine_of(eps, stage, state, num_experts=PYRAMID, buffered=False):
    model = Pyramid(eps, stage, num_experts, buffered)
    for layer in model.moes:
        layer.set_deepspeed_parallelism()
    load_full_state_dict(model, state)
    return adamw_engine(model, stage=stage, lr=LR, batch_size=B)


def step(engine, i, rank):
    loss = engine(*batch(i, rank))
    engine.backward(loss)
    engine.step()
    return float(loss)


def snapshot(engine):
    return {k: v.clone() for k, v in full_state_dict(engine.module).items()}


def to_single_range_layout(path):
    """Rewrite a (single-shape) checkpoint as the code before pyramid checkpoints wrote it.

    Also leaves a stale file of an ep-1 save of the same tag, with zeros: never read at ep size 2.
    """
    dense_file = os.path.join(path, "dense.pt")
    dense = torch.load(dense_file, weights_only=False)
    assert not dense["meta"].pop("expert_buffers")
    assert dense["meta"].pop("expert_layout") == "single_range"
    torch.save(dense, dense_file)
    blobs = []
    for f in expert_files(path):
        assert f.shape is None and f.name == f"experts_{f.first:06d}-{f.last:06d}.pt"
        blob = torch.load(os.path.join(path, f.name), weights_only=False)
        assert not blob["buffers"]
        blobs.append(blob)
        torch.save({"first": blob["first"], "last": blob["last"], "params": blob["params"]},
                   os.path.join(path, f.name))
    stale = {stack: {k: torch.zeros_like(torch.cat([b["params"][stack][k] for b in blobs])) for k in entry}
             for stack, entry in blobs[0]["params"].items()}
    torch.save({"first": 0, "last": 4, "params": stale}, os.path.join(path, "experts_000000-000004.pt"))


def init_ranks():
    import deepspeed

    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")


def pyramid_run(rank, world_size, root):
    init_ranks()
    state = full_state()
    out = {}
    for name, (eps, stage) in SAVES.items():
        engine = engine_of(eps, stage, state)
        for i in range(2):
            step(engine, i, rank)
        save_checkpoint(engine, root, name)
        expected = {"loss": step(engine, 2, rank), "params": snapshot(engine)}
        got = []
        for load_eps, load_stage in LOADS[name]:
            engine = engine_of(load_eps, load_stage, state)
            load_checkpoint(engine, root, name)
            got.append({"eps": load_eps, "stage": load_stage, "loss": step(engine, 2, rank),
                        "params": snapshot(engine)})
        out[name] = (expected, got)
    # rank 1's expert file of layer 0 lost: rank 0 does not read it, yet every rank refuses before any collective
    if rank == 0:
        shutil.copytree(os.path.join(root, "z2"), os.path.join(root, "z2_missing"))
        os.remove(os.path.join(root, "z2_missing", "moe_proto", "experts_e2-ep2_000001-000002.pt"))
    dist.barrier()
    engine = engine_of((2, 1), 0, state)
    try:
        load_checkpoint(engine, root, "z2_missing")
        out["missing"] = None
    except FileNotFoundError as e:
        out["missing"] = str(e)
    dist.barrier()  # both ranks got here: nobody waits in a collective of the load
    return out


def buffers_and_single_range_run(rank, world_size, root):
    init_ranks()
    out = {}
    # per-expert buffers: saved at ep 2 (ZeRO 2), loaded at ep 1 (ZeRO 0 and 3)
    buffered = full_state((4, 4), buffered=True)
    engine = engine_of((2, 2), 2, buffered, (4, 4), True)
    for i in range(2):
        step(engine, i, rank)
    save_checkpoint(engine, root, "buffers")
    saved = snapshot(engine)
    expected = step(engine, 2, rank)
    loads = []
    for stage in (0, 3):
        engine = engine_of((1, 1), stage, buffered, (4, 4), True)
        load_checkpoint(engine, root, "buffers")
        loads.append({"stage": stage, "loaded": snapshot(engine), "loss": step(engine, 2, rank)})
    out["buffers"] = {"saved": saved, "expected": expected, "loads": loads,
                      "names": sorted(expert_buffers(engine.module))}
    # the single-range layout as written before (no buffer sections), saved at ep 2, loaded at ep 1
    uniform = full_state((4, 4))
    engine = engine_of((2, 2), 2, uniform, (4, 4))
    for i in range(2):
        step(engine, i, rank)
    path = save_checkpoint(engine, root, "single_range")
    expected = step(engine, 2, rank)
    if rank == 0:
        to_single_range_layout(path)
    dist.barrier()
    engine = engine_of((1, 1), 0, uniform, (4, 4))
    load_checkpoint(engine, root, "single_range")
    out["single_range"] = (expected, step(engine, 2, rank))
    return out


@pytest.fixture(scope="module")
def launch(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("pyramid"))
    return run_distributed(pyramid_run, WORLD, args=(root,), timeout_s=60), root


@pytest.fixture(scope="module")
def buffer_launch(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("buffers"))
    return run_distributed(buffers_and_single_range_run, WORLD, args=(root,), timeout_s=60), root


def test_a_lost_expert_file_is_refused_on_every_rank_before_any_collective(launch):
    results, _ = launch
    for rank, per_rank in enumerate(results):
        assert per_rank["missing"] is not None, rank
        assert per_rank["missing"].startswith("moes.0.experts.deepspeed_experts.*.")
        assert "['experts_e2-ep2_000001-000002.pt'] are missing" in per_rank["missing"]


@pytest.mark.parametrize("saved", list(SAVES))
def test_pyramid_resumes_at_other_ep_sizes_and_zero_stages(launch, saved):
    results, _ = launch
    for rank, per_rank in enumerate(results):
        expected, got = per_rank[saved]
        assert len(got) == len(LOADS[saved])
        for g in got:
            where = (saved, rank, g["eps"], g["stage"])
            assert g["loss"] == pytest.approx(expected["loss"], rel=1e-5, abs=1e-7), where
            assert g["params"].keys() == expected["params"].keys(), where
            for key, value in expected["params"].items():
                torch.testing.assert_close(g["params"][key], value, rtol=1e-5, atol=1e-6, msg=f"{where} {key}")


def test_pyramid_files_are_per_writer_rank_and_layer_shape(launch):
    _, root = launch
    path = os.path.join(root, "z2", "moe_proto")
    # layer 0 (2 experts, ep 2): ranks 0 and 1 write one expert each; layer 1 (4 experts, ep 1): rank 0 all four
    assert [(f.shape, f.first, f.last) for f in expert_files(path)] == [((2, 2), 0, 1), ((2, 2), 1, 2),
                                                                       ((4, 1), 0, 4)]
    blob = torch.load(os.path.join(path, "experts_e2-ep2_000001-000002.pt"), weights_only=False)
    assert sorted(blob["params"]) == ["moes.0.experts.deepspeed_experts.*.bias",
                                      "moes.0.experts.deepspeed_experts.*.weight"]
    assert blob["params"]["moes.0.experts.deepspeed_experts.*.weight"]["exp_avg_sq"].shape == (1, D, D)
    blob = torch.load(os.path.join(path, "experts_e4-ep1_000000-000004.pt"), weights_only=False)
    assert sorted(blob["params"]) == ["moes.1.experts.w1", "moes.1.experts.w2"]
    assert float(blob["params"]["moes.1.experts.w1"]["exp_avg_sq"].abs().sum()) > 0


def test_per_expert_buffers_saved_at_ep2_load_at_ep1(buffer_launch):
    results, root = buffer_launch
    for rank, per_rank in enumerate(results):
        r = per_rank["buffers"]
        assert "moes.0.experts.deepspeed_experts.0.1.running_mean" in r["names"]
        keys = [f"moes.0.experts.deepspeed_experts.{g}.1.{b}" for g in range(4) for b in ("running_mean", "rows_seen")]
        # distinct per expert and moved by training: a rank-0-only save would have failed here
        assert len({tuple(r["saved"][k].tolist()) for k in keys if k.endswith("running_mean")}) == 4
        assert int(sum(r["saved"][k] for k in keys if k.endswith("rows_seen"))) > 0
        assert [load["stage"] for load in r["loads"]] == [0, 3]
        for load in r["loads"]:
            where = (rank, load["stage"])
            # every global expert's buffers as the ep-2 run held them (ep 1 holds all four experts on each rank)
            for key in keys:
                torch.testing.assert_close(load["loaded"][key], r["saved"][key], rtol=0, atol=0, msg=f"{where} {key}")
            assert load["loaded"].keys() == r["saved"].keys()
            for key, value in r["saved"].items():
                torch.testing.assert_close(load["loaded"][key], value, rtol=0, atol=0, msg=f"{where} {key}")
            assert load["loss"] == pytest.approx(r["expected"], rel=1e-5, abs=1e-7), where
    meta = torch.load(os.path.join(root, "buffers", "moe_proto", "dense.pt"), weights_only=False)
    assert not any("running_mean" in k for k in meta["buffers"])  # not among rank 0's replicated buffers
    assert meta["meta"]["expert_buffers"]["moes.0.experts.deepspeed_experts.*.1.running_mean"] == {
        "num_experts": 4, "ep_size": 2}


def test_single_range_checkpoints_written_before_still_load(buffer_launch):
    results, root = buffer_launch
    assert sorted(os.listdir(os.path.join(root, "single_range", "moe_proto"))) == [
        "dense.pt", "experts_000000-000002.pt", "experts_000000-000004.pt", "experts_000002-000004.pt", "meta.json"]
    for rank, per_rank in enumerate(results):
        expected, loss = per_rank["single_range"]
        assert loss == pytest.approx(expected, rel=1e-5, abs=1e-7), rank


# ----------------------------------------------------------------------------- through sparse_scale.SparseEngine


def sparse_engine_run(rank, world_size, root):
    import sparse_scale

    def engine_at(eps, stage, seed):
        torch.manual_seed(seed)
        config = {"train_micro_batch_size_per_gpu": B, "steps_per_print": 10**6,
                  "zero_optimization": {"stage": stage},
                  "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0, "torch_adam": True}}}
        engine, *_ = sparse_scale.initialize(model=Pyramid(eps, 0), config=config)
        return engine

    engine = engine_at((2, 1), 2, seed=0)
    for i in range(2):
        step(engine, i, rank)
    engine.save_checkpoint(root, client_state={"step": 2})
    expected = {"loss": step(engine, 2, rank), "params": snapshot(engine)}
    got = []
    for eps, stage in (((1, 2), 0), ((2, 2), 3)):
        engine = engine_at(eps, stage, seed=123)  # other initial weights: the checkpoint must set them all
        path, client = engine.load_checkpoint(root)
        got.append({"eps": eps, "stage": stage, "path": path, "client": client, "steps": engine.global_steps,
                    "loss": step(engine, 2, rank), "params": snapshot(engine)})
    return expected, got


def test_pyramid_saves_and_resumes_through_the_sparse_scale_engine(tmp_path):
    results = run_distributed(sparse_engine_run, WORLD, args=(str(tmp_path),), timeout_s=60)
    assert (tmp_path / "latest").read_text() == "global_step2"
    assert [f.shape for f in expert_files(str(tmp_path / "global_step2" / "moe_proto"))] == [(2, 2), (2, 2), (4, 1)]
    for rank, (expected, got) in enumerate(results):
        for g in got:
            where = (rank, g["eps"], g["stage"])
            assert g["path"].endswith("global_step2") and g["client"] == {"step": 2} and g["steps"] == 2, where
            assert g["loss"] == pytest.approx(expected["loss"], rel=1e-5, abs=1e-7), where
            assert g["params"].keys() == expected["params"].keys(), where
            for key, value in expected["params"].items():
                torch.testing.assert_close(g["params"][key], value, rtol=1e-5, atol=1e-6, msg=f"{where} {key}")


def sparse_engine_buffers_run(rank, world_size, root):
    import sparse_scale

    def engine_at(eps, seed):
        torch.manual_seed(seed)
        config = {"train_micro_batch_size_per_gpu": B, "steps_per_print": 10**6, "zero_optimization": {"stage": 0},
                  "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0, "torch_adam": True}}}
        model = Pyramid(eps, 0, (4, 4), buffered=True)
        with torch.no_grad():
            for name, buf in model.named_buffers():
                if name.endswith("running_mean"):
                    buf.normal_()
        engine, *_ = sparse_scale.initialize(model=model, config=config)
        return engine

    engine = engine_at((2, 2), seed=rank)  # every rank's experts hold their own buffers
    step(engine, 0, rank)
    engine.save_checkpoint(root)
    saved = snapshot(engine)
    engine = engine_at((1, 1), seed=123)
    engine.load_checkpoint(root)
    return saved, snapshot(engine)


def test_per_expert_buffers_through_the_sparse_scale_engine_at_another_ep_size(tmp_path):
    results = run_distributed(sparse_engine_buffers_run, WORLD, args=(str(tmp_path),), timeout_s=60)
    for rank, (saved, loaded) in enumerate(results):
        for g in range(4):
            key = f"moes.0.experts.deepspeed_experts.{g}.1.running_mean"
            torch.testing.assert_close(loaded[key], saved[key], rtol=0, atol=0, msg=f"rank {rank} expert {g}")


# ----------------------------------------------------------------------------- DeepSpeed's PR-MoE test model, 4 ranks

PRMOE_LOADS = [((4, 2), 1), ((1, 1), 0), ((2, 2), 3)]  # (ep sizes of the 4- and 8-expert layers, ZeRO stage)


def prmoe_run(rank, world_size, root):
    import deepspeed

    from moe_proto.zero3 import to_zero3
    from tests.moe_proto.test_ds_battery import PRMoEModel, make_engine, perturb_experts
    from tests.moe_proto.test_ds_battery import batch as ds_batch

    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")

    def train(engine, i):
        loss = engine(*ds_batch(i, rank))
        engine.backward(loss)
        engine.step()
        return float(loss)

    torch.manual_seed(0)
    model = PRMoEModel("ours", num_experts=(4, 8), ep_sizes=(2, 4))  # 4 experts at ep 2, 8 at ep 4
    perturb_experts(model, rank)
    engine = make_engine(model, 2)
    for i in range(2):
        train(engine, i)
    save_checkpoint(engine, root, "prmoe")
    expected = {"loss": train(engine, 2), "params": snapshot(engine)}
    got = []
    for eps, stage in PRMOE_LOADS:
        torch.manual_seed(1)
        model = PRMoEModel("ours", num_experts=(4, 8), ep_sizes=eps)
        if stage == 3:
            for layer in model.moes:
                to_zero3(layer)
        engine = make_engine(model, stage)
        load_checkpoint(engine, root, "prmoe")
        got.append({"eps": eps, "stage": stage, "loss": train(engine, 2), "params": snapshot(engine)})
    return expected, got


@pytest.mark.soak
def test_deepspeeds_prmoe_model_resumes_at_other_ep_sizes(tmp_path):
    results = run_distributed(prmoe_run, 4, args=(str(tmp_path),), timeout_s=90)
    shapes = [(f.shape, f.first, f.last) for f in expert_files(str(tmp_path / "prmoe" / "moe_proto"))]
    assert shapes == [((4, 2), 0, 2), ((4, 2), 2, 4)] + [((8, 4), 2 * r, 2 * r + 2) for r in range(4)]
    for rank, (expected, got) in enumerate(results):
        for g in got:
            where = (rank, g["eps"], g["stage"])
            assert g["loss"] == pytest.approx(expected["loss"], rel=1e-5, abs=1e-7), where
            assert g["params"].keys() == expected["params"].keys(), where
            for key, value in expected["params"].items():
                torch.testing.assert_close(g["params"][key], value, rtol=1e-5, atol=1e-6, msg=f"{where} {key}")
