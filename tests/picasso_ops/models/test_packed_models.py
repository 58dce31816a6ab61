"""Packed wide-and-deep and DLRM models against the plain per-field models, and the sparse step contract."""
from __future__ import annotations

import pytest
import torch

from picasso_ops.distributed import engine_step, sparse_step
from picasso_ops.models import (
    DLRM,
    DLRMArgs,
    SparseArgs,
    WideAndDeep,
    WideAndDeepArgs,
    packed_dlrm,
    packed_wide_and_deep,
)


def _jagged(num_fields, batch, vocab, max_len, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, max_len + 1, (num_fields, batch), generator=g)
    values = torch.randint(0, vocab, (int(lengths.sum()),), generator=g)
    return values, lengths


def _copy_plain_into_packed(plain: torch.nn.Module, packed: torch.nn.Module) -> None:
    """Give a packed model the plain model's weights (dense layers by name, tables field by field)."""
    dense = {k: v for k, v in plain.state_dict().items() if ".bags." not in k}
    packed.load_state_dict(dense, strict=False)
    with torch.no_grad():
        for part in ("embeddings", "wide"):
            if not hasattr(plain, part):
                continue
            coll = getattr(packed, part).collection
            prefix = "emb" if part == "embeddings" else "wide"
            for f, bag in enumerate(getattr(plain, part).bags):
                coll.table_weight(f"{prefix}{f}").copy_(bag.weight)


@pytest.mark.parametrize("packing", [True, False])
def test_packed_wide_and_deep_trains_like_the_plain_model(packing):
    """Same weights, SGD on everything: the fused sparse update equals dense autograd + torch SGD."""
    args = WideAndDeepArgs(vocab_sizes=[13, 7, 13, 5], num_dense=3, embedding_dim=4, hidden=(8,))
    torch.manual_seed(0)
    plain = WideAndDeep(args)
    for bag in plain.wide.bags:
        torch.nn.init.normal_(bag.weight, std=0.1)  # non-zero wide weights so the wide path is checked too
    lr = 0.1
    packed = packed_wide_and_deep(args, SparseArgs(optimizer="sgd", optimizer_params={"lr": lr}, packing=packing))
    _copy_plain_into_packed(plain, packed)
    assert not [n for n, _ in packed.named_parameters() if "embeddings" in n or "wide." in n]  # tables are no params
    opt_plain = torch.optim.SGD(plain.parameters(), lr=lr)
    opt_packed = torch.optim.SGD(packed.parameters(), lr=lr)
    for step in range(4):
        values, lengths = _jagged(4, 16, 5, 3, seed=step)
        dense = torch.randn(16, 3, generator=torch.Generator().manual_seed(step))
        labels = (torch.arange(16) % 2).float()
        for model, opt in ((plain, opt_plain), (packed, opt_packed)):
            loss = torch.nn.functional.binary_cross_entropy_with_logits(model(dense, values, lengths), labels)
            opt.zero_grad()
            loss.backward()
            opt.step()
        assert sparse_step(packed) == 2  # deep and wide tables, one step each
    for f, bag in enumerate(plain.embeddings.bags):
        torch.testing.assert_close(packed.embeddings.collection.table_weight(f"emb{f}"), bag.weight, atol=1e-6, rtol=0)
    for f, bag in enumerate(plain.wide.bags):
        torch.testing.assert_close(packed.wide.collection.table_weight(f"wide{f}"), bag.weight, atol=1e-6, rtol=0)
    torch.testing.assert_close(packed.mlp[0].weight, plain.mlp[0].weight, atol=1e-6, rtol=0)


def test_dlrm_interactions_are_the_distinct_pairwise_dots():
    args = DLRMArgs(vocab_sizes=[9] * 3, num_dense=2, embedding_dim=4, bottom=(5,), top=(6,))
    torch.manual_seed(1)
    model = DLRM(args)
    values, lengths = _jagged(3, 7, 9, 2, seed=3)
    dense = torch.randn(7, 2)
    x = model.bottom(dense)
    t = torch.cat([x.unsqueeze(1), model.embeddings(values, lengths)], dim=1)
    pairs = torch.stack([(t[:, i] * t[:, j]).sum(-1) for i in range(4) for j in range(i)], dim=1)
    torch.testing.assert_close(model(dense, values, lengths), model.top(torch.cat([x, pairs], 1)).squeeze(-1))


@pytest.mark.parametrize("sharding", ["data_parallel", "row_wise"])
def test_packed_dlrm_forward_matches_plain_and_learns_a_planted_rule(sharding):
    args = DLRMArgs(vocab_sizes=[4, 4], num_dense=1, embedding_dim=4, bottom=(4,), top=(16,))
    torch.manual_seed(0)
    plain = DLRM(args)
    packed = packed_dlrm(args, SparseArgs(optimizer="rowwise_adagrad", optimizer_params={"lr": 0.1}, sharding=sharding))
    _copy_plain_into_packed(plain, packed)
    values, lengths = _jagged(2, 8, 4, 3, seed=5)
    torch.testing.assert_close(packed(torch.ones(8, 1), values, lengths), plain(torch.ones(8, 1), values, lengths))

    opt = torch.optim.Adam(packed.parameters(), lr=0.02)
    lengths = torch.ones(2, 64, dtype=torch.long)
    g = torch.Generator().manual_seed(0)
    for _ in range(250):
        values = torch.randint(0, 4, (128,), generator=g)
        labels = (values[:64] == values[64:]).float()  # click iff both fields carry the same id
        loss = torch.nn.functional.binary_cross_entropy_with_logits(packed(torch.zeros(64, 1), values, lengths), labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sparse_step(packed)
    assert loss.item() < 0.25


class _FakeEngine:
    """The part of DeepSpeed's engine that ``engine_step`` reads, with a scripted boundary, scale and overflow."""

    def __init__(self, module, gas, loss_scale=None, overflow_at=()):
        self.module, self.gas, self.micro_steps = module, gas, 0
        self.loss_scale, self.overflow_at, self.applied = loss_scale, set(overflow_at), False

    def is_gradient_accumulation_boundary(self):
        return (self.micro_steps + 1) % self.gas == 0

    def fp16_enabled(self):
        return self.loss_scale is not None

    def _get_optimizer_loss_scale(self):
        return self.loss_scale

    def step(self):
        self.applied = self.is_gradient_accumulation_boundary() and self.micro_steps not in self.overflow_at
        self.micro_steps += 1

    def was_step_applied(self):
        return self.applied


def test_engine_step_applies_one_unscaled_sparse_step_per_accumulation_window():
    """gas=2 and loss scale 8 through engine_step equal one step on the mean of the two micro-batch losses."""
    args = WideAndDeepArgs(vocab_sizes=[6, 6], num_dense=1, embedding_dim=4, hidden=(4,))
    sparse = SparseArgs(optimizer="rowwise_adagrad", optimizer_params={"lr": 0.1})
    torch.manual_seed(0)
    model = packed_wide_and_deep(args, sparse)
    torch.manual_seed(0)
    ref = packed_wide_and_deep(args, sparse)
    engine = _FakeEngine(model, gas=2, loss_scale=8.0, overflow_at={5})
    batches = [_jagged(2, 8, 6, 2, seed=s) for s in range(8)]
    for i, (values, lengths) in enumerate(batches):
        dense = torch.ones(8, 1)
        loss = model(dense, values, lengths).pow(2).mean()
        (loss / 2 * 8.0).backward()  # what engine.backward does: / gas, * loss scale
        boundary = engine_step(engine)
        assert boundary == (i % 2 == 1)
        if i // 2 != 2:  # window 2 (micro-steps 4, 5) overflowed: the engine and the tables skip it
            (ref(dense, values, lengths).pow(2).mean() / 2).backward()
            if i % 2 == 1:
                sparse_step(ref)
    for name in ("emb0", "emb1"):
        torch.testing.assert_close(
            model.embeddings.collection.table_weight(name), ref.embeddings.collection.table_weight(name),
            atol=1e-6, rtol=0,
        )


# ---------------------------------------------------------------- the main job
def _train_rec_with_picasso(rank, world_size, argv):
    """Run train_rec, capturing the model build_model made; return digests of its tables before and after."""
    import hashlib
    import importlib.util
    import os
    import sys
    from pathlib import Path

    os.environ["WANDB_MODE"] = "offline"
    root = Path(__file__).resolve().parents[3]
    spec = importlib.util.spec_from_file_location("train_rec", root / "launch" / "train_rec.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["train_rec"] = mod  # dataclasses look their module up by name
    spec.loader.exec_module(mod)
    built, digests = {}, {}

    def tables_digest(model):
        sd = {k: v for k, v in model.state_dict().items() if k.startswith(("embeddings.", "wide."))}
        blob = b"".join(sd[k].detach().contiguous().numpy().tobytes() for k in sorted(sd))
        return hashlib.sha256(blob).hexdigest(), sorted(sd)

    original = mod.build_model

    def build_model(job):
        built["model"] = original(job)
        digests["init"] = tables_digest(built["model"])[0]
        return built["model"]

    mod.build_model = build_model
    summary = mod.train(mod.parse_args(argv))
    final, keys = tables_digest(built["model"])
    return {"init": digests["init"], "final": final, "keys": keys, "type": type(built["model"].embeddings).__name__,
            "steps": summary["steps"], "auc": summary["auc"]}


@pytest.mark.slow
def test_train_rec_with_a_picasso_block_keeps_data_parallel_tables_identical(tmp_path):
    import json
    from pathlib import Path

    from sparse_scale.multiproc import run_distributed

    root = Path(__file__).resolve().parents[3]
    cfg = json.loads((root / "ds_configs" / "demo_cpu.json").read_text())
    cfg.update(train_micro_batch_size_per_gpu=64, gradient_accumulation_steps=2, wandb={"enabled": False},
               picasso={"packing": True, "embedding_dim": 8, "optimizer": {"type": "rowwise_adagrad", "lr": 0.05}})
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps(cfg))
    argv = ["--config", str(path), "--out", str(tmp_path / "out"), "--steps", "3", "--eval-samples", "1024",
            "--vocab", "300", "--threads", "1"]
    got = run_distributed(_train_rec_with_picasso, 2, args=(argv,), timeout_s=400, init_process_group=False)
    assert got[0]["type"] == "PackedFieldEmbeddings" and got[0]["steps"] == 3
    assert "emb0.weight" in " ".join(got[0]["keys"]) and any(k.endswith("momentum1") for k in got[0]["keys"])
    assert got[0]["init"] == got[1]["init"]  # replicas start equal (broadcast from rank 0)
    assert got[0]["final"] == got[1]["final"]  # and stay bit-identical without a dense all-reduce
    assert got[0]["final"] != got[0]["init"]  # the sparse step did run
    assert 0.0 < got[0]["auc"] < 1.0
