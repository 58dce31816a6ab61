"""Training hygiene of the rec job: keep-best and early stopping, the finite-explosion guard, embedding weight decay.

Unit tests (the tracker, the guard, the optimizers against torch's and written-out references) need no
process group; the job tests run sparse-train-rec in spawned processes on tiny Criteo TSV files or the
synthetic stream: the issue's lr 1e6 demo run must exit non-zero, a healthy demo run must not, the kept
checkpoint's log loss is the best of its run (scored again from OUT/best), and early stopping stops.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from picasso_ops.embedding import PackedEmbeddingCollection
from picasso_ops.embedding.sparse_optim import LazyAdam, RowUpdate, RowWiseAdagrad, SparseSGD, create_optimizer
from sparse_scale.divergence import AGREE_EVERY, EXPLOSION_WINDOW, DivergenceError, DivergenceGuard, bce_entropy
from sparse_scale.multiproc import run_distributed
from sparse_scale.rec.early_stop import EarlyStopping
from tests.picasso_ops.data.test_files import random_rows, write_tsv
from tests.picasso_ops.embedding.test_packed import Reference, copy_weights, make_batch, make_specs, reference_update, touched_rows

ROOT = Path(__file__).resolve().parents[3]
SMALL = ["--eval-samples", "512", "--vocab", "200", "--threads", "1"]


# ---------------------------------------------------------------- keep-best and early stopping, by hand

def _entry(step, auc, log_loss, epoch=None):
    return {"step": step, **({"epoch": epoch} if epoch is not None else {}), "auc": auc, "log_loss": log_loss}


def test_tracker_keeps_the_lowest_log_loss_and_stops_after_patience():
    t = EarlyStopping("logloss", patience=2)
    assert t.observe(_entry(10, 0.70, 0.50, 0)).improved
    assert t.observe(_entry(20, 0.72, 0.45, 1)).improved  # lower log loss: better, whatever the AUC does
    v = t.observe(_entry(30, 0.75, 0.46, 2))
    assert not v.improved and not v.stop and t.since_best == 1
    v = t.observe(_entry(40, 0.76, 0.47, 3))
    assert not v.improved and v.stop
    assert t.best == _entry(20, 0.72, 0.45, 1)
    assert t.reason() == ("early stop at step 40: logloss did not improve in 2 evaluations since the best, 0.4500 "
                          "at step 20 (epoch 1)")
    s = t.summary()
    assert s["early_stopped"] and s["stopped_at_step"] == 40 and s["step"] == 20 and s["metric"] == "logloss"


def test_tracker_on_auc_with_min_delta_patience_zero_and_nan():
    t = EarlyStopping("auc", patience=0, min_delta=0.01)
    assert not t.observe(_entry(5, float("nan"), float("nan"))).improved  # a NaN evaluation is never the best
    assert t.observe(_entry(10, 0.70, 0.5)).improved
    assert not t.observe(_entry(20, 0.705, 0.4)).improved  # up by 0.005 <= min_delta: no improvement
    assert t.observe(_entry(30, 0.7101, 0.6)).improved  # up by more than min_delta
    for step in range(40, 100, 10):  # patience 0: never stops, only keeps the best
        assert not t.observe(_entry(step, 0.6, 0.7)).stop
    assert t.best["step"] == 30 and t.stopped_at is None and t.reason() == ""
    t2 = EarlyStopping("auc", patience=1)
    t2.observe(_entry(10, 0.7, 0.5))
    assert not t2.observe(_entry(20, 0.6, 0.5), final=True).stop  # the job's end evaluation never stops anything
    for bad in (dict(metric="loss"), dict(metric="auc", patience=-1), dict(metric="auc", min_delta=float("nan"))):
        with pytest.raises(ValueError, match="--early-stop-metric|--patience|--min-delta"):
            EarlyStopping(**bad)


def test_tracker_resumes_from_best_json_of_the_same_metric(tmp_path):
    t = EarlyStopping("logloss")
    t.observe(_entry(10, 0.7, 0.4, 0))
    t.saved(str(tmp_path / "step10"))
    t.write(tmp_path)
    again = EarlyStopping("logloss")
    again.restore(tmp_path)
    assert again.best == {**_entry(10, 0.7, 0.4, 0), "checkpoint": str(tmp_path / "step10")}
    assert not again.observe(_entry(20, 0.8, 0.41)).improved  # the earlier part's best still counts
    other = EarlyStopping("auc")
    other.restore(tmp_path)  # kept by log loss: not this tracker's best
    assert other.best is None


# ---------------------------------------------------------------- the finite-explosion guard, by hand

def _run_steps(guard, losses, first_step=1, baseline=None):
    for step, loss in enumerate(losses, start=first_step):
        guard.start_step(None)
        guard.loss(loss, baseline=baseline)
        guard.end_step(step, None)


def test_guard_stops_a_finite_explosion_with_the_reason_and_the_last_good_checkpoint(tmp_path):
    guard = DivergenceGuard(explosion_factor=10.0)
    _run_steps(guard, [0.69, 0.6, 0.55, 0.5], baseline=bce_entropy(0.25))
    guard.checkpoint_saved(tmp_path / "step4", 4)
    _run_steps(guard, [0.5, 0.52, 30.0], first_step=5)  # step 7's loss is past 6.9; a single one is no stop
    guard.checkpoint_saved(tmp_path / "step7", 7)  # saved after the loss began to explode
    with pytest.raises(DivergenceError) as info:
        _run_steps(guard, [1e3, 6.2e21], first_step=8)
    msg = str(info.value)
    assert msg.startswith("training diverged at step 9: the loss exploded while staying finite: the median of the "
                          f"last {EXPLOSION_WINDOW} steps' loss is 30, more than 10x the reference 0.69")
    assert "the constant predictor's 0.5623" in msg and "it first passed 6.9 at step 7" in msg, msg
    assert f"the last good checkpoint {tmp_path / 'step4'} is kept" in msg, msg  # latest: not a folder here
    assert f"{tmp_path / 'step7'} was saved after the loss began to explode" in msg, msg


def test_guard_judges_against_the_constant_predictor_and_never_fires_on_healthy_noise():
    # a first step far below the constant predictor (a resumed, trained model): the bar is 10x the predictor's loss
    guard = DivergenceGuard(explosion_factor=10.0)
    _run_steps(guard, [0.05] + [5.0] * 10, baseline=bce_entropy(0.5))  # 5.0 < 10 x 0.693
    with pytest.raises(DivergenceError, match="exploded while staying finite"):
        _run_steps(guard, [8.0] * EXPLOSION_WINDOW, first_step=12, baseline=bce_entropy(0.5))
    # noisy losses around the predictor's, with single spikes: never a stop
    g = torch.Generator().manual_seed(0)
    healthy = (0.3 + 0.8 * torch.rand(400, generator=g)).tolist()
    for k in range(0, 400, 37):
        healthy[k] = 9.0
    _run_steps(DivergenceGuard(explosion_factor=10.0), healthy, baseline=bce_entropy(0.03))
    _run_steps(DivergenceGuard(), [0.7, 1e30, 1e30, 1e30, 1e30, 1e30, 1e30])  # factor 0 (the default): off
    for bad in (1.0, -2.0, float("inf")):
        with pytest.raises(ValueError, match="--loss-explosion-factor"):
            DivergenceGuard(explosion_factor=bad)
    assert math.isclose(bce_entropy(0.5), math.log(2)) and bce_entropy(1.0) == 0.0


# ---------------------------------------------------------------- weight decay of the embedding rows

def test_sgd_and_adam_weight_decay_match_torch_when_every_row_is_touched():
    torch.manual_seed(0)
    w0 = torch.randn(6, 4)
    for ours, theirs in ((SparseSGD(lr=0.1, weight_decay=0.3), lambda p: torch.optim.SGD([p], lr=0.1, weight_decay=0.3)),
                         (LazyAdam(lr=0.05, weight_decay=0.2), lambda p: torch.optim.AdamW([p], lr=0.05, weight_decay=0.2,
                                                                                            eps=1e-8))):
        w, p = w0.clone(), torch.nn.Parameter(w0.clone())
        opt, state = theirs(p), ours.init_state(6, 4, num_logical_rows=6)
        for step in range(1, 6):
            grad = torch.randn(6, 4)
            ours.update(w, state, RowUpdate.simple(torch.arange(6), grad, step=step))
            p.grad = grad.clone()
            opt.step()
            torch.testing.assert_close(w, p.detach(), atol=1e-6, rtol=1e-5, msg=lambda m: f"{ours!r} step {step}: {m}")


def test_rowwise_adagrad_decays_only_the_touched_rows():
    opt = RowWiseAdagrad(lr=0.5, weight_decay=0.1)
    w = torch.ones(4, 2)
    state = opt.init_state(4, 2, num_logical_rows=4)
    opt.update(w, state, RowUpdate.simple(torch.tensor([1, 3]), torch.full((2, 2), 2.0), step=1))
    # touched: 1 * (1 - 0.5 * 0.1) - 0.5 * 2 / (sqrt(4) + eps); untouched rows keep their weight (lazy decay)
    assert w[[1, 3]].flatten().tolist() == pytest.approx([0.95 - 0.5] * 4)
    assert w[[0, 2]].flatten().tolist() == [1.0] * 4
    assert create_optimizer("sgd", {"lr": 0.5}).hyperparams["weight_decay"] == 0.0  # default: off
    with pytest.raises(ValueError, match=r"lr 0.5 x weight_decay 4 = 2 must be < 1"):
        create_optimizer("sgd", {"lr": 0.5, "weight_decay": 4})
    with pytest.raises(ValueError, match="weight_decay"):
        create_optimizer("adam", {"weight_decay": -0.1})
    decaying = create_optimizer("sgd", {"lr": 0.1, "weight_decay": 2.0})
    with pytest.raises(ValueError, match="must be < 1"):
        decaying.lr = 0.5  # a schedule may not push lr x weight_decay past 1 either


@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad", "adam"])
def test_packed_tables_with_weight_decay_match_the_written_out_update(optimizer):
    """Through the packed collection's fused backward (which hands decaying packs to the torch path)."""
    hp = {"sgd": {"lr": 0.1}, "rowwise_adagrad": {"lr": 0.1, "eps": 1e-8},
          "adam": {"lr": 0.01, "beta1": 0.9, "beta2": 0.99, "eps": 1e-8}}[optimizer]
    hp = {**hp, "weight_decay": 0.5}
    torch.manual_seed(2)
    specs = make_specs(optimizer, hp)
    emb = PackedEmbeddingCollection(specs, mode="fused")
    ref = Reference(specs, weighted=True)
    copy_weights(ref, emb)
    ref_state = {s.name: {k: torch.zeros_like(v, dtype=torch.float32) for k, v in emb.table_state(s.name).items()
                          if k != "step"} for s in specs}
    for step in range(1, 4):
        batch = make_batch(specs, seed=300 + step, weighted=True)
        targets = {f: torch.randn_like(v) for f, v in ref(batch).items()}
        out = emb(batch)
        sum((out[f] * t).sum() for f, t in targets.items()).backward()
        ref.zero_grad()
        sum((v * targets[f]).sum() for f, v in ref(batch).items()).backward()
        with torch.no_grad():
            for s in specs:
                table, rows = ref.tables[s.name], touched_rows(s, batch)
                table.weight[rows] *= 1 - hp["lr"] * hp["weight_decay"]  # decoupled decay, touched rows only
                if optimizer == "sgd":
                    table.weight[rows] -= hp["lr"] * table.weight.grad[rows]
                else:
                    reference_update(optimizer, hp, table.weight, table.weight.grad, rows, ref_state[s.name], step)
        for s in specs:
            torch.testing.assert_close(emb.table_weight(s.name), ref.tables[s.name].weight, atol=1e-6, rtol=1e-6,
                                       msg=lambda m: f"step {step}, {s.name}: {m}")


def test_picasso_block_weight_decay_field_reaches_the_tables_and_is_validated():
    import pydantic

    from picasso_ops import ops as custom_ops
    from picasso_ops.config import PicassoConfig
    from picasso_ops.embedding.sparse_optim import OPTIMIZERS

    block = PicassoConfig.model_validate({"optimizer": {"type": "adam", "lr": 0.01, "weight_decay": 0.05}})
    opt = block.optimizer
    params = {k: float(getattr(opt, k)) for k in OPTIMIZERS[opt.type].defaults}  # what SparseArgs.from_block takes
    assert params["weight_decay"] == 0.05
    assert PicassoConfig.model_validate({}).optimizer.weight_decay == 0.0
    for bad in (-0.1, float("inf")):
        with pytest.raises(pydantic.ValidationError, match="weight_decay"):
            PicassoConfig.model_validate({"optimizer": {"weight_decay": bad}})
    with pytest.raises(ValueError, match="weight_decay is applied by SparseOptimizer.update"):
        custom_ops.packed_backward_update(torch.zeros(3, 2), {}, torch.tensor([1]), torch.tensor([0, 1]),
                                          torch.ones(1, 2), torch.tensor([0]), optimizer="sgd",
                                          hyperparams={"lr": 0.1, "weight_decay": 0.1})


# ---------------------------------------------------------------- the job: flags

def test_flags_are_checked(tmp_path):
    from sparse_scale.rec import RecJobConfig, RecJobError
    from sparse_scale.rec.cli import job_config, parse_args

    cfg = _ds_config(tmp_path)
    files = ["--data", "criteo", "--train-files", "a.tsv", "--eval-files", "b.tsv"]
    with pytest.raises(RecJobError, match="--patience: sets early stopping, which --early-stop-metric"):
        job_config(parse_args(["--config", cfg, *files, "--patience", "3"]))
    with pytest.raises(RecJobError, match="needs evaluations during training"):
        job_config(parse_args(["--config", cfg, *files, "--early-stop-metric", "auc"]))
    got = job_config(parse_args(["--config", cfg, *files, "--epochs", "3", "--early-stop-metric", "logloss",
                                 "--min-delta", "0.001"]))
    assert (got.early_stop_metric, got.patience, got.min_delta, got.loss_explosion_factor) == ("logloss", 2, 0.001, 10)
    for field, value, match in (("patience", -1, "--patience"), ("min_delta", -1.0, "--min-delta"),
                                ("loss_explosion_factor", 0.5, "--loss-explosion-factor"),
                                ("early_stop_metric", "loss", "--early-stop-metric")):
        with pytest.raises(RecJobError, match=match):
            RecJobConfig(config=cfg, eval_every=5, **{field: value})
    with pytest.raises(RecJobError, match="not with a gba block"):
        RecJobConfig(config=str(ROOT / "ds_configs" / "gba_cpu.json"), eval_every=5, early_stop_metric="auc")


# ---------------------------------------------------------------- the job: end to end

def _ds_config(tmp_path, lr=None, micro=None, name="ds.json"):
    cfg = json.loads((ROOT / "ds_configs" / "demo_cpu.json").read_text())
    cfg["wandb"] = {"enabled": False}
    if micro is not None:
        cfg["train_micro_batch_size_per_gpu"] = micro
    if lr is not None:
        cfg["optimizer"]["params"]["lr"] = lr
        cfg["scheduler"]["params"]["warmup_max_lr"] = lr
    path = tmp_path / name
    path.write_text(json.dumps(cfg))
    return str(path)


def _cli(rank, world_size, argv):
    """sparse-train-rec's main as the console script runs it: exit code, message, and summary.json if written."""
    import os

    os.environ["WANDB_MODE"] = "disabled"
    from sparse_scale.rec.cli import main

    try:
        main(argv)
    except SystemExit as exc:
        return {"code": exc.code if isinstance(exc.code, int) else 1, "message": str(exc.code)}
    return {"code": 0, "message": ""}


def test_the_issues_lr_1e6_demo_run_exits_non_zero(tmp_path):
    """The shipped demo config at lr 1e6 for 60 steps trained to a loss of 6e21 and exited 0; now it stops."""
    out = tmp_path / "diverged"
    argv = [*SMALL, "--config", _ds_config(tmp_path, lr=1e6), "--out", str(out), "--steps", "60", "--save-every", "1"]
    got = run_distributed(_cli, 1, args=(argv,), timeout_s=50, init_process_group=False)[0]
    assert got["code"] != 0, got
    msg = got["message"]
    assert "the loss exploded while staying finite" in msg and "more than 10x the reference" in msg, msg
    onset = int(msg.split("first passed ")[1].split(" at step ")[1].split(" ")[0])
    good = f"step{onset - 2}"  # its weights gave step onset - 1's loss, the last below the bar
    assert f"the last good checkpoint {out / 'checkpoints' / good} is kept, and 'latest' points at it again" in msg, msg
    assert (out / "checkpoints" / "latest").read_text() == good  # --resume starts from the good one
    assert f"{out / 'checkpoints' / f'step{onset - 1}'}" in msg.split("kept")[1]  # named as suspect
    assert not (out / "summary.json").exists()


def test_the_shipped_demo_config_trains_without_a_false_stop(tmp_path):
    healthy = tmp_path / "healthy"  # the shipped settings: the guard stays quiet
    (healthy / "best").mkdir(parents=True)  # an earlier run's kept best: --overwrite starts over without it
    (healthy / "best" / "best.json").write_text("{}")
    argv = [*SMALL, "--config", _ds_config(tmp_path, name="demo.json"), "--out", str(healthy), "--steps", "60",
            "--overwrite"]
    got = run_distributed(_cli, 1, args=(argv,), timeout_s=50, init_process_group=False)[0]
    assert got["code"] == 0, got
    assert json.loads((healthy / "summary.json").read_text())["steps"] == 60
    assert not (healthy / "best").exists()


@pytest.fixture
def ctr_files(tmp_path):
    """Training and held-out Criteo TSV files of random rows (their labels are noise: the held-out loss rises)."""
    train = [write_tsv(tmp_path / f"train{k}.tsv", random_rows(96, seed=40 + k, first_id=96 * k)) for k in range(2)]
    held_out = write_tsv(tmp_path / "eval.tsv", random_rows(128, seed=99, first_id=1000))
    return [str(p) for p in train], str(held_out)


def _files_argv(tmp_path, ctr_files, out, *extra):
    train, held_out = ctr_files
    return ["--config", _ds_config(tmp_path, micro=16, lr=0.01), "--data", "criteo", "--train-files", *train,
            "--eval-files", held_out, "--vocab", "64", "--threads", "1", "--out", str(out), *extra]


def _train_then_score_best(rank, world_size, argv, best):
    """Train as the console script does, then load OUT/best into a freshly built engine and score it again."""
    import os

    os.environ["WANDB_MODE"] = "disabled"
    from sparse_scale.distenv import init_distributed
    from sparse_scale.rec import checkpoint, engines, evaluate, model
    from sparse_scale.rec.cli import job_config, parse_args, train
    from sparse_scale.rec.job import RecJob

    summary = train(parse_args(argv))  # the CLI's run, short of its process-group shutdown: the scoring reuses it
    config = job_config(parse_args(argv))
    ctx = init_distributed()
    torch.manual_seed(config.seed + 1)  # other initial weights: only the checkpoint can make them the best's
    job = RecJob.build(config, ctx.rank, ctx.world_size)
    engine = engines.build_engine(job, model.build_model(job), ctx)
    progress, _ = checkpoint.resume(engine, Path(best), ctx.rank)
    metrics = evaluate.evaluate(engine, job)
    engine.close()
    return summary, progress.step, metrics


def test_kept_checkpoint_holds_the_best_log_loss_of_its_run(tmp_path, ctr_files):
    out = tmp_path / "keep"
    argv = _files_argv(tmp_path, ctr_files, out, "--epochs", "4", "--steps", "1000",
                       "--early-stop-metric", "logloss", "--patience", "0")
    result, step, metrics = run_distributed(_train_then_score_best, 1, args=(argv, str(out / "best")), timeout_s=50,
                                            init_process_group=False)[0]
    summary = json.loads((out / "summary.json").read_text())
    assert result == summary
    history, best = summary["eval_history"], summary["best"]
    assert [h["epoch"] for h in history] == [0, 1, 2, 3]  # every epoch's end, the last by the end evaluation
    assert best["log_loss"] == min(h["log_loss"] for h in history)
    assert best["step"] == next(h["step"] for h in history if h["log_loss"] == best["log_loss"])
    assert not best["early_stopped"] and summary["steps"] == history[-1]["step"]
    kept = [p.name for p in (out / "best").iterdir() if p.is_dir()]
    assert kept == [f"step{best['step']}"] and best["checkpoint"] == str(out / "best" / kept[0])
    assert step == best["step"]
    assert metrics["log_loss"] == pytest.approx(best["log_loss"], abs=1e-6)
    assert metrics["log_loss"] <= min(h["log_loss"] for h in history) + 1e-6


def test_early_stop_ends_the_run_when_patience_runs_out(tmp_path, ctr_files):
    out = tmp_path / "stop"
    # no later epoch can beat the first by more than 1 nat: patience 1 stops right after epoch 1's evaluation
    argv = _files_argv(tmp_path, ctr_files, out, "--epochs", "6", "--steps", "1000", "--early-stop-metric",
                       "logloss", "--patience", "1", "--min-delta", "1.0")
    got = run_distributed(_cli, 1, args=(argv,), timeout_s=50, init_process_group=False)[0]
    assert got["code"] == 0, got  # it trained: stopping early is a success
    summary = json.loads((out / "summary.json").read_text())
    history, best = summary["eval_history"], summary["best"]
    assert [h["epoch"] for h in history] == [0, 1]
    assert best["early_stopped"] and best["step"] == history[0]["step"]
    assert best["stopped_at_step"] == history[1]["step"] == summary["steps"]
    assert summary["log_loss"] == history[1]["log_loss"]  # the stopped model, scored once
    assert "early stop at step" in best["reason"] and "did not improve by more than 1" in best["reason"]
    assert (out / "checkpoints" / "latest").read_text() == f"step{summary['steps']}"
    assert (out / "best" / "latest").read_text() == f"step{best['step']}"


def _two_ranks_one_explodes(rank, world_size, folder):
    """Rank 1's loss explodes, rank 0's stays healthy: both must stop at the same step, naming the same checkpoint.

    Like the rec loop, each save is preceded by check_params (an agreement of the ranks)."""
    import torch

    guard, net = DivergenceGuard(explosion_factor=10.0), torch.nn.Linear(2, 1)
    losses = [0.69, 0.6, 0.55, 0.5, 0.5, 0.5] + ([0.5] if rank == 0 else [50.0]) * (AGREE_EVERY - 6)
    for step, loss in enumerate(losses, start=1):
        guard.start_step(None)
        guard.loss(loss, baseline=bce_entropy(0.5))
        try:
            guard.end_step(step, None)
            if step in (4, 8):
                guard.check_params(net, step)
        except DivergenceError as exc:
            return step, str(exc)
        if step in (4, 8):
            if rank == 0:  # what a committed save leaves: the folder and 'latest' naming it
                (Path(folder) / f"step{step}").mkdir()
                (Path(folder) / "latest").write_text(f"step{step}")
            guard.checkpoint_saved(Path(folder) / f"step{step}", step)
    return None


def test_ranks_agree_on_a_finite_explosion_seen_by_one_of_them(tmp_path):
    got = run_distributed(_two_ranks_one_explodes, 2, args=(str(tmp_path),), timeout_s=30)
    # rank 1 sees it at step 9 (median of 5: 3 bad); the ranks agree at the next multiple of AGREE_EVERY
    assert got[0] is not None and got[1] is not None and got[0][0] == got[1][0] == AGREE_EVERY, got
    assert all(message.startswith("training diverged at step 9: ") for _, message in got), got
    assert "exploded on another rank while staying finite (more than 10x its reference from step 7 on" in got[0][1]
    assert "exploded while staying finite: the median of the last 5 steps' loss is 50" in got[1][1]
    for _, message in got:  # step 8 was saved after the explosion began (step 7): step 4 is the good one
        assert f"the last good checkpoint {tmp_path / 'step4'} is kept, and 'latest' points at it again" in message
        assert f"{tmp_path / 'step8'} was saved after the loss began to explode" in message
    assert (tmp_path / "latest").read_text() == "step4"


def test_early_stop_on_step_evaluations_of_the_synthetic_stream(tmp_path):
    out = tmp_path / "steps"
    argv = [*SMALL, "--config", _ds_config(tmp_path, micro=32), "--out", str(out), "--steps", "100",
            "--eval-every", "5", "--early-stop-metric", "auc", "--patience", "2", "--min-delta", "1.0"]
    got = run_distributed(_cli, 1, args=(argv,), timeout_s=50, init_process_group=False)[0]
    assert got["code"] == 0, got
    summary = json.loads((out / "summary.json").read_text())
    assert [h["step"] for h in summary["eval_history"]] == [5, 10, 15] and summary["steps"] == 15
    best = summary["best"]
    assert best["early_stopped"] and best["step"] == 5 and best["metric"] == "auc"
    assert best["checkpoint"] == str(out / "best" / "step5") and (out / "best" / "step5" / "MANIFEST.json").is_file()
    assert json.loads((out / "best" / "best.json").read_text())["step"] == 5
