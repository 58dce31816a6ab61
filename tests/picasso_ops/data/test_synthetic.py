"""CTRBatch layout, the synthetic CTR stream with its planted teacher, and the metrics."""
import itertools
import math
import time

import pytest
import torch
from pydantic import ValidationError

from picasso_ops.data import (CTRBatch, SyntheticConfig, SyntheticCTRGenerator, SyntheticCTRStream, auc,
                              bayes_optimal_auc, bayes_optimal_log_loss, log_loss)
from picasso_ops.data.zipf import ZipfSampler

SMALL = SyntheticConfig(vocab_sizes=1000, seed=5)  # 26 fields, multi-hot 1..3


def reference_segments(batch: CTRBatch) -> dict[tuple[int, int], list[int]]:
    """Ids of every (field, sample) by walking values in field-major order, one by one."""
    out, pos = {}, 0
    for f in range(batch.num_fields):
        for b in range(batch.batch_size):
            n = int(batch.lengths[f, b])
            out[f, b] = batch.values[pos:pos + n].tolist()
            pos += n
    return out


def assert_same_batch(a: CTRBatch, b: CTRBatch) -> None:
    assert torch.equal(a.values, b.values)
    assert torch.equal(a.lengths, b.lengths)
    assert torch.equal(a.dense, b.dense)
    assert torch.equal(a.labels, b.labels)
    assert (a.teacher_prob is None) == (b.teacher_prob is None)
    if a.teacher_prob is not None:
        assert torch.equal(a.teacher_prob, b.teacher_prob)


# ---------------------------------------------------------------- CTRBatch

def test_batch_helpers_on_a_hand_built_batch():
    # field 0: sample0 [5], sample1 [7, 8]; field 1: sample0 [], sample1 [9]
    batch = CTRBatch(dense=torch.zeros(2, 3), values=torch.tensor([5, 7, 8, 9]),
                     lengths=torch.tensor([[1, 2], [0, 1]]), labels=torch.tensor([0.0, 1.0]))
    assert (batch.batch_size, batch.num_fields, batch.num_dense) == (2, 2, 3)
    assert batch.offsets().tolist() == [[0, 1, 3], [0, 0, 1]]
    assert batch.field_starts().tolist() == [0, 3, 4]
    assert batch.flat_offsets().tolist() == [0, 1, 3, 3, 4]
    ids, offs = batch.field_values(1)
    assert ids.tolist() == [9] and offs.tolist() == [0, 0, 1]
    assert ids.data_ptr() == batch.values[3:].data_ptr()  # a view, not a copy
    with pytest.raises(IndexError):
        batch.field_values(2)


@pytest.mark.parametrize("bad", [
    dict(lengths=torch.tensor([[1, 2]]), values=torch.tensor([1, 2])),           # sum 3 != 2 ids
    dict(lengths=torch.tensor([1, 2]), values=torch.tensor([1, 2, 3])),          # not [F, B]
    dict(lengths=torch.tensor([[1, 2]]), values=torch.tensor([1, 2, 3], dtype=torch.int32)),
])
def test_batch_rejects_inconsistent_tensors(bad):
    with pytest.raises(ValueError):
        CTRBatch(dense=torch.zeros(2, 1), labels=torch.zeros(2), **bad)


def test_field_values_narrow_split_concat_match_reference():
    batch = SyntheticCTRGenerator.for_config(SMALL).batch(9, 0)
    ref = reference_segments(batch)
    for f in range(batch.num_fields):
        ids, offs = batch.field_values(f)
        for b in range(batch.batch_size):
            assert ids[offs[b]:offs[b + 1]].tolist() == ref[f, b]
    part = batch.narrow(2, 5)
    part_ref = reference_segments(part)
    assert all(part_ref[f, b] == ref[f, b + 2] for f in range(26) for b in range(5))
    pieces = batch.split(4)
    assert [p.batch_size for p in pieces] == [3, 2, 2, 2]
    assert_same_batch(CTRBatch.concat(pieces), batch)


def test_concat_interleaves_fields_correctly():
    gen = SyntheticCTRGenerator.for_config(SMALL)
    a, b = gen.batch(3, 1), gen.batch(4, 2)
    both = CTRBatch.concat([a, b])
    ref_a, ref_b, ref = reference_segments(a), reference_segments(b), reference_segments(both)
    for f in range(26):
        assert [ref[f, i] for i in range(7)] == [ref_a[f, i] for i in range(3)] + [ref_b[f, i] for i in range(4)]


# ---------------------------------------------------------------- config

@pytest.mark.parametrize("kwargs", [
    dict(num_fields=25), dict(num_fields=1001), dict(vocab_sizes=[10] * 25), dict(zipf_exponent=1.0),
    dict(min_ids_per_field=2, max_ids_per_field=1), dict(max_ids_per_field=[2] * 30), dict(typo_key=1),
    dict(linear_weight=0.0, interaction_weight=0.0, dense_weight=0.0), dict(vocab_sizes=0),
])
def test_config_rejects_bad_values(kwargs):
    with pytest.raises(ValidationError):
        SyntheticConfig(**kwargs)


def test_lengths_follow_single_multi_and_per_field_settings():
    single = SyntheticCTRGenerator(SyntheticConfig(vocab_sizes=500, max_ids_per_field=1)).batch(64, 0)
    assert torch.all(single.lengths == 1) and single.values.numel() == 26 * 64
    maxes = [1 + f % 4 for f in range(26)]
    multi = SyntheticCTRGenerator(SyntheticConfig(vocab_sizes=500, min_ids_per_field=0,
                                                  max_ids_per_field=maxes)).batch(512, 0)
    assert multi.lengths.min() == 0
    assert torch.equal(multi.lengths.max(dim=1).values, torch.tensor(maxes))
    assert multi.values.min() >= 0 and multi.values.max() < 500


def test_thousand_fields_small_batch():
    cfg = SyntheticConfig(num_fields=1000, vocab_sizes=[50 + f for f in range(1000)], max_ids_per_field=2)
    batch = SyntheticCTRStream(cfg, batch_size=16, split="eval", num_batches=1).generator.batch(16, 0, "eval")
    assert batch.lengths.shape == (1000, 16)
    assert torch.all(batch.values.view(-1) >= 0)
    _, _ = batch.field_values(999)
    vocab = torch.tensor([50 + f for f in range(1000)])
    field_of_value = torch.repeat_interleave(torch.arange(1000), batch.lengths.sum(1))
    assert torch.all(batch.values < vocab[field_of_value])


# ---------------------------------------------------------------- determinism, sharding, resume

def test_same_seed_same_batches_and_order_independence():
    gen = SyntheticCTRGenerator.for_config(SMALL)
    later_first = gen.batch(64, 5)
    for k in range(5):
        gen.batch(64, k)
    assert_same_batch(gen.batch(64, 5), later_first)
    fresh = SyntheticCTRGenerator(SyntheticConfig(vocab_sizes=1000, seed=5))  # not the cached one
    assert_same_batch(fresh.batch(64, 5), later_first)
    other = SyntheticCTRGenerator(SyntheticConfig(vocab_sizes=1000, seed=6)).batch(64, 5)
    assert not torch.equal(other.labels, later_first.labels) or not torch.equal(other.values, later_first.values)
    assert not torch.equal(gen.batch(64, 5, "eval").dense, later_first.dense)
    assert not torch.equal(gen.batch(64, 6).dense, later_first.dense)  # every global index is its own batch


@pytest.mark.parametrize("world_size", [2, 3])
def test_rank_shards_union_is_the_single_rank_stream(world_size):
    single = list(SyntheticCTRStream(SMALL, 32, num_batches=7))
    assert len(single) == 7
    for rank in range(world_size):
        stream = SyntheticCTRStream(SMALL, 32, rank=rank, world_size=world_size, num_batches=7)
        shard = list(stream)
        assert len(shard) == len(stream) == len(single[rank::world_size])
        for got, want in zip(shard, single[rank::world_size]):
            assert_same_batch(got, want)


def test_resume_continues_exactly_with_same_and_new_world_size():
    stream = SyntheticCTRStream(SMALL, 32, rank=1, world_size=2)
    first = list(itertools.islice(stream, 3))  # global batches 1, 3, 5
    state = stream.state()
    assert state["next_batch"] == 6
    resumed = next(iter(SyntheticCTRStream(SMALL, 32, rank=1, world_size=2, start_batch=state["next_batch"])))
    assert_same_batch(resumed, SyntheticCTRGenerator.for_config(SMALL).batch(32, 7))
    assert_same_batch(first[2], SyntheticCTRGenerator.for_config(SMALL).batch(32, 5))
    # after 3 steps on 2 ranks, global batches 0..5 are done; one rank continues from 6
    alone = next(iter(SyntheticCTRStream(SMALL, 32, start_batch=state["next_batch"])))
    assert_same_batch(alone, SyntheticCTRGenerator.for_config(SMALL).batch(32, 6))


def test_eval_stream_needs_a_length_and_train_is_infinite():
    with pytest.raises(ValueError, match="num_batches"):
        SyntheticCTRStream(SMALL, 8, split="eval")
    train = SyntheticCTRStream(SMALL, 8)
    assert sum(1 for _ in itertools.islice(train, 50)) == 50
    with pytest.raises(TypeError):
        len(train)


# ---------------------------------------------------------------- Zipf

def test_zipf_skew_and_scattered_hot_ids():
    cfg = SyntheticConfig(vocab_sizes=100_000, max_ids_per_field=1, seed=2)
    batch = SyntheticCTRGenerator.for_config(cfg).batch(8192, 0)
    ids = batch.values.view(26, 8192)
    shares, top_ids = [], []
    for f in range(26):
        counts = torch.bincount(ids[f], minlength=100_000)
        top = torch.topk(counts, 1000)  # the top 1% of the vocabulary
        shares.append(float(top.values.sum()) / 8192)
        top_ids.append(int(top.indices[0]))
    # exact Zipf(1.1) over 100k ranks gives the top 1000 ranks ~75% of the mass; uniform gives 1%
    assert min(shares) > 0.6
    assert len(set(top_ids)) > 20 and max(top_ids) > 1000  # hot ids differ per field, not 0, 1, 2


@pytest.mark.parametrize("vocab", [50, 3000, 2_000_000])
def test_zipf_rank_frequencies_match_the_exact_law(vocab):
    s = 1.2
    sampler = ZipfSampler([vocab, vocab], s, seed=1)
    g = torch.Generator().manual_seed(0)
    ids = sampler.sample(torch.rand(2, 200_000, generator=g, dtype=torch.float64))
    assert ids.min() >= 0 and ids.max() < vocab
    ranks = sampler.rank_of(0, ids[0])
    exact = torch.arange(1, vocab + 1, dtype=torch.float64).pow(-s)
    exact /= exact.sum()
    freq = torch.bincount(ranks, minlength=vocab).double() / ranks.numel()
    for r in (0, 1, 9):
        assert abs(freq[r] - exact[r]) < 4 * (exact[r] / 200_000) ** 0.5 + 1e-4
    for cut in (10, 1000, 100_000):  # mass beyond a rank, which covers the closed-form tail
        if cut < vocab:
            assert abs(freq[cut:].sum() - exact[cut:].sum()) < 0.006
    assert sampler.probability_of_rank(0, 0) == pytest.approx(float(exact[0]), rel=1e-6)


@pytest.mark.parametrize("s,vocab", [(1.05, 5000), (1.2, 3000), (2.5, 400)])
def test_zipf_ranks_equal_the_exact_inverse_cdf(s, vocab):
    sampler = ZipfSampler([vocab], s, seed=0)
    u = torch.rand(1, 100_000, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    cum = torch.cumsum(torch.arange(1, vocab + 1, dtype=torch.float64).pow(-s), 0)
    exact = torch.searchsorted(cum / cum[-1], u[0], right=True)
    got = sampler.sample_ranks(u)[0]
    # the head is an exact table lookup; the closed-form tail may differ by one rank at a boundary
    assert (got - exact).abs().max() <= 1
    assert (got == exact).double().mean() > 0.999
    assert torch.equal(sampler.rank_of(0, sampler.ranks_to_ids(got.view(1, -1))[0]), got)


# ---------------------------------------------------------------- teacher and metrics

@pytest.fixture(scope="module")
def default_eval():
    cfg = SyntheticConfig()
    return cfg, list(SyntheticCTRStream(cfg, 4096, split="eval", num_batches=4))


def test_bayes_auc_in_target_range_and_ctr(default_eval):
    cfg, batches = default_eval
    best = bayes_optimal_auc(batches)
    assert 0.75 <= best <= 0.85
    assert abs(best - cfg.target_auc) < 0.02
    ctr = float(torch.cat([b.labels for b in batches]).mean())
    assert 0.1 <= ctr <= 0.3 and abs(ctr - cfg.target_ctr) < 0.02


def test_teacher_beats_constant_and_linear_part(default_eval):
    cfg, batches = default_eval
    labels = torch.cat([b.labels for b in batches])
    constant = torch.full_like(labels, float(labels.mean()))
    assert bayes_optimal_log_loss(batches) < log_loss(constant, labels) - 0.03
    teacher = SyntheticCTRGenerator.for_config(cfg).teacher
    parts = torch.cat([teacher.components(b.dense, b.values, b.lengths) for b in batches])
    # the jagged path reproduces the generator's fast grid path
    probs = torch.cat([b.teacher_prob for b in batches])
    assert torch.allclose(torch.sigmoid(teacher.logit_from_components(parts)), probs, atol=1e-5)
    without_pairs = parts[:, [0, 2]] @ teacher.coef[[0, 2]]
    # pairwise interactions carry signal a linear model cannot reach
    assert auc(without_pairs, labels) < auc(probs, labels) - 0.03


def brute_auc(scores, labels):
    pos = [s for s, y in zip(scores, labels) if y == 1]
    neg = [s for s, y in zip(scores, labels) if y == 0]
    wins = sum(1.0 if p > n else 0.5 if p == n else 0.0 for p in pos for n in neg)
    return wins / (len(pos) * len(neg))


@pytest.mark.parametrize("seed", range(6))
def test_auc_matches_pairwise_count_with_ties(seed):
    g = torch.Generator().manual_seed(seed)
    n = 5 + seed * 7
    scores = torch.randint(0, 4, (n,), generator=g).float()  # many ties
    labels = torch.randint(0, 2, (n,), generator=g).float()
    labels[0], labels[1] = 0.0, 1.0
    assert auc(scores, labels) == pytest.approx(brute_auc(scores.tolist(), labels.tolist()), abs=1e-12)


def test_auc_edges():
    assert auc(torch.tensor([0.1, 0.9]), torch.tensor([0.0, 1.0])) == 1.0
    assert auc(torch.tensor([0.9, 0.1]), torch.tensor([0.0, 1.0])) == 0.0
    assert auc(torch.tensor([0.5, 0.5]), torch.tensor([0.0, 1.0])) == 0.5
    with pytest.raises(ValueError, match="both classes"):
        auc(torch.tensor([0.1, 0.2]), torch.tensor([1.0, 1.0]))


def test_log_loss_values():
    p = torch.tensor([0.9, 0.2, 0.5])
    y = torch.tensor([1.0, 0.0, 1.0])
    expected = -(torch.log(torch.tensor(0.9)) + torch.log(torch.tensor(0.8)) + torch.log(torch.tensor(0.5))) / 3
    assert log_loss(p, y) == pytest.approx(float(expected), rel=1e-6)
    worst = log_loss(torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0]))  # clamped, not infinite
    assert worst == pytest.approx(-math.log(1e-7), rel=1e-3)
    with pytest.raises(ValueError):
        log_loss(torch.tensor([1.5]), torch.tensor([1.0]))


def test_generation_speed_is_reasonable():
    gen = SyntheticCTRGenerator.for_config(SyntheticConfig(vocab_sizes=100_000, max_ids_per_field=1, seed=2))
    gen.batch(4096, 0)
    times = []
    for k in range(3):
        start = time.process_time()
        gen.batch(4096, k + 1)
        times.append(time.process_time() - start)
    assert sorted(times)[1] < 0.25  # measured ~10-20 ms; a loose bound for a busy shared machine
