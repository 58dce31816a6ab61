"""JaggedBatch: construction, offsets, field access, select, validation, torchrec conversion."""

import pytest
import torch

from picasso_ops.jagged import JaggedBatch


def _random_batch(num_fields=5, batch_size=7, weighted=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 4, (num_fields, batch_size), generator=g)
    nnz = int(lengths.sum())
    values = torch.randint(0, 1000, (nnz,), generator=g)
    weights = torch.rand(nnz, generator=g) if weighted else None
    keys = [f"f{i}" for i in range(num_fields)]
    return JaggedBatch(keys, values, lengths, weights)


def test_offsets_and_field_access_match_a_python_walk():
    batch = _random_batch()
    F, B = batch.num_fields, batch.batch_size
    lengths = batch.lengths.tolist()
    pos, expected_offsets, per_field = 0, [0], {}
    for f in range(F):
        start = pos
        for b in range(B):
            pos += lengths[f][b]
            expected_offsets.append(pos)
        per_field[f"f{f}"] = batch.values[start:pos].tolist()
    assert batch.offsets.tolist() == expected_offsets
    assert batch.offsets.dtype == torch.int64
    assert batch.field_offsets.tolist() == [expected_offsets[f * B] for f in range(F + 1)]
    for key, ids in per_field.items():
        assert batch.field_values(key).tolist() == ids
    assert (batch.num_fields, batch.batch_size, batch.num_values) == (F, B, int(batch.lengths.sum()))


def test_flat_and_2d_lengths_and_offsets_constructor_agree():
    a = _random_batch(weighted=True)
    flat = JaggedBatch(a.keys, a.values, a.lengths.reshape(-1), a.weights)
    from_off = JaggedBatch.from_offsets(a.keys, a.values, a.offsets, a.weights)
    for other in (flat, from_off):
        assert other.lengths.shape == a.lengths.shape
        assert torch.equal(other.lengths, a.lengths)
        assert torch.equal(other.offsets, a.offsets)
    assert flat.lengths.data_ptr() == a.lengths.data_ptr()  # a view, not a copy


def test_int32_lengths_and_values_are_accepted():
    batch = JaggedBatch(["a", "b"], torch.tensor([1, 2, 3], dtype=torch.int32), torch.tensor([[2, 0], [0, 1]], dtype=torch.int32))
    assert batch.offsets.tolist() == [0, 2, 2, 2, 3]
    assert batch.offsets.dtype == torch.int64


def test_select_reorders_fields_with_their_weights():
    batch = _random_batch(weighted=True)
    picked = batch.select(["f3", "f0", "f4"])
    assert picked.keys == ("f3", "f0", "f4")
    assert torch.equal(picked.lengths, batch.lengths[[3, 0, 4]])
    expected = torch.cat([batch.field_values(k) for k in ["f3", "f0", "f4"]])
    assert torch.equal(picked.values, expected)
    starts = batch.field_offsets.tolist()
    expected_w = torch.cat([batch.weights[starts[f] : starts[f + 1]] for f in (3, 0, 4)])
    assert torch.equal(picked.weights, expected_w)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(keys=["a", "b"], values=torch.arange(3), lengths=torch.tensor([1, 1, 1])), "do not split"),
        (dict(keys=["a"], values=torch.arange(3), lengths=torch.tensor([[1, 1]])), "add up to 2"),
        (dict(keys=["a"], values=torch.arange(2), lengths=torch.tensor([[3, -1]])), "non-negative"),
        (dict(keys=["a", "a"], values=torch.arange(2), lengths=torch.tensor([[1], [1]])), "duplicate keys"),
        (dict(keys=["a"], values=torch.arange(2).float(), lengths=torch.tensor([[2]])), "int64 or int32"),
        (dict(keys=["a"], values=torch.arange(2), lengths=torch.tensor([[2]]), weights=torch.ones(3)), "weights"),
    ],
)
def test_invalid_batches_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        JaggedBatch(**kwargs)


def test_unknown_key_names_the_known_ones():
    with pytest.raises(KeyError, match="'zz' is not in this batch.*f0"):
        _random_batch().field_values("zz")


def test_kjt_round_trip():
    pytest.importorskip("torchrec")
    batch = _random_batch(weighted=True)
    kjt = batch.to_kjt()
    assert list(kjt.keys()) == list(batch.keys)
    assert torch.equal(kjt.lengths(), batch.lengths.reshape(-1))
    back = JaggedBatch.from_kjt(kjt)
    assert back.keys == batch.keys
    assert torch.equal(back.values, batch.values)
    assert torch.equal(back.lengths, batch.lengths)
    assert torch.equal(back.weights, batch.weights)
