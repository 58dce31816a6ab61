"""DeepFM and DCN-v2 (picasso_ops.models), the towers' dropout in all four models, and the rec job with each new model.

In-process: shapes, the formulas against explicit sums, gradients reaching every dense parameter
and the packed tables, packed tables training exactly like per-field ``nn.EmbeddingBag`` tables
(SGD on both), the interleave cut, dropout on in training and off in ``eval()``. One process of
the rec job per new model (synthetic, a few steps, packed tables with a cache and interleaving),
run through the console script's ``main`` to its summary.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from picasso_ops.data.batch import CTRBatch
from picasso_ops.distributed import sparse_step
from picasso_ops.interleave.forward import InterleavedForward
from picasso_ops.models import (
    DLRM,
    MODEL_NAMES,
    CrossNetwork,
    DCNv2,
    DCNv2Args,
    DeepFM,
    DeepFMArgs,
    DLRMArgs,
    SparseArgs,
    WideAndDeep,
    WideAndDeepArgs,
    build_model,
    fm_interaction,
    model_args,
    packed_dcn_v2,
    packed_deepfm,
)
from sparse_scale.multiproc import run_distributed

ROOT = Path(__file__).resolve().parents[3]
VOCAB = [13, 7, 13, 5]


def _jagged(num_fields, batch, vocab, max_len, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, max_len + 1, (num_fields, batch), generator=g)
    values = torch.randint(0, vocab, (int(lengths.sum()),), generator=g)
    return values, lengths


def _batch(batch=16, seed=0, num_dense=3):
    values, lengths = _jagged(len(VOCAB), batch, min(VOCAB), 3, seed=seed)
    dense = torch.randn(batch, num_dense, generator=torch.Generator().manual_seed(100 + seed))
    return dense, values, lengths


def _args(name, **kw):
    base = dict(vocab_sizes=VOCAB, num_dense=3, embedding_dim=4, dropout=0.0)
    base.update({"hidden": (8,)} if name != "dlrm" else {"top": (8,), "bottom": (5,)})
    return model_args(name, **{**base, **kw})


def test_fm_interaction_is_the_sum_over_field_pairs():
    e = torch.randn(5, 4, 3)
    pairs = sum((e[:, i] * e[:, j]).sum(-1) for i in range(4) for j in range(i + 1, 4))
    torch.testing.assert_close(fm_interaction(e), pairs)
    with pytest.raises(ValueError, match=r"\[B, F, D\]"):
        fm_interaction(torch.ones(2, 3))


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_every_model_gives_one_logit_per_sample_and_grads_reach_every_parameter(name):
    torch.manual_seed(0)
    model = build_model(name, _args(name))
    for m in model.modules():  # non-zero first-order weights, so their gradient path is exercised too
        if isinstance(m, torch.nn.EmbeddingBag):
            torch.nn.init.normal_(m.weight, std=0.1)
    dense, values, lengths = _batch()
    logits = model(dense, values, lengths)
    assert logits.shape == (16,) and torch.isfinite(logits).all()
    torch.nn.functional.binary_cross_entropy_with_logits(logits, (torch.arange(16) % 2).float()).backward()
    silent = [n for n, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert not silent


def test_deepfm_is_first_order_plus_fm_over_all_fields_plus_the_mlp():
    torch.manual_seed(1)
    model = DeepFM(_args("deepfm"))
    for bag in list(model.embeddings.bags) + list(model.wide.bags):
        torch.nn.init.normal_(bag.weight)
    dense, values, lengths = _batch(seed=2)
    emb, wide = model.embeddings(values, lengths), model.wide(values, lengths)
    fields = torch.cat([emb, dense.unsqueeze(-1) * model.dense_fields.vectors], dim=1)  # dense j: x_j v_j
    assert fields.shape == (16, len(VOCAB) + 3, 4)
    n = fields.shape[1]
    pairwise = sum((fields[:, i] * fields[:, j]).sum(-1) for i in range(n) for j in range(i + 1, n))
    first = wide.sum((1, 2)) + model.dense_fields.linear(dense).squeeze(-1)
    expect = first + pairwise + model.mlp(fields.flatten(1)).squeeze(-1)
    torch.testing.assert_close(model(dense, values, lengths), expect)


def test_dcn_v2_cross_layers_then_the_mlp():
    torch.manual_seed(2)
    model = DCNv2(_args("dcn_v2", cross_layers=2))
    dense, values, lengths = _batch(seed=3)
    x0 = torch.cat([model.embeddings(values, lengths).flatten(1), dense], 1)
    w = [layer for layer in model.cross.layers]
    x1 = x0 * (x0 @ w[0].weight.T + w[0].bias) + x0
    x2 = x0 * (x1 @ w[1].weight.T + w[1].bias) + x1
    torch.testing.assert_close(model(dense, values, lengths), model.mlp(x2).squeeze(-1))
    assert torch.equal(CrossNetwork(6, 0)(x0[:, :6]), x0[:, :6])  # no layers: the identity


def _copy_plain_into_packed(plain, packed):
    """The plain model's weights into the packed one: dense layers by name, tables field by field."""
    packed.load_state_dict({k: v for k, v in plain.state_dict().items() if ".bags." not in k}, strict=False)
    with torch.no_grad():
        for part, prefix in (("embeddings", "emb"), ("wide", "wide")):
            if hasattr(plain, part):
                for f, bag in enumerate(getattr(plain, part).bags):
                    getattr(packed, part).collection.table_weight(f"{prefix}{f}").copy_(bag.weight)


@pytest.mark.parametrize("packing", [True, False])
@pytest.mark.parametrize("name", ["deepfm", "dcn_v2"])
def test_packed_tables_train_like_per_field_tables(name, packing):
    """Same weights, SGD everywhere: the fused sparse update equals dense autograd + torch SGD, step by step."""
    lr = 0.1
    args = _args(name)
    torch.manual_seed(0)
    plain = build_model(name, args)
    if name == "deepfm":
        for bag in plain.wide.bags:
            torch.nn.init.normal_(bag.weight, std=0.1)
    sparse = SparseArgs(optimizer="sgd", optimizer_params={"lr": lr}, packing=packing)
    packed = (packed_deepfm if name == "deepfm" else packed_dcn_v2)(args, sparse)
    _copy_plain_into_packed(plain, packed)
    assert not [n for n, _ in packed.named_parameters() if n.startswith(("embeddings.", "wide."))]  # no params
    opts = [torch.optim.SGD(m.parameters(), lr=lr) for m in (plain, packed)]
    for step in range(4):
        dense, values, lengths = _batch(seed=step)
        labels = (torch.arange(16) % 2).float()
        logits = []
        for model, opt in zip((plain, packed), opts):
            out = model(dense, values, lengths)
            logits.append(out.detach())
            opt.zero_grad()
            torch.nn.functional.binary_cross_entropy_with_logits(out, labels).backward()
            opt.step()
        torch.testing.assert_close(logits[1], logits[0], atol=1e-6, rtol=0)
        assert sparse_step(packed) == (2 if name == "deepfm" else 1)  # one step per table collection
    for part, prefix in (("embeddings", "emb"), ("wide", "wide")):
        for f, bag in enumerate(getattr(plain, part).bags if hasattr(plain, part) else ()):
            got = getattr(packed, part).collection.table_weight(f"{prefix}{f}")
            torch.testing.assert_close(got, bag.weight, atol=1e-6, rtol=0)
    for key, value in plain.state_dict().items():
        if ".bags." not in key:
            torch.testing.assert_close(packed.state_dict()[key], value, atol=1e-6, rtol=0)


@pytest.mark.parametrize("name", ["deepfm", "dcn_v2"])
def test_row_wise_tables_and_the_interleave_cut_give_the_same_logits(name):
    args = _args(name)
    torch.manual_seed(0)
    plain = build_model(name, args)
    build = packed_deepfm if name == "deepfm" else packed_dcn_v2
    row_wise = build(args, SparseArgs(sharding="row_wise"))
    _copy_plain_into_packed(plain, row_wise)
    dense, values, lengths = _batch(seed=4)
    torch.testing.assert_close(row_wise(dense, values, lengths), plain(dense, values, lengths))
    stages = plain.pipeline_stages()
    b = CTRBatch(dense, values, lengths, torch.zeros(16))
    torch.testing.assert_close(stages.dense(b, stages.lookup(b)), plain(dense, values, lengths))
    packed = build(args, SparseArgs(optimizer="sgd", optimizer_params={"lr": 0.1}))
    _copy_plain_into_packed(plain, packed)
    interleaved = InterleavedForward(packed, micro_batches=2)
    try:
        torch.testing.assert_close(interleaved(dense, values, lengths), plain(dense, values, lengths))
    finally:
        interleaved.close()


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_dropout_acts_in_training_only(name):
    torch.manual_seed(3)
    model = build_model(name, _args(name, dropout=0.5))
    tower = model.top if name == "dlrm" else model.mlp
    assert sum(isinstance(m, torch.nn.Dropout) for m in tower) == 1  # one per hidden layer
    dense, values, lengths = _batch(seed=5)
    model.train()
    assert not torch.equal(model(dense, values, lengths), model(dense, values, lengths))
    model.eval()
    first = model(dense, values, lengths)
    assert torch.equal(first, model(dense, values, lengths))
    # eval is the model without dropout: the same Linear layers in a tower built with dropout 0
    torch.manual_seed(3)
    bare = build_model(name, _args(name))
    bare_tower = bare.top if name == "dlrm" else bare.mlp
    assert not any(isinstance(m, torch.nn.Dropout) for m in bare.modules())  # default 0: no module, keys unchanged
    bare.load_state_dict({k: v for k, v in model.state_dict().items() if not k.startswith(("mlp.", "top."))},
                         strict=False)
    linears = [m for m in tower if isinstance(m, torch.nn.Linear)]
    for mine, theirs in zip([m for m in bare_tower if isinstance(m, torch.nn.Linear)], linears, strict=True):
        mine.load_state_dict(theirs.state_dict())
    bare.eval()
    torch.testing.assert_close(bare(dense, values, lengths), first)


def test_dropout_and_shape_values_are_checked():
    with pytest.raises(ValueError, match="dropout 1.0"):
        DeepFMArgs(vocab_sizes=[5], num_dense=1, dropout=1.0)
    with pytest.raises(ValueError, match="cross_layers -1"):
        DCNv2Args(vocab_sizes=[5], num_dense=1, cross_layers=-1)
    with pytest.raises(ValueError, match="dropout -0.1"):
        WideAndDeep(WideAndDeepArgs(vocab_sizes=[5], num_dense=1, dropout=-0.1))
    with pytest.raises(ValueError, match="dropout 2"):
        DLRM(DLRMArgs(vocab_sizes=[5], num_dense=1, dropout=2))
    with pytest.raises(ValueError, match=r"dense features must be \[B, 3\]"):
        DeepFM(_args("deepfm"))(torch.zeros(16, 2), *_batch()[1:])
    with pytest.raises(ValueError, match="expected one of wide_deep, dlrm, deepfm, dcn_v2"):
        model_args("fm", vocab_sizes=[5], num_dense=1)
    with pytest.raises(TypeError, match="takes DCNv2Args"):
        build_model("dcn_v2", _args("deepfm"))


def test_rec_job_flags_take_the_new_models_and_refuse_a_bad_dropout(tmp_path):
    from sparse_scale.rec.cli import job_config, parse_args
    from sparse_scale.rec.config import RecJobConfig, RecJobError
    from sparse_scale.rec.job import RecJob

    config = str(ROOT / "ds_configs" / "demo_cpu.json")
    for name, shape in (("deepfm", DeepFMArgs), ("dcn_v2", DCNv2Args)):
        job = job_config(parse_args(["--config", config, "--model", name, "--dropout", "0.2"]))
        args = RecJob.build(job, rank=0, world_size=1).model_args
        assert isinstance(args, shape) and args.dropout == 0.2 and len(args.vocab_sizes) == 26
    with pytest.raises(RecJobError, match=r"--dropout 1\.5: must be a probability in \[0, 1\)"):
        RecJobConfig(config=config, dropout=1.5)


def _cli_run(rank: int, world_size: int, argv: list[str]) -> dict:
    from sparse_scale.rec.cli import main

    main(argv)  # a job error is a SystemExit, which fails the rank
    return {"summary": json.loads((Path(argv[argv.index("--out") + 1]) / "summary.json").read_text())}


@pytest.mark.slow
@pytest.mark.soak  # 6-20 s each on the shared 2-core machine
@pytest.mark.parametrize("name", ["deepfm", "dcn_v2"])
def test_rec_job_trains_each_new_model_on_packed_tables(tmp_path, name):
    """sparse-train-rec --model NAME on one process: packed tables behind a cache, 2 interleaved micro-batches."""
    cfg = json.loads((ROOT / "ds_configs" / "rec_picasso_cpu.json").read_text())
    cfg["scheduler"]["params"].update(warmup_num_steps=2)
    cfg.update(train_micro_batch_size_per_gpu=64, wandb={"enabled": False})
    cfg["picasso"]["cache"]["rows"] = 2000
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps(cfg))
    argv = ["--config", str(path), "--out", str(tmp_path / "out"), "--model", name, "--steps", "8",
            "--eval-samples", "2048", "--vocab", "300", "--threads", "1", "--dropout", "0.1"]
    got = run_distributed(_cli_run, 1, args=(argv,), timeout_s=170, init_process_group=False)[0]
    summary = got["summary"]
    assert summary["model"] == name and summary["steps"] == 8 and summary["eval_samples"] == 2048
    assert 0.0 < summary["auc"] < 1.0 and summary["log_loss"] < 1.0
    assert summary["picasso"]["interleave_micro_batches"] == 2 and summary["picasso"]["cache_hit_rate"] > 0


def _gba_config(tmp_path: Path, picasso: dict | None) -> str:
    cfg = json.loads((ROOT / "ds_configs" / "gba_cpu.json").read_text())
    cfg.update(wandb={"enabled": False})
    if picasso is not None:
        cfg["picasso"] = picasso
    path = tmp_path / "gba.json"
    path.write_text(json.dumps(cfg))
    return str(path)


@pytest.mark.parametrize("name,collections", [("deepfm", 2), ("dcn_v2", 1), ("wide_deep", 2), ("dlrm", 1)])
def test_gba_jobs_put_every_models_tables_on_the_servers(tmp_path, name, collections):
    """--server-tables (per-field) and gba + picasso blocks (packed): the tables live on the servers, not in DeepSpeed."""
    from gba_engine.packed_tables import ServerPackedFieldEmbeddings
    from gba_engine.tables import ServerFieldEmbeddings, server_tables
    from sparse_scale.rec.combinations import refusals
    from sparse_scale.rec.config import RecJobConfig
    from sparse_scale.rec.job import RecJob
    from sparse_scale.rec.model import build_model as build_job_model

    picasso = {"packing": True, "embedding_dim": 8, "optimizer": {"type": "rowwise_adagrad", "lr": 0.05}}
    for blocks, kind, flag in ((None, ServerFieldEmbeddings, True), (picasso, ServerPackedFieldEmbeddings, False)):
        config = RecJobConfig(config=_gba_config(tmp_path, blocks), model=name, fields=26, vocab=50,
                              server_tables=flag, dropout=0.1)
        assert refusals(config) == []
        net = build_job_model(RecJob.build(config, rank=0, world_size=3))
        assert len([m for m in net.modules() if isinstance(m, kind)]) == collections
        specs, _ = server_tables(net)
        assert sum(s.num_rows for s in specs) == collections * 26 * 50
        assert not [n for n, _ in net.named_parameters() if n.startswith(("embeddings.", "wide."))]
        assert any(isinstance(m, torch.nn.Dropout) for m in net.modules())


def _system_run(rank: int, world_size: int, argv: list[str]) -> dict:
    from sparse_scale.rec.cli import job_config, parse_args
    from sparse_scale.rec.runner import run

    summary = run(job_config(parse_args(argv)), wandb_mode="disabled").to_dict()
    return {"server": True} if summary.get("server") else {k: summary.get(k) for k in ("auc", "steps", "moe", "model")}


@pytest.mark.slow
@pytest.mark.soak
@pytest.mark.parametrize("name", ["deepfm", "dcn_v2"])
def test_the_system_config_trains_each_new_model_with_all_three_blocks(tmp_path, name):
    """ds_configs/rec_system_cpu.json small: packed server tables behind the worker cache (gba + picasso), gba auto,
    an MoE tower with replicated experts in place of the deep MLP, with dropout; 2 workers + 1 server."""
    cfg = json.loads((ROOT / "ds_configs" / "rec_system_cpu.json").read_text())
    cfg.update(train_micro_batch_size_per_gpu=32, wandb={"enabled": False})
    cfg["picasso"]["cache"]["rows"] = 500  # of 26 x 200 rows per table
    cfg["gba"].update(timeout_s=20, heartbeat_s=0.5)
    path = tmp_path / "system.json"
    path.write_text(json.dumps(cfg))
    argv = ["--config", str(path), "--out", str(tmp_path / "run"), "--model", name, "--dropout", "0.1",
            "--steps", "10", "--eval-samples", "2048", "--vocab", "200", "--threads", "1"]
    w0, w1, server = run_distributed(_system_run, 3, args=(argv,), timeout_s=110, init_process_group=False)
    assert server == {"server": True} and w0["steps"] + w1["steps"] == 20
    assert w0["model"] == name and 0.0 < w0["auc"] < 1.0 and w0["auc"] == w1["auc"]
    assert w0["moe"]["experts"] == "replicated" and w0["moe"]["layers"]
