"""Tables whose replicas drift apart across ranks are named, never trained silently (issue 26).

* A plain ``PackedEmbeddingCollection`` training on 2 real ranks under ``deepspeed.initialize`` warns at its
  first training forward (once, RuntimeWarning + log) and its replicas do diverge; a
  ``DataParallelEmbeddingCollection`` stepped by ``engine_step``, a row-sharded collection and a
  ``rank_local=True`` collection do not warn.
* ``replica_problems`` lists exactly the diverging table modules of a model, by path.
* docs/picasso.md's "Using the package directly" snippet runs on 2 ranks under the deepspeed launcher,
  without the warning, and its replicas agree.
"""
from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

from picasso_ops.cache import CachedEmbeddingTable, CachedFieldEmbeddings, HostRowStore
from picasso_ops.distributed import (DataParallelEmbeddingCollection, RowShardedEmbeddingCollection, engine_step,
                                     replica_problems)
from picasso_ops.embedding import PackedEmbeddingCollection, TableSpec
from picasso_ops.jagged import JaggedBatch
from picasso_ops.vocab import DynamicEmbeddingTable
from sparse_scale.multiproc import free_port, run_distributed

REPO = Path(__file__).resolve().parents[3]
FIELDS = ("a", "b", "c")
V, D, B = 50, 4, 8
DS_CONFIG = {"train_micro_batch_size_per_gpu": B, "steps_per_print": 10**6,
             "optimizer": {"type": "AdamW", "params": {"lr": 0.001, "torch_adam": True}}}
MARK = "PackedEmbeddingCollection (tables"  # how the warning starts


def _specs() -> list[TableSpec]:
    return [TableSpec(f, V, D, optimizer="sgd", optimizer_params={"lr": 0.5}) for f in FIELDS]


class _Model(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        if kind == "plain":
            self.emb = PackedEmbeddingCollection(_specs())
        elif kind == "rank_local":
            self.emb = PackedEmbeddingCollection(_specs(), rank_local=True)
        elif kind == "data_parallel":
            self.emb = DataParallelEmbeddingCollection(_specs())
        else:
            self.emb = RowShardedEmbeddingCollection(_specs())
        self.top = nn.Linear(D * len(FIELDS), 1)

    def forward(self, values: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        return self.top(self.emb(JaggedBatch(FIELDS, values, lengths)).values).squeeze(-1)


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + step)  # each rank its own samples, as in data parallelism
    lengths = torch.randint(1, 3, (len(FIELDS), B), generator=g)
    values = torch.randint(0, V, (int(lengths.sum()),), generator=g)
    return values, lengths, torch.randint(0, 2, (B,), generator=g).float()


def _tables(emb: nn.Module) -> torch.Tensor:
    if isinstance(emb, RowShardedEmbeddingCollection):
        state = emb.full_state_dict()
        return torch.cat([state[f"{f}.weight"].flatten() for f in FIELDS])
    return torch.cat([emb.table_weight(f).flatten() for f in FIELDS])


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _train(rank: int, world_size: int, kind: str, steps: int = 3) -> dict:
    """Train ``kind`` on this rank under deepspeed.initialize; the replica warnings seen after each call."""
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")  # wraps the harness's process group
    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
    torch.manual_seed(0)
    model = _Model(kind)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=list(model.parameters()), config=DS_CONFIG)
    records = _Records()
    logging.getLogger("picasso_ops.embedding.packed").addHandler(records)
    seen: dict[str, int] = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")

        def count() -> int:
            return sum(1 for w in caught if issubclass(w.category, RuntimeWarning) and MARK in str(w.message))

        with torch.no_grad():  # evaluation does not update the tables: no warning
            engine(*_batch(rank, -1)[:2])
        engine.eval()
        engine(*_batch(rank, -2)[:2])
        engine.train()
        seen["before_training"] = count()
        for step in range(steps):
            values, lengths, labels = _batch(rank, step)
            logits = engine(values, lengths)
            if step == 0:
                seen["after_first_training_forward"] = count()
            engine.backward(nn.functional.binary_cross_entropy_with_logits(logits, labels))
            engine_step(engine)
        seen["after_training"] = count()
        texts = [str(w.message) for w in caught if MARK in str(w.message)]
    tables = _tables(model.emb)
    gathered = [torch.empty_like(tables) for _ in range(world_size)]
    torch.distributed.all_gather(gathered, tables)
    return {"seen": seen, "texts": texts, "logs": [m for m in records.messages if MARK in m],
            "replicas_equal": all(torch.equal(gathered[0], t) for t in gathered[1:])}


@pytest.fixture(scope="module")
def runs() -> dict[str, list[dict]]:
    return {kind: run_distributed(_train, 2, args=(kind,), timeout_s=150)
            for kind in ("plain", "data_parallel", "rank_local", "row_wise")}


def test_plain_collection_on_two_ranks_warns_once_at_its_first_training_forward(runs):
    for rank, out in enumerate(runs["plain"]):
        assert out["seen"] == {"before_training": 0, "after_first_training_forward": 1, "after_training": 1}, \
            f"rank {rank}: replica warnings counted {out['seen']}"
        text = out["texts"][0]
        for part in ("PackedEmbeddingCollection", "['a', 'b', 'c']", "2 ranks", "world size 2", "diverge",
                     "DataParallelEmbeddingCollection", "RowShardedEmbeddingCollection", "engine_step(engine)",
                     "sparse_scale.tables_from_block", "rank_local=True"):
            assert part in text, f"rank {rank}: the warning does not say {part!r}: {text}"
        assert out["logs"] == [text], f"rank {rank}: expected the warning once in the log, got {out['logs']}"
    # the warning is true: the plain collection's replicas did drift apart
    assert not runs["plain"][0]["replicas_equal"], "plain collection's replicas stayed equal; the test lost its point"


@pytest.mark.parametrize("kind", ["data_parallel", "rank_local", "row_wise"])
def test_synced_or_rank_local_tables_do_not_warn(runs, kind):
    for rank, out in enumerate(runs[kind]):
        assert out["seen"]["after_training"] == 0 and not out["logs"], \
            f"{kind}, rank {rank}: unexpected replica warning {out['texts'] or out['logs']}"
    if kind != "rank_local":
        assert runs[kind][0]["replicas_equal"], f"{kind}: the replicas differ after training"


def test_plain_collection_in_one_process_does_not_warn():
    emb = PackedEmbeddingCollection(_specs())
    values, lengths, _ = _batch(0, 0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        emb(JaggedBatch(FIELDS, values, lengths)).values.sum().backward()


class _Wrapper(nn.Module):
    """A module with a sparse step of its own around a plain collection: it handles the ranks itself."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = PackedEmbeddingCollection([TableSpec("w", V, D)])

    def sparse_step(self, grad_scale: float = 1.0) -> None:
        pass

    def discard_pending(self) -> None:
        pass


def _cached_fields() -> CachedFieldEmbeddings:
    store = HostRowStore(2 * V, D, CachedFieldEmbeddings.state_dims("rowwise_adagrad", D))
    return CachedFieldEmbeddings(["x0", "x1"], [V, V], D, "sum", store, capacity=V)


def test_replica_problems_lists_exactly_the_diverging_modules():
    model = nn.Module()
    model.emb = PackedEmbeddingCollection([TableSpec("u", V, D), TableSpec("i", V, D)])
    model.tower = nn.Module()
    model.tower.tables = PackedEmbeddingCollection([TableSpec(f"t{k}", V, D) for k in range(6)])
    model.tower.mlp = nn.Linear(2, 2)
    model.cache = CachedEmbeddingTable(HostRowStore(V, D), capacity=10)
    model.vocab = DynamicEmbeddingTable(10, D)
    # not diverging: synced, sharded, cached data-parallel, deliberately rank-local, autograd, wrapped, dense
    model.dp = DataParallelEmbeddingCollection([TableSpec("dp", V, D)])
    model.rw = RowShardedEmbeddingCollection([TableSpec("rw", V, D)])
    model.fields = _cached_fields()
    model.local = PackedEmbeddingCollection([TableSpec("local", V, D)], rank_local=True)
    model.auto = PackedEmbeddingCollection([TableSpec("auto", V, D)], mode="autograd")
    model.wrapped = _Wrapper()
    model.bag = nn.EmbeddingBag(V, D)
    model.shared = model.emb  # the same module under a second name: listed once

    problems = replica_problems(model, world_size=2)
    assert [p.split(":")[0] for p in problems] == ["emb", "tower.tables", "cache", "vocab"], problems
    assert "PackedEmbeddingCollection (tables ['u', 'i'])" in problems[0], problems[0]
    assert "['t0', 't1', 't2', 't3'] and 2 more" in problems[1], problems[1]
    for line in problems:
        assert "2 replicas would diverge" in line, line
    assert "DataParallelEmbeddingCollection" in problems[0] and "engine_step(engine)" in problems[0]
    assert "rank_local" in problems[2] and "rank_local" in problems[3]
    assert replica_problems(model, world_size=1) == []


def test_replica_problems_names_the_model_itself_and_honours_the_attribute():
    emb = PackedEmbeddingCollection([TableSpec("a", V, D)])
    assert [p.split(":")[0] for p in replica_problems(emb, 4)] == ["<model>"]
    assert "4 replicas would diverge" in replica_problems(emb, 4)[0]
    emb.rank_local = True
    assert replica_problems(emb, 4) == []


# ------------------------------------------------------------------ the docs' snippet, on the deepspeed launcher

SNIPPET_CHECK = """
import warnings as _w
_mine = [str(x.message) for x in _caught if "PackedEmbeddingCollection (tables" in str(x.message)]
assert not _mine, _mine
_sum = torch.stack([model.emb.table_weight(f).double().sum() for f in FIELDS])
_all = [torch.empty_like(_sum) for _ in range(torch.distributed.get_world_size())]
torch.distributed.all_gather(_all, _sum)
assert all(torch.equal(_all[0], s) for s in _all), f"replicas differ: {_all}"
print(f"SNIPPET OK rank {torch.distributed.get_rank()} of {torch.distributed.get_world_size()}", flush=True)
"""


def docs_snippet() -> str:
    """The python block of docs/picasso.md's "Using the package directly" section."""
    text = (REPO / "docs" / "picasso.md").read_text()
    section = text.split("## Using the package directly", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    assert len(blocks) == 1, f"expected one python block in the section, found {len(blocks)}"
    return blocks[0]


def test_docs_snippet_shows_the_synced_tables_and_engine_step():
    code = docs_snippet()
    assert "DataParallelEmbeddingCollection(" in code and "engine_step(engine)" in code, code
    assert code.rstrip().splitlines()[-1].startswith("shutdown_distributed()"), "the snippet ends the run cleanly"
    assert "PackedEmbeddingCollection(" not in code.replace("DataParallelEmbeddingCollection(", ""), code
    compile(code, "docs/picasso.md", "exec")


@pytest.mark.soak  # a launcher run of 10 s or more: make soak (CI runs it)
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_docs_snippet_runs_on_two_ranks_with_equal_replicas(tmp_path):
    script = tmp_path / "snippet.py"
    train, end = docs_snippet().rsplit("shutdown_distributed()", 1)  # the check's all_gather runs before the end
    script.write_text("import warnings as _warnings\n_warnings.simplefilter('always')\n"
                      "_caught_cm = _warnings.catch_warnings(record=True)\n_caught = _caught_cm.__enter__()\n"
                      + train + SNIPPET_CHECK + "shutdown_distributed()" + end)
    env = _launch_env()
    cmd = [str(Path(sys.executable).parent / "deepspeed"), "--num_gpus", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), str(script)]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"the docs snippet failed on 2 ranks (rc {proc.returncode}):\n{out[-4000:]}"
    assert "SNIPPET OK rank 0 of 2" in out and "SNIPPET OK rank 1 of 2" in out, out[-4000:]


def _launch_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not re.match(r"^(RANK|WORLD_SIZE|LOCAL_RANK|LOCAL_WORLD_SIZE|MASTER_PORT)$", k)}
    env.update(MASTER_ADDR="127.0.0.1", GLOO_SOCKET_IFNAME="lo", PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1",
               PYTHONPATH=str(REPO) + os.pathsep + env.get("PYTHONPATH", ""))
    return env
