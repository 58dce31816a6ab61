"""Embedding tables on the parameter servers (ServerEmbeddingBagCollection) in sync, gba and auto modes.

One launch of 2 workers + 2 servers (rows split by id % 2, the dense vector by range) runs every phase; a single-process reference (nn.EmbeddingBag
tables, torch SGD, the global batch) trains the same model in the test process. With plain SGD a
lazy row update equals a dense one, so every mode must land on the reference's tables and layers.
"""
from __future__ import annotations

import os
import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parameters_to_vector

from sparse_scale.multiproc import run_distributed

STEPS = 6
AUTO_STEPS = 16
SLOW = range(2, 8)
TABLES = (("a", 40, 4, 1), ("b", 25, 3, 2))  # name, rows, dim, seed
SERVERS = 2


def _specs():
    from gba_engine.ps.sharding import ServerTableSpec

    return [ServerTableSpec(n, rows, dim, init_std=0.3, seed=seed) for n, rows, dim, seed in TABLES]


def _mlp() -> nn.Module:
    torch.manual_seed(7)
    return nn.Sequential(nn.Linear(4 + 3 + 2, 12), nn.Tanh(), nn.Linear(12, 1))


class ServerNet(nn.Module):
    def __init__(self):
        super().__init__()
        from gba_engine import ServerEmbeddingBagCollection

        self.emb = ServerEmbeddingBagCollection(_specs())
        self.mlp = _mlp()

    def forward(self, x, ids, offsets):
        pooled = self.emb(ids, offsets)
        return self.mlp(torch.cat([pooled["a"], pooled["b"], x], dim=1))


class ReferenceNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.ModuleDict({s.name: nn.EmbeddingBag(s.num_rows, s.dim, mode="sum") for s in _specs()})
        with torch.no_grad():
            for s in _specs():
                self.emb[s.name].weight.copy_(s.initial_table(num_servers=SERVERS))
        self.mlp = _mlp()

    def forward(self, x, ids, offsets):
        pooled = {n: self.emb[n](ids[n], offsets[n]) for n in ids}
        return self.mlp(torch.cat([pooled["a"], pooled["b"], x], dim=1))


def _batch(step: int, worker: int):
    g = torch.Generator().manual_seed(1000 * step + worker)
    x = torch.randn(8, 2, generator=g)
    ids, offsets = {}, {}
    for name, rows, _, _ in TABLES:
        lengths = torch.randint(1, 4, (8,), generator=g)
        ids[name] = torch.randint(0, rows // 2, (int(lengths.sum()),), generator=g)  # half the rows stay untouched
        offsets[name] = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)[:-1]])
    y = torch.tanh(x[:, :1] - 0.5 * x[:, 1:])
    return x, ids, offsets, y


CLIP = 0.05  # small enough that most updates are clipped


def _config(mode: str, optimizer: dict, clip: float = 0.0, **gba) -> dict:
    return {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1, "optimizer": optimizer,
            "zero_optimization": {"stage": 0}, "steps_per_print": 10 ** 6, "gradient_clipping": clip,
            "gba": {"mode": mode, "num_servers": SERVERS, "timeout_s": 20, "heartbeat_s": 0.2, **gba}}


SGD = {"type": "SGD", "params": {"lr": 0.2}}
ADAMW = {"type": "AdamW", "params": {"lr": 0.02, "torch_adam": True}}


def _phase(rank, tmp, mode, steps, optimizer=SGD, first_step=0, save=None, load=None, slow=(), clip=0.0, **gba):
    import gba_engine

    engine = gba_engine.initialize(model=ServerNet(), config=_config(mode, optimizer, clip, **gba))
    if engine.is_server:
        return {"server": engine.server_stats}
    if load:
        engine.load_checkpoint(os.path.join(tmp, load))
    modes, losses = [], []
    for step in range(first_step, first_step + steps):
        x, ids, offsets, y = _batch(step, rank)
        loss = F.mse_loss(engine(x, ids, offsets), y)
        time.sleep(0.03 + (0.2 if rank == 1 and step in slow else 0.0))
        engine.backward(loss)
        engine.step()
        modes.append(engine.mode)
        losses.append(loss.item())
    out = {"modes": modes, "losses": losses, "version": engine.version}
    if save:
        engine.save_checkpoint(os.path.join(tmp, save), tag="t")
    if engine.mode == "gba":
        engine.client.pull(dense=False, min_version=first_step + steps)  # the other worker's last push is applied
        engine.eval()  # pulls the servers' final dense part
    out["dense"] = parameters_to_vector(engine.module.parameters()).detach().clone()
    out["tables"] = {n: engine.table_rows(n, torch.arange(rows)) for n, rows, _, _ in TABLES}
    out["summary"] = engine.summary()
    engine.close()
    return out


def _launch(rank: int, world_size: int, tmp: str) -> dict:
    out = {"sync": _phase(rank, tmp, "sync", STEPS)}
    out["gba"] = _phase(rank, tmp, "gba", STEPS, max_lead=0)
    out["auto"] = _phase(rank, tmp, "auto", AUTO_STEPS, slow=SLOW, max_lead=0,
                         switch={"window": 2, "min_dwell_steps": 2, "slow_ratio": 1.5, "recover_ratio": 1.2})
    out["adam_full"] = _phase(rank, tmp, "sync", STEPS, optimizer=ADAMW)
    out["adam_first"] = _phase(rank, tmp, "sync", STEPS // 2, optimizer=ADAMW, save="ck")
    out["adam_resumed"] = _phase(rank, tmp, "sync", STEPS // 2, optimizer=ADAMW, first_step=STEPS // 2, load="ck")
    out["clip_sync"] = _phase(rank, tmp, "sync", STEPS, clip=CLIP)
    out["clip_gba"] = _phase(rank, tmp, "gba", STEPS, clip=CLIP, max_lead=0)
    return out


@pytest.fixture(scope="module")
def launch(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("gba_tables"))
    res = run_distributed(_launch, world_size=2 + SERVERS, args=(tmp,), timeout_s=150)
    return {"w0": res[0], "w1": res[1], "server": res[2]}


def _reference(steps: int, clip: float = 0.0):
    net = ReferenceNet()
    opt = torch.optim.SGD(net.parameters(), lr=0.2)
    for step in range(steps):
        opt.zero_grad()
        loss = sum(F.mse_loss(net(x, ids, off), y) for x, ids, off, y in (_batch(step, 0), _batch(step, 1))) / 2
        loss.backward()
        if clip:  # DeepSpeed's clipping covers its own (dense) parameters, not the servers' rows
            torch.nn.utils.clip_grad_norm_(net.mlp.parameters(), clip)
        opt.step()
    dense = parameters_to_vector(net.mlp.parameters()).detach()
    return dense, {n: net.emb[n].weight.detach() for n, _, _, _ in TABLES}


def _assert_matches(run: dict, ref) -> None:
    dense, tables = ref
    torch.testing.assert_close(run["dense"], dense, rtol=1e-5, atol=1e-6)
    for name, rows in tables.items():
        torch.testing.assert_close(run["tables"][name], rows, rtol=1e-5, atol=1e-6)


@pytest.mark.soak
def test_gradient_clipping_runs_on_the_servers_like_deepspeed(launch):
    ref = _reference(STEPS, clip=CLIP)
    _assert_matches(launch["w0"]["clip_sync"], ref)  # DeepSpeed clips the all-reduced gradient
    _assert_matches(launch["w0"]["clip_gba"], ref)  # the servers clip by the norm over both shards
    assert launch["w0"]["clip_gba"]["summary"]["clipped_updates"] >= STEPS // 2
    # and clipping mattered: the unclipped run ends elsewhere
    assert not torch.allclose(launch["w0"]["clip_sync"]["dense"], launch["w0"]["sync"]["dense"], atol=1e-3)


@pytest.mark.soak
def test_sync_with_tables_on_the_servers_equals_one_process_on_the_global_batch(launch):
    run = launch["w0"]["sync"]
    assert set(run["modes"]) == {"sync"} and run["version"] == STEPS
    _assert_matches(run, _reference(STEPS))
    # both workers read the same rows: the servers are the one copy of the tables
    for name in run["tables"]:
        assert torch.equal(run["tables"][name], launch["w1"]["sync"]["tables"][name])
    # untouched rows keep their initial values exactly
    init = {s.name: s.initial_table(SERVERS) for s in _specs()}
    assert torch.equal(run["tables"]["a"][20:], init["a"][20:])


@pytest.mark.soak
def test_gba_lockstep_with_tables_equals_sync(launch):
    run = launch["w0"]["gba"]
    assert set(run["modes"]) == {"gba"}
    _assert_matches(run, _reference(STEPS))
    assert launch["server"]["gba"]["server"]["staleness"] == {"0": 2 * STEPS}


@pytest.mark.soak
def test_auto_switches_both_ways_and_hands_the_tables_over_with_the_dense_part(launch):
    run = launch["w0"]["auto"]
    assert "gba" in run["modes"] and run["modes"][-1] == "sync", run["modes"]
    sw = run["summary"]["switches"]
    assert [(e["src"], e["dst"]) for e in sw][:2] == [("sync", "gba"), ("gba", "sync")]
    # the dense part (9 x 12 + 12 + 13 floats, SGD: no moments) and, from the workers' sync phase, every
    # table's rows (SGD: no row state), split over both servers
    dense_numel = 9 * 12 + 12 + 12 + 1
    table_numel = sum(rows * dim for _, rows, dim, _ in TABLES)
    assert all(e["nbytes"] == (dense_numel + table_numel) * 4 for e in sw), sw
    for name in run["tables"]:  # no worker diverges
        assert torch.equal(run["tables"][name], launch["w1"]["auto"]["tables"][name])
    # lockstep gba + exact hand-over: the whole run is the one-process run on the global batches
    _assert_matches(run, _reference(AUTO_STEPS))


@pytest.mark.soak
def test_checkpoint_with_tables_resumes_exactly(launch):
    full, resumed = launch["w0"]["adam_full"], launch["w0"]["adam_resumed"]
    assert resumed["version"] == STEPS
    torch.testing.assert_close(resumed["dense"], full["dense"], rtol=0, atol=1e-7)
    for name in full["tables"]:  # rows and their Adam moments came back from the server shard
        torch.testing.assert_close(resumed["tables"][name], full["tables"][name], rtol=0, atol=1e-7)
    # and Adam's lazy rows differ from SGD's: the optimizer of the config ran on the servers
    assert not torch.allclose(full["tables"]["a"], launch["w0"]["sync"]["tables"]["a"])


def test_unbound_collection_is_a_clear_error():
    with pytest.raises(RuntimeError, match="not bound to a parameter server"):
        ServerNet()(*_batch(0, 0)[:3])


def test_repeated_table_names_are_a_clear_error():
    from gba_engine.ps.sharding import ServerTableSpec
    from gba_engine.tables import ServerEmbeddingBagCollection, server_tables

    model = nn.ModuleList([ServerEmbeddingBagCollection([ServerTableSpec("u", 5, 2)]),
                           ServerEmbeddingBagCollection([ServerTableSpec("u", 7, 2)])])
    with pytest.raises(ValueError, match=r"repeated: \['u'\]"):
        server_tables(model)


@pytest.mark.parametrize("kind", ["deepspeed adamw", "picasso lazy adam"])
def test_row_optimizer_state_round_trips_and_refuses_a_wrong_shape(kind):
    from gba_engine.ps.optim import OptimizerSpec, TableOptimizerSpec

    # the job's optimizer on the servers, or a table's own (the picasso block's, e.g. packed tables)
    spec = OptimizerSpec.of("adamw", lr=0.1) if kind == "deepspeed adamw" else TableOptimizerSpec.of("adam", lr=0.1)
    a = spec.build_rows(torch.randn(6, 3))
    a.step(torch.tensor([1, 4]), torch.randn(2, 3))
    b = spec.build_rows(torch.zeros(6, 3))
    b.load_state_dict(a.state_dict())
    g = torch.randn(2, 3)
    a.step(torch.tensor([1, 2]), g)
    b.step(torch.tensor([1, 2]), g)
    assert b.steps == 2 and len(a.state_dict()) == 4  # weight, two moments, steps
    assert all(torch.equal(v, b.state_dict()[k]) for k, v in a.state_dict().items() if k != "steps")
    with pytest.raises(ValueError, match="another num_servers"):
        spec.build_rows(torch.zeros(5, 3)).load_state_dict(a.state_dict())


class _LocalRows:
    """A ServerRowClient over in-memory tables: checks the collection's pooling and gradients without servers."""

    def __init__(self, tables):
        self.tables, self.recorded = tables, []

    def fetch_rows(self, ids):
        return {n: self.tables[n][i].clone() for n, i in ids.items()}

    def record_rows(self, table, ids, rows):
        self.recorded.append((table, ids, rows))


def test_field_embeddings_pool_like_per_field_embedding_bags_and_return_row_gradients():
    from gba_engine.tables import ServerFieldEmbeddings

    vocab = [7, 5, 9]
    emb = ServerFieldEmbeddings(vocab, dim=3, pooling="mean", init_std=0.5, prefix="f", seed=4)
    tables = {s.name: s.initial_table(1) for s in emb.collection.tables}
    source = _LocalRows(tables)
    emb.collection.bind(source)
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, 4, (3, 6), generator=g)
    values = torch.cat([torch.randint(0, v, (int(lengths[f].sum()),), generator=g) for f, v in enumerate(vocab)])
    out = emb(values, lengths)
    bags = [nn.EmbeddingBag.from_pretrained(tables[f"f{f}"].clone(), freeze=False, mode="mean") for f in range(3)]
    ref, lo = [], 0
    for f in range(3):
        n = int(lengths[f].sum())
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths[f].cumsum(0)[:-1]])
        ref.append(bags[f](values[lo:lo + n], offsets))
        lo += n
    ref = torch.stack(ref, dim=1)
    torch.testing.assert_close(out, ref)
    weights = torch.randn(out.shape, generator=g)
    (out * weights).sum().backward()
    (ref * weights).sum().backward()
    for table, ids, rows in source.recorded:  # per unique id: the dense gradient's rows
        torch.testing.assert_close(rows.grad, bags[int(table[1:])].weight.grad[ids])


def test_server_field_embeddings_meet_picasso_field_embedding_contract():
    """``FieldEmbeddingLookup`` is not runtime-checkable (every module has a forward): check its signature and shape."""
    import inspect

    from gba_engine.tables import ServerFieldEmbeddings
    from picasso_ops.contracts import FieldEmbeddingLookup

    contract = list(inspect.signature(FieldEmbeddingLookup.forward).parameters)
    assert list(inspect.signature(ServerFieldEmbeddings.forward).parameters) == contract  # self, values, lengths
    emb: FieldEmbeddingLookup = ServerFieldEmbeddings([4, 6], dim=5, pooling="sum", init_std=0.1)
    emb.collection.bind(_LocalRows({s.name: s.initial_table(1) for s in emb.collection.tables}))
    lengths = torch.tensor([[1, 2, 0], [2, 1, 1]])  # [F, B]
    values = torch.tensor([0, 1, 3, 5, 0, 2, 4])
    assert emb(values, lengths).shape == (3, 2, 5)  # [B, F, D]
