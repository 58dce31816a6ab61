"""The MoE LM job end to end on real gloo ranks: training, held-out bits/byte, checkpoint and resume.

The job is the library ``sparse_scale.lm`` (``run(LMJobConfig) -> LMSummary``); its command line
(``sparse_scale.lm.cli``, ``launch/train_moe_lm.py``, ``python -m sparse_scale.lm``) only parses flags and prints.
"""
import contextlib
import dataclasses
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

from sparse_scale.multiproc import run_distributed

ROOT = Path(__file__).resolve().parents[2]
# summary.json's keys in order, as launch/train_moe_lm.py wrote them before it became a library.
SUMMARY_KEYS = ["world_size", "launcher", "steps", "tokens", "tokens_per_s", "train_time_s", "params", "num_experts",
                "num_prototypes", "top_k", "train_files", "heldout_files", "eval_loss", "eval_bits_per_byte",
                "eval_tokens", "checkpoint", "wandb_mode", "wandb_dir"]
KEYS = ("steps", "tokens", "eval_loss", "eval_bits_per_byte", "eval_tokens", "checkpoint", "tokens_per_s")


def _run_cli(rank, world_size, argv):
    """The command line in a rank: what it printed on stdout, and summary.json's keys it produced."""
    import os

    from sparse_scale.lm.cli import main

    os.environ["WANDB_MODE"] = "offline"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        main(argv)
    return printed.getvalue()


def _run_job(rank, world_size, job_fields):
    """The library in a rank: ``run(LMJobConfig(...))`` called directly, no flags."""
    import os

    from sparse_scale.lm import LMJobConfig, run

    os.environ["WANDB_MODE"] = "offline"
    s = run(LMJobConfig(**job_fields))
    return {k: getattr(s, k) for k in KEYS}


def _data(tmp_path):
    folder = tmp_path / "texts"
    folder.mkdir()
    src = sorted((ROOT / "moe_proto").glob("*.py")) + sorted((ROOT / "launch").glob("*.py"))
    for f in src:
        (folder / f.name).write_bytes(f.read_bytes())
    return str(folder)


def _config(tmp_path, **moe):
    cfg = json.loads((ROOT / "ds_configs" / "moe_lm_cpu.json").read_text())
    cfg["train_micro_batch_size_per_gpu"] = 2
    cfg["wandb"] = {"enabled": False}
    cfg["moe_model"] = {"num_layers": 2, "d_model": 32, "num_heads": 2, "ffn_hidden_size": 64, "seq_len": 32}
    cfg["moe_proto"].update(moe_every=1, num_experts=4, **moe)
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps(cfg))
    return str(path)


def _job(cfg, data, out, steps, **more):
    return dict(config=cfg, data=data, steps=steps, out=str(out), threads=1, eval_tokens=3000, heldout_fraction=0.2,
                show_progress=False, **more)


def _argv(cfg, data, out, steps):
    return ["--config", cfg, "--data", data, "--steps", str(steps), "--out", str(out), "--threads", "1",
            "--eval-tokens", "3000", "--heldout-fraction", "0.2"]


def test_one_rank_trains_evaluates_and_checkpoints(tmp_path):
    data, cfg = _data(tmp_path), _config(tmp_path)
    (out,) = run_distributed(_run_job, 1, args=(_job(cfg, data, tmp_path / "a", 4),), timeout_s=300,
                             init_process_group=False)
    assert out["steps"] == 4 and out["tokens"] == 4 * 2 * 32
    assert out["eval_tokens"] == 3000
    assert out["eval_bits_per_byte"] == pytest.approx(out["eval_loss"] / 0.6931471805599453)
    assert 0 < out["eval_bits_per_byte"] < 9 and out["tokens_per_s"] > 0
    assert Path(out["checkpoint"], "moe_proto", "dense.pt").is_file()
    summary = json.loads((tmp_path / "a" / "summary.json").read_text())
    assert summary["num_experts"] == 4 and summary["heldout_files"] >= 1
    assert {k: summary[k] for k in KEYS} == out  # summary.json is the returned LMSummary


def test_cli_writes_the_summary_and_prints_its_table(tmp_path):
    from sparse_scale.lm import LMSummary

    data, cfg = _data(tmp_path), _config(tmp_path)
    (printed,) = run_distributed(_run_cli, 1, args=(_argv(cfg, data, tmp_path / "a", 2),), timeout_s=300,
                                 init_process_group=False)
    summary = json.loads((tmp_path / "a" / "summary.json").read_text())
    assert list(summary) == SUMMARY_KEYS == [f.name for f in dataclasses.fields(LMSummary)]
    assert summary["steps"] == 2 and summary["wandb_mode"] == "offline"
    assert summary["world_size"] == 1 and summary["checkpoint"].endswith("step2")
    table = {line.split("  ")[0]: line.split("  ", 1)[1].strip() for line in printed.splitlines()
             if "  " in line and not line.startswith("-")}
    assert table["ranks"] == f"1 ({summary['launcher']})" and table["steps / tokens"] == "2 / 128"
    assert table["bits per byte"] == f"{summary['eval_bits_per_byte']:.4f}"
    assert table["model"].endswith("4 experts, 2 prototype(s) x top-1")
    assert table["checkpoint"] == summary["checkpoint"]


@pytest.mark.slow
def test_two_ranks_train_and_resume_exactly(tmp_path):
    """Stop after 2 of 4 steps and resume: the same model as the straight run (expert param group, WarmupLR)."""
    data, cfg = _data(tmp_path), _config(tmp_path, num_prototypes=2)
    straight = run_distributed(_run_job, 2, args=(_job(cfg, data, tmp_path / "a", 4),), timeout_s=300,
                               init_process_group=False)
    assert straight[0]["tokens"] == 4 * 2 * 32 * 2
    assert straight[0]["eval_loss"] == straight[1]["eval_loss"]  # all-reduced over the ranks' shares
    run_distributed(_run_job, 2, args=(_job(cfg, data, tmp_path / "b", 2),), timeout_s=300, init_process_group=False)
    resumed = run_distributed(_run_job, 2, args=(_job(cfg, data, tmp_path / "b", 4, resume=True),), timeout_s=300,
                              init_process_group=False)
    assert resumed[0]["tokens"] == straight[0]["tokens"]
    # Same windows in the same order, restored weights, Adam state and lr (WarmupLR alone leaves the resumed
    # step 3 at warmup_min_lr): the same model.
    assert resumed[0]["eval_loss"] == pytest.approx(straight[0]["eval_loss"], abs=1e-6)


def test_missing_model_block_is_a_clear_error(tmp_path):
    from sparse_scale.lm import model_args_from_config

    cfg = json.loads((ROOT / "ds_configs" / "moe_lm_cpu.json").read_text())
    del cfg["moe_model"]
    path = tmp_path / "c.json"
    path.write_text(json.dumps(cfg))
    with pytest.raises(Exception, match="no 'moe_model' block"):
        model_args_from_config(str(path))


def test_resume_without_a_checkpoint_is_a_clear_error(tmp_path):
    from sparse_scale.lm import NoCheckpointError
    from sparse_scale.lm.checkpoints import load_job_checkpoint

    with pytest.raises(NoCheckpointError, match="no checkpoint found in"):
        load_job_checkpoint(engine=None, ckpt_dir=tmp_path / "checkpoints")


@pytest.mark.parametrize("command", [["launch/train_moe_lm.py"], ["-m", "sparse_scale.lm"]])
def test_entry_points_need_no_path_edits(command):
    """The launch script and ``python -m`` both reach the CLI from anywhere (the package is installed)."""
    done = subprocess.run([sys.executable, *[str(ROOT / c) if c.endswith(".py") else c for c in command], "--help"],
                          cwd="/", capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "--heldout-fraction" in done.stdout and "--resume" in done.stdout


@pytest.mark.slow
def test_two_ranks_train_and_resume_under_zero_stage_3_with_expert_parallelism(tmp_path):
    """ZeRO-3 (the layers are ZeRO3MoE), ep=2, prototypes: stop after 2 of 4 steps, resume, same model."""
    data, cfg = _data(tmp_path), _config(tmp_path, num_prototypes=2, ep_size=2)
    raw = json.loads(Path(cfg).read_text())
    raw["zero_optimization"] = {"stage": 3}
    Path(cfg).write_text(json.dumps(raw))
    straight = run_distributed(_run_job, 2, args=(_job(cfg, data, tmp_path / "a", 4),), timeout_s=300,
                               init_process_group=False)
    assert straight[0]["steps"] == 4 and straight[0]["eval_loss"] == straight[1]["eval_loss"]
    assert 0 < straight[0]["eval_bits_per_byte"] < 9
    run_distributed(_run_job, 2, args=(_job(cfg, data, tmp_path / "b", 2),), timeout_s=300, init_process_group=False)
    resumed = run_distributed(_run_job, 2, args=(_job(cfg, data, tmp_path / "b", 4, resume=True),), timeout_s=300,
                              init_process_group=False)
    assert resumed[0]["eval_loss"] == pytest.approx(straight[0]["eval_loss"], abs=1e-6)
