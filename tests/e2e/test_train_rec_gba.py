"""launch/train_rec.py with a ``gba`` block on real gloo ranks: 2 workers + 1 parameter server.

ds_configs/gba_cpu.json with test-sized knobs (micro batch, detector window and dwell,
heartbeat): an asynchronous gba run where worker 1 is 20x slower, so worker 0 takes more of
the job's numbered batches, and a lockstep auto run where ``--straggler 1:8:3-9`` slows worker 1
over a window of job steps so the job moves sync -> gba -> sync. Server ranks return no summary; the
workers compute the AUC over the gathered held-out set.
"""
import json
from pathlib import Path

import pytest

from sparse_scale.multiproc import run_distributed

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["--eval-samples", "2048", "--vocab", "200", "--threads", "1"]


def _run(rank: int, world_size: int, argv: list) -> dict:
    import os

    from tests.e2e.test_train_rec import _train_rec

    os.environ["WANDB_MODE"] = "offline"
    train_rec = _train_rec()
    summary = train_rec.train(train_rec.parse_args(argv))
    if summary.get("server"):
        return {"server": True}
    return {k: summary[k] for k in ("auc", "steps", "samples", "eval_samples", "gba", "world_size", "local_samples")}


def _config(tmp_path: Path, mode: str, timeout_s: float = 20) -> str:
    cfg = json.loads((ROOT / "ds_configs" / "gba_cpu.json").read_text())
    cfg["train_micro_batch_size_per_gpu"] = 32
    cfg["wandb"] = {"enabled": False}
    # gba: fully asynchronous (fast workers run ahead); auto: lockstep, so its switches are exact
    # heartbeat 0.5 s (lease 2.5 s): a loaded 2-core box can starve a heartbeat thread for over a second
    cfg["gba"].update(mode=mode, timeout_s=timeout_s, heartbeat_s=0.5, max_lead=None if mode == "gba" else 0,
                      switch={"slow_ratio": 1.5, "recover_ratio": 1.2, "window": 2, "min_dwell_steps": 2})
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / f"{mode}.json"
    path.write_text(json.dumps(cfg))
    return str(path)


@pytest.mark.parametrize("mode,steps,straggler", [("gba", 8, ["--straggler", "1:20"]),
                                                   ("auto", 24, ["--straggler", "1:8:3-9"]),
                                                   pytest.param("auto", 24, ["--straggler", "1:8:3-9", "--server-tables"],
                                                                marks=pytest.mark.soak)],
                         ids=["gba", "auto", "auto-server-tables"])
def test_train_rec_gba_block_on_workers_and_a_server(tmp_path, mode, steps, straggler):
    argv = [*SMALL, "--steps", str(steps), "--config", _config(tmp_path, mode), "--out", str(tmp_path / mode),
            *straggler]
    res = run_distributed(_run, 3, args=(argv,), timeout_s=110, init_process_group=False)
    w0, w1, server = res
    assert server == {"server": True}  # a server rank returns early, no summary
    # the job's steps x 2 workers batches are handed out by number: together the workers train exactly them
    assert w0["steps"] + w1["steps"] == steps * 2
    for w in (w0, w1):
        assert w["samples"] == steps * 32 * 2  # data over the 2 workers only
        assert w["eval_samples"] == 2048 and 0.0 < w["auc"] < 1.0
    assert w0["auc"] == w1["auc"]  # gathered over the worker group
    summary = json.loads((tmp_path / mode / "summary.json").read_text())
    switches = [(e["src"], e["dst"]) for e in summary["gba"]["switches"]]
    if mode == "gba":
        assert summary["gba"]["mode"] == "gba" and summary["gba"]["server_version"] >= 1
        assert w0["steps"] > w1["steps"]  # worker 1 is 20x slower: the fast worker takes more batches
    else:
        assert switches[:2] == [("sync", "gba"), ("gba", "sync")], switches
        assert summary["gba"]["steps_per_mode"].get("gba", 0) > 0
    if "--server-tables" in straggler:
        _check_server_tables(tmp_path / mode, summary)


def _check_server_tables(out: Path, summary: dict) -> None:
    import torch

    from gba_engine.checkpoint import load_tables
    from gba_engine.ps import ServerTableSpec
    from picasso_ops.models import WideAndDeep, WideAndDeepArgs

    plain = WideAndDeep(WideAndDeepArgs([200] * 26, num_dense=13, embedding_dim=16))
    tables = sum(p.numel() for n, p in plain.named_parameters() if "bags" in n)
    dense = sum(p.numel() for p in plain.parameters()) - tables
    # a switch hands over the dense layers with their two Adam moments and, from the sync phase's workers, the
    # deep (dim 16) and wide (dim 1) tables with their two Adam moments (gba.sync_tables "workers", the default)
    rows = 26 * 200
    table_bytes = rows * (16 + 1) * 3 * 4
    assert all(e["nbytes"] == dense * 3 * 4 + table_bytes for e in summary["gba"]["switches"]), \
        (dense, table_bytes, [e["nbytes"] for e in summary["gba"]["switches"]])
    saved = load_tables(out / "checkpoints" / (out / "checkpoints" / "latest").read_text(), 0, 1)
    assert len(saved) == 52 and saved["deep0"]["weight"].shape == (200, 16) and saved["wide25"]["weight"].shape == (200, 1)
    assert saved["deep0"]["steps"] == 24  # one update per global batch of the job, in every mode
    start = ServerTableSpec("deep0", 200, 16, init_std=0.01, seed=1234 * 100_003).initial_shard(0, 1)
    moved = (saved["deep0"]["weight"] - start).abs().amax(dim=1) > 0
    assert 0 < int(moved.sum()) < 200  # the rows the batches touched were trained, the others kept their start


def test_dlrm_with_server_tables_in_gba_mode(tmp_path):
    """--model dlrm --server-tables: DLRM's 26 tables live on the server and take the job's updates."""
    from gba_engine.checkpoint import load_tables

    out = tmp_path / "dlrm"
    argv = [*SMALL, "--steps", "6", "--config", _config(tmp_path, "gba"), "--out", str(out), "--server-tables",
            "--model", "dlrm"]
    w0, w1, server = run_distributed(_run, 3, args=(argv,), timeout_s=110, init_process_group=False)
    assert server == {"server": True} and w0["steps"] + w1["steps"] == 12
    assert 0.0 < w0["auc"] < 1.0 and w0["auc"] == w1["auc"]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["model"] == "dlrm" and summary["gba"]["server_version"] >= 1
    saved = load_tables(out / "checkpoints" / (out / "checkpoints" / "latest").read_text(), 0, 1)
    assert sorted(saved) == sorted(f"deep{i}" for i in range(26))  # no wide part in DLRM
    assert saved["deep0"]["weight"].shape == (200, 16) and saved["deep0"]["steps"] >= 1


def test_gba_run_saves_by_job_batches_and_resumes_from_them(tmp_path):
    """--save-every with numbered batches: checkpoints tagged by the job's batches; --resume takes only the rest."""
    cfg, out = _config(tmp_path, "gba"), str(tmp_path / "run")
    first = [*SMALL, "--steps", "4", "--save-every", "2", "--config", cfg, "--out", out]
    w0, w1, _ = run_distributed(_run, 3, args=(first,), timeout_s=110, init_process_group=False)
    assert w0["steps"] + w1["steps"] == 8 and w0["samples"] == 8 * 32
    tags = sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir() if p.is_dir())
    assert "batch8" in tags and len(tags) >= 2, tags  # a periodic save, then the final one at all 8 batches
    assert (tmp_path / "run" / "checkpoints" / "latest").read_text() == "batch8"
    resumed = [*SMALL, "--steps", "6", "--config", cfg, "--out", out, "--resume"]
    w0, w1, _ = run_distributed(_run, 3, args=(resumed,), timeout_s=110, init_process_group=False)
    assert w0["local_samples"] + w1["local_samples"] == 4 * 32  # batches 8..11 of the job's 12
    assert (tmp_path / "run" / "checkpoints" / "latest").read_text() == "batch12"


def test_gba_mode_on_criteo_files_hands_out_numbered_row_ranges(tmp_path):
    """gba with file data: batch k is rows [32k, 32k + 32) of the files; the fast worker takes more of them."""
    from tests.e2e.test_train_rec import _write_criteo

    train = _write_criteo(tmp_path / "train.tsv", 700, seed=0, bad_every=100)  # lines 100, 200, ... are bad
    evalf = _write_criteo(tmp_path / "eval.tsv", 256, seed=1)
    argv = ["--data", "criteo", "--train-files", str(train), "--eval-files", str(evalf), "--vocab", "64",
            "--threads", "1", "--max-bad-fraction", "0.05", "--steps", "100", "--straggler", "1:20",
            "--config", _config(tmp_path, "gba"), "--out", str(tmp_path / "files")]
    w0, w1, server = run_distributed(_run, 3, args=(argv,), timeout_s=110, init_process_group=False)
    assert server == {"server": True}
    # 700 rows hold 21 whole batches of 32 (rows 0-671, 6 of them bad): fewer than 100 steps x 2 workers
    assert w0["steps"] + w1["steps"] == 21 and w0["steps"] > w1["steps"]
    assert w0["samples"] == 672 - 6 and w0["eval_samples"] == 256 and 0.0 < w0["auc"] < 1.0


@pytest.mark.soak
def test_gba_job_goes_on_without_a_crashed_worker_and_scores_its_eval_shard(tmp_path):
    """--crash 1:3 in gba mode: worker 0 trains every remaining batch and scores the whole held-out set."""
    # timeout 5 s: the servers give a silent worker timeout_s to come back before they end the job
    argv = [*SMALL, "--steps", "8", "--crash", "1:3", "--config", _config(tmp_path, "gba", timeout_s=5),
            "--out", str(tmp_path / "c")]
    w0, dead, server = run_distributed(_run, 3, args=(argv,), timeout_s=110, init_process_group=False,
                                       expect_exit={1: 17})
    assert dead is None and server == {"server": True}
    assert w0["steps"] == 16 - 3  # the job's 8 x 2 batches less the 3 the dead worker trained
    assert w0["eval_samples"] == 2048 and 0.0 < w0["auc"] < 1.0  # its own shard and the dead worker's
    assert w0["gba"]["lost_workers"] == [1] and w0["gba"]["rejoined_workers"] == []


_REJOINER = """
import json, os, sys, threading, time
threading.Timer(100, lambda: os._exit(3)).start()  # never outlives the test
os.environ["WANDB_MODE"] = "offline"
from gba_engine.ps import PSConnectionError
from tests.e2e.test_train_rec import _train_rec
train_rec = _train_rec()
argv, result = json.loads(sys.argv[1]), sys.argv[2]
deadline = time.monotonic() + 80
while True:  # a supervisor: retry until the job is up and the old process is gone
    try:
        summary = train_rec.train(train_rec.parse_args(argv))
        break
    except (ValueError, PSConnectionError) as exc:
        if time.monotonic() > deadline:
            raise
        time.sleep(0.3)
keys = ("auc", "steps", "samples", "eval_samples", "gba", "local_samples")
open(result, "w").write(json.dumps({k: summary[k] for k in keys}))
os._exit(0)
"""


@pytest.mark.soak
def test_crashed_worker_is_replaced_by_train_rec_rejoin_as(tmp_path):
    """--crash 1:3, then `train_rec.py --rejoin-as 1` (same config and --out) takes the job's next batches."""
    import subprocess
    import sys

    argv = [*SMALL, "--steps", "40", "--config", _config(tmp_path, "gba"), "--out", str(tmp_path / "r")]
    log = open(tmp_path / "rejoiner.log", "w")
    proc = subprocess.Popen([sys.executable, "-c", _REJOINER, json.dumps([*argv, "--rejoin-as", "1"]),
                             str(tmp_path / "rejoiner.json")], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    try:
        # worker 0 is slowed (100x its first steps' compute) so that the job still runs when the new process is in;
        # once in, the new process (not slowed) takes most of the remaining batches
        w0, dead, server = run_distributed(_run, 3, args=([*argv, "--crash", "1:3", "--straggler", "0:100"],),
                                           timeout_s=120, init_process_group=False, expect_exit={1: 17})
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()
    assert proc.returncode == 0, (tmp_path / "rejoiner.log").read_text()[-4000:]
    new = json.loads((tmp_path / "rejoiner.json").read_text())
    assert w0["steps"] + 3 + new["steps"] == 80 and new["steps"] >= 1  # every batch of the job trained once
    assert w0["eval_samples"] == new["eval_samples"] == 2048 and w0["auc"] == new["auc"]  # scored together
    assert w0["samples"] == new["samples"]  # the live workers' samples, gathered over the control plane
    assert w0["gba"]["rejoined_workers"] == [1] and w0["gba"]["lost_workers"] == []
