"""``engine.pipeline(batches)`` in a user's own loop: the sparse-dist pipeline outside the rec job.

Real gloo ranks (sparse_scale.multiproc.run_distributed). The pipelined loop must train exactly as the
plain loop (same losses, same weights bit for bit), where it applies; elsewhere it hands the batches back.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

import sparse_scale
from picasso_ops.distributed.pipelined_loader import PipelinedLoader, kjt_ids
from sparse_scale.multiproc import run_distributed
from tests.sparse_scale.test_entry import FIELDS, PICASSO, VOCAB, OwnDLRM, batch, ds_config


def _kjt_batch(step: int, rank: int):
    dense, values, lengths, labels = batch(step, rank)
    kjt = KeyedJaggedTensor(keys=[f"f{i}" for i in range(FIELDS)], values=values, lengths=lengths.flatten())
    return dense, kjt, labels


def _engine(config):
    torch.manual_seed(0)
    tables = sparse_scale.tables_from_block(config, [VOCAB + 5 * f for f in range(FIELDS)])
    return sparse_scale.initialize(model=OwnDLRM(tables), config=config)[0]


def _step(engine, dense, kjt, labels) -> float:
    logits, aux = engine(dense, kjt.values(), kjt.lengths().view(FIELDS, -1))
    loss = F.binary_cross_entropy_with_logits(logits, labels) + aux
    engine.backward(loss)
    engine.step()
    return float(loss)


def _pipelined_and_plain(rank, world, picasso):
    """Two passes through engine.pipeline (the second left early), then the same batches without it."""
    engine = _engine(ds_config(picasso=picasso))
    losses, kinds, rounds = [], [], 0
    first = engine.pipeline(_kjt_batch(step, rank) for step in range(4))
    kinds.append(type(first).__name__)
    for b in first:
        losses.append(_step(engine, *b))
    rounds += first.stats.get("rounds", 0) if isinstance(first, PipelinedLoader) else 0
    second = engine.pipeline(_kjt_batch(step, rank) for step in range(4, 9))
    for i, b in enumerate(second):
        losses.append(_step(engine, *b))
        if i == 1:
            break  # steps 4 and 5; the batch read ahead (6) is dropped
    engine.close_pipeline()
    state = {k: v.clone() for k, v in engine.module.state_dict().items()}

    plain = _engine(ds_config(picasso={**picasso, "pipeline": "off"}))
    passed = plain.pipeline(_kjt_batch(step, rank) for step in range(6))
    kinds.append(type(passed).__name__)
    plain_losses = [_step(plain, *b) for b in passed]
    differ = sorted(k for k, v in plain.module.state_dict().items() if not torch.equal(v, state[k]))
    return {"losses": losses, "plain": plain_losses, "differ": differ, "kinds": kinds, "rounds": rounds}


@pytest.mark.parametrize("picasso", [
    {**PICASSO, "sharding": "row_wise"},
    {**PICASSO, "sharding": "auto", "table_sharding": {"emb0": "row_wise"}, "pipeline": "all"},
], ids=["row_wise", "mixed-all"])
def test_an_own_loop_through_engine_pipeline_trains_as_the_plain_loop(picasso):
    results = run_distributed(_pipelined_and_plain, world_size=2, args=(picasso,), timeout_s=60)
    for rank, r in enumerate(results):
        assert r["kinds"] == ["PipelinedLoader", "generator"], r["kinds"]  # "off": the batches come back as they are
        assert r["rounds"] >= 3, r["rounds"]  # the batches after the first were prepared ahead
        assert len(r["losses"]) == 6
        assert r["losses"] == r["plain"], f"rank {rank}: {r['losses']} != {r['plain']}"
        assert r["differ"] == [], f"rank {rank}: weights differ from the plain loop's: {r['differ']}"


def _wrong_ids(rank, world):
    engine = _engine(ds_config(picasso={**PICASSO, "sharding": "row_wise"}))
    shifted = lambda b: (b[1].values() + 1 - (b[1].values() + 1 >= VOCAB).long(), b[1].lengths().view(FIELDS, -1))
    try:
        for b in engine.pipeline((_kjt_batch(step, rank) for step in range(3)), ids=shifted):
            _step(engine, *b)
    except RuntimeError as exc:
        engine.close_pipeline()
        return str(exc)
    return None


def test_ids_that_are_not_the_forwards_raise_instead_of_training_on_other_rows():
    for rank, message in enumerate(run_distributed(_wrong_ids, world_size=2, timeout_s=60)):
        assert message is not None and "prepared ahead is of another batch" in message, message
        assert f"rank {rank}" in message


def _passthrough(rank, world):
    engine = _engine(ds_config(picasso=PICASSO))  # data-parallel tables, the default "row_wise" pipeline
    batches = [_kjt_batch(0, rank)]
    return engine.pipeline(batches) is batches


def test_a_model_without_row_wise_tables_gets_its_batches_back():
    assert run_distributed(_passthrough, world_size=1, timeout_s=60) == [True]


def test_kjt_ids_finds_the_one_keyed_jagged_tensor_or_says_what_to_pass():
    dense, kjt, labels = _kjt_batch(0, 0)
    values, lengths = kjt_ids({"dense": dense, "sparse": kjt, "labels": labels})
    assert torch.equal(values, kjt.values()) and lengths.shape == (FIELDS, dense.shape[0])
    with pytest.raises(TypeError, match="holds 0 KeyedJaggedTensors; pass ids="):
        kjt_ids((dense, labels))
