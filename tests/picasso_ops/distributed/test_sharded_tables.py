"""Data-parallel and row-sharded packed tables on real gloo ranks against one process on the global batch."""
from __future__ import annotations

import pytest
import torch

from picasso_ops.distributed import DataParallelEmbeddingCollection, RowShardedEmbeddingCollection, shard_rows
from picasso_ops.distributed.comm import coalesce_rows, pack_rows, unpack_rows
from picasso_ops.embedding import PackedEmbeddingCollection, TableSpec
from picasso_ops.jagged import JaggedBatch
from sparse_scale.multiproc import run_distributed

KEYS = ("f0", "f1", "f2", "f3", "f4")
OPTIMIZERS = {
    "sgd": {"lr": 0.05},
    "rowwise_adagrad": {"lr": 0.1},
    "adam": {"lr": 0.01},
}


def _specs(optimizer: str) -> list[TableSpec]:
    params = OPTIMIZERS[optimizer]
    return [
        TableSpec("t0", 50, 8, "sum", optimizer, params, feature_names=("f0", "f1")),  # two fields share a table
        TableSpec("t1", 30, 8, "mean", optimizer, params, feature_names=("f2",)),
        TableSpec("t2", 3, 8, "sum", optimizer, params, feature_names=("f3",)),  # fewer rows than 4 ranks
        TableSpec("t3", 40, 4, "sum", optimizer, params, feature_names=("f4",)),  # a second pack
    ]


def _global_batch(step: int, batch: int, weighted: bool) -> JaggedBatch:
    g = torch.Generator().manual_seed(1000 + step)
    rows = torch.tensor([50, 50, 30, 3, 40])
    lengths = torch.randint(0, 4, (len(KEYS), batch), generator=g)
    lengths[:, 0] = 0  # an empty bag in every field
    per_id_rows = torch.repeat_interleave(rows, lengths.sum(1))
    # skewed ids so ranks share rows (the combine step must sum across ranks)
    values = (torch.rand(per_id_rows.numel(), generator=g).pow(3) * per_id_rows).long()
    weights = torch.rand(values.numel(), generator=g) + 0.5 if weighted else None
    return JaggedBatch(KEYS, values, lengths, weights)


def _slice(batch: JaggedBatch, rank: int, world: int) -> JaggedBatch:
    """Samples ``[rank * b, (rank + 1) * b)`` of a field-major batch."""
    B = batch.batch_size
    b = B // world
    offsets = batch.offsets.view(-1)
    parts, wparts = [], []
    for f in range(batch.num_fields):  # test helper: a loop over 5 fields is fine
        lo, hi = int(offsets[f * B + rank * b]), int(offsets[f * B + (rank + 1) * b])
        parts.append(batch.values[lo:hi])
        if batch.weights is not None:
            wparts.append(batch.weights[lo:hi])
    weights = torch.cat(wparts) if wparts else None
    return JaggedBatch(batch.keys, torch.cat(parts), batch.lengths[:, rank * b : (rank + 1) * b], weights)


def _loss(values: torch.Tensor, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(7 + step)
    target = torch.randn(values.shape[1], generator=g)
    return ((values * target).sum(1) - 0.3).pow(2).mean()  # mean over this process's samples


def _assert_close(name: str, got: dict, want: dict) -> None:
    """Weights to 1e-6 absolute; optimizer state (sums of squares, can be >> 1) to 1e-6 relative."""
    assert set(got) == set(want), (name, sorted(got), sorted(want))
    for key in want:
        rtol = 0.0 if key.endswith(".weight") else 1e-6
        torch.testing.assert_close(got[key].float(), want[key].float(), atol=1e-6, rtol=rtol, msg=f"{name}: {key}")


def _check_all(rank: int, world: int, steps: int = 4, batch: int = 8) -> dict:
    """Every optimizer, weighted and unweighted, DP and row-sharded, plain and accumulated steps."""
    report = {}
    for optimizer in OPTIMIZERS:
        for weighted in (False, True):
            torch.manual_seed(0)  # the reference (and so the initial weights) is the same on every rank
            # the reference on the torch kernels: the replicas' deferred update is torch arithmetic, and the C++
            # fused update agrees with it only to float rounding (up to ~1e-5 relative in Adam's momentum2)
            ref = PackedEmbeddingCollection(_specs(optimizer), custom_ops=False)
            init = {k: v.clone() for k, v in ref.state_dict().items()}
            torch.manual_seed(rank)  # different RNG per rank: replicas must agree by construction, not by luck
            dp = DataParallelEmbeddingCollection(_specs(optimizer))
            dp.load_state_dict(init)
            rw = RowShardedEmbeddingCollection(_specs(optimizer))
            rw.load_full_state_dict(init)
            # the shard holds exactly the rows id % world == rank
            assert rw.shard.table_weight("t0").shape[0] == shard_rows(50, rank, world)
            for step in range(steps):
                full = _global_batch(step, batch * world, weighted)
                local = _slice(full, rank, world)
                _loss(ref(full).values, step).backward()
                out_dp, out_rw = dp(local), rw(local)
                torch.testing.assert_close(out_rw.values, out_dp.values, atol=1e-6, rtol=1e-6)
                _loss(out_dp.values, step).backward()
                _loss(out_rw.values, step).backward()
                dp.sparse_step()
                rw.sparse_step()
            want = ref.state_dict()
            _assert_close(f"dp/{optimizer}/{weighted}", dp.state_dict(), want)
            _assert_close(f"rw/{optimizer}/{weighted}", rw.full_state_dict(), want)
            with torch.no_grad():  # eval lookups: sharded = replicated = reference on the local samples
                local = _slice(_global_batch(99, batch * world, weighted), rank, world)
                torch.testing.assert_close(rw(local).values, ref(local).values, atol=1e-6, rtol=1e-6)
            report[(optimizer, weighted)] = float(dp.table_weight("t0").sum())

    # gradient accumulation: two micro-batches per rank, loss / 2 each, one sparse step = one reference step
    torch.manual_seed(0)
    ref = PackedEmbeddingCollection(_specs("rowwise_adagrad"))
    ref.defer_updates = True
    init = {k: v.clone() for k, v in ref.state_dict().items()}
    dp = DataParallelEmbeddingCollection(_specs("rowwise_adagrad"))
    dp.load_state_dict(init)
    rw = RowShardedEmbeddingCollection(_specs("rowwise_adagrad"))
    rw.load_full_state_dict(init)
    for step in range(3):
        for micro in range(2):
            full = _global_batch(10 * step + micro, batch * world, False)
            (_loss(ref(full).values, step) / 2).backward()
            local = _slice(full, rank, world)
            (_loss(dp(local).values, step) / 2).backward()
            (_loss(rw(local).values, step) / 2).backward()
        ref.step()
        dp.sparse_step()
        rw.sparse_step()
    want = ref.state_dict()
    _assert_close("dp/accumulate", dp.state_dict(), want)
    _assert_close("rw/accumulate", rw.full_state_dict(), want)
    return report


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])  # 4 ranks: ~45 s on a busy box
def test_dp_and_row_sharded_match_one_process_on_the_global_batch(world):
    reports = run_distributed(_check_all, world, timeout_s=120)
    # replicas are bit-identical across ranks, not just close to the reference
    assert all(r == reports[0] for r in reports)


def test_single_process_collections_match_the_plain_collection():
    report = _check_all(0, 1, steps=3)
    assert len(report) == 2 * len(OPTIMIZERS)


def test_dp_broadcasts_tables_and_refuses_immediate_updates():
    dp = DataParallelEmbeddingCollection(_specs("sgd"))
    with pytest.raises(ValueError, match="always defers"):
        dp.defer_updates = False


def test_row_sharded_rejects_sequence_tables_and_bad_ids():
    with pytest.raises(ValueError, match="must be pooled"):
        RowShardedEmbeddingCollection([TableSpec("s", 10, 4, pooling="none")])
    rw = RowShardedEmbeddingCollection(_specs("sgd"))
    bad = JaggedBatch(KEYS, torch.tensor([0, 0, 0, 7, 0]), torch.ones(5, 1, dtype=torch.long))
    with pytest.raises(IndexError, match="'f3': id 7"):
        rw(bad)


def test_row_and_gradient_message_round_trips_exactly():
    rows = torch.tensor([2**40 + 3, 0, 17])
    grads = torch.randn(3, 5)
    back_rows, back_grads = unpack_rows(pack_rows(rows, grads), 5)
    assert back_rows.tolist() == rows.tolist() and torch.equal(back_grads, grads)
    r, g = coalesce_rows(torch.tensor([4, 1, 4]), torch.tensor([[1.0], [2.0], [3.0]]))
    assert r.tolist() == [1, 4] and g.view(-1).tolist() == [2.0, 4.0]


def test_collections_move_with_module_to_as_deepspeed_does():
    """DeepSpeed's engine calls module.to(device); the pack kernels' own _apply must not break that."""
    dp = DataParallelEmbeddingCollection(_specs("adam")).to("cpu").bfloat16()  # as DeepSpeed's bf16 mode does
    rw = RowShardedEmbeddingCollection(_specs("adam")).to(torch.device("cpu")).half()
    assert dp.table_weight("t0").dtype == torch.float32 and dp.kernels[0].state["momentum1"].dtype == torch.float32
    assert rw.table_weight("t0").dtype == torch.float32
    batch = _global_batch(0, 4, False)
    _loss(dp(batch).values, 0).backward()
    dp.sparse_step()
    assert rw(batch).values.shape == dp(batch).values.shape
