"""Issue 26, gba: modules that cannot train under a gba block are refused on every rank before any wait,
and a collective the servers never join ends the job with an error that names it, within gba.timeout_s.

Before, a DLRM over picasso's data-parallel tables under ``gba_engine.initialize`` (auto mode) printed
nothing for 5 minutes: both workers waited in ``DataParallelEmbeddingCollection.sparse_step`` (an
all-gather over the world group, which includes the server rank) and the server in
``ServerLoop._wait_command``.

Multi-process runs: 2 workers + 1 server (world size 3), gloo on 127.0.0.1, each with a deadline of 40 s.
"""
from __future__ import annotations

import logging
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from sparse_scale.multiproc import run_distributed

TIMEOUT_S = 5  # the gba block's timeout_s in these runs
VOCAB = [12, 9]
REFUSED = {  # case -> (class named in the error, path of the refused module)
    "data_parallel": ("picasso_ops.distributed.data_parallel.DataParallelEmbeddingCollection", "model.emb"),
    "row_sharded": ("picasso_ops.distributed.row_sharded.RowShardedEmbeddingCollection", "model.emb"),
    "packed": ("picasso_ops.embedding.packed.PackedEmbeddingCollection", "model.emb"),
    "cached": ("picasso_ops.cache.fields.CachedFieldEmbeddings", "model.emb"),
    "wide_and_deep": ("picasso_ops.distributed.data_parallel.DataParallelEmbeddingCollection",
                      "model.embeddings.collection"),
}


def _config(mode: str = "sync", **gba) -> dict:
    return {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
            "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "zero_optimization": {"stage": 0},
            "steps_per_print": 10 ** 6, "gradient_clipping": 0.0,
            "gba": {"mode": mode, "num_servers": 1, "timeout_s": TIMEOUT_S, "heartbeat_s": 0.2, **gba}}


class Net(nn.Module):
    """A user's own small model: one table module and a dense layer."""

    def __init__(self, emb: nn.Module) -> None:
        super().__init__()
        self.emb = emb
        self.dense = nn.Linear(3, 1)


def _refused_model(case: str) -> nn.Module:
    from picasso_ops.cache.fields import CachedFieldEmbeddings
    from picasso_ops.distributed import DataParallelEmbeddingCollection, RowShardedEmbeddingCollection
    from picasso_ops.embedding import TableSpec
    from picasso_ops.embedding.packed import PackedEmbeddingCollection
    from picasso_ops.models import PackedFieldEmbeddings, SparseArgs, WideAndDeepArgs, packed_wide_and_deep

    torch.manual_seed(3)
    specs = [TableSpec("user", 12, 4), TableSpec("item", 9, 4)]
    if case == "data_parallel":
        return Net(DataParallelEmbeddingCollection(specs))
    if case == "row_sharded":
        return Net(RowShardedEmbeddingCollection(specs))
    if case == "packed":
        return Net(PackedEmbeddingCollection(specs))
    if case == "cached":
        return Net(CachedFieldEmbeddings.from_packed(PackedFieldEmbeddings(VOCAB, 4, "mean", SparseArgs()),
                                                     capacity=16))
    if case == "wide_and_deep":  # picasso's own model over data-parallel packed tables
        return packed_wide_and_deep(WideAndDeepArgs(vocab_sizes=VOCAB, num_dense=2, embedding_dim=4, hidden=(4,)),
                                    SparseArgs())
    raise ValueError(case)


class ServerNet(nn.Module):
    """What works: the tables on the servers (gba_engine.packed_tables.ServerPackedFieldEmbeddings)."""

    def __init__(self) -> None:
        super().__init__()
        from gba_engine.packed_tables import ServerPackedFieldEmbeddings
        from gba_engine.ps.optim import TableOptimizerSpec

        self.emb = ServerPackedFieldEmbeddings(VOCAB, 2, "mean", 0.1, TableOptimizerSpec.of("sgd", lr=0.1))
        torch.manual_seed(5)
        self.dense = nn.Linear(2 + 2 * len(VOCAB), 1)

    def forward(self, x, values, lengths):
        return self.dense(torch.cat([x, self.emb(values, lengths).flatten(1)], dim=1)).squeeze(1)


def _batch(step: int, worker: int):
    g = torch.Generator().manual_seed(10 * step + worker)
    lengths = torch.randint(1, 3, (len(VOCAB), 4), generator=g)
    values = torch.cat([torch.randint(0, v, (int(lengths[f].sum()),), generator=g) for f, v in enumerate(VOCAB)])
    return torch.randn(4, 2, generator=g), values, lengths, torch.randn(4, generator=g)


def _refusals_launch(rank: int, world_size: int) -> dict:
    import gba_engine

    out = {}
    for case in REFUSED:
        model = _refused_model(case)  # built on every rank (the data-parallel tables broadcast at construction)
        t0 = time.monotonic()
        try:
            gba_engine.initialize(model=model, config=_config("auto"))
            out[case] = ("accepted", "", time.monotonic() - t0)
        except gba_engine.GBAModelError as exc:
            out[case] = (type(exc).__name__, str(exc), time.monotonic() - t0)
    # nothing was left waiting on any rank: the same ranks run a job over server tables right after
    engine = gba_engine.initialize(model=ServerNet(), config=_config("sync"))
    if engine.is_server:
        out["job"] = {"version": engine.server_stats["version"]}
        return out
    for step in range(2):
        x, values, lengths, y = _batch(step, rank)
        engine.backward(F.mse_loss(engine(x, values, lengths), y))
        engine.step()
    out["job"] = {"version": engine.version}
    engine.close()
    return out


def test_each_refused_table_raises_the_named_error_on_every_rank_before_any_wait():
    t0 = time.monotonic()
    ranks = run_distributed(_refusals_launch, world_size=3, timeout_s=40)
    wall = time.monotonic() - t0
    for case, (cls, path) in REFUSED.items():
        messages = {ranks[r][case][1] for r in range(3)}
        assert len(messages) == 1, f"{case}: the ranks refused differently: {messages}"
        for r in range(3):
            kind, message, seconds = ranks[r][case]
            assert kind == "GBAModelError", f"{case}: rank {r} was not refused: {kind}"
            assert f"{path} ({cls}" in message, message
            assert "cannot train under a gba block" in message
            assert "gba_engine.packed_tables.ServerPackedFieldEmbeddings" in message
            assert "sparse_scale.tables_from_block" in message
            assert seconds < 2.0, f"{case}: rank {r} took {seconds:.1f}s to refuse"
    dp = ranks[0]["data_parallel"][1]
    assert "all-gathers" in dp and "never join a collective" in dp and "drift apart" in dp
    assert "drift apart" in ranks[0]["packed"][1]
    assert "inside model.embeddings (PackedFieldEmbeddings)" in ranks[0]["wide_and_deep"][1]
    assert [ranks[r]["job"]["version"] for r in range(3)] == [2, 2, 2]
    assert wall < 40


def test_check_lists_every_refused_module_and_passes_server_tables():
    import gba_engine
    from gba_engine.tables import ServerFieldEmbeddings

    class UserTable(nn.Module):  # a user's own table with picasso's sparse-step contract
        def sparse_step(self, grad_scale: float = 1.0) -> None: ...

        def discard_pending(self) -> None: ...

    model = nn.ModuleDict({"tower": nn.Sequential(nn.Linear(2, 2), _refused_model("packed").emb),
                           "mine": UserTable(), "ok": ServerNet(),
                           "per_field": ServerFieldEmbeddings(VOCAB, 2, "sum", 0.1), "plain": nn.EmbeddingBag(5, 2)})
    found = {r.path: r for r in gba_engine.gba_refusals(model, name="net")}
    assert sorted(found) == ["net.mine", "net.tower.1"]
    assert found["net.tower.1"].inside == "net.tower (Sequential)"
    assert "SparseStepModule contract" in found["net.mine"].reason
    assert gba_engine.gba_refusals(ServerNet()) == []
    gba_engine.check_gba_model(nn.Sequential(ServerNet()))  # returns quietly
    with pytest.raises(gba_engine.GBAModelError, match=r"2 modules that cannot train") as info:
        gba_engine.check_gba_model(model, name="net")
    assert [r.path for r in info.value.refusals] == ["net.tower.1", "net.mine"]


def test_initialize_and_rejoin_refuse_before_asking_any_rank(monkeypatch):
    """The refusal comes before torch.distributed starts (initialize) and before the job is contacted (rejoin)."""
    import deepspeed

    import gba_engine

    def no_rendezvous(*args, **kwargs):
        raise AssertionError("gba_engine waited on other ranks before refusing the model")

    monkeypatch.setattr(deepspeed, "init_distributed", no_rendezvous)
    monkeypatch.setattr(dist, "init_process_group", no_rendezvous)
    assert not dist.is_initialized()
    with pytest.raises(gba_engine.GBAModelError, match=r"model\.emb \(picasso_ops\.embedding\.packed\."):
        gba_engine.initialize(model=_refused_model("packed"), config=_config("auto"))
    t0 = time.monotonic()
    with pytest.raises(gba_engine.GBAModelError, match=r"(?s)gba_engine\.rejoin .*model\.emb"):
        gba_engine.rejoin(model=_refused_model("packed"), config=_config("gba"), worker=0,
                          control_plane="127.0.0.1:9")  # nobody answers there: a contact would fail after timeout_s
    assert time.monotonic() - t0 < 2.0
    assert not dist.is_initialized()


# ---------------------------------------------------------------------------------------------- the hang of issue 26
class WorldSyncTable(nn.Module):
    """A user's hand-written table whose sparse step averages its rows over the default (world) group.

    It has a ``sparse_step`` but not picasso's whole ``SparseStepModule`` contract (no
    ``discard_pending``), so the model check cannot tell it from a dense module: the run shows what
    happens at the collective itself, the hang of issue 26 without picasso's classes.
    """

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("rows", torch.zeros(6, 1))

    def forward(self, ids):
        return self.rows[ids]

    via_deepspeed = False  # through deepspeed.comm (whose collectives the engine wraps to time them) or torch's

    def sparse_step(self) -> None:
        if self.via_deepspeed:
            import deepspeed.comm

            deepspeed.comm.all_reduce(self.rows)  # the world again, through the wrapped backend
        else:
            dist.all_reduce(self.rows)  # group=None: the world, which includes the server rank


class HangNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.table = WorldSyncTable()
        self.dense = nn.Linear(3, 1)

    def forward(self, x, ids):
        return self.dense(x) + self.table(ids)


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _hang_launch(rank: int, world_size: int, via_deepspeed: bool = False) -> dict:
    import gba_engine

    records = _Records()
    logging.getLogger("gba_engine").addHandler(records)
    model = HangNet()
    model.table.via_deepspeed = via_deepspeed
    t0 = time.time()
    try:
        engine = gba_engine.initialize(model=model, config=_config("auto"))
    except gba_engine.StuckCollectiveError as exc:  # the server: its wait for the next command ended
        return {"error": type(exc).__name__, "message": str(exc), "raised": time.time(), "worker": exc.worker}
    if engine.is_server:
        return {"error": None, "served_s": time.time() - t0}
    entered = None
    try:
        for step in range(3):
            g = torch.Generator().manual_seed(step * 10 + rank)
            x, ids = torch.randn(4, 3, generator=g), torch.randint(0, 6, (4,), generator=g)
            engine.backward(F.mse_loss(engine(x, ids), torch.zeros(4, 1)))
            engine.step()
            entered = time.time()
            model.table.sparse_step()  # the collective the server never joins
    except RuntimeError as exc:
        return {"error": type(exc).__name__, "message": str(exc), "entered": entered, "raised": time.time(),
                "logged": records.messages}
    return {"error": None, "logged": records.messages}


@pytest.mark.parametrize("via_deepspeed", [False, True], ids=["torch", "deepspeed.comm"])
def test_a_collective_the_server_never_joins_fails_within_timeout_s_naming_the_module_and_the_wait(via_deepspeed):
    t0 = time.monotonic()
    w0, w1, server = run_distributed(_hang_launch, world_size=3, args=(via_deepspeed,), timeout_s=40)
    assert time.monotonic() - t0 < 40
    # the server stops waiting for its next command as soon as a worker is seen stuck, with the reason
    assert server["error"] == "StuckCollectiveError", server
    message = server["message"]
    for part in ("rank 2 (parameter server 0)", "waits in torch.distributed.all_reduce",
                 "over the default (world) process group (ranks [0, 1, 2], with parameter-server rank 2)",
                 "called by model.table (WorldSyncTable).sparse_step at", "test_refusals.py:",
                 "never join a collective", f"gba.timeout_s={TIMEOUT_S}s", "engine.worker_group",
                 "gba_engine.packed_tables.ServerPackedFieldEmbeddings"):
        assert part in message, f"{part!r} not in {message!r}"
    assert server["worker"] in (0, 1)
    first_entered = min(w["entered"] for w in (w0, w1))
    assert server["raised"] - first_entered < TIMEOUT_S, "the server did not stop within gba.timeout_s"
    # each worker: its collective ends when the server's process exits (gloo: connection closed) or at the latest
    # when the default group's timeout (gba.timeout_s during the job) ends
    for w in (w0, w1):
        assert w["error"] == "RuntimeError", w
        assert "Connection closed by peer" in w["message"] or "Timed out" in w["message"], w["message"]
        assert w["raised"] - w["entered"] < TIMEOUT_S + 2, w["raised"] - w["entered"]
    # the worker the server names said why on its own rank first; the other may have entered the collective so late
    # that the server's exit ended it before its watch took two samples, so it need not log
    stuck = (w0, w1)[server["worker"]]
    assert any("waits in torch.distributed.all_reduce" in m and "model.table (WorldSyncTable).sparse_step" in m
               for m in stuck["logged"]), stuck["logged"]
