"""picasso_ops.contracts: every implementer satisfies its protocol; the shared eviction scoring; no mutated inputs."""
from __future__ import annotations

import inspect
import subprocess
import sys

import pytest
import torch
from torch import nn

from picasso_ops.block import apply_picasso_block, with_children
from picasso_ops.cache import CachedFieldEmbeddings, HostRowStore, MmapRowStore, TableRowStore
from picasso_ops.cache.cached_table import CachedEmbeddingTable
from picasso_ops.config import PicassoConfig
from picasso_ops.contracts import (FieldEmbeddingLookup, FieldRowPrefetcher, RowStore, SparseBackwardQueue, SparseStepModule,
                                   StageableModel, StagedModel, TableRowService)
from picasso_ops.data.batch import CTRBatch
from picasso_ops.distributed import (DataParallelEmbeddingCollection, RowShardedEmbeddingCollection, sparse_modules,
                                     sparse_step)
from picasso_ops.eviction import eviction_scores, pick_victims
from picasso_ops.interleave import InterleavedForward, KInterleavedRowShardedCollection, stages_for
from picasso_ops.models import (DLRM, DLRMArgs, DLRMStages, FieldEmbeddings, PackedFieldEmbeddings, SparseArgs,
                                WideAndDeep, WideAndDeepArgs, WideAndDeepStages, packed_dlrm, packed_wide_and_deep)
from picasso_ops.vocab import DynamicEmbeddingTable

VOCAB = [20, 30, 10]


def _field_batch(batch: int = 4, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 3, (len(VOCAB), batch), generator=g)
    values = torch.cat([torch.randint(0, v, (int(lengths[f].sum()),), generator=g) for f, v in enumerate(VOCAB)])
    return values, lengths


def _field_lookups() -> dict[str, nn.Module]:
    packed = PackedFieldEmbeddings(VOCAB, 4, "mean", SparseArgs(), 0.01, "emb")
    return {
        "FieldEmbeddings": FieldEmbeddings(VOCAB, 4, "mean", 0.01),
        "PackedFieldEmbeddings": packed,
        "CachedFieldEmbeddings": CachedFieldEmbeddings.from_packed(packed, capacity=40),
    }


# ------------------------------------------------------------------ field embeddings
@pytest.mark.parametrize("name", ["FieldEmbeddings", "PackedFieldEmbeddings", "CachedFieldEmbeddings"])
def test_field_embedding_lookups_map_values_and_lengths_to_batch_fields_dim(name):
    module: FieldEmbeddingLookup = _field_lookups()[name]
    assert list(inspect.signature(module.forward).parameters) == ["values", "lengths"]
    values, lengths = _field_batch()
    assert module(values, lengths).shape == (4, len(VOCAB), 4)
    # the models accept any of them in place of the default
    model = WideAndDeep(WideAndDeepArgs(VOCAB, 2, embedding_dim=4), embeddings=module)
    assert model(torch.zeros(4, 2), values, lengths).shape == (4,)


def test_server_field_embeddings_has_the_field_lookup_signature():
    from gba_engine.tables import ServerFieldEmbeddings

    want = inspect.signature(FieldEmbeddingLookup.forward).parameters
    got = inspect.signature(ServerFieldEmbeddings.forward).parameters
    assert list(got) == list(want) == ["self", "values", "lengths"]


# ------------------------------------------------------------------ sparse step
def test_sparse_step_modules_declare_the_contract():
    for cls in (DataParallelEmbeddingCollection, RowShardedEmbeddingCollection, KInterleavedRowShardedCollection,
                CachedFieldEmbeddings):
        assert issubclass(cls, SparseStepModule), cls
    lookups = _field_lookups()
    assert isinstance(lookups["CachedFieldEmbeddings"], SparseStepModule)
    assert isinstance(lookups["PackedFieldEmbeddings"].collection, SparseStepModule)
    assert not isinstance(lookups["FieldEmbeddings"], SparseStepModule)
    assert issubclass(CachedFieldEmbeddings, FieldRowPrefetcher)
    assert not isinstance(lookups["PackedFieldEmbeddings"], FieldRowPrefetcher)


def test_sparse_modules_are_found_by_the_protocol_not_by_a_single_method():
    class HalfDeclared(nn.Module):  # sparse_step without discard_pending: not the contract
        def sparse_step(self, grad_scale: float = 1.0) -> None:
            raise AssertionError("must not be stepped")

    class Structural(nn.Module):  # both methods, no declaration: conforms structurally
        def __init__(self) -> None:
            super().__init__()
            self.steps: list[float] = []

        def sparse_step(self, grad_scale: float = 1.0) -> None:
            self.steps.append(grad_scale)

        def discard_pending(self) -> None:
            pass

    model = nn.Sequential(HalfDeclared(), Structural())
    assert [type(m).__name__ for m in sparse_modules(model)] == ["Structural"]
    assert sparse_step(model, grad_scale=0.5) == 1 and model[1].steps == [0.5]
    packed = packed_wide_and_deep(WideAndDeepArgs(VOCAB, 2), SparseArgs())
    assert [type(m) for m in sparse_modules(packed)] == [DataParallelEmbeddingCollection] * 2


def test_interleaved_forward_is_a_sparse_backward_queue():
    model = InterleavedForward(packed_wide_and_deep(WideAndDeepArgs(VOCAB, 2), SparseArgs()), 2)
    assert isinstance(model, SparseBackwardQueue)
    assert not isinstance(model.model, SparseBackwardQueue)
    cached = apply_picasso_block(packed_wide_and_deep(WideAndDeepArgs(VOCAB, 2), SparseArgs()),
                                 PicassoConfig(cache={"rows": 20}, interleave={"micro_batches": 2}))
    assert [type(m) for m in cached._prefetchers] == [CachedFieldEmbeddings] * 2  # deep and wide, found by protocol


# ------------------------------------------------------------------ row stores
def test_row_stores_and_the_table_row_service_have_distinct_names(tmp_path):
    class FakePS:
        def get_rows(self, table: str, ids: torch.Tensor) -> torch.Tensor:
            return torch.zeros(ids.numel(), 2)

        def put_rows(self, table: str, ids: torch.Tensor, rows: torch.Tensor) -> None:
            pass

    stores = [HostRowStore(10, 2), MmapRowStore(tmp_path / "t.rows", 10, 2, {}, create=True),
              TableRowStore(FakePS(), "t", 10, 2)]
    for store in stores:
        assert isinstance(store, RowStore), type(store)
    assert isinstance(FakePS(), TableRowService) and not isinstance(FakePS(), RowStore)
    import picasso_ops.cache as cache

    assert not hasattr(cache, "RowSource")  # the name is gba_engine's (a different protocol)


# ------------------------------------------------------------------ staged models
def test_reference_models_cut_themselves_for_interleaving():
    values, lengths = _field_batch(6, seed=1)
    batch = CTRBatch(torch.randn(6, 2), values, lengths, torch.zeros(6))
    for model, adapter in ((packed_wide_and_deep(WideAndDeepArgs(VOCAB, 2, embedding_dim=4), SparseArgs()),
                            WideAndDeepStages),
                           (packed_dlrm(DLRMArgs(VOCAB, 2, embedding_dim=4), SparseArgs()), DLRMStages)):
        assert isinstance(model, StageableModel)
        stages: StagedModel = stages_for(model)
        assert type(stages) is adapter
        with torch.no_grad():
            torch.testing.assert_close(stages.dense(batch, stages.lookup(batch)),
                                       model(batch.dense, batch.values, batch.lengths), rtol=0, atol=0)
    with pytest.raises(TypeError, match="pass stages="):
        stages_for(nn.Linear(2, 2))


def test_interleaving_imports_no_model():
    code = ("import sys, picasso_ops.interleave; "
            "assert not any(m.startswith('picasso_ops.models') for m in sys.modules), "
            "sorted(m for m in sys.modules if m.startswith('picasso_ops.models'))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]


# ------------------------------------------------------------------ eviction
def test_eviction_scores_order_by_uses_then_recency_and_do_not_touch_inputs():
    freq = torch.tensor([3, 1, 1, 5, 0])
    last = torch.tensor([7, 2, 6, 1, 0])
    before = (freq.clone(), last.clone())
    lfu = eviction_scores("lfu", freq, last, clock=7)
    assert lfu.dtype == torch.int64 and lfu.argsort().tolist() == [4, 1, 2, 0, 3]
    lru = eviction_scores("lru", freq.double(), last, clock=7)
    assert lru.dtype == torch.float64 and lru.tolist() == [7.0, 2.0, 6.0, 1.0, 0.0]
    aged = eviction_scores("lfu", torch.tensor([0.5, 0.5, 2.0], dtype=torch.float64), torch.tensor([3, 1, 0]), 3)
    assert aged.argsort().tolist() == [1, 0, 2]
    occupied = torch.tensor([True, True, True, True, False])
    victims = pick_victims(lfu, 2, occupied=occupied, protect=torch.tensor([1]))
    assert sorted(victims.tolist()) == [0, 2]  # 4 is empty, 1 protected
    assert pick_victims(lfu, 10, occupied=occupied, protect=torch.tensor([0])).numel() == 3
    assert pick_victims(lfu, 1, occupied=torch.zeros(5, dtype=torch.bool),
                        protect=torch.tensor([], dtype=torch.long)).numel() == 0
    assert torch.equal(freq, before[0]) and torch.equal(last, before[1])
    assert torch.equal(lfu, eviction_scores("lfu", freq, last, clock=7))  # pick_victims did not write it
    with pytest.raises(ValueError, match="eviction policy"):
        eviction_scores("fifo", freq, last, 7)


@pytest.mark.parametrize("policy", ["lfu", "lru"])
def test_cache_and_vocabulary_evict_the_same_rows_for_the_same_history(policy):
    """Same ids through a cache and a dynamic table of one capacity: the same rows stay resident."""
    capacity = 6
    cache = CachedEmbeddingTable(HostRowStore(100, 2), capacity, policy=policy)
    vocab = DynamicEmbeddingTable(capacity, 2, eviction=policy)
    g = torch.Generator().manual_seed(3)
    for _ in range(30):
        ids = torch.unique(torch.randint(0, 12, (3,), generator=g))
        cache.lookup(ids)
        vocab(ids)
    cache_ids = sorted(cache._index.ids_of(cache._index.occupied().nonzero().squeeze(1)).tolist())
    vocab_ids = sorted(vocab._index.items()[0].tolist())
    assert len(cache_ids) == len(vocab_ids) == capacity
    if policy == "lru":  # same recency clock in both; LFU counts differ (the cache ages its sketch counts)
        assert cache_ids == vocab_ids


# ------------------------------------------------------------------ no mutated inputs
def test_apply_picasso_block_leaves_its_argument_unchanged():
    model = packed_wide_and_deep(WideAndDeepArgs(VOCAB, 2, embedding_dim=4), SparseArgs())
    children = dict(model.named_children())
    state = {k: v.clone() for k, v in model.state_dict().items()}
    out = apply_picasso_block(model, PicassoConfig(cache={"rows": 20}, interleave={"micro_batches": 2}))
    assert isinstance(out, InterleavedForward) and isinstance(out.model.embeddings, CachedFieldEmbeddings)
    assert dict(model.named_children()) == children  # the same objects under the same names
    assert isinstance(model.embeddings, PackedFieldEmbeddings) and isinstance(model.wide, PackedFieldEmbeddings)
    assert out.model is not model and out.model.mlp is model.mlp  # dense layers shared, not copied
    after = model.state_dict()
    assert sorted(after) == sorted(state) and all(torch.equal(after[k], v) for k, v in state.items())
    values, lengths = _field_batch()
    with torch.no_grad():  # the cache starts from the packed rows: both give the same logits
        torch.testing.assert_close(out.model(torch.zeros(4, 2), values, lengths),
                                   model(torch.zeros(4, 2), values, lengths), rtol=0, atol=0)


def test_with_children_copies_the_registries():
    seq = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    new = with_children(seq, {"1": nn.Tanh()})
    new.register_buffer("extra", torch.zeros(1))
    new.add_module("2", nn.Identity())
    assert type(seq[1]) is nn.ReLU and len(seq) == 2 and "extra" not in dict(seq.named_buffers())
    assert new[0] is seq[0]
    with pytest.raises(KeyError, match="no children"):
        with_children(seq, {"nope": nn.Identity()})


def test_models_annotate_their_embeddings_with_the_protocol():
    assert inspect.signature(DLRM.__init__).parameters["embeddings"].annotation.endswith("FieldEmbeddingLookup]")
    assert "FieldEmbeddingLookup" in inspect.signature(WideAndDeep.__init__).parameters["embeddings"].annotation
