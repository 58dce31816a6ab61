"""Interleaving (issue 4 item 6): D-interleaved steps equal plain steps, traces, failures, K-interleaving on gloo."""
from __future__ import annotations

import contextlib
import json
import threading
import time

import pytest
import torch
import torch.nn.functional as F

from picasso_ops.data import SyntheticConfig, SyntheticCTRStream
from picasso_ops.distributed import DataParallelEmbeddingCollection, RowShardedEmbeddingCollection, sparse_step
from picasso_ops.embedding import PackedEmbeddingCollection, TableSpec
from picasso_ops.interleave import (
    BatchPrefetcher,
    InterleavedForward,
    InterleavedTrainer,
    KInterleavedRowShardedCollection,
    PipelineTimeout,
    StageError,
    ThreadPipeline,
    Timeline,
    interleaved_sparse_step,
)
from picasso_ops.interleave.streams import CudaStageStreams, StageStreams, stage_streams, tensors_in
from picasso_ops.jagged import JaggedBatch
from picasso_ops.models import DLRMArgs, SparseArgs, WideAndDeepArgs, WideAndDeepStages, packed_dlrm, packed_wide_and_deep
from sparse_scale.multiproc import run_distributed

FIELDS, VOCAB, DENSE = 26, 300, 4
CFG = SyntheticConfig(num_fields=FIELDS, vocab_sizes=VOCAB, num_dense=DENSE, seed=7)
SPARSE = {"sgd": {"lr": 0.3}, "rowwise_adagrad": {"lr": 0.1}}


def _model(optimizer: str, kind: str = "wide_deep", sharding: str = "data_parallel"):
    torch.manual_seed(0)
    sparse = SparseArgs(optimizer=optimizer, optimizer_params=SPARSE[optimizer], sharding=sharding)
    if kind == "dlrm":
        return packed_dlrm(DLRMArgs(vocab_sizes=[VOCAB] * FIELDS, num_dense=DENSE, embedding_dim=8,
                                    bottom=(16,), top=(16,)), sparse)
    return packed_wide_and_deep(WideAndDeepArgs(vocab_sizes=[VOCAB] * FIELDS, num_dense=DENSE, embedding_dim=8,
                                                hidden=(32, 16)), sparse)


def _plain_step(model, opt, batch) -> float:
    """The non-interleaved reference step on the whole batch."""
    loss = F.binary_cross_entropy_with_logits(model(batch.dense, batch.values, batch.lengths), batch.labels.float())
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    sparse_step(model)
    return float(loss.detach())


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].double() - b[k].double()).abs().max()) if a[k].numel() else 0.0 for k in a)


@pytest.mark.parametrize("kind", ["wide_deep", "dlrm"])
@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad"])
def test_interleaved_steps_equal_plain_steps(optimizer, kind):
    batches = list(SyntheticCTRStream(CFG, 96, num_batches=3))
    ref, inter = _model(optimizer, kind), _model(optimizer, kind)
    assert _max_diff(ref.state_dict(), inter.state_dict()) == 0.0
    # torch's Adagrad is left out on purpose: its first step is ~g / |g| for gradients near its eps, which
    # turns summation-order rounding of near-zero gradients into ~4e-6 weight differences
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    inter_opt = torch.optim.SGD(inter.parameters(), lr=0.1, momentum=0.9)
    with InterleavedTrainer(inter, inter_opt, micro_batches=5, timeout_s=60) as trainer:  # 96 / 5: uneven parts
        for batch in batches:
            expected = _plain_step(ref, ref_opt, batch)
            assert trainer.step(batch) == pytest.approx(expected, rel=1e-5)
    state = ref.state_dict()
    assert any(".weight" in k and "emb" in k for k in state)  # the tables are compared, not just the MLP
    assert _max_diff(state, inter.state_dict()) < 1e-6


def test_plain_packed_collection_is_switched_to_deferred_updates():
    specs = [TableSpec("t", 50, 4, optimizer="rowwise_adagrad", optimizer_params={"lr": 0.2})]

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = PackedEmbeddingCollection(specs)
            self.lin = torch.nn.Linear(4, 1)

    class Stages:
        def __init__(self, m: Model) -> None:
            self.m = m

        def lookup(self, b):
            return [self.m.emb(JaggedBatch(["t"], b.values, b.lengths[:1])).values]

        def dense(self, b, e):
            return self.m.lin(e[0]).squeeze(-1)

    cfg = SyntheticConfig(num_fields=26, vocab_sizes=50, num_dense=1, seed=1)
    batch = next(iter(SyntheticCTRStream(cfg, 40)))
    batch = type(batch)(batch.dense, batch.values[: int(batch.lengths[0].sum())], batch.lengths[:1],
                        batch.labels)  # field 0 only
    torch.manual_seed(0)
    ref, inter = Model(), Model()
    inter.load_state_dict(ref.state_dict())
    ref_opt, inter_opt = torch.optim.SGD(ref.parameters(), lr=0.1), torch.optim.SGD(inter.parameters(), lr=0.1)
    loss = F.binary_cross_entropy_with_logits(Stages(ref).dense(batch, Stages(ref).lookup(batch)), batch.labels.float())
    loss.backward()  # fused: the table is updated inside backward
    ref_opt.step()
    with InterleavedTrainer(inter, inter_opt, micro_batches=4, stages=Stages(inter)) as trainer:
        trainer.step(batch)
    assert inter.emb.defer_updates
    assert _max_diff(ref.state_dict(), inter.state_dict()) < 1e-6


def test_trace_has_every_stage_of_every_micro_batch_and_overlap(tmp_path):
    tl = Timeline()
    model = _model("rowwise_adagrad")
    steps, n = 2, 3
    with InterleavedTrainer(model, torch.optim.SGD(model.parameters(), lr=0.01), micro_batches=n,
                            timeline=tl) as trainer:
        losses = trainer.train(iter(SyntheticCTRStream(CFG, 60)), num_steps=steps)
    assert len(losses) == steps
    path = tl.write_chrome_trace(tmp_path / "trace.json")
    trace = json.loads(path.read_text())
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert all(e["dur"] >= 0 and "ts" in e and "tid" in e for e in spans)
    got = {(e["name"], e["args"]["step"], e["args"]["micro_batch"]) for e in spans}
    for step in range(steps):
        for mb in range(n):
            for stage in ("split", "lookup", "dense", "sparse"):
                assert (stage, step, mb) in got
        assert ("update", step, None) in got
        assert ("load", step, None) in got
    names = {e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M"}
    assert {"interleave-lookup", "interleave-dense", "interleave-sparse", "interleave-load"} <= names
    # overlap is computed from the intervals; how much there is depends on the machine
    pairs = tl.overlaps()
    assert all((a.step, a.micro_batch) != (b.step, b.micro_batch) for a, b in pairs)
    assert tl.overlap_seconds() >= 0.0


def test_pipeline_overlaps_micro_batches():
    """Stage B holds micro-batch 0 until stage A has started micro-batch 1: their spans must intersect."""
    started_1 = threading.Event()

    def a(i: int, x: int) -> int:
        if i == 1:
            started_1.set()
            time.sleep(0.02)  # still inside A's span of item 1 while B finishes item 0
        return x

    def b(i: int, x: int) -> int:
        if i == 0:
            assert started_1.wait(timeout=10)
        return x * 10

    tl = Timeline()
    with ThreadPipeline([("a", a), ("b", b)], timeline=tl, timeout_s=20) as p:
        assert p.map([1, 2, 3]) == [10, 20, 30]
    pairs = {((x.stage, x.micro_batch), (y.stage, y.micro_batch)) for x, y in tl.overlaps()}
    assert (("b", 0), ("a", 1)) in pairs or (("a", 1), ("b", 0)) in pairs
    assert tl.overlap_seconds() > 0.0


def test_stage_error_propagates_with_stage_name_and_shuts_down():
    def boom(i: int, x: int) -> int:
        if i == 2:
            raise ValueError("bad micro-batch")
        return x

    p = ThreadPipeline([("first", lambda i, x: x), ("boom", boom), ("last", lambda i, x: x)], timeout_s=20)
    t0 = time.monotonic()
    with pytest.raises(StageError, match="'boom'.*micro-batch 2.*bad micro-batch") as info:
        p.map(list(range(6)))
    assert info.value.stage == "boom" and info.value.micro_batch == 2
    assert isinstance(info.value.__cause__, ValueError)
    p.close(timeout_s=5)
    assert p.closed and not any(t.is_alive() for t in p._threads)
    assert time.monotonic() - t0 < 15
    with pytest.raises(RuntimeError, match="closed"):
        p.map([1])


def test_trainer_stage_error_names_the_stage():
    model = _model("sgd")
    stages = WideAndDeepStages(model)

    class Broken:
        lookup = staticmethod(stages.lookup)

        @staticmethod
        def dense(batch, embedded):
            raise RuntimeError("dense exploded")

    batch = next(iter(SyntheticCTRStream(CFG, 32)))
    trainer = InterleavedTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), micro_batches=2,
                                 stages=Broken(), timeout_s=20)
    with pytest.raises(StageError, match="'dense'.*dense exploded"):
        trainer.step(batch)
    trainer.close()
    assert not any(t.is_alive() for t in trainer.pipeline._threads)
    # the failed step's sparse gradients were dropped, not left for a later step
    assert all(not k._pending for k in model.embeddings.collection.kernels)


def test_stuck_stage_hits_the_deadline():
    release = threading.Event()
    p = ThreadPipeline([("stuck", lambda i, x: release.wait(timeout=10))], timeout_s=0.5)
    t0 = time.monotonic()
    with pytest.raises(PipelineTimeout, match="stuck"):
        p.map([1])
    assert time.monotonic() - t0 < 5
    release.set()
    p.close(timeout_s=5)
    assert not any(t.is_alive() for t in p._threads)


def test_load_error_propagates():
    def source():
        yield 1
        raise OSError("disk gone")

    with BatchPrefetcher(source(), timeout_s=10) as loader:
        assert loader.next() == 1
        with pytest.raises(StageError, match="'load'.*disk gone"):
            loader.next()


# ---------------------------------------------------------------- K-interleaving on gloo
KEYS = ("f0", "f1", "f2", "f3")


def _specs() -> list[TableSpec]:
    p = {"lr": 0.1}
    return [  # three packs: dim 8 sum+mean, dim 4, dim 2
        TableSpec("t0", 40, 8, "sum", "rowwise_adagrad", p, feature_names=("f0",)),
        TableSpec("t1", 30, 8, "mean", "rowwise_adagrad", p, feature_names=("f1",)),
        TableSpec("t2", 25, 4, "sum", "rowwise_adagrad", p, feature_names=("f2",)),
        TableSpec("t3", 3, 2, "sum", "rowwise_adagrad", p, feature_names=("f3",)),
    ]


def _batch(rank: int, step: int) -> JaggedBatch:
    g = torch.Generator().manual_seed(100 * step + rank)
    lengths = torch.randint(0, 4, (len(KEYS), 12), generator=g)
    rows = torch.repeat_interleave(torch.tensor([40, 30, 25, 3]), lengths.sum(1))
    values = (torch.rand(rows.numel(), generator=g).pow(2) * rows).long()
    return JaggedBatch(KEYS, values, lengths)


def _k_interleave_check(rank: int, world: int) -> dict:
    out: dict = {}
    full = PackedEmbeddingCollection(_specs()).state_dict()
    # row-sharded: sequential exchange vs interleaved, same shards
    seq = RowShardedEmbeddingCollection(_specs())
    tl = Timeline()
    kint = KInterleavedRowShardedCollection(_specs(), timeline=tl, timeout_s=60)
    seq.load_full_state_dict(full)
    kint.load_full_state_dict(full)
    assert len(seq.shard.kernels) == 3
    diffs = []
    for step in range(3):
        batch = _batch(rank, step)
        a, b = seq(batch).values, kint(batch).values
        diffs.append(float((a - b).abs().max()))
        w = torch.linspace(-1, 1, a.shape[1])
        (a * w).sum().backward()
        (b * w).sum().backward()
        seq.sparse_step()
        kint.sparse_step()
    sa, sb = seq.full_state_dict(), kint.full_state_dict()
    out["rw_forward"] = max(diffs)
    out["rw_state"] = max(float((sa[k] - sb[k]).abs().max()) for k in sa)
    out["rw_spans"] = sorted({s.stage for s in tl.spans()})
    # data-parallel: sparse_step vs interleaved_sparse_step
    dp_seq, dp_int = DataParallelEmbeddingCollection(_specs()), DataParallelEmbeddingCollection(_specs())
    dp_seq.load_state_dict(full)
    dp_int.load_state_dict(full)
    for step in range(3):
        batch = _batch(rank, step)
        for emb in (dp_seq, dp_int):
            out_v = emb(batch).values
            (out_v * torch.linspace(-1, 1, out_v.shape[1])).sum().backward()
        dp_seq.sparse_step()
        interleaved_sparse_step(dp_int, timeout_s=60)
    sa, sb = dp_seq.state_dict(), dp_int.state_dict()
    out["dp_state"] = max(float((sa[k] - sb[k]).abs().max()) for k in sa)
    out["dp_changed"] = max(float((sa[k] - full[k]).abs().max()) for k in sa if k.endswith(".weight"))
    return out


def test_k_interleaving_equals_sequential_exchange_on_two_gloo_ranks():
    reports = run_distributed(_k_interleave_check, 2, timeout_s=120)
    for r in reports:
        assert r["rw_forward"] == 0.0 and r["rw_state"] == 0.0, r
        assert r["dp_state"] == 0.0 and r["dp_changed"] > 0.0, r
        assert {"ids", "gather", "rows", "pool", "grads", "apply"} <= set(r["rw_spans"]), r


def _trainer_row_sharded(rank: int, world: int) -> float:
    """The D-interleaved trainer over row-sharded tables (lookups are collectives on the lookup thread)."""
    batches = list(SyntheticCTRStream(CFG, 48, rank=rank, world_size=world, num_batches=4))
    ref, inter = _model("rowwise_adagrad", sharding="row_wise"), _model("rowwise_adagrad", sharding="row_wise")
    inter.load_state_dict(ref.state_dict())
    ref_opt, inter_opt = torch.optim.SGD(ref.parameters(), lr=0.05), torch.optim.SGD(inter.parameters(), lr=0.05)
    with InterleavedTrainer(inter, inter_opt, micro_batches=3, timeout_s=60) as trainer:
        for batch in batches:
            _plain_step(ref, ref_opt, batch)  # the dense layers are local here: no all-reduce in either
            trainer.step(batch)
    return _max_diff(ref.state_dict(), inter.state_dict())


def test_interleaved_trainer_over_row_sharded_tables_on_two_gloo_ranks():
    assert max(run_distributed(_trainer_row_sharded, 2, timeout_s=120)) < 1e-6


class RecordingStreams(StageStreams):
    """Stage streams that record every hook call: tokens name the stage (or caller) whose stream made them."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self._local = threading.local()
        self._lock = threading.Lock()
        self._count = 0

    def token(self):
        with self._lock:
            self._count += 1
            tok = (getattr(self._local, "stage", "caller"), self._count)
            self.calls.append(("token", tok))
        return tok

    @contextlib.contextmanager
    def run(self, stage):
        self._local.stage = stage
        try:
            yield
        finally:
            self._local.stage = None

    def accept(self, stage, token, payload):
        with self._lock:
            self.calls.append(("accept", stage, token, len(list(tensors_in(payload)))))

    def wait(self, token, payload):
        with self._lock:
            self.calls.append(("wait", token))


def test_pipeline_orders_every_hand_off_through_the_stage_streams():
    """Stage k waits for the mark its producer made on its own stream; the caller waits for the last stage's."""
    streams = RecordingStreams()
    stages = [(name, lambda i, x: (x, torch.ones(2))) for name in ("a", "b", "c")]
    with ThreadPipeline(stages, streams=streams, timeout_s=20) as p:
        out = p.map([torch.zeros(1)] * 4)
    assert len(out) == 4
    made = {s: {tok for kind, tok in (c[:2] for c in streams.calls) if kind == "token" and tok[0] == s}
            for s in ("caller", 0, 1, 2)}
    assert len(made["caller"]) == 1 and all(len(made[k]) == 4 for k in (0, 1, 2))  # one mark per item per stage
    accepted = {k: [c[2] for c in streams.calls if c[0] == "accept" and c[1] == k] for k in (0, 1, 2)}
    assert accepted[0] == [next(iter(made["caller"]))] * 4  # the batch: the caller's queued work first
    assert set(accepted[1]) == made[0] and set(accepted[2]) == made[1]
    assert {c[1] for c in streams.calls if c[0] == "wait"} == made[2]
    # the payload's tensors are marked for the consumer: stage 1 gets (input, ones) from stage 0
    assert all(c[3] == 2 for c in streams.calls if c[0] == "accept" and c[1] == 1)


def test_stage_streams_are_none_on_cpu_and_walk_batches():
    assert type(stage_streams(torch.device("cpu"), 3)) is StageStreams
    batch = next(iter(SyntheticCTRStream(CFG, 8)))
    assert {id(t) for t in tensors_in([batch, {"x": (batch.dense,)}])} >= {id(batch.dense), id(batch.values),
                                                                          id(batch.lengths), id(batch.labels)}
    with pytest.raises(ValueError, match="at least one stage"):
        CudaStageStreams(torch.device("cuda"), 0)


def test_interleaved_forward_sparse_jobs_hand_their_stream_marks_to_the_step():
    model = _model("sgd")
    streams = RecordingStreams()
    inter = InterleavedForward(model, 3, timeout_s=30)
    batch = next(iter(SyntheticCTRStream(CFG, 30)))
    inter(batch.dense, batch.values, batch.lengths)  # builds the pipeline (and its no-op CPU streams)
    inter.wait_sparse_backward()
    inter._streams = inter._pipeline.streams = streams
    loss = F.binary_cross_entropy_with_logits(inter(batch.dense, batch.values, batch.lengths), batch.labels.float())
    loss.backward()
    sparse_step(inter)  # waits for the sparse thread through the streams
    sparse_marks = {tok for kind, tok in (c[:2] for c in streams.calls) if kind == "token" and tok[0] == 2}
    assert len(sparse_marks) == 3 * 2  # deep and wide embeddings of 3 micro-batches
    assert {c[1] for c in streams.calls if c[0] == "wait" and c[1][0] == 2} == sparse_marks
    assert all(c[3] == 2 for c in streams.calls if c[0] == "accept" and c[1] == 2)  # (embedded, grad)
    inter.close()
