"""launch/train_rec.py with both a gba and a picasso block: packed tables on the parameter server (2 workers + 1).

No --server-tables flag: the two blocks together put the picasso block's packed tables on the
servers, which run its sparse optimizer (row-wise Adagrad here). A lockstep auto run moves
sync -> gba -> sync under a straggler window and hands over the dense part only; a second
run resumes the first one's checkpoint and trains only the rest of the job's batches.
"""
import json
from pathlib import Path

import pytest

from sparse_scale.multiproc import run_distributed
from tests.e2e.test_train_rec_gba import SMALL, _config, _run

STEPS = 24


def _picasso_config(tmp_path: Path, mode: str) -> str:
    path = Path(_config(tmp_path, mode))
    cfg = json.loads(path.read_text())
    cfg["picasso"] = {"packing": True, "embedding_dim": 8, "optimizer": {"type": "rowwise_adagrad", "lr": 0.05}}
    path.write_text(json.dumps(cfg))
    return str(path)


@pytest.mark.slow
@pytest.mark.soak
def test_train_rec_packed_tables_on_the_server_in_auto_mode_and_resume(tmp_path):
    import torch

    from gba_engine.checkpoint import load_tables
    from picasso_ops.models import WideAndDeep, WideAndDeepArgs

    cfg, out = _picasso_config(tmp_path, "auto"), tmp_path / "run"
    argv = [*SMALL, "--steps", str(STEPS), "--config", cfg, "--out", str(out), "--straggler", "1:8:3-9"]
    w0, w1, server = run_distributed(_run, 3, args=(argv,), timeout_s=110, init_process_group=False)
    assert server == {"server": True} and w0["steps"] + w1["steps"] == STEPS * 2
    assert 0.0 < w0["auc"] < 1.0 and w0["auc"] == w1["auc"]
    summary = json.loads((out / "summary.json").read_text())
    switches = summary["gba"]["switches"]
    assert [(e["src"], e["dst"]) for e in switches][:2] == [("sync", "gba"), ("gba", "sync")], switches
    # the hand-over carries the dense layers with their two Adam moments and, from the sync phase's workers,
    # both packed tables with their row-wise Adagrad accumulators (gba.sync_tables "workers", the default)
    plain = WideAndDeep(WideAndDeepArgs([200] * 26, num_dense=13, embedding_dim=8))
    dense = sum(p.numel() for n, p in plain.named_parameters() if "bags" not in n)
    rows = 26 * 200
    assert all(e["nbytes"] == dense * 3 * 4 + (rows * (8 + 1) + rows * (1 + 1)) * 4 for e in switches), (dense, switches)
    folder = out / "checkpoints" / (out / "checkpoints" / "latest").read_text()
    saved = load_tables(folder, 0, 1)
    assert sorted(saved) == ["deep0", "wide0"]  # picasso's layout: one packed table per collection
    assert saved["deep0"]["weight"].shape == (26 * 200, 8) and saved["wide0"]["weight"].shape == (26 * 200, 1)
    assert sorted(saved["deep0"]) == ["momentum1", "steps", "weight"]  # the block's row-wise Adagrad ran there
    assert saved["deep0"]["steps"] == STEPS  # one update per global batch, in every mode
    assert 0 < int((saved["deep0"]["momentum1"] > 0).sum()) < 26 * 200  # touched rows only (lazy)

    more = [*SMALL, "--steps", str(STEPS + 4), "--config", cfg, "--out", str(out), "--resume"]
    r0, r1, _ = run_distributed(_run, 3, args=(more,), timeout_s=110, init_process_group=False)
    assert r0["local_samples"] + r1["local_samples"] == 4 * 2 * 32  # only the job's batches the first run left
    resumed = load_tables(out / "checkpoints" / (out / "checkpoints" / "latest").read_text(), 0, 1)
    assert resumed["deep0"]["steps"] == STEPS + 4  # the rows' optimizer clock continued from the checkpoint
    assert torch.all(resumed["deep0"]["momentum1"] >= saved["deep0"]["momentum1"])  # accumulators only grow


@pytest.mark.parametrize("model,collections", [("wide_deep", 2), ("dlrm", 1)])
def test_gba_and_picasso_blocks_build_packed_server_tables(tmp_path, model, collections):
    """No flag needed: the two blocks give the packed model over server tables (DLRM: no wide part)."""
    from gba_engine.packed_tables import ServerPackedFieldEmbeddings
    from gba_engine.tables import server_tables
    from sparse_scale.rec.config import RecJobConfig
    from sparse_scale.rec.job import RecJob
    from sparse_scale.rec.model import build_model

    job = RecJob.build(RecJobConfig(config=_picasso_config(tmp_path, "gba"), model=model, fields=26, vocab=50),
                       rank=0, world_size=3)
    net = build_model(job)
    packed = [m for m in net.modules() if isinstance(m, ServerPackedFieldEmbeddings)]
    assert len(packed) == collections
    specs, _ = server_tables(net)
    assert [(s.num_rows, s.optimizer.type, s.optimizer.lr) for s in specs][0] == (26 * 50, "rowwise_adagrad", 0.05)
    assert specs[0].dim == 8 and all(s.optimizer.lr_schedule == "deepspeed" for s in specs)
    assert not any("bags" in n for n, _ in net.named_parameters())  # no table is a DeepSpeed parameter


@pytest.mark.parametrize("picasso,rule,reason", [
    ({"sharding": "row_wise"}, "gba+picasso-row-wise", "spread over the parameter servers by id already"),
    ({"interleave": {"micro_batches": 2}}, "gba+picasso-interleave", "set micro_batches to 1"),
    ({"interleave": {"prefetch_batches": 2}}, "gba+picasso-prefetch", "hands its batches out by number"),
])
def test_what_packed_server_tables_do_not_support_is_refused_with_its_reason(tmp_path, picasso, rule, reason):
    from sparse_scale.rec.combinations import refusals
    from sparse_scale.rec.config import RecJobConfig

    path = Path(_picasso_config(tmp_path, "gba"))
    cfg = json.loads(path.read_text())
    cfg["picasso"].update(picasso)
    path.write_text(json.dumps(cfg))
    found = refusals(RecJobConfig(config=str(path)))
    assert [e.rule for e in found] == [rule] and reason in str(found[0])
    assert refusals(RecJobConfig(config=_picasso_config(tmp_path / "ok", "gba"))) == []


def _system_run(rank: int, world_size: int, argv: list) -> dict:
    import os

    from tests.e2e.test_train_rec import _train_rec

    os.environ["WANDB_MODE"] = "offline"
    train_rec = _train_rec()
    summary = train_rec.train(train_rec.parse_args(argv))
    return {"server": True} if summary.get("server") else {k: summary[k] for k in ("auc", "steps", "gba", "moe")}


@pytest.mark.slow
def test_the_system_config_runs_all_three_blocks_in_one_job(tmp_path):
    """ds_configs/rec_system_cpu.json small (make demo-system's job): packed server tables behind the worker
    cache, gba auto with a straggler window, an MoE tower with replicated experts, on 2 workers + 1 server."""
    from tests.e2e.test_train_rec_gba import ROOT

    cfg = json.loads((ROOT / "ds_configs" / "rec_system_cpu.json").read_text())
    assert {"picasso", "gba", "moe_proto"} <= set(cfg)
    cfg["train_micro_batch_size_per_gpu"] = 32
    cfg["wandb"] = {"enabled": False}
    cfg["picasso"]["cache"]["rows"] = 500  # of 26 x 200 rows per table
    cfg["gba"].update(timeout_s=20, heartbeat_s=0.5, max_lead=0,
                      switch={"slow_ratio": 1.5, "recover_ratio": 1.2, "window": 2, "min_dwell_steps": 2})
    path = tmp_path / "system.json"
    path.write_text(json.dumps(cfg))
    argv = [*SMALL, "--steps", "20", "--config", str(path), "--out", str(tmp_path / "run"), "--straggler", "1:8:3-9"]
    w0, w1, server = run_distributed(_system_run, 3, args=(argv,), timeout_s=110, init_process_group=False)
    assert server == {"server": True} and w0["steps"] + w1["steps"] == 40
    assert 0.5 < w0["auc"] < 1.0 and w0["auc"] == w1["auc"]
    assert [(e["src"], e["dst"]) for e in w0["gba"]["switches"]][:1] == [("sync", "gba")]
    cache = w0["gba"]["row_cache"]
    assert cache["lookups"] > 0 and cache["hits"] > 0 and cache["max_served_age"] <= cfg["gba"]["staleness"]["threshold"]
    moe = w0["moe"]
    assert moe["num_experts"] == 4 and moe["experts"] == "replicated"
    (layer,) = moe["layers"].values()
    assert len(layer["tokens_per_expert"]) == 4 and sum(layer["tokens_per_expert"]) > 0
