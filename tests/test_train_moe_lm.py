"""The MoE LM job end to end on real gloo ranks: training, held-out bits/byte, checkpoint and resume."""
import importlib
import json
from pathlib import Path

import pytest

from sparse_scale.multiproc import run_distributed

ROOT = Path(__file__).resolve().parents[1]


def _module():
    return importlib.import_module("launch.train_moe_lm")


def _run(rank, world_size, argv):
    import os

    os.environ["WANDB_MODE"] = "offline"
    mod = _module()
    s = mod.train(mod.parse_args(argv))
    return {k: s[k] for k in ("steps", "tokens", "eval_loss", "eval_bits_per_byte", "eval_tokens", "checkpoint",
                              "tokens_per_s")}


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


def _argv(cfg, data, out, steps):
    return ["--config", cfg, "--data", data, "--steps", str(steps), "--out", str(out), "--threads", "1",
            "--eval-tokens", "3000", "--heldout-fraction", "0.2"]


def test_one_rank_trains_evaluates_and_checkpoints(tmp_path):
    data, cfg = _data(tmp_path), _config(tmp_path)
    (out,) = run_distributed(_run, 1, args=(_argv(cfg, data, tmp_path / "a", 4),), timeout_s=300,
                             init_process_group=False)
    assert out["steps"] == 4 and out["tokens"] == 4 * 2 * 32
    assert out["eval_tokens"] == 3000
    assert out["eval_bits_per_byte"] == pytest.approx(out["eval_loss"] / 0.6931471805599453)
    assert 0 < out["eval_bits_per_byte"] < 9 and out["tokens_per_s"] > 0
    assert Path(out["checkpoint"], "moe_proto", "dense.pt").is_file()
    summary = json.loads((tmp_path / "a" / "summary.json").read_text())
    assert summary["num_experts"] == 4 and summary["heldout_files"] >= 1


@pytest.mark.slow
def test_two_ranks_train_and_resume_exactly(tmp_path):
    """Stop after 2 of 4 steps and resume: the same model as the straight run (expert param group, WarmupLR)."""
    data, cfg = _data(tmp_path), _config(tmp_path, num_prototypes=2)
    straight = run_distributed(_run, 2, args=(_argv(cfg, data, tmp_path / "a", 4),), timeout_s=300,
                               init_process_group=False)
    assert straight[0]["tokens"] == 4 * 2 * 32 * 2
    assert straight[0]["eval_loss"] == straight[1]["eval_loss"]  # all-reduced over the ranks' shares
    run_distributed(_run, 2, args=(_argv(cfg, data, tmp_path / "b", 2),), timeout_s=300, init_process_group=False)
    resumed = run_distributed(_run, 2, args=([*_argv(cfg, data, tmp_path / "b", 4), "--resume"],), timeout_s=300,
                              init_process_group=False)
    assert resumed[0]["tokens"] == straight[0]["tokens"]
    # Same windows in the same order, restored weights, Adam state and lr (WarmupLR alone leaves the resumed
    # step 3 at warmup_min_lr): the same model.
    assert resumed[0]["eval_loss"] == pytest.approx(straight[0]["eval_loss"], abs=1e-6)


def test_missing_model_block_is_a_clear_error(tmp_path):
    cfg = json.loads((ROOT / "ds_configs" / "moe_lm_cpu.json").read_text())
    del cfg["moe_model"]
    path = tmp_path / "c.json"
    path.write_text(json.dumps(cfg))
    with pytest.raises(Exception, match="no 'moe_model' block"):
        _module().model_args_from_config(str(path))
