"""The divergence guard: a diverging run stops with a clear error, exit non-zero, and keeps (and names) the last good
checkpoint, or says that none was written yet."""
import json
from pathlib import Path

import pytest

from sparse_scale.divergence import DivergenceError, DivergenceGuard
from sparse_scale.multiproc import run_distributed

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["--eval-samples", "512", "--vocab", "200", "--threads", "1"]


class _FakeDeepSpeed:
    """What the guard reads of a DeepSpeed engine: its skipped-step counter and the last gradient norm."""

    def __init__(self) -> None:
        self.skipped_steps, self.norm = 0, 1.0

    def get_global_grad_norm(self) -> float:
        return self.norm


def _steps(guard: DivergenceGuard, ds: _FakeDeepSpeed, skips: list[bool], loss: float = 0.5) -> int:
    for step, skipped in enumerate(skips, start=1):
        guard.start_step(ds)
        guard.loss(loss)
        ds.skipped_steps += int(skipped)
        guard.end_step(step, ds)
    return len(skips)


def test_skipped_steps_in_a_row_stop_only_past_the_limit():
    guard, ds = DivergenceGuard(max_skipped_steps=3), _FakeDeepSpeed()
    _steps(guard, ds, [True, True, True, False, True, True, True])  # warm-up style bursts reset on an applied step
    guard.start_step(ds)
    ds.skipped_steps += 1
    with pytest.raises(DivergenceError, match=r"at step 8: 4 optimizer steps in a row were skipped.*steps 5-8"):
        guard.end_step(8, ds)


def test_non_finite_loss_and_grad_norm_name_step_and_value():
    guard, ds = DivergenceGuard(max_skipped_steps=5), _FakeDeepSpeed()
    guard.start_step(ds)
    guard.loss(float("inf"))
    with pytest.raises(DivergenceError, match=r"at step 3: loss is inf .*hidden states entering the MoE layers"):
        guard.end_step(3, ds)
    guard.start_step(ds)
    guard.loss(0.3)
    ds.norm = float("nan")
    with pytest.raises(DivergenceError, match=r"at step 4: the gradient norm is nan.*lower learning rate"):
        guard.end_step(4, ds)
    with pytest.raises(ValueError, match="--max-skipped-steps 0"):
        DivergenceGuard(max_skipped_steps=0)


def test_the_message_names_the_last_checkpoint_or_says_there_is_none(tmp_path):
    guard, ds = DivergenceGuard(max_skipped_steps=5), _FakeDeepSpeed()
    guard.start_step(ds)
    guard.loss(float("nan"))
    with pytest.raises(DivergenceError) as info:
        guard.end_step(1, ds)
    assert "no checkpoint was written yet, so there is nothing to resume from" in str(info.value)
    assert "is kept" not in str(info.value)

    guard = DivergenceGuard(max_skipped_steps=5, last_checkpoint=tmp_path / "step2")  # e.g. the one resumed from
    guard.checkpoint_saved(tmp_path / "step4")
    guard.start_step(ds)
    guard.loss(float("inf"))
    with pytest.raises(DivergenceError) as info:
        guard.end_step(5, ds)
    assert f"the last good checkpoint {tmp_path / 'step4'} is kept (resume from it with --resume)" in str(info.value)


def test_non_finite_parameters_are_never_checkpointed():
    import torch

    net = torch.nn.Linear(2, 2)
    DivergenceGuard().check_params(net, 5)
    with torch.no_grad():
        net.bias[0] = float("nan")
    with pytest.raises(DivergenceError, match="parameter bias holds NaN/inf; not saving it"):
        DivergenceGuard().check_params(net, 5)


def _config(tmp_path: Path, lr: float) -> str:
    cfg = json.loads((ROOT / "ds_configs" / "demo_cpu.json").read_text())
    cfg["train_micro_batch_size_per_gpu"] = 32
    cfg["optimizer"]["params"]["lr"] = lr
    cfg["scheduler"]["params"].update(warmup_max_lr=lr, warmup_num_steps=1, total_num_steps=1000)
    cfg["wandb"] = {"enabled": False}
    cfg.pop("gradient_clipping")  # the finding's run: nothing holds the updates back
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps(cfg))
    return str(path)


def _cli(rank, world_size, argv, module="sparse_scale.rec.cli"):
    """Run a CLI's main like the entry script does; the exit status and message it ends with."""
    import importlib
    import os

    os.environ["WANDB_MODE"] = "offline"
    main = importlib.import_module(module).main

    try:
        main(argv)
    except SystemExit as exc:
        return {"code": exc.code if isinstance(exc.code, int) else 1, "message": str(exc.code)}
    return {"code": 0, "message": ""}


def _poison_after(step: int):
    """A model factory whose model starts emitting NaN logits after ``step`` forwards (a diverged run, made certain)."""
    from sparse_scale.rec.model import build_model

    def factory(job):
        net = build_model(job)
        calls = {"n": 0}

        def hook(module, inputs, output):
            calls["n"] += 1
            return output * float("nan") if calls["n"] > step else output

        net.register_forward_hook(hook)
        return net
    return factory


def _run_poisoned(rank, world_size, argv, step, what="logits"):
    import os

    os.environ["WANDB_MODE"] = "offline"
    from sparse_scale.rec import runner
    from sparse_scale.rec.cli import job_config, parse_args
    from sparse_scale.rec.loop import TrainingDivergedError

    try:
        factory = _poison_after(step) if what == "logits" else _inf_grads_after(step)
        runner.run(job_config(parse_args(argv)), model_factory=factory)
    except TrainingDivergedError as exc:
        return str(exc)
    return None


def test_diverging_rec_job_stops_and_keeps_the_last_good_checkpoint(tmp_path):
    out = tmp_path / "run"
    argv = [*SMALL, "--config", _config(tmp_path, 0.003), "--out", str(out), "--steps", "12", "--save-every", "2"]
    got = run_distributed(_run_poisoned, 2, args=(argv, 5), timeout_s=40, init_process_group=False)
    assert got[0] is not None and got[1] is not None, "both ranks must stop, none may hang"
    assert "training diverged at step 6" in got[0] and "loss is nan" in got[0]
    ckpt = out / "checkpoints"
    for message in got:  # names the checkpoint to resume from, on every rank
        assert f"the last good checkpoint {ckpt / 'step4'} is kept (resume from it with --resume)" in message, message
    assert (ckpt / "latest").read_text() == "step4"  # step 6 diverged: never saved over the good one
    assert sorted(p.name for p in ckpt.iterdir() if p.is_dir() and not p.name.startswith(".")) == ["step2", "step4"]
    assert not (out / "summary.json").exists()


def test_diverging_before_any_save_says_there_is_no_checkpoint(tmp_path):
    out = tmp_path / "run"
    argv = [*SMALL, "--config", _config(tmp_path, 0.003), "--out", str(out), "--steps", "12"]
    got = run_distributed(_run_poisoned, 1, args=(argv, 3), timeout_s=40, init_process_group=False)[0]
    assert got is not None and "training diverged at step 4" in got, got
    assert "no checkpoint was written yet, so there is nothing to resume from" in got and "is kept" not in got, got
    assert not (out / "checkpoints" / "latest").exists()


def test_huge_learning_rate_exits_non_zero_with_a_clear_message(tmp_path):
    out = tmp_path / "run"
    argv = [*SMALL, "--config", _config(tmp_path, 1e12), "--out", str(out), "--steps", "40",
            "--max-skipped-steps", "3"]
    got = run_distributed(_cli, 1, args=(argv,), timeout_s=40, init_process_group=False)[0]
    assert got["code"] != 0
    assert "training diverged at step" in got["message"], got["message"]
    assert any(word in got["message"] for word in ("skipped", "non-finite", "NaN/inf")), got["message"]
    assert "lower learning rate" in got["message"]
    assert not (out / "summary.json").exists()


def _inf_grads_after(step: int):
    """A model factory whose gradients turn inf after ``step`` backwards while the loss stays finite."""
    from sparse_scale.rec.model import build_model

    def factory(job):
        net = build_model(job)
        first = next(p for p in net.parameters() if p.requires_grad)
        calls = {"n": 0}

        def hook(grad):
            calls["n"] += 1
            return grad * float("inf") if calls["n"] > step else grad

        first.register_hook(hook)
        return net
    return factory


def test_overflow_skipped_steps_in_a_row_stop_a_real_deepspeed_run(tmp_path):
    out = tmp_path / "run"
    argv = [*SMALL, "--config", _config(tmp_path, 0.003), "--out", str(out), "--steps", "30", "--save-every", "2",
            "--max-skipped-steps", "3"]
    got = run_distributed(_run_poisoned, 1, args=(argv, 4, "grads"), timeout_s=40, init_process_group=False)[0]
    # ZeRO 1 finds the inf gradients and skips steps 5, 6, 7, 8: the 4th in a row is past the limit
    assert got is not None and "training diverged at step 8: 4 optimizer steps in a row were skipped" in got, got
    # skipped steps leave the weights alone, so step 6 is a good state; step 8, where the guard stopped, is not saved
    assert (out / "checkpoints" / "latest").read_text() == "step6"
    assert not (out / "checkpoints" / "step8").exists()


# --- the MoE LM job ---------------------------------------------------------------------------------------------

def test_diverging_moe_lm_exits_non_zero_and_keeps_the_last_good_checkpoint(tmp_path):
    from tests.e2e.test_train_moe_lm import _argv, _config as lm_config, _data

    data, cfg_path = _data(tmp_path), Path(lm_config(tmp_path))
    cfg = json.loads(cfg_path.read_text())
    cfg["optimizer"]["params"]["lr"] = 1e12
    cfg.pop("scheduler", None)
    cfg.pop("gradient_clipping", None)
    cfg_path.write_text(json.dumps(cfg))
    out = tmp_path / "lm"
    argv = [*_argv(str(cfg_path), data, out, 30), "--save-every", "1", "--max-skipped-steps", "3"]
    got = run_distributed(_cli, 1, args=(argv, "sparse_scale.lm.cli"), timeout_s=40, init_process_group=False)[0]
    assert got["code"] != 0 and "training diverged at step" in got["message"], got
    step = int(got["message"].split("training diverged at step ")[1].split(":")[0])
    latest = (out / "checkpoints" / "latest").read_text() if (out / "checkpoints" / "latest").exists() else None
    assert latest != f"step{step}" and not (out / "checkpoints" / f"step{step}").exists()
    if latest is None:
        assert "no checkpoint was written yet, so there is nothing to resume from" in got["message"], got
    else:
        assert f"the last good checkpoint {out / 'checkpoints' / latest} is kept" in got["message"], got
    assert not (out / "summary.json").exists()


# --- ranks agree every AGREE_EVERY steps, before each save, and when DeepSpeed's checks stop the run -------------

def _one_rank_goes_nan(rank, world_size, scenario):
    """Run a guard in lockstep over real gloo ranks; the (step, message) where this rank stopped, or None.

    Rank 1's loss is NaN at step 5 (not a multiple of AGREE_EVERY); in "two", rank 0's turns inf at step 9 as well;
    in "save", the loop checks the parameters before a save at step 7; in "norm", DeepSpeed's global gradient norm
    (the same on every rank) is NaN at step 5.
    """
    import torch

    from sparse_scale.divergence import AGREE_EVERY

    guard, ds, net = DivergenceGuard(max_skipped_steps=5), _FakeDeepSpeed(), torch.nn.Linear(2, 1)
    for step in range(1, 2 * AGREE_EVERY + 1):
        guard.start_step(ds)
        loss = float("nan") if (rank == 1 and step == 5) else 0.5
        if scenario == "two" and rank == 0 and step >= 9:
            loss = float("inf")
        guard.loss(loss)
        ds.norm = float("nan") if scenario == "norm" and step == 5 else 1.0
        try:
            guard.end_step(step, ds)
            if scenario == "save" and step == 7:
                guard.check_params(net, step)
        except DivergenceError as exc:
            return step, str(exc)
    return None


@pytest.mark.parametrize("scenario", ["two", "save", "norm"])
def test_a_nan_loss_on_one_rank_stops_every_rank_naming_its_step_and_rank(scenario):
    from sparse_scale.divergence import AGREE_EVERY

    got = run_distributed(_one_rank_goes_nan, 2, args=(scenario,), timeout_s=40)
    stop = {"two": AGREE_EVERY, "save": 7, "norm": 5}[scenario]
    assert [g[0] if g else None for g in got] == [stop, stop], got  # every rank, at the same step
    for _, message in got:
        assert message.startswith("training diverged at step 5: loss is nan on rank 1 (non-finite"), message
        assert ("every rank stopped at step" in message) == (stop != 5), message


def _count_agreements(rank, world_size, agree_every, lockstep, steps):
    """How many all_reduce calls the guard makes over ``steps`` healthy optimizer steps, and with check_params."""
    import torch
    import torch.distributed as dist

    calls = {"n": 0}
    real = dist.all_reduce

    def counting(*args, **kwargs):
        calls["n"] += 1
        return real(*args, **kwargs)

    dist.all_reduce = counting  # this rank's process only
    guard, ds = DivergenceGuard(group=None, lockstep=lockstep, agree_every=agree_every), _FakeDeepSpeed()
    for step in range(1, steps + 1):
        guard.start_step(ds)
        guard.loss(0.5)
        guard.end_step(step, ds)
    in_steps = calls["n"]
    guard.check_params(torch.nn.Linear(2, 1), steps)  # a save or the end: one collective for loss and parameters
    return in_steps, calls["n"] - in_steps


def test_the_guard_all_reduces_once_every_k_steps_and_once_per_check_params():
    from sparse_scale.divergence import AGREE_EVERY

    steps = 3 * AGREE_EVERY + 5
    got = run_distributed(_count_agreements, 2, args=(None, True, steps), timeout_s=40)
    assert got == [(3, 1), (3, 1)], got  # N // K in the steps, whatever rank
    assert run_distributed(_count_agreements, 2, args=(1, True, 7), timeout_s=40) == [(7, 1), (7, 1)]
    assert run_distributed(_count_agreements, 2, args=(4, False, 9), timeout_s=40) == [(0, 0), (0, 0)]  # gba


def test_agree_every_must_be_a_positive_int():
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match=r"agree_every=.*must be an int >= 1"):
            DivergenceGuard(agree_every=bad)
