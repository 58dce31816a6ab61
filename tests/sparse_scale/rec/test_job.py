"""sparse_scale.rec as a library: run(RecJobConfig(...)) on one rank, a resume, and the console script's edge."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from sparse_scale.multiproc import run_distributed

ROOT = Path(__file__).resolve().parents[3]
SUMMARY_KEYS = {"model", "world_size", "launcher", "steps", "samples", "samples_per_s", "train_time_s",
                "local_samples", "auc", "log_loss", "eval_samples", "bayes_auc", "bayes_log_loss", "checkpoint",
                "wandb_mode", "wandb_dir", "eval_history"}


def _config(tmp_path: Path) -> str:
    cfg = json.loads((ROOT / "ds_configs" / "demo_cpu.json").read_text())
    # a fixed schedule length: "auto" would follow steps, which differs between the halves of the resumed run
    cfg["scheduler"]["params"].update(total_num_steps=4, warmup_num_steps=1)
    cfg.update(train_micro_batch_size_per_gpu=64, wandb={"enabled": False})
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps(cfg))
    return str(path)


def _three_runs(rank: int, world_size: int, config: str, out: str) -> dict:
    """In one process: 4 steps straight, then 2 steps and a resume to 4, all through ``run``."""
    import dataclasses

    from sparse_scale.rec import RecJobConfig, RecSummary, run

    job = RecJobConfig(config=config, steps=4, vocab=100, eval_samples=1024, threads=1, eval_every=2,
                       out=f"{out}/straight")
    straight = run(job, wandb_mode="disabled")
    assert isinstance(straight, RecSummary) and not straight.is_server
    half = run(dataclasses.replace(job, steps=2, eval_every=0, out=f"{out}/half"), wandb_mode="disabled")
    resumed = run(dataclasses.replace(job, eval_every=0, out=f"{out}/half", resume=True), wandb_mode="disabled")
    return {"straight": straight.to_dict(), "half": half.to_dict(), "resumed": resumed.to_dict()}


@pytest.mark.slow
def test_run_trains_reports_and_resumes_exactly(tmp_path):
    out = tmp_path / "runs"
    got = run_distributed(_three_runs, 1, args=(_config(tmp_path), str(out)), timeout_s=170,
                          init_process_group=False)[0]
    straight, half, resumed = got["straight"], got["half"], got["resumed"]
    assert set(straight) == SUMMARY_KEYS  # no picasso or gba part without those blocks
    assert (straight["steps"], straight["samples"], straight["local_samples"]) == (4, 4 * 64, 4 * 64)
    assert (straight["world_size"], straight["launcher"], straight["model"]) == (1, "env", "wide_deep")
    assert straight["eval_samples"] == 1024 and 0.0 < straight["auc"] < 1.0 and straight["bayes_auc"] > 0.7
    assert [h["step"] for h in straight["eval_history"]] == [2]  # every 2 steps, not again at the end
    assert straight["wandb_mode"] == "disabled" and straight["wandb_dir"] is None
    assert json.loads((out / "straight" / "summary.json").read_text()) == straight  # rank 0 wrote to_dict()
    assert Path(straight["checkpoint"]).name == "step4" and Path(straight["checkpoint"]).is_dir()
    assert half["steps"] == 2 and Path(half["checkpoint"]).name == "step2"
    # the resumed run trains steps 3 and 4 on the same batches with the restored optimizer: the straight run's result
    assert (resumed["steps"], resumed["samples"], resumed["local_samples"]) == (4, 4 * 64, 2 * 64)
    assert resumed["log_loss"] == pytest.approx(straight["log_loss"], abs=1e-6)
    assert resumed["auc"] == pytest.approx(straight["auc"], abs=1e-6)


def test_run_refuses_a_combination_before_starting_anything(tmp_path):
    from sparse_scale.rec import CombinationError, RecJobConfig, run

    job = RecJobConfig(config=_config(tmp_path), server_tables=True)
    with pytest.raises(CombinationError, match="--server-tables needs a gba block") as err:
        run(job)  # no ctx: it would start torch.distributed, but the refusal comes first
    assert err.value.rule == "server-tables-without-gba"


def test_job_config_rejects_unknown_kinds(tmp_path):
    from sparse_scale.rec import RecJobConfig, RecJobError

    with pytest.raises(RecJobError, match="--data 'csv'"):
        RecJobConfig(config=_config(tmp_path), data="csv")  # type: ignore[arg-type]
    with pytest.raises(RecJobError, match="--model 'mlp'"):
        RecJobConfig(config=_config(tmp_path), model="mlp")  # type: ignore[arg-type]
    with pytest.raises(RecJobError, match="--steps -1: must be >= 1"):
        RecJobConfig(config=_config(tmp_path), steps=-1)


def test_cli_flags_become_the_job_config(tmp_path):
    from sparse_scale.rec.cli import job_config, parse_args
    from sparse_scale.rec.faults import Crash, Straggler

    cfg = _config(tmp_path)
    job = job_config(parse_args(["--config", cfg, "--steps", "7", "--straggler", "1:4:2-5", "--straggler", "0:2",
                                 "--crash", "1:3", "--data", "criteo", "--train-files", "a.tsv", "b.tsv",
                                 "--model", "dlrm"]))
    assert (job.steps, job.data, job.train_files, job.model) == (7, "criteo", ("a.tsv", "b.tsv"), "dlrm")
    assert job.stragglers == (Straggler(1, 4.0, 2, 5), Straggler(0, 2.0)) and job.crash == Crash(1, 3)
    assert job.loaded.ds["train_micro_batch_size_per_gpu"] == 64


def test_main_turns_a_job_error_into_an_exit_message(tmp_path):
    from sparse_scale.rec.cli import main

    with pytest.raises(SystemExit, match=r"cfg\.json: --rejoin-as needs a gba block"):
        main(["--config", _config(tmp_path), "--rejoin-as", "1", "--out", str(tmp_path / "o")])


def test_bad_fault_flags_are_usage_errors(tmp_path, capsys):
    from sparse_scale.rec.cli import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--config", "x.json", "--straggler", "1:0.5"])
    assert "--straggler '1:0.5': RANK must be >= 0 and FACTOR a finite number >= 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args(["--config", "x.json", "--crash", "1"])
    assert "--crash '1'" in capsys.readouterr().err


@pytest.mark.parametrize("cmd", [[str(Path(sys.executable).parent / "sparse-train-rec"), "--help"],
                                 [sys.executable, "-m", "sparse_scale.rec", "--help"],
                                 [sys.executable, "launch/train_rec.py", "--help"]],
                         ids=["console-script", "module", "script"])
def test_entry_points_show_the_flags(cmd):
    # make test installs the project (pip install -e .): a missing console script is a packaging defect, not a skip
    assert Path(cmd[0]).exists(), f"{cmd[0]} not installed: setup.py's console_scripts did not install it"
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "--rejoin-as WORKER" in out.stdout and "--straggler RANK:FACTOR[:START-END]" in out.stdout
