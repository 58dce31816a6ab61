"""picasso.bounds_check: "fatal" names the field, table, id and range; "warn" (row 0) and "clamp" replace, count, log once.

Also: NaN/inf per-sample weights are refused before a lookup, and the rec job reports the counts.
"""
import logging

import pytest
import torch

from picasso_ops.block import PicassoBlockError, apply_picasso_block, picasso_summary, set_bounds_check
from picasso_ops.config import PicassoConfig
from picasso_ops.embedding import PackedEmbeddingCollection, TableSpec
from picasso_ops.embedding.bounds import BoundsCheck
from picasso_ops.jagged import JaggedBatch
from picasso_ops.models import SparseArgs, WideAndDeepArgs, packed_wide_and_deep
from sparse_core.config_file import ConfigError, validate_model
from sparse_scale.rec.summary import bounds_rows, summary_rows

SPECS = [TableSpec("user", 10, 4, optimizer="sgd", optimizer_params={"lr": 0.5}),
         TableSpec("item", 5, 4, optimizer="sgd", optimizer_params={"lr": 0.5})]
# user: ids 3 | 12, -1 ; item: 7 | 2  (lengths [F, B] = [[1, 2], [1, 1]])
VALUES, LENGTHS = torch.tensor([3, 12, -1, 7, 2]), torch.tensor([[1, 2], [1, 1]])


def _collection(mode, custom_ops, specs=SPECS, **kw):
    torch.manual_seed(0)
    return PackedEmbeddingCollection(specs, bounds_check=mode, custom_ops=custom_ops, **kw)


def _lookup(emb, values=VALUES, lengths=LENGTHS, keys=("user", "item")):
    return emb(JaggedBatch(list(keys), values.clone(), lengths))


@pytest.mark.parametrize("custom_ops", [False, True])
def test_fatal_is_the_default_and_names_field_table_id_and_range(custom_ops):
    emb = PackedEmbeddingCollection(SPECS, custom_ops=custom_ops)
    assert emb.bounds_check == "fatal"
    with pytest.raises(IndexError, match=r"field 'user': id (12|-1) is out of range for table 'user' of size 10 "
                                         r"\(valid ids are 0\.\.9"):
        _lookup(emb)
    assert emb.bounds_check_counts() == {}


@pytest.mark.parametrize("custom_ops", [False, True])
@pytest.mark.parametrize("mode, fixed", [("warn", [3, 0, 0, 0, 2]), ("clamp", [3, 9, 0, 4, 2])])
def test_warn_and_clamp_look_up_the_replaced_rows_and_count_them(mode, fixed, custom_ops):
    emb = _collection(mode, custom_ops)
    ref = _collection("fatal", custom_ops)  # same init (seeded): looks up the replaced ids directly
    values = VALUES.clone()
    with torch.no_grad():
        got = emb(JaggedBatch(["user", "item"], values, LENGTHS)).values
        want = _lookup(ref, torch.tensor(fixed)).values
    torch.testing.assert_close(got, want)
    assert torch.equal(values, VALUES), "the caller's ids are never changed in place"
    assert emb.bounds_check_counts() == {"user": 2, "item": 1}


@pytest.mark.parametrize("custom_ops", [False, True])
def test_warn_trains_row_0_for_a_bad_id(custom_ops):
    emb = _collection("warn", custom_ops)
    before = emb.table_weight("item").clone()
    _lookup(emb, torch.tensor([1, 2, 3, 9, 9]), torch.tensor([[1, 2], [1, 1]])).values.sum().backward()
    changed = (emb.table_weight("item") != before).any(dim=1).nonzero().flatten().tolist()
    assert changed == [0]  # both item ids (9, 9) were out of range: row 0 took their gradient, no other row
    assert emb.bounds_check_counts() == {"item": 2}


def test_warn_logs_once_per_table_then_counts(caplog):
    emb = _collection("warn", custom_ops=False)
    with caplog.at_level(logging.INFO, logger="picasso_ops.embedding.bounds"):
        with torch.no_grad():
            for _ in range(3):
                _lookup(emb)
    lines = [r.getMessage() for r in caplog.records if r.name == "picasso_ops.embedding.bounds"]
    assert len(lines) == 2 and all(r.levelno == logging.WARNING for r in caplog.records
                                   if r.name == "picasso_ops.embedding.bounds")
    assert any("table 'user' of 10 rows" in m and "looked up as row 0" in m for m in lines)
    assert any("field 'item': id 7" in m for m in lines)
    assert emb.bounds_check_counts() == {"user": 6, "item": 3}


def test_sub_row_tables_and_sequence_features_count_each_id_once():
    specs = [TableSpec("wide", 6, 8, optimizer="sgd"), TableSpec("narrow", 6, 4, optimizer="sgd"),
             TableSpec("seq", 4, 4, pooling="none", optimizer="sgd")]
    emb = PackedEmbeddingCollection(specs, bounds_check="clamp", across_dims=True, min_width=4, custom_ops=False)
    batch = JaggedBatch(["wide", "narrow", "seq"], torch.tensor([6, 1, 7, 2, 2, 4]),
                        torch.tensor([[1, 1], [1, 1], [2, 0]]))
    with torch.no_grad():
        out = emb(batch)
    assert emb.bounds_check_counts() == {"wide": 1, "narrow": 1, "seq": 1}
    torch.testing.assert_close(out["wide"][0], emb.table_weight("wide")[5])  # 6 clamped to the last row
    torch.testing.assert_close(out["seq"][1], emb.table_weight("seq")[3])   # 4 clamped to 3


def test_mode_can_be_switched_and_an_unknown_one_is_refused():
    emb = _collection("fatal", custom_ops=False)
    emb.bounds_check = "clamp"
    with torch.no_grad():
        _lookup(emb)
    assert emb.bounds_check_counts() == {"user": 2, "item": 1}
    with pytest.raises(ValueError, match="bounds_check must be one of fatal, warn, clamp, got 'ignore'"):
        emb.bounds_check = "ignore"
    with pytest.raises(ValueError, match="got 'off'"):
        BoundsCheck("off")


def test_config_key_is_validated_and_named():
    assert PicassoConfig().bounds_check == "fatal"
    with pytest.raises(ConfigError, match=r"job\.json: picasso\.bounds_check: Input should be 'fatal', 'warn' or "
                                          r"'clamp' \(got 'ignore'\)"):
        validate_model("picasso", PicassoConfig, {"bounds_check": "ignore"}, source="job.json")


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_per_sample_weights_are_refused_naming_the_field(bad):
    emb = _collection("fatal", custom_ops=False)
    before = emb.table_weight("item").clone()
    weights = torch.tensor([1.0, 1.0, 1.0, 1.0, bad])
    with pytest.raises(ValueError, match=r"per-sample weights: field 'item': weight 1 of the field \(position 4 "
                                         r"of the batch\) is (nan|inf|-inf); 1 of 5"):
        emb(JaggedBatch(["user", "item"], torch.tensor([3, 1, 2, 4, 2]), LENGTHS, weights))
    assert torch.equal(emb.table_weight("item"), before)


def _packed_model(block):
    args = WideAndDeepArgs(vocab_sizes=[7, 9], num_dense=2, embedding_dim=4, hidden=(8,))
    return apply_picasso_block(packed_wide_and_deep(args, SparseArgs(optimizer="sgd", optimizer_params={"lr": 0.1})),
                               block)


def test_the_block_sets_every_collection_and_the_summary_reports_the_counts():
    model = _packed_model(PicassoConfig(bounds_check="warn"))
    values, lengths = torch.tensor([3, 7, 100, 1]), torch.tensor([[1, 1], [1, 1]])  # field 0: 3, 7; field 1: 100, 1
    model(torch.zeros(2, 2), values, lengths)
    summary = picasso_summary(model)["bounds_check"]
    assert summary["mode"] == "warn" and summary["out_of_range_ids"] == 4  # deep and wide tables: 2 ids each
    assert set(summary["by_table"].values()) == {1}
    rows = dict(summary_rows({"world_size": 1, "launcher": "none", "steps": 1, "samples": 2, "samples_per_s": 1.0,
                              "eval_samples": 2, "auc": 0.5, "log_loss": 0.7, "checkpoint": "c", "wandb_dir": "w",
                              "wandb_mode": "offline", "picasso": {"bounds_check": summary}}))
    assert rows["picasso ids out of range (warn, rank 0)"].startswith("4 -> row 0 (")
    assert "bounds_check" not in picasso_summary(_packed_model(PicassoConfig()))  # fatal: nothing to report


def test_bounds_rows_for_clamp_and_none():
    assert bounds_rows(None) == []
    assert bounds_rows({"mode": "clamp", "out_of_range_ids": 0, "by_table": {}}) == [
        ("picasso ids out of range (clamp, rank 0)", "0 -> clamped")]


@pytest.mark.parametrize("block, words", [
    ({"bounds_check": "warn", "cache": {"rows": 8}}, "with picasso.cache"),
    ({"bounds_check": "clamp", "sharding": "row_wise"}, 'with picasso.sharding = "row_wise"'),
])
def test_library_refuses_modes_it_cannot_apply(block, words):
    with pytest.raises(PicassoBlockError, match=words):
        set_bounds_check(torch.nn.Linear(1, 1), PicassoConfig.model_validate(block))


def test_a_copied_collection_keeps_its_mode_and_counts_apart():
    import copy
    import pickle

    emb = _collection("warn", custom_ops=False)
    with torch.no_grad():
        _lookup(emb)
    twin = copy.deepcopy(emb)
    assert twin.bounds_check == "warn" and twin.bounds_check_counts() == {"user": 2, "item": 1}
    assert all(k.bounds is twin._bounds for k in twin.kernels)  # the copy's packs share the copy's counter
    with torch.no_grad():
        _lookup(twin)
    assert emb.bounds_check_counts() == {"user": 2, "item": 1}
    assert pickle.loads(pickle.dumps(emb._bounds)).counts() == {"user": 2, "item": 1}
