"""Packed tables on the parameter servers (gba_engine.packed_tables) under sync, gba and auto, with picasso's optimizers.

One launch of 2 workers + 2 servers (group-table rows split by id % 2) runs every phase of a
wide-and-deep model whose deep and wide embeddings are ServerPackedFieldEmbeddings. The
reference is a one-process run of the same model over picasso_ops' packed tables
(PackedFieldEmbeddings, their fused local optimizer) and torch SGD on the global batch: sync
must equal it, and so must lockstep gba and an auto run with forced switches.
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from torch.nn.utils import parameters_to_vector

from sparse_scale.multiproc import run_distributed

VOCAB = [30, 20, 26]
DIM = 4
SERVERS = 2
STEPS = 6
DENSE_LR = 0.2
SCHEDULER = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.02, "warmup_max_lr": DENSE_LR,
                                            "warmup_num_steps": 4, "warmup_type": "linear"}}
# (optimizer, table lr, lr schedule, packing)
ADAGRAD = ("rowwise_adagrad", 0.3, "deepspeed", True)
ADAM = ("adam", 0.05, "constant", False)
SGD = ("sgd", 0.5, "constant", True)


def _args():
    from picasso_ops.models import WideAndDeepArgs

    return WideAndDeepArgs(vocab_sizes=VOCAB, num_dense=2, embedding_dim=DIM, hidden=(8,), pooling="mean")


def _table_optimizer(kind):
    from gba_engine.ps.optim import TableOptimizerSpec

    name, lr, schedule, _ = kind
    return TableOptimizerSpec.of(name, lr=lr, lr_schedule=schedule)


def _server_model(kind):
    from gba_engine.packed_tables import ServerPackedFieldEmbeddings
    from picasso_ops.models import WideAndDeep

    opt, packing = _table_optimizer(kind), kind[3]
    deep = ServerPackedFieldEmbeddings(VOCAB, DIM, "mean", 0.3, opt, packing=packing, prefix="deep", seed=1)
    wide = ServerPackedFieldEmbeddings(VOCAB, 1, "mean", 0.2, opt, packing=packing, prefix="wide", seed=2)
    torch.manual_seed(7)
    return WideAndDeep(_args(), embeddings=deep, wide=wide)


def _group_tables(model) -> dict[str, tuple[int, int]]:
    """Server table name -> (rows, dim) of both collections."""
    return {t.name: (t.num_rows, t.dim) for c in (model.embeddings, model.wide) for t in c.collection.tables}


def _reference_model(kind):
    """The same model over picasso's packed tables (local fused optimizer), started from the servers' rows."""
    from picasso_ops.models import PackedFieldEmbeddings, SparseArgs, WideAndDeep

    server = _server_model(kind)
    opt = _table_optimizer(kind)
    sparse = SparseArgs(optimizer=opt.type, optimizer_params=dict(opt.params), packing=kind[3])
    deep = PackedFieldEmbeddings(VOCAB, DIM, "mean", sparse, prefix="deep")
    wide = PackedFieldEmbeddings(VOCAB, 1, "mean", sparse, prefix="wide")
    with torch.no_grad():
        for mine, prefix, theirs in ((deep, "deep", server.embeddings), (wide, "wide", server.wide)):
            for name, table, (a, b) in zip(theirs.names, theirs.collection.tables, theirs.group_ranges):
                start = table.initial_table(SERVERS)
                for f in range(a, b):
                    off = int(theirs.row_offset[f])
                    mine.collection.table_weight(f"{prefix}{f}").copy_(start[off:off + VOCAB[f]])
    torch.manual_seed(7)
    return WideAndDeep(_args(), embeddings=deep, wide=wide), server


def _batch(step: int, worker: int):
    g = torch.Generator().manual_seed(1000 * step + worker)
    lengths = torch.randint(0, 4, (len(VOCAB), 8), generator=g)
    values = torch.cat([torch.randint(0, v // 2, (int(lengths[f].sum()),), generator=g)  # half the rows stay cold
                        for f, v in enumerate(VOCAB)])
    dense = torch.randn(8, 2, generator=g)
    labels = (torch.rand(8, generator=g) < 0.4).float()
    return dense, values, lengths, labels


def _config(mode: str, scheduler: bool, **gba) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1,
           "optimizer": {"type": "SGD", "params": {"lr": DENSE_LR}}, "zero_optimization": {"stage": 0},
           "steps_per_print": 10 ** 6, "gradient_clipping": 0.0,
           "gba": {"mode": mode, "num_servers": SERVERS, "timeout_s": 20, "heartbeat_s": 0.2, **gba}}
    if scheduler:
        cfg["scheduler"] = SCHEDULER
    return cfg


def _phase(rank, tmp, mode, kind, steps=STEPS, first_step=0, save=None, load=None, force=(), **gba):
    import gba_engine

    model = _server_model(kind)
    engine = gba_engine.initialize(model=model, config=_config(mode, kind[2] == "deepspeed", **gba))
    if engine.is_server:
        return {"server": engine.server_stats}
    if load:
        engine.load_checkpoint(os.path.join(tmp, load))
    modes = []
    for step in range(first_step, first_step + steps):
        if step in force:  # a forced hand-over: sync -> gba -> sync at the steps named
            (engine.switch_to_gba if engine.mode == "sync" else engine.switch_to_sync)(f"forced at step {step}")
        dense, values, lengths, labels = _batch(step, rank)
        loss = F.binary_cross_entropy_with_logits(engine(dense, values, lengths), labels)
        engine.backward(loss)
        engine.step()
        modes.append(engine.mode)
    out = {"modes": modes, "version": engine.version}
    if save:
        engine.save_checkpoint(os.path.join(tmp, save), tag="t")
    if engine.mode == "gba":
        engine.client.pull(dense=False, min_version=first_step + steps)  # the other worker's last push is applied
        engine.eval()  # pulls the servers' final dense part
    out["dense"] = parameters_to_vector(engine.module.parameters()).detach().clone()
    out["tables"] = {n: engine.table_rows(n, torch.arange(rows)) for n, (rows, _) in _group_tables(model).items()}
    out["summary"] = engine.summary()
    engine.close()
    return out


def _launch(rank: int, world_size: int, tmp: str) -> dict:
    return {
        "adagrad_sync": _phase(rank, tmp, "sync", ADAGRAD),
        "adam_gba": _phase(rank, tmp, "gba", ADAM, max_lead=0),
        "sgd_auto": _phase(rank, tmp, "auto", SGD, force=(2, 4), max_lead=0,
                           switch={"window": 2, "min_dwell_steps": 1, "slow_ratio": 1000.0, "recover_ratio": 999.0}),
        "sgd_auto_servers": _phase(rank, tmp, "auto", SGD, force=(2, 4), max_lead=0, sync_tables="servers",
                                   switch={"window": 2, "min_dwell_steps": 1, "slow_ratio": 1000.0,
                                           "recover_ratio": 999.0}),
        "adagrad_first": _phase(rank, tmp, "sync", ADAGRAD, steps=STEPS // 2, save="ck"),
        "adagrad_resumed": _phase(rank, tmp, "sync", ADAGRAD, steps=STEPS // 2, first_step=STEPS // 2, load="ck"),
    }


@pytest.fixture(scope="module")
def launch(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("gba_packed"))
    res = run_distributed(_launch, world_size=2 + SERVERS, args=(tmp,), timeout_s=120)
    return {"w0": res[0], "w1": res[1], "server": res[2], "tmp": tmp}


def _reference(kind, steps: int = STEPS):
    """One process, the global batch (both workers' batches), picasso's fused table update, torch SGD, DeepSpeed's
    WarmupLR on the dense lr and, with lr_schedule "deepspeed", table lr = block lr x dense lr / peak."""
    from deepspeed.runtime.lr_schedules import WarmupLR

    from picasso_ops.distributed import sparse_step

    net, server = _reference_model(kind)
    opt = torch.optim.SGD(net.parameters(), lr=DENSE_LR)
    sched = WarmupLR(opt, **SCHEDULER["params"]) if kind[2] == "deepspeed" else None
    for step in range(steps):
        opt.zero_grad()
        loss = sum(F.binary_cross_entropy_with_logits(net(d, v, ln), y)
                   for d, v, ln, y in (_batch(step, 0), _batch(step, 1))) / 2
        loss.backward()
        factor = opt.param_groups[0]["lr"] / DENSE_LR  # the lr DeepSpeed's optimizer steps with, over the peak
        for emb in (net.embeddings, net.wide):
            emb.collection.lr = kind[1] * factor
        opt.step()
        sparse_step(net)
        if sched is not None:
            sched.step()
    dense = parameters_to_vector(net.parameters()).detach()
    tables = {}
    for mine, prefix, theirs in ((net.embeddings, "deep", server.embeddings), (net.wide, "wide", server.wide)):
        for name, (a, b) in zip(theirs.names, theirs.group_ranges):  # a group table = its fields' rows in order
            tables[name] = torch.cat([mine.collection.table_weight(f"{prefix}{f}") for f in range(a, b)])
    return dense, tables


def _assert_matches(run: dict, ref, atol: float = 1e-6) -> None:
    dense, tables = ref
    torch.testing.assert_close(run["dense"], dense, rtol=1e-5, atol=atol)
    assert set(run["tables"]) == set(tables)
    for name, rows in tables.items():
        torch.testing.assert_close(run["tables"][name], rows, rtol=1e-5, atol=atol)


@pytest.mark.soak
def test_sync_packed_server_tables_equal_one_process_with_picasso_tables(launch):
    run = launch["w0"]["adagrad_sync"]
    assert set(run["modes"]) == {"sync"} and run["version"] == STEPS
    assert sorted(run["tables"]) == ["deep0", "wide0"]  # packing: all fields in one server table per collection
    _assert_matches(run, _reference(ADAGRAD))
    for name in run["tables"]:  # one copy of the rows: both workers read the same
        assert torch.equal(run["tables"][name], launch["w1"]["adagrad_sync"]["tables"][name])
    # the warm-up mattered: with a constant table lr the rows end elsewhere
    constant = _reference(("rowwise_adagrad", 0.3, "constant", True))[1]["deep0"]
    assert not torch.allclose(run["tables"]["deep0"], constant, atol=1e-4)


@pytest.mark.soak
def test_lockstep_gba_packed_tables_equal_one_process(launch):
    run = launch["w0"]["adam_gba"]
    assert set(run["modes"]) == {"gba"}
    assert sorted(run["tables"]) == [f"{p}{f}" for p in ("deep", "wide") for f in range(len(VOCAB))]  # unpacked
    _assert_matches(run, _reference(ADAM))
    assert launch["server"]["adam_gba"]["server"]["staleness"] == {"0": 2 * STEPS}


@pytest.mark.soak
def test_forced_auto_switches_hand_over_the_dense_part_and_the_workers_rows(launch):
    run = launch["w0"]["sgd_auto"]
    assert run["modes"] == ["sync", "sync", "gba", "gba", "sync", "sync"], run["modes"]
    switches = run["summary"]["switches"]
    assert [(e["src"], e["dst"]) for e in switches] == [("sync", "gba"), ("gba", "sync")]
    dense_numel = run["dense"].numel()  # SGD: no moments, no row state; the rows travel with the dense part
    table_bytes = sum(t.numel() * 4 for t in run["tables"].values())
    assert all(e["nbytes"] == dense_numel * 4 + table_bytes for e in switches), switches
    _assert_matches(run, _reference(SGD))
    for name in run["tables"]:  # both workers' copies equal after the round trip
        assert torch.equal(run["tables"][name], launch["w1"]["sgd_auto"]["tables"][name])


@pytest.mark.soak
def test_forced_auto_switches_with_rows_on_the_servers_hand_over_the_dense_part_only(launch):
    run = launch["w0"]["sgd_auto_servers"]
    assert run["modes"] == ["sync", "sync", "gba", "gba", "sync", "sync"], run["modes"]
    switches = run["summary"]["switches"]
    dense_numel = run["dense"].numel()  # sync_tables "servers": the tables never move
    assert all(e["nbytes"] == dense_numel * 4 for e in switches), switches
    _assert_matches(run, _reference(SGD))


@pytest.mark.soak
def test_checkpoint_carries_rows_and_optimizer_state_and_resumes_exactly(launch):
    full, resumed = launch["w0"]["adagrad_sync"], launch["w0"]["adagrad_resumed"]
    assert resumed["version"] == STEPS
    torch.testing.assert_close(resumed["dense"], full["dense"], rtol=0, atol=1e-7)
    for name in full["tables"]:  # rows, their accumulators and the schedule's position came back
        torch.testing.assert_close(resumed["tables"][name], full["tables"][name], rtol=0, atol=1e-7)
    from gba_engine.checkpoint import load_tables

    for server in range(SERVERS):  # each shard holds its rows' weights, row-wise accumulators and step count
        shard = load_tables(os.path.join(launch["tmp"], "ck", "t"), server, SERVERS)
        assert sorted(shard) == ["deep0", "wide0"]
        assert sorted(shard["deep0"]) == ["momentum1", "steps", "weight"] and shard["deep0"]["steps"] == STEPS // 2
        assert shard["deep0"]["momentum1"].shape == (sum(VOCAB) // SERVERS,) and shard["deep0"]["momentum1"].any()


# ----------------------------------------------------------------------------- in one process


class _LocalRows:
    """A ServerRowClient over in-memory row optimizers: the servers' update without servers."""

    def __init__(self, specs):
        self.tables = {s.name: s.optimizer.build_rows(s.initial_table(1)) for s in specs}
        self.recorded = []

    def fetch_rows(self, ids):
        return {n: self.tables[n].weight[i].clone() for n, i in ids.items()}

    def record_rows(self, table, ids, rows):
        self.recorded.append((table, ids, rows))

    def apply(self):
        for table, ids, leaf in self.recorded:
            self.tables[table].step(ids, leaf.grad)
        self.recorded = []


@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad", "adam"])
@pytest.mark.parametrize("packing", [True, False], ids=["packed", "per-field"])
def test_server_row_optimizer_and_lookup_equal_picasso_packed_tables(optimizer, packing):
    """Same batches through picasso's packed tables (fused update) and the servers' tables -> same rows to 1e-6."""
    from gba_engine.packed_tables import ServerPackedFieldEmbeddings
    from gba_engine.ps.optim import TableOptimizerSpec
    from picasso_ops.distributed import sparse_step
    from picasso_ops.models import PackedFieldEmbeddings, SparseArgs

    opt = TableOptimizerSpec.of(optimizer, lr=0.1)
    emb = ServerPackedFieldEmbeddings(VOCAB, DIM, "mean", 0.5, opt, packing=packing, prefix="t", seed=3)
    rows = _LocalRows(emb.collection.tables)
    emb.collection.bind(rows)
    ref = PackedFieldEmbeddings(VOCAB, DIM, "mean", SparseArgs(optimizer, dict(opt.params), packing), prefix="r")
    where = {}  # field -> (server table, first row)
    for name, (a, b) in zip(emb.names, emb.group_ranges):
        for f in range(a, b):
            where[f] = (name, int(emb.row_offset[f]))
    with torch.no_grad():
        for f, (name, off) in where.items():
            ref.collection.table_weight(f"r{f}").copy_(rows.tables[name].weight[off:off + VOCAB[f]])
    g = torch.Generator().manual_seed(0)
    for _ in range(4):
        lengths = torch.randint(0, 4, (len(VOCAB), 6), generator=g)  # empty bags included
        values = torch.cat([torch.randint(0, v, (int(lengths[f].sum()),), generator=g) for f, v in enumerate(VOCAB)])
        weights = torch.randn(6, len(VOCAB), DIM, generator=g)
        out, expected = emb(values, lengths), ref(values, lengths)
        torch.testing.assert_close(out, expected)
        (out * weights).sum().backward()
        rows.apply()
        (expected * weights).sum().backward()
        sparse_step(ref)
    assert len(emb.collection.tables) == (1 if packing else len(VOCAB))
    for f, (name, off) in where.items():
        torch.testing.assert_close(rows.tables[name].weight[off:off + VOCAB[f]], ref.collection.table_weight(f"r{f}"),
                                   rtol=0, atol=1e-6)


def test_table_optimizer_spec_refuses_bad_settings_by_name():
    from gba_engine.ps.optim import TableOptimizerSpec

    with pytest.raises(ValueError, match="must be one of .*'rowwise_adagrad'"):
        TableOptimizerSpec.of("adagrad", lr=0.1)
    with pytest.raises(ValueError, match="unknown hyperparameter 'beta3'"):
        TableOptimizerSpec.of("adam", lr=0.1, beta3=0.5)
    with pytest.raises(ValueError, match="lr_schedule must be one of"):
        TableOptimizerSpec.of("sgd", lr=0.1, lr_schedule="cosine")
    spec = TableOptimizerSpec.of("sgd", lr=0.1, lr_schedule="deepspeed")
    assert spec.scheduled_lr(0.5) == 0.1  # no scheduler: the block's lr throughout
    assert spec.with_peak(2.0).scheduled_lr(0.5) == pytest.approx(0.025)
    assert TableOptimizerSpec.of("sgd", lr=0.1).with_peak(2.0).scheduled_lr(0.5) == 0.1  # constant


def test_schedule_peaks_reach_only_tables_on_a_deepspeed_schedule():
    from gba_engine.ps import OptimizerSpec
    from gba_engine.ps.optim import TableOptimizerSpec
    from gba_engine.ps.sharding import ServerTableSpec
    from gba_engine.startup import with_schedule_peaks

    tables = [ServerTableSpec("a", 4, 2, optimizer=TableOptimizerSpec.of("sgd", lr=0.1, lr_schedule="deepspeed")),
              ServerTableSpec("b", 4, 2, optimizer=TableOptimizerSpec.of("sgd", lr=0.1)), ServerTableSpec("c", 4, 2)]
    got = with_schedule_peaks(tables, {"scheduler": SCHEDULER}, OptimizerSpec.of("sgd", lr=DENSE_LR))
    assert got[0].optimizer.schedule_peak == DENSE_LR
    assert got[1].optimizer.schedule_peak is None and got[2].optimizer is None
    assert with_schedule_peaks(tables, {}, OptimizerSpec.of("sgd", lr=DENSE_LR))[0].optimizer.schedule_peak is None


def test_out_of_range_ids_name_their_field():
    from gba_engine.packed_tables import ServerPackedFieldEmbeddings
    from gba_engine.ps.optim import TableOptimizerSpec

    emb = ServerPackedFieldEmbeddings([5, 3], 2, "sum", 0.1, TableOptimizerSpec.of("sgd", lr=0.1))
    emb.collection.bind(_LocalRows(emb.collection.tables))
    with pytest.raises(IndexError, match=r"field 1: id 3 outside \[0, 3\)"):
        emb(torch.tensor([4, 0, 3]), torch.tensor([[1, 1], [1, 0]]))  # 3 is a row of the pack, not of field 1
    with pytest.raises(ValueError, match=r"lengths must be \[F=2, B\]"):
        emb(torch.tensor([1]), torch.tensor([[1]]))
