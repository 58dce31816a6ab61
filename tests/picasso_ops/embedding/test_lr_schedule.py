"""The packed tables follow DeepSpeed's learning-rate schedule (``picasso.optimizer.lr_schedule``).

* a one-process DeepSpeed engine (AdamW, ZeRO 1, WarmupDecayLR, gradient accumulation 2) over a model whose
  loss is linear in the pooled embeddings, so each row's gradient is a known count whatever the weights: the
  tables' lr at every step is the block lr x DeepSpeed's lr of that same step / the schedule's peak (0 at the
  first two steps, as for the dense layers), and the SGD tables equal the hand-computed update with those lrs;
* ``"constant"`` keeps the block lr; without a scheduler both settings give the same weights bit for bit;
* the cached and row-sharded tables follow the schedule too (cached: the plain tables' weights bit for bit);
* the factor for DeepSpeed's and torch's schedulers, a peak of 0, and a bad config value naming its key.
"""
from __future__ import annotations

import logging
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from pydantic import ValidationError
from torch import nn

from picasso_ops.config import PicassoConfig, SparseOptimizerConfig
from picasso_ops.distributed.step import deepspeed_lr_factor, schedule_peak_lr, set_sparse_lr
from picasso_ops.models import SparseArgs
from picasso_ops.models.wide_deep import PackedFieldEmbeddings
from sparse_scale.config import ConfigError, parse_config
from sparse_scale.multiproc import run_distributed

F, VOCAB, DIM, B, GAS = 3, 12, 4, 8, 2
K = 0.1  # loss = K * sum of the pooled embeddings (+ a dense term): d loss / d row = K * occurrences
BLOCK_LR = 0.5
OPT_LR, PEAK, WARMUP, TOTAL = 0.05, 0.02, 3, 6  # AdamW's own lr differs from the schedule's peak on purpose
WINDOWS = 8  # optimizer steps: lr 0 twice, warm-up, peak at step WARMUP + 1, decay to 0 at the last


def _expected_dense_lr(t: int) -> float:
    """WarmupDecayLR (warmup_type linear, warmup_min_lr 0) for optimizer step ``t``, from DeepSpeed's formula.

    The scheduler starts at iteration -1 (``warmup_min_lr``) and each step advances it after the optimizer
    step, so step ``t`` runs at iteration ``t - 1``: steps 0 and 1 both run at lr 0.
    """
    it = t - 1
    if it < 0:
        return 0.0
    if it < WARMUP:
        return PEAK * it / WARMUP
    return PEAK * max(0.0, (TOTAL - it) / max(1, TOTAL - WARMUP))


class _LinearInTables(nn.Module):
    """Sum-pooled SGD tables whose gradient does not depend on the weights, plus a dense layer for DeepSpeed."""

    def __init__(self, sharding: str = "data_parallel") -> None:
        super().__init__()
        sparse = SparseArgs(optimizer="sgd", optimizer_params={"lr": BLOCK_LR}, sharding=sharding)
        self.emb = PackedFieldEmbeddings([VOCAB] * F, DIM, "sum", sparse, init_std=0.1)
        self.dense = nn.Linear(2, 1)

    def forward(self, x: torch.Tensor, values: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        return K * self.emb(values, lengths).sum() + self.dense(x).pow(2).mean()


def _batch(i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + i)
    lengths = torch.randint(0, 3, (F, B), generator=g)
    values = torch.randint(0, VOCAB, (int(lengths.sum()),), generator=g)
    return torch.randn(B, 2, generator=g), values, lengths


def _counts(values: torch.Tensor, lengths: torch.Tensor) -> np.ndarray:
    """Occurrences of each row of each field, ``[F, VOCAB]`` (values are field-major)."""
    per_field = torch.split(values, lengths.sum(1).tolist())
    return np.stack([np.bincount(v.numpy(), minlength=VOCAB) for v in per_field]).astype(np.float64)


def _tables(model: nn.Module) -> np.ndarray:
    """The tables as ``[F, VOCAB, DIM]`` float64 (one rank: a row-wise shard is the whole table)."""
    coll = getattr(model.emb, "collection", None)
    if coll is None:  # CachedFieldEmbeddings: its checkpoint entries have the packed collection's keys
        state = model.state_dict()
        return np.stack([state[f"emb.collection.field{f}.weight"].double().numpy() for f in range(F)])
    return np.stack([coll.table_weight(f"field{f}").detach().double().numpy() for f in range(F)])


def _train(variant: str, lr_schedule: str, scheduler: bool) -> dict:
    """Train WINDOWS optimizer steps; record DeepSpeed's lr before each step and the tables' lr after it."""
    import deepspeed

    from picasso_ops.cache.fields import CachedFieldEmbeddings
    from picasso_ops.distributed import engine_step

    torch.manual_seed(0)
    model = _LinearInTables("row_wise" if variant == "row_wise" else "data_parallel")
    if variant == "cache":
        model.emb = CachedFieldEmbeddings.from_packed(model.emb, capacity=VOCAB * F)
    initial_tables, initial_dense = _tables(model), model.dense.weight.detach().clone()
    cfg = {"train_micro_batch_size_per_gpu": B, "gradient_accumulation_steps": GAS, "steps_per_print": 10**6,
           "optimizer": {"type": "AdamW", "params": {"lr": OPT_LR, "weight_decay": 0.0, "torch_adam": True}},
           "zero_optimization": {"stage": 1}}
    if scheduler:
        cfg["scheduler"] = {"type": "WarmupDecayLR", "params": {
            "warmup_min_lr": 0.0, "warmup_max_lr": PEAK, "warmup_num_steps": WARMUP, "warmup_type": "linear",
            "total_num_steps": TOTAL}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=list(model.parameters()), config=cfg)
    from launch.train_rec import scheduled_sparse_lr  # train_rec's glue: block -> engine_step's sparse_lr

    block = PicassoConfig(optimizer=SparseOptimizerConfig(type="sgd", lr=BLOCK_LR, lr_schedule=lr_schedule))
    peak = scheduled_sparse_lr(block)
    dense_lrs, table_lrs, counts, dense_after_first = [], [], [], None
    window = np.zeros((F, VOCAB))
    for i in range(WINDOWS * GAS):
        x, values, lengths = _batch(i)
        window += _counts(values, lengths)
        dense_lr = float(engine.get_lr()[0])  # the lr DeepSpeed's optimizer uses at this boundary
        engine.backward(engine(x, values, lengths))
        if engine_step(engine, sparse_lr=peak):
            dense_lrs.append(dense_lr)
            coll = model.emb.cache.optimizer if variant == "cache" else model.emb.collection
            table_lrs.append(float(coll.lr))
            counts.append(window)
            window = np.zeros((F, VOCAB))
            if dense_after_first is None:
                dense_after_first = model.dense.weight.detach().clone()
    moved = float((dense_after_first - initial_dense).abs().max())
    return {"dense_lrs": dense_lrs, "table_lrs": table_lrs, "counts": counts, "initial": initial_tables,
            "final": _tables(model), "dense_moved_at_first_step": moved,
            "peak": schedule_peak_lr(engine.lr_scheduler) if engine.lr_scheduler is not None else None}


def _runs(rank: int, world_size: int) -> dict:
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")  # wraps the harness's process group
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    return {name: _train(*spec) for name, spec in {
        "deepspeed": ("data_parallel", "deepspeed", True),
        "constant": ("data_parallel", "constant", True),
        "cache": ("cache", "deepspeed", True),
        "row_wise": ("row_wise", "deepspeed", True),
        "no_scheduler_deepspeed": ("data_parallel", "deepspeed", False),
        "no_scheduler_constant": ("data_parallel", "constant", False),
    }.items()}


def _hand_sgd(run: dict, lrs: list[float]) -> np.ndarray:
    """Rows after SGD steps with these lrs on the known gradients (K * count / GAS in every column)."""
    out = run["initial"].copy()
    for lr, count in zip(lrs, run["counts"]):
        out -= lr * (K * count / GAS)[:, :, None]
    return out


@pytest.fixture(scope="module")
def runs() -> dict:
    return run_distributed(_runs, 1, timeout_s=170)[0]


def test_tables_follow_deepspeed_schedule_at_the_same_step(runs):
    run = runs["deepspeed"]
    assert run["peak"] == pytest.approx(PEAK)  # the schedule's peak, not AdamW's own lr
    expected_dense = [_expected_dense_lr(t) for t in range(WINDOWS)]
    np.testing.assert_allclose(run["dense_lrs"], expected_dense, rtol=1e-12, atol=1e-15)
    assert run["dense_lrs"][0] == 0.0 and run["dense_moved_at_first_step"] == 0.0  # dense step 0 used lr 0...
    expected = [BLOCK_LR * lr / PEAK for lr in run["dense_lrs"]]
    np.testing.assert_allclose(run["table_lrs"], expected, rtol=1e-12, atol=1e-15)
    assert run["table_lrs"][0] == 0.0 and run["table_lrs"][WARMUP + 1] == pytest.approx(BLOCK_LR)  # so did the tables
    assert max(run["table_lrs"]) == pytest.approx(BLOCK_LR) and run["table_lrs"][-1] == 0.0
    np.testing.assert_allclose(run["final"], _hand_sgd(run, expected), rtol=0, atol=1e-6)
    # the update is not the constant-lr one: the schedule changed the rows
    assert np.abs(run["final"] - _hand_sgd(run, [BLOCK_LR] * WINDOWS)).max() > 1e-3


def test_constant_keeps_the_block_lr(runs):
    run = runs["constant"]
    np.testing.assert_allclose(run["dense_lrs"], [_expected_dense_lr(t) for t in range(WINDOWS)], rtol=1e-12)
    assert run["table_lrs"] == [BLOCK_LR] * WINDOWS
    np.testing.assert_allclose(run["final"], _hand_sgd(run, [BLOCK_LR] * WINDOWS), rtol=0, atol=1e-6)


def test_cached_and_row_sharded_tables_follow_the_schedule(runs):
    ref = runs["deepspeed"]
    for name in ("cache", "row_wise"):
        run = runs[name]
        assert run["table_lrs"] == ref["table_lrs"], name
        np.testing.assert_allclose(run["final"], _hand_sgd(run, run["table_lrs"]), rtol=0, atol=1e-6, err_msg=name)
    np.testing.assert_array_equal(runs["cache"]["final"], ref["final"])  # the cache runs the packed arithmetic


def test_without_a_scheduler_both_settings_are_identical(runs):
    a, b = runs["no_scheduler_deepspeed"], runs["no_scheduler_constant"]
    assert a["peak"] is None and a["table_lrs"] == b["table_lrs"] == [BLOCK_LR] * WINDOWS
    assert a["dense_lrs"] == [OPT_LR] * WINDOWS
    assert np.array_equal(a["final"], b["final"])  # bit for bit: factor 1 exactly


# ---------------------------------------------------------------- the factor, without an engine's training loop
def _param() -> list[nn.Parameter]:
    return [nn.Parameter(torch.zeros(1))]


def _stand_in_engine(scheduler, optimizer) -> SimpleNamespace:
    """What deepspeed_lr_factor reads from an engine: the scheduler and param group 0's lr (get_lr)."""
    return SimpleNamespace(lr_scheduler=scheduler, get_lr=lambda: [g["lr"] for g in optimizer.param_groups])


def test_factor_for_deepspeed_and_torch_schedulers():
    from deepspeed.runtime.lr_schedules import OneCycle, WarmupCosineLR, WarmupLR

    opt = torch.optim.SGD(_param(), lr=0.4)
    sched = WarmupLR(opt, warmup_min_lr=0.0, warmup_max_lr=0.2, warmup_num_steps=4, warmup_type="linear")
    factors = []
    for _ in range(6):
        factors.append(deepspeed_lr_factor(_stand_in_engine(sched, opt)))
        opt.step()
        sched.step()
    assert factors == pytest.approx([0.0, 0.0, 0.25, 0.5, 0.75, 1.0])  # iteration -1 (min), then 0, 1, ...

    opt = torch.optim.SGD(_param(), lr=0.4)
    cos = WarmupCosineLR(opt, total_num_steps=10, warmup_num_steps=2, warmup_type="linear")
    assert schedule_peak_lr(cos) == pytest.approx(0.4)  # its ratio multiplies the optimizer's lr
    for _ in range(5):
        opt.step()
        cos.step()
    assert deepspeed_lr_factor(_stand_in_engine(cos, opt)) == pytest.approx(cos.get_lr_ratio())

    opt = torch.optim.SGD(_param(), lr=0.4, momentum=0.9)
    cycle = OneCycle(opt, cycle_min_lr=0.01, cycle_max_lr=0.1, cycle_first_step_size=2)
    assert schedule_peak_lr(cycle) == pytest.approx(0.1)

    opt = torch.optim.SGD(_param(), lr=0.4)
    step_lr = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    opt.step()
    step_lr.step()
    assert deepspeed_lr_factor(_stand_in_engine(step_lr, opt)) == pytest.approx(0.5)


def test_factor_is_one_without_a_usable_peak(caplog):
    from deepspeed.runtime.lr_schedules import WarmupLR

    opt = torch.optim.SGD(_param(), lr=0.4)
    assert deepspeed_lr_factor(_stand_in_engine(None, opt)) == 1.0
    zero = WarmupLR(opt, warmup_min_lr=0.0, warmup_max_lr=0.0, warmup_num_steps=4)
    with caplog.at_level(logging.WARNING):
        assert deepspeed_lr_factor(_stand_in_engine(zero, opt)) == 1.0
    assert "peak lr is 0.0" in caplog.text


def test_set_sparse_lr_reaches_every_kind_of_table():
    from picasso_ops.cache.fields import CachedFieldEmbeddings

    dp = PackedFieldEmbeddings([VOCAB] * F, DIM, "sum", SparseArgs(optimizer="adam"))
    rw = PackedFieldEmbeddings([VOCAB] * F, DIM, "sum", SparseArgs(optimizer="adam", sharding="row_wise"))
    cached = CachedFieldEmbeddings.from_packed(
        PackedFieldEmbeddings([VOCAB] * F, DIM, "sum", SparseArgs(optimizer="adam")), capacity=VOCAB)
    model = nn.ModuleDict({"dp": dp, "rw": rw, "cached": cached})
    assert set_sparse_lr(model, 0.125) == 3
    assert dp.collection.lr == rw.collection.lr == cached.cache.optimizer.lr == 0.125

    class Opaque(nn.Module):  # sparse tables with no lr the step could set
        def sparse_step(self, grad_scale: float = 1.0) -> None: ...

        def discard_pending(self) -> None: ...

    with pytest.raises(TypeError, match='lr_schedule = "constant"'):
        set_sparse_lr(Opaque(), 0.1)


def test_default_and_bad_value_name_the_key():
    assert PicassoConfig().optimizer.lr_schedule == "deepspeed"
    assert PicassoConfig.model_validate({"optimizer": {"lr_schedule": "constant"}}).optimizer.lr_schedule == "constant"
    with pytest.raises(ValidationError) as e:
        PicassoConfig.model_validate({"optimizer": {"type": "adam", "lr_schedule": "cosine"}})
    assert e.value.errors()[0]["loc"] == ("optimizer", "lr_schedule")
    with pytest.raises(ConfigError, match=r"x\.json: picasso\.optimizer\.lr_schedule: .*'deepspeed' or 'constant'.*"
                                          r"\(got 'cosine'\)"):
        parse_config({"picasso": {"optimizer": {"lr_schedule": "cosine"}}}, source="x.json")
