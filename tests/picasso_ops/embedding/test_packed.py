"""PackedEmbeddingCollection against per-table nn.EmbeddingBag references: lookup, fused training, checkpoints, errors."""

import math

import pytest
import torch
from torch import nn

from picasso_ops.embedding import PackedEmbeddingCollection, TableSpec, plan_packing
from picasso_ops.jagged import JaggedBatch

PACKINGS = {
    "packed": dict(packing=True),
    "unpacked": dict(packing=False),
    "across_dims": dict(across_dims=True),
}
HYPER = {
    "sgd": {"lr": 0.1},
    "rowwise_adagrad": {"lr": 0.1, "eps": 1e-8},
    "adam": {"lr": 0.01, "beta1": 0.9, "beta2": 0.99, "eps": 1e-8},
}
# batch field order differs from spec order and carries a field nobody looks up (packs gather their ids)
BATCH_KEYS = ["t_sum16", "unused", "f_b", "t_seq8", "f_a", "t_mean4", "t_seq4", "t_mean8"]
# spec order: most packs read their ids in place as one slice
SPEC_KEYS = ["f_a", "f_b", "t_mean8", "t_sum16", "t_mean4", "t_seq8", "t_seq4"]


def make_specs(optimizer="sgd", params=None):
    params = HYPER[optimizer] if params is None else params
    return [
        TableSpec("t_sum8", 11, 8, "sum", optimizer, params, feature_names=("f_a", "f_b")),
        TableSpec("t_mean8", 7, 8, "mean", optimizer, params),
        TableSpec("t_sum16", 13, 16, "sum", optimizer, params),
        TableSpec("t_mean4", 5, 4, "mean", optimizer, params),
        TableSpec("t_seq8", 9, 8, "none", optimizer, params),
        TableSpec("t_seq4", 6, 4, "none", optimizer, params),  # across dims: shares t_seq8's pack, 1 vs 2 rows
    ]


def feature_table(specs):
    return {f: s for s in specs for f in s.feature_names}


def make_batch(specs, seed, batch_size=6, weighted=False, max_len=4, keys=BATCH_KEYS):
    """Small tables and up to 4 ids per bag: many repeated ids and some empty bags."""
    g = torch.Generator().manual_seed(seed)
    table_of = feature_table(specs)
    lengths = torch.randint(0, max_len + 1, (len(keys), batch_size), generator=g)
    lengths[:, 0] = 0  # sample 0 has an empty bag in every field
    rows = torch.tensor([table_of[k].num_embeddings if k in table_of else 50 for k in keys])
    bound = torch.repeat_interleave(rows, lengths.sum(1))
    values = (torch.rand(bound.numel(), generator=g) * bound).long()
    weights = torch.rand(values.numel(), generator=g) + 0.5 if weighted else None
    return JaggedBatch(keys, values, lengths, weights)


class Reference(nn.Module):
    """One nn.EmbeddingBag (nn.Embedding for sequences) per table, dense autograd."""

    def __init__(self, specs, weighted):
        super().__init__()
        self.specs = specs
        self.weighted = weighted
        self.tables = nn.ModuleDict()
        for s in specs:
            if s.pooling == "none":
                self.tables[s.name] = nn.Embedding(s.num_embeddings, s.embedding_dim)
            else:
                mode = "sum" if weighted or s.pooling == "sum" else "mean"
                self.tables[s.name] = nn.EmbeddingBag(s.num_embeddings, s.embedding_dim, mode=mode)

    def forward(self, batch):
        out = {}
        for s in self.specs:
            for feat in s.feature_names:
                f = batch.key_index(feat)
                ids = batch.field_values(feat)
                if s.pooling == "none":
                    out[feat] = self.tables[s.name](ids)
                    continue
                lengths = batch.lengths[f]
                offsets = torch.cumsum(lengths, 0) - lengths
                psw = None
                if self.weighted:
                    lo, hi = batch.field_offsets[f : f + 2].tolist()
                    psw = batch.weights[lo:hi]
                pooled = self.tables[s.name](ids, offsets, per_sample_weights=psw)
                if self.weighted and s.pooling == "mean":
                    pooled = pooled / lengths.clamp(min=1).unsqueeze(1).float()
                out[feat] = pooled
        return out


def copy_weights(ref, emb):
    with torch.no_grad():
        for s in ref.specs:
            ref.tables[s.name].weight.copy_(emb.table_weight(s.name))


def check_lookup(emb, ref, batch):
    out = emb(batch)
    expected = ref(batch)
    for feat, value in expected.items():
        torch.testing.assert_close(out[feat], value, atol=1e-6, rtol=1e-6, msg=lambda m: f"{feat}: {m}")
    return out, expected


@pytest.mark.parametrize("keys", [BATCH_KEYS, SPEC_KEYS], ids=["gathered", "in_place"])
@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
@pytest.mark.parametrize("packing", list(PACKINGS))
def test_lookup_matches_per_table_embedding_bag(packing, weighted, keys):
    torch.manual_seed(0)
    specs = make_specs()
    emb = PackedEmbeddingCollection(specs, **PACKINGS[packing])
    ref = Reference(specs, weighted)
    copy_weights(ref, emb)
    for seed in range(3):
        batch = make_batch(specs, seed, weighted=weighted, keys=keys)
        values_before = batch.values.clone()
        with torch.no_grad():
            out, expected = check_lookup(emb, ref, batch)
        assert torch.equal(batch.values, values_before)  # the batch is an input: never modified
        # one [B, sum D] tensor in spec order, per-feature entries are views of it
        pooled = [f for s in specs if s.pooling != "none" for f in s.feature_names]
        assert out.keys == tuple(pooled)
        torch.testing.assert_close(out.values, torch.cat([expected[f] for f in pooled], 1), atol=1e-6, rtol=1e-6)
        assert all(out[f].untyped_storage().data_ptr() == out.values.untyped_storage().data_ptr() for f in pooled)
        assert out.values[0].abs().sum() == 0  # the empty bags of sample 0
        assert out["t_seq8"].shape == (batch.lengths[keys.index("t_seq8")].sum(), 8)


def test_int64_index_path_matches_and_leaves_the_batch_intact():
    """Packs over 2**31 buffer rows index with int64; force that path on small tables."""
    torch.manual_seed(0)
    specs = make_specs()
    emb = PackedEmbeddingCollection(specs)
    wide = PackedEmbeddingCollection(specs)
    wide.load_state_dict(emb.state_dict())
    for kernel in wide.kernels:
        kernel.columns.index_dtype = torch.int64
        kernel.columns.add = kernel.columns.add.long()
    batch = make_batch(specs, seed=9, keys=SPEC_KEYS)
    values_before = batch.values.clone()
    with torch.no_grad():
        expected, got = emb(batch), wide(batch)
    assert torch.equal(batch.values, values_before)
    torch.testing.assert_close(got.values, expected.values)
    torch.testing.assert_close(got["t_seq8"], expected["t_seq8"])


def reference_update(optimizer, hp, weight, grad, rows, state, step):
    """The optimizer definitions written out (FBGEMM row-wise Adagrad, lazy Adam with global step)."""
    g = grad[rows]
    if optimizer == "rowwise_adagrad":
        state["momentum1"][rows] += (g * g).mean(1)
        weight[rows] -= hp["lr"] * g / (state["momentum1"][rows].sqrt() + hp["eps"]).unsqueeze(1)
    elif optimizer == "adam":
        b1, b2 = hp["beta1"], hp["beta2"]
        state["momentum1"][rows] = b1 * state["momentum1"][rows] + (1 - b1) * g
        state["momentum2"][rows] = b2 * state["momentum2"][rows] + (1 - b2) * g * g
        m_hat = state["momentum1"][rows] / (1 - b1**step)
        v_hat = state["momentum2"][rows] / (1 - b2**step)
        weight[rows] -= hp["lr"] * m_hat / (v_hat.sqrt() + hp["eps"])
    else:
        raise AssertionError(optimizer)


def touched_rows(spec, batch):
    return torch.unique(torch.cat([batch.field_values(f) for f in spec.feature_names]))


@pytest.mark.parametrize("mode", ["fused", "fused_small_blocks", "autograd"])
@pytest.mark.parametrize("packing", list(PACKINGS))
@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad", "adam"])
def test_training_steps_match_reference(optimizer, packing, mode):
    torch.manual_seed(1)
    specs = make_specs(optimizer)
    emb = PackedEmbeddingCollection(specs, mode=mode.replace("_small_blocks", ""), **PACKINGS[packing])
    if mode == "fused_small_blocks":  # backward sorts and updates table by table instead of once per pack
        for kernel in emb.kernels:
            kernel.sort_block = 1
    ref = Reference(specs, weighted=True)
    copy_weights(ref, emb)
    hp = HYPER[optimizer]
    torch_sgd = torch.optim.SGD(ref.parameters(), lr=hp["lr"]) if optimizer == "sgd" else None
    ref_state = {
        s.name: {k: torch.zeros_like(v, dtype=torch.float32) for k, v in emb.table_state(s.name).items() if k != "step"}
        for s in specs
    }
    for step in range(1, 5):
        batch = make_batch(specs, seed=100 + step, weighted=True, keys=BATCH_KEYS if step % 2 else SPEC_KEYS)
        targets = {f: torch.randn_like(v) for f, v in ref(batch).items()}
        out = emb(batch)  # one forward = one optimizer step in fused mode
        loss = sum((out[f] * t).sum() for f, t in targets.items())
        loss.backward()
        emb.step()  # no-op in fused mode: the update already happened in backward
        ref.zero_grad()
        sum((v * targets[f]).sum() for f, v in ref(batch).items()).backward()
        with torch.no_grad():
            if torch_sgd is not None:
                torch_sgd.step()
            else:
                for s in specs:
                    table = ref.tables[s.name]
                    reference_update(optimizer, hp, table.weight, table.weight.grad, touched_rows(s, batch), ref_state[s.name], step)
        for s in specs:
            torch.testing.assert_close(emb.table_weight(s.name), ref.tables[s.name].weight, atol=1e-6, rtol=1e-6,
                                       msg=lambda m: f"step {step}, {s.name} weight: {m}")
            state = emb.table_state(s.name)
            for key, expected in ref_state[s.name].items():
                torch.testing.assert_close(state[key], expected, atol=1e-6, rtol=1e-6,
                                           msg=lambda m: f"step {step}, {s.name} {key}: {m}")
            if optimizer == "adam":
                assert int(state["step"]) == step


@pytest.mark.parametrize("custom_ops", [False, True], ids=["torch", "custom-ops"])
def test_fused_backward_never_makes_a_dense_gradient(custom_ops):
    specs = [TableSpec("big", 400_000, 16, optimizer="rowwise_adagrad"), TableSpec("small", 50, 16, optimizer="rowwise_adagrad")]
    emb = PackedEmbeddingCollection(specs, custom_ops=custom_ops)
    assert list(emb.parameters()) == []
    assert all(not k.weight.requires_grad for k in emb.kernels)
    batch = JaggedBatch(["big", "small"], torch.tensor([5, 5, 399_999, 7, 1, 1, 2, 3]), torch.tensor([[2, 2], [3, 1]]))
    table_bytes = 400_000 * 16 * 4

    def peak_backward_allocation(run_backward):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
            run_backward()
        return max((e.cpu_memory_usage for e in prof.events()), default=0)

    captured = []
    kernel = emb.kernels[0]
    original = kernel.optimizer.update
    kernel.optimizer.update = lambda w, s, upd: captured.append(upd) or original(w, s, upd)
    out = emb(batch)
    fused_peak = peak_backward_allocation(lambda: out.values.sum().backward())
    # positive control: the same measurement sees a dense nn.EmbeddingBag gradient
    dense = nn.EmbeddingBag(400_000, 16, mode="sum")
    dense_out = dense(torch.tensor([5, 5, 399_999]), torch.tensor([0, 2]))
    dense_peak = peak_backward_allocation(lambda: dense_out.sum().backward())
    assert dense_peak >= table_bytes
    assert fused_peak < table_bytes / 100
    assert all(k.weight.grad is None for k in emb.kernels)
    if custom_ops:
        return  # the C++/Triton op updates rows in place; the torch optimizer is not called
    (upd,) = captured
    assert upd.rows.tolist() == [5, 7, 399_999, 400_001, 400_002, 400_003]  # unique rows only
    assert upd.grad.shape == (6, 16)
    assert torch.equal(upd.grad[0], torch.full((16,), 2.0))  # id 5 twice in one bag


def test_state_dict_is_per_table_and_loads_into_another_packing():
    torch.manual_seed(2)
    specs = [
        TableSpec("a", 30, 8, optimizer="adam"),
        TableSpec("b", 20, 16, "mean", optimizer="adam"),
        TableSpec("c", 25, 8, optimizer="rowwise_adagrad"),
        TableSpec("d", 10, 4, "none", optimizer="rowwise_adagrad"),
    ]
    keys = ["a", "b", "c", "d"]
    gen = torch.Generator().manual_seed(0)

    def batch():
        lengths = torch.randint(0, 4, (4, 5), generator=gen)
        bound = torch.repeat_interleave(torch.tensor([30, 20, 25, 10]), lengths.sum(1))
        return JaggedBatch(keys, (torch.rand(bound.numel(), generator=gen) * bound).long(), lengths)

    trained = PackedEmbeddingCollection(specs, across_dims=True)
    assert len(trained.groups) == 3  # a+b share a width-8 buffer
    for _ in range(3):
        out = trained(batch())
        (out.values.square().sum() + out["d"].sum()).backward()
    sd = trained.state_dict()
    assert set(sd) == {
        "a.weight", "a.momentum1", "a.momentum2", "a.step",
        "b.weight", "b.momentum1", "b.momentum2", "b.step",
        "c.weight", "c.momentum1", "d.weight", "d.momentum1",
    }
    assert sd["b.weight"].shape == (20, 16) and sd["c.momentum1"].shape == (25,) and int(sd["a.step"]) == 3

    unpacked = PackedEmbeddingCollection(specs, packing=False)
    assert len(unpacked.groups) == 4
    unpacked.load_state_dict(sd)
    for key, value in unpacked.state_dict().items():
        assert torch.equal(value, sd[key]), key
    # and both keep training identically (state and step counts came across)
    nxt = batch()
    for model in (trained, unpacked):
        out = model(nxt)
        (out.values.square().sum() + out["d"].sum()).backward()
    for s in specs:
        torch.testing.assert_close(trained.table_weight(s.name), unpacked.table_weight(s.name), atol=1e-6, rtol=1e-6)

    wrapped = nn.ModuleDict({"emb": PackedEmbeddingCollection(specs)})
    wrapped.load_state_dict({f"emb.{k}": v for k, v in sd.items()})
    assert torch.equal(wrapped["emb"].table_weight("b"), trained.table_weight("b"))
    bad = dict(sd)
    del bad["c.momentum1"]
    bad["c.extra"] = torch.zeros(1)
    with pytest.raises(RuntimeError, match=r"Missing key\(s\).*c\.momentum1[\s\S]*Unexpected key\(s\).*c\.extra"):
        unpacked.load_state_dict(bad)
    with pytest.raises(RuntimeError, match=r"size mismatch for a\.weight.*\(31, 8\).*\(30, 8\)"):
        unpacked.load_state_dict({**sd, "a.weight": torch.zeros(31, 8)})


@pytest.mark.parametrize("packing", list(PACKINGS))
def test_out_of_range_ids_name_the_field_id_and_table_size(packing):
    specs = make_specs()
    emb = PackedEmbeddingCollection(specs, **PACKINGS[packing])
    batch = make_batch(specs, seed=3)
    # f_b reads t_sum8 (11 rows); 12 is valid for t_sum16 (13 rows) in the same pack, so only the exact check catches it
    for feature, bad_id, size in [("f_b", 12, 11), ("t_mean4", -1, 5), ("t_seq8", 9, 9), ("t_sum16", 13, 13)]:
        values = batch.values.clone()
        f = BATCH_KEYS.index(feature)
        values[int(batch.field_offsets[f]) + 1] = bad_id
        broken = JaggedBatch(BATCH_KEYS, values, batch.lengths)
        with pytest.raises(IndexError, match=rf"field '{feature}': id {bad_id} is out of range .* size {size}"):
            emb(broken)


def test_missing_feature_is_named():
    emb = PackedEmbeddingCollection(make_specs())
    batch = make_batch(make_specs(), seed=0).select(["f_a", "t_sum16", "t_mean8", "t_mean4", "t_seq8", "t_seq4"])
    with pytest.raises(KeyError, match=r"lacks features \['f_b'\]"):
        emb(batch)


def test_grouping_keeps_compatible_tables_together_and_others_apart():
    base = dict(optimizer="rowwise_adagrad", optimizer_params={"lr": 0.1})
    specs = [
        TableSpec("s16", 10, 16, "sum", **base),
        TableSpec("m16", 10, 16, "mean", **base),  # sum and mean share a kernel
        TableSpec("lr16", 10, 16, "sum", "rowwise_adagrad", {"lr": 0.2}),  # other hyperparameters
        TableSpec("sgd16", 10, 16, "sum", "sgd", {"lr": 0.1}),  # other optimizer
        TableSpec("n16", 10, 16, "none", **base),  # sequence output
        TableSpec("s32", 10, 32, "sum", **base),  # other dim
        TableSpec("h16", 10, 16, "sum", dtype=torch.float64, **base),  # other dtype
        TableSpec("s16b", 10, 16, "sum", **base),
    ]
    names = lambda groups: [[p.spec.name for p in g.tables] for g in groups]
    assert names(plan_packing(specs)) == [["s16", "m16", "s16b"], ["lr16"], ["sgd16"], ["n16"], ["s32"], ["h16"]]
    across = plan_packing(specs, across_dims=True)
    assert names(across) == [["s16", "m16", "s32", "s16b"], ["lr16"], ["sgd16"], ["n16"], ["h16"]]
    assert [p.sub_rows for p in across[0].tables] == [1, 1, 2, 1] and across[0].width == 16
    assert names(plan_packing(specs, pack=False)) == [[s.name] for s in specs]
    odd = [TableSpec("d6", 10, 6), TableSpec("d9", 10, 9), TableSpec("d6b", 10, 6)]
    assert names(plan_packing(odd, across_dims=True)) == [["d6", "d6b"], ["d9"]]  # gcd 3 < min_width


def test_deferred_updates_apply_the_summed_gradient_once():
    torch.manual_seed(3)
    specs = make_specs("adam")
    fused = PackedEmbeddingCollection(specs, across_dims=True)
    reference = PackedEmbeddingCollection(specs, mode="autograd")
    reference.load_state_dict(fused.state_dict())
    fused.defer_updates = True
    before = fused.table_weight("t_sum8").clone()
    micro = [make_batch(specs, seed=s, weighted=True) for s in (7, 8)]
    for model in (fused, reference):
        for batch in micro:
            out = model(batch)
            (out.values.square().sum() + out["t_seq8"].sum()).backward()
    assert torch.equal(fused.table_weight("t_sum8"), before)  # nothing applied yet
    fused.step()
    reference.step()
    for s in specs:
        torch.testing.assert_close(fused.table_weight(s.name), reference.table_weight(s.name), atol=1e-6, rtol=1e-6)
        assert int(fused.table_state(s.name)["step"]) == 1


def test_learning_rate_is_set_by_the_training_loop():
    specs = make_specs("sgd")
    emb = PackedEmbeddingCollection(specs)
    assert emb.lr == 0.1
    emb.lr = 0.0
    before = {s.name: emb.table_weight(s.name).clone() for s in specs}
    out = emb(make_batch(specs, seed=4))
    (out.values.sum() + out["t_seq8"].sum()).backward()
    assert all(torch.equal(emb.table_weight(n), w) for n, w in before.items())
    emb.lr = 1.0
    out = emb(make_batch(specs, seed=4))
    (out.values.sum() + out["t_seq8"].sum()).backward()
    assert not torch.equal(emb.table_weight("t_sum8"), before["t_sum8"])
    mixed = PackedEmbeddingCollection([TableSpec("a", 5, 4, optimizer_params={"lr": 0.1}), TableSpec("b", 5, 4, optimizer_params={"lr": 0.2})])
    with pytest.raises(ValueError, match="different learning rates"):
        _ = mixed.lr
    assert mixed.table_lr("b") == 0.2


def test_second_backward_through_a_fused_lookup_raises():
    emb = PackedEmbeddingCollection([TableSpec("a", 5, 4)])
    out = emb(JaggedBatch(["a"], torch.tensor([1, 2]), torch.tensor([[1, 1]])))
    loss = out.values.sum()
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="apply the sparse update twice"):
        loss.backward()


def test_initial_weights_do_not_depend_on_packing():
    specs = make_specs()
    weights = []
    for kwargs in PACKINGS.values():
        torch.manual_seed(5)
        emb = PackedEmbeddingCollection(specs, **kwargs)
        weights.append({s.name: emb.table_weight(s.name).clone() for s in specs})
    for other in weights[1:]:
        assert all(torch.equal(weights[0][n], other[n]) for n in other)
    bound = math.sqrt(1 / 5)
    assert weights[0]["t_mean4"].abs().max() <= bound


@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad"])
def test_fused_steps_match_fbgemm_table_batched_embedding(optimizer):
    """FBGEMM's CPU TBE is the definition of EXACT_SGD / EXACT_ROWWISE_ADAGRAD (its CPU build has no ADAM)."""
    pytest.importorskip("fbgemm_gpu")
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import ComputeDevice, SplitTableBatchedEmbeddingBagsCodegen

    torch.manual_seed(7)
    rows, dim, batch_size = [11, 7, 13], 8, 5
    fbgemm_opt = {"sgd": EmbOptimType.EXACT_SGD, "rowwise_adagrad": EmbOptimType.EXACT_ROWWISE_ADAGRAD}[optimizer]
    extra = {"eps": 1e-8} if optimizer == "rowwise_adagrad" else {}
    tbe = SplitTableBatchedEmbeddingBagsCodegen(
        [(r, dim, EmbeddingLocation.HOST, ComputeDevice.CPU) for r in rows],
        optimizer=fbgemm_opt, learning_rate=0.1, pooling_mode=PoolingMode.SUM, **extra,
    )
    emb = PackedEmbeddingCollection(
        [TableSpec(f"t{i}", r, dim, optimizer=optimizer, optimizer_params={"lr": 0.1, **extra}) for i, r in enumerate(rows)]
    )
    with torch.no_grad():
        for i, w in enumerate(tbe.split_embedding_weights()):
            w.copy_(emb.table_weight(f"t{i}"))
    g = torch.Generator().manual_seed(0)
    for _ in range(4):
        lengths = torch.randint(0, 4, (3, batch_size), generator=g)
        bound = torch.repeat_interleave(torch.tensor(rows), lengths.sum(1))
        ids = (torch.rand(bound.numel(), generator=g) * bound).long()
        weights = torch.rand(ids.numel(), generator=g) + 0.5
        target = torch.randn(batch_size, 3 * dim, generator=g)
        offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.reshape(-1).cumsum(0)])
        (tbe(ids, offsets, per_sample_weights=weights) * target).sum().backward()
        (emb(JaggedBatch(["t0", "t1", "t2"], ids, lengths, weights)).values * target).sum().backward()
    for i, w in enumerate(tbe.split_embedding_weights()):
        torch.testing.assert_close(emb.table_weight(f"t{i}"), w, atol=1e-6, rtol=1e-6)


def test_kjt_input():
    pytest.importorskip("torchrec")
    specs = make_specs()
    emb = PackedEmbeddingCollection(specs)
    batch = make_batch(specs, seed=6, weighted=True)
    with torch.no_grad():
        torch.testing.assert_close(emb(batch.to_kjt()).values, emb(batch).values)
