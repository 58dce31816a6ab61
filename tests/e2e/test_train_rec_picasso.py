"""train_rec.py with the picasso block's cache and interleave fields, on 1 and 2 gloo ranks.

* cache on vs off: bit-identical final tables, dense layers and AUC (the cache runs the packed tables' arithmetic);
* a checkpoint taken through the cache resumes to the straight run's weights, with or without the cache;
* interleave.micro_batches = 2 vs 1: equal up to float rounding (sums of partial sums, see InterleavedForward);
* interleave.prefetch_batches on vs off: bit-identical weights; a prefetched file stream resumes exactly;
* bad values name their key.
"""
from __future__ import annotations

import importlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from sparse_scale.multiproc import run_distributed

ROOT = Path(__file__).resolve().parents[2]
# 26 fields of 200 rows: each cached module packs 5200 rows; a 32-sample batch looks up ~830 of them, a half ~500
SMALL = ["--eval-samples", "1024", "--vocab", "200", "--threads", "1"]


def _train_rec():
    return importlib.import_module("launch.train_rec")


def _run(rank: int, world_size: int, argv: list[str]) -> dict:
    """Run train_rec; return its summary and the final model state (numpy, packed-collection keys either way)."""
    import os

    os.environ["WANDB_MODE"] = "offline"
    train_rec = _train_rec()
    built = {}
    original = train_rec.build_model

    def build_model(job):
        built["model"] = original(job)
        return built["model"]

    from sparse_scale.rec import data

    original_prefetched = data.prefetched

    def prefetched(stream, depth, rank):  # the training stream train_rec reads, and the source below a prefetcher
        built["source"], built["stream"] = stream, original_prefetched(stream, depth, rank)
        return built["stream"]

    import logging

    warned: list[str] = []  # the entry point's warnings (a prefetching job must not be told it gave no data)
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warned.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("sparse_scale.entry").addHandler(handler)
    train_rec.build_model = build_model
    data.prefetched = prefetched
    try:
        summary = train_rec.train(train_rec.parse_args(argv))
    finally:
        train_rec.build_model = original
        data.prefetched = original_prefetched
        logging.getLogger("sparse_scale.entry").removeHandler(handler)
    state = {k: v.detach().numpy().copy() for k, v in built["model"].state_dict().items()}
    keep = ("auc", "log_loss", "steps", "samples", "checkpoint", "picasso")
    stream = built["stream"]
    data = {"prefetched": type(stream).__name__ == "Prefetcher", "state": stream.state(),
            "source_state": built["source"].state(), "consumed": getattr(stream, "consumed", None),
            "thread_alive": stream._thread.is_alive() if hasattr(stream, "_thread") else None}
    return {"summary": {k: summary.get(k) for k in keep}, "state": state, "data": data, "warned": warned}


def _config(path: Path, picasso: dict, **overrides) -> str:
    cfg = json.loads((ROOT / "ds_configs" / "demo_cpu.json").read_text())
    # a fixed schedule: "auto" follows --steps, which differs between the halves of a resumed run
    cfg["scheduler"]["params"].update(total_num_steps=6, warmup_num_steps=2)
    cfg.update(train_micro_batch_size_per_gpu=32, wandb={"enabled": False}, picasso=picasso, **overrides)
    path.mkdir(parents=True, exist_ok=True)
    (path / "cfg.json").write_text(json.dumps(cfg))
    return str(path / "cfg.json")


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), set(a) ^ set(b)
    return max(float(np.abs(a[k].astype(np.float64) - b[k].astype(np.float64)).max()) if a[k].size else 0.0
               for k in a)


BLOCK = {"packing": True, "embedding_dim": 8, "optimizer": {"type": "rowwise_adagrad", "lr": 0.05}}


@pytest.mark.slow
def test_cache_on_and_off_give_identical_weights_on_two_ranks(tmp_path):
    """mmap store, a cache of 1200 of 5200 rows (it churns), gradient accumulation 2."""
    runs = {}
    for name, extra in (("off", {}), ("on", {"cache": {"rows": 1200, "policy": "lfu", "store": "mmap"}})):
        cfg = _config(tmp_path / name, {**BLOCK, **extra}, gradient_accumulation_steps=2)
        runs[name] = run_distributed(_run, 2, args=([*SMALL, "--steps", "4", "--config", cfg,
                                                      "--out", str(tmp_path / f"out_{name}")],),
                                     timeout_s=55, init_process_group=False)
    off, on = runs["off"], runs["on"]
    assert _max_diff(on[0]["state"], on[1]["state"]) == 0.0  # replicas stay identical
    assert any(k.startswith("embeddings.collection.emb") for k in on[0]["state"])  # the tables are compared too
    assert _max_diff(on[0]["state"], off[0]["state"]) == 0.0  # bit for bit: the packed tables' arithmetic
    assert on[0]["summary"]["auc"] == pytest.approx(off[0]["summary"]["auc"], abs=1e-6)
    assert on[0]["summary"]["log_loss"] == pytest.approx(off[0]["summary"]["log_loss"], abs=1e-6)
    stats = on[0]["summary"]["picasso"]
    assert 0.0 < stats["cache_hit_rate"] < 1.0
    assert stats["cache"]["embeddings"]["evictions"] > 0 and stats["cache"]["wide"]["writebacks"] > 0
    assert "cache_hit_rate" not in off[0]["summary"]["picasso"]
    assert (tmp_path / "out_on" / "picasso_cache" / "rank1" / "embeddings.rows").is_file()


@pytest.mark.slow
def test_cache_checkpoint_resume_equals_straight_run(tmp_path):
    """One rank, lazy Adam (element state, a step count): 6 steps vs 3 + 3 resumed, with and without the cache."""
    block = {**BLOCK, "optimizer": {"type": "adam", "lr": 0.01},
             "cache": {"rows": 1000, "policy": "lru", "store": "memory"}}
    cfg = _config(tmp_path / "cfg", block)
    plain_cfg = _config(tmp_path / "plain", {k: v for k, v in block.items() if k != "cache"})

    def run(config, out, steps, *extra):
        argv = [*SMALL, "--steps", str(steps), "--config", config, "--out", str(tmp_path / out), "--save-every", "2",
                *extra]
        return run_distributed(_run, 1, args=(argv,), timeout_s=55, init_process_group=False)[0]

    straight = run(cfg, "straight", 6)
    run(cfg, "half", 3)
    shutil.copytree(tmp_path / "half", tmp_path / "half_plain")  # the same step-3 checkpoint, resumed below without
    resumed = run(cfg, "half", 6, "--resume")
    assert resumed["summary"]["steps"] == 6 and resumed["summary"]["samples"] == straight["summary"]["samples"]
    assert _max_diff(resumed["state"], straight["state"]) == 0.0
    assert resumed["summary"]["auc"] == pytest.approx(straight["summary"]["auc"], abs=1e-6)
    assert resumed["summary"]["log_loss"] == pytest.approx(straight["summary"]["log_loss"], abs=1e-6)
    # the checkpoint has the packed collection's layout: it resumes without the cache to the same weights
    without = run(plain_cfg, "half_plain", 6, "--resume")
    assert _max_diff(without["state"], straight["state"]) == 0.0


@pytest.mark.slow
def test_interleave_two_micro_batches_agrees_with_one(tmp_path):
    """K = 2 (with the cache and its prefetch) vs K = 1 without, 2 ranks: equal up to float rounding."""
    runs = {}
    for name, extra in (("k1", {}), ("k2", {"interleave": {"micro_batches": 2},
                                            "cache": {"rows": 800, "policy": "lfu", "prefetch": True}})):
        cfg = _config(tmp_path / name, {**BLOCK, **extra})
        runs[name] = run_distributed(_run, 2, args=([*SMALL, "--steps", "5", "--config", cfg,
                                                      "--out", str(tmp_path / f"out_{name}")],),
                                     timeout_s=55, init_process_group=False)
    k1, k2 = runs["k1"], runs["k2"]
    assert _max_diff(k2[0]["state"], k2[1]["state"]) == 0.0
    # not bitwise: the dense gradient is a sum of 2 partial matmuls, each row's sparse gradient of 2 partial sums
    assert _max_diff(k2[0]["state"], k1[0]["state"]) < 1e-5
    assert k2[0]["summary"]["auc"] == pytest.approx(k1[0]["summary"]["auc"], abs=1e-4)
    assert k2[0]["summary"]["log_loss"] == pytest.approx(k1[0]["summary"]["log_loss"], abs=1e-6)
    stats = k2[0]["summary"]["picasso"]
    assert stats["interleave_micro_batches"] == 2 and stats["cache"]["embeddings"]["prefetched"] > 0


@pytest.mark.slow
def test_prefetch_on_and_off_give_identical_weights(tmp_path):
    """Synthetic data, 2 ranks, gradient accumulation 2, 4 steps: batches read 3 ahead on a thread vs none."""
    runs = {}
    for name, depth in (("off", 0), ("on", 3)):
        cfg = _config(tmp_path / name, {**BLOCK, "interleave": {"prefetch_batches": depth}},
                      gradient_accumulation_steps=2)
        runs[name] = run_distributed(_run, 2, args=([*SMALL, "--steps", "4", "--config", cfg,
                                                      "--out", str(tmp_path / f"out_{name}")],),
                                     timeout_s=55, init_process_group=False)
    off, on = runs["off"], runs["on"]
    assert not off[0]["data"]["prefetched"] and on[0]["data"]["prefetched"] and on[1]["data"]["prefetched"]
    assert not [m for r in on for m in r["warned"] if "training_data" in m], on[0]["warned"]  # it reads ahead itself
    for rank in (0, 1):
        d = on[rank]["data"]
        # 8 micro-batches consumed; the checkpointed position is theirs (rank r took global batches r, r+2, ...)
        assert d["consumed"] == 8 and d["state"]["next_batch"] == 16 == off[rank]["data"]["state"]["next_batch"]
        assert d["thread_alive"] is False  # closed at the end of the training loop
    assert _max_diff(on[0]["state"], off[0]["state"]) == 0.0
    assert _max_diff(on[1]["state"], off[1]["state"]) == 0.0
    assert on[0]["summary"]["auc"] == off[0]["summary"]["auc"]
    assert on[0]["summary"]["samples"] == off[0]["summary"]["samples"] == 4 * 2 * 32 * 2


@pytest.mark.slow
def test_prefetched_file_stream_resumes_exactly(tmp_path):
    """Criteo TSV with bad rows, 2 ranks: stop after 4 steps with prefetch on, resume with it on, vs a straight run
    without it. The checkpoint must hold the rows consumed, not the ones read ahead, or the resumed run skips rows."""
    from tests.e2e.test_train_rec import _write_criteo

    train = _write_criteo(tmp_path / "train.tsv", 900, seed=0, bad_every=150)
    evalf = _write_criteo(tmp_path / "eval.tsv", 300, seed=1)
    base = ["--data", "criteo", "--train-files", str(train), "--eval-files", str(evalf), "--vocab", "64",
            "--threads", "1", "--max-bad-fraction", "0.05"]
    off = _config(tmp_path / "off", {**BLOCK, "interleave": {"prefetch_batches": 0}})
    on = _config(tmp_path / "on", {**BLOCK, "interleave": {"prefetch_batches": 2}})

    def run(config, out, steps, *extra):
        argv = [*base, "--steps", str(steps), "--config", config, "--out", str(tmp_path / out), *extra]
        return run_distributed(_run, 2, args=(argv,), timeout_s=55, init_process_group=False)

    # until the data runs out. Rows are dealt round-robin and the 6 bad rows (149, 299, ...) are all rank 1's:
    # rank 0 has 450 good rows (15 batches of 32, the last of 2), rank 1 444 (14, the last of 28); all ranks
    # stop when rank 1's ends: 14 steps, 14 * 32 + 444 = 892 samples
    straight = run(off, "straight", 100)
    assert straight[0]["summary"]["steps"] == 14 and straight[0]["summary"]["samples"] == 892
    half = run(on, "half", 4)
    for rank in (0, 1):
        d = half[rank]["data"]
        assert d["prefetched"] and d["consumed"] == 4
        # the reader itself was ahead when the checkpoint was written; the prefetcher's state was not
        assert d["source_state"]["next_row"] > d["state"]["next_row"]
        assert d["state"]["epoch"] == 0 and d["state"]["taken"] == 0  # epoch 0 in file order (--epochs 1)
    resumed = run(on, "half", 100, "--resume")
    assert resumed[0]["summary"]["steps"] == 14 and resumed[0]["summary"]["samples"] == 892
    assert _max_diff(resumed[0]["state"], straight[0]["state"]) == 0.0
    assert resumed[0]["summary"]["log_loss"] == straight[0]["summary"]["log_loss"]
    end = [resumed[r]["data"]["state"] for r in (0, 1)]
    assert [e["next_row"] for e in end] == [straight[r]["data"]["state"]["next_row"] for r in (0, 1)]
    # rank 1 read on from the consumed position to the end of the data, no row skipped
    assert end[1] == {"epoch": 1, "next_row": 0, "window": 0, "taken": 0}  # past the end of the one epoch


def _build(tmp_path, block: dict):
    """RecJob + build_model in this process (no ranks needed to build)."""
    from sparse_scale.rec.cli import job_config
    from sparse_scale.rec.job import RecJob
    from sparse_scale.rec.model import build_model

    cfg = _config(tmp_path, block)
    args = _train_rec().parse_args([*SMALL, "--config", cfg, "--out", str(tmp_path / "out")])
    return build_model(RecJob.build(job_config(args), 0, 1))


@pytest.mark.parametrize("extra,key", [
    ({"cache": {"rows": 6000}}, r"picasso\.cache\.rows = 6000 is larger than the table it caches.*5200 rows"),
    ({"cache": {"rows": 100, "store": "ps"}}, r'picasso\.cache\.store = "ps".*gba'),
    ({"cache": {"rows": 100}, "sharding": "row_wise"}, r"picasso\.cache with picasso\.sharding"),
])
def test_bad_cache_values_name_the_key(tmp_path, extra, key):
    from sparse_scale.rec.config import RecJobError

    with pytest.raises(RecJobError, match=key) as err:
        _build(tmp_path, {**BLOCK, **extra})
    assert "cfg.json" in str(err.value)  # and the file


def test_cache_too_small_for_a_batch_names_the_key(tmp_path):
    import torch

    from picasso_ops.data import SyntheticConfig, SyntheticCTRStream

    model = _build(tmp_path, {**BLOCK, "cache": {"rows": 50}})
    batch = next(iter(SyntheticCTRStream(SyntheticConfig(num_fields=26, vocab_sizes=200, num_dense=13), 32)))
    with pytest.raises(ValueError, match=r"picasso\.cache\.rows = 50 is too small: one lookup needed \d+ distinct"):
        model(batch.dense, batch.values, batch.lengths)
    with torch.no_grad():  # evaluation reads around the cache: any batch size works
        assert model.eval()(batch.dense, batch.values, batch.lengths).shape == (32,)


# ---------------------------------------------------------------- the library pieces, in one process
def _packed(optimizer: str):
    import torch

    from picasso_ops.models import SparseArgs, WideAndDeepArgs, packed_wide_and_deep

    torch.manual_seed(0)
    return packed_wide_and_deep(WideAndDeepArgs(vocab_sizes=[300] * 26, num_dense=4, embedding_dim=8, hidden=(32, 16)),
                                SparseArgs(optimizer=optimizer, optimizer_params={"lr": 0.1}))


def _steps(model, batches, gas: int) -> dict:
    import torch
    import torch.nn.functional as F

    from picasso_ops.distributed import sparse_step

    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for i, b in enumerate(batches):
        (F.binary_cross_entropy_with_logits(model(b.dense, b.values, b.lengths), b.labels) / gas).backward()
        if (i + 1) % gas == 0:
            opt.step()
            opt.zero_grad()
            sparse_step(model)  # waits for an InterleavedForward's queued embedding backwards first
    return {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad", "adam"])
def test_cached_and_interleaved_models_match_the_packed_one(tmp_path, optimizer):
    import copy

    from picasso_ops.block import apply_picasso_block, picasso_summary
    from picasso_ops.config import PicassoConfig
    from picasso_ops.data import SyntheticConfig, SyntheticCTRStream

    batches = list(SyntheticCTRStream(SyntheticConfig(num_fields=26, vocab_sizes=300, num_dense=4, seed=7), 64,
                                      num_batches=8))
    ref = _steps(_packed(optimizer), batches, gas=2)
    for block, exact in (({"cache": {"rows": 2000, "store": "mmap", "policy": "lru"}}, True),
                         ({"interleave": {"micro_batches": 3}}, False),
                         ({"cache": {"rows": 1000}, "interleave": {"micro_batches": 2}}, False)):
        model = apply_picasso_block(_packed(optimizer), PicassoConfig.model_validate(block), workdir=tmp_path)
        got = _steps(model, batches, gas=2)
        diff = _max_diff(got, ref)
        assert diff == 0.0 if exact else diff < 1e-4, (block, diff)  # adam: ~1e-5, sgd/adagrad: ~1e-7
        summary = picasso_summary(model)
        if "cache" in block:
            assert summary["cache"]["embeddings"]["evictions"] > 0
            assert (summary["cache"]["embeddings"]["prefetched"] > 0) == ("interleave" in block)
        twin = copy.deepcopy(model)  # what train_rec's --straggler calibration does
        assert _max_diff({k: v.numpy() for k, v in twin.state_dict().items()}, got) == 0.0
        for m in (model, twin):
            for sub in m.modules():
                if callable(getattr(sub, "close", None)):
                    sub.close()  # cache I/O threads, mmap files, stage threads


def test_interleaved_sparse_backward_failure_names_the_stage():
    import torch
    import torch.nn.functional as F

    from picasso_ops.data import SyntheticConfig, SyntheticCTRStream
    from picasso_ops.distributed import sparse_step
    from picasso_ops.interleave import InterleavedForward, StageError

    model = InterleavedForward(_packed("sgd"), 2, timeout_s=30)
    batch = next(iter(SyntheticCTRStream(SyntheticConfig(num_fields=26, vocab_sizes=300, num_dense=4), 16)))
    kernel = model.embeddings.collection.kernels[0]

    def broken(*args, **kwargs):
        raise RuntimeError("disk on fire")

    kernel.backward_update = broken
    F.binary_cross_entropy_with_logits(model(batch.dense, batch.values, batch.lengths), batch.labels).backward()
    with pytest.raises(StageError, match=r"stage 'sparse' failed on micro-batch \d of step 0: RuntimeError: disk on"):
        sparse_step(model)
    with torch.no_grad():  # evaluation runs the wrapped model directly
        assert model.eval()(batch.dense, batch.values, batch.lengths).shape == (16,)
    model.close()


@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad", "adam"])
def test_cache_built_straight_into_the_store_equals_the_converted_packed_model(tmp_path, optimizer):
    """cached_field_embeddings (no packed tables ever built) = packed tables + apply_picasso_block, bit for bit."""
    import torch

    from picasso_ops.block import apply_picasso_block, cached_field_embeddings
    from picasso_ops.cache import CachedFieldEmbeddings
    from picasso_ops.config import PicassoConfig
    from picasso_ops.data import SyntheticConfig, SyntheticCTRStream
    from picasso_ops.distributed.data_parallel import DataParallelEmbeddingCollection
    from picasso_ops.models import SparseArgs, WideAndDeepArgs, packed_wide_and_deep

    block = PicassoConfig.model_validate({"cache": {"rows": 2000, "store": "mmap", "policy": "lfu"}})
    args = WideAndDeepArgs(vocab_sizes=[300] * 26, num_dense=4, embedding_dim=8, hidden=(32, 16))
    sparse = SparseArgs(optimizer=optimizer, optimizer_params={"lr": 0.1})
    converted = apply_picasso_block(_packed(optimizer), block, workdir=tmp_path / "a")
    torch.manual_seed(0)
    direct = packed_wide_and_deep(args, sparse, field_embeddings=cached_field_embeddings(block, workdir=tmp_path / "b"))
    direct = apply_picasso_block(direct, block, workdir=tmp_path / "b")  # keeps the built caches
    assert not any(isinstance(m, DataParallelEmbeddingCollection) for m in direct.modules())
    assert isinstance(direct.embeddings, CachedFieldEmbeddings) and isinstance(direct.wide, CachedFieldEmbeddings)
    start = {k: v.detach().numpy().copy() for k, v in converted.state_dict().items()}
    assert _max_diff({k: v.detach().numpy().copy() for k, v in direct.state_dict().items()}, start) == 0.0
    batches = list(SyntheticCTRStream(SyntheticConfig(num_fields=26, vocab_sizes=300, num_dense=4, seed=7), 64,
                                      num_batches=6))
    assert _max_diff(_steps(direct, batches, gas=2), _steps(converted, batches, gas=2)) == 0.0
    # rows initialised in chunks (7 rows: tables split mid-way) draw the same values as one fill per table
    torch.manual_seed(3)
    chunked = CachedFieldEmbeddings.from_init([50, 23, 40], 4, "sum", sparse, None, "t", capacity=20, chunk_rows=7)
    torch.manual_seed(3)
    whole = CachedFieldEmbeddings.from_init([50, 23, 40], 4, "sum", sparse, None, "t", capacity=20)
    assert _max_diff({k: v.numpy() for k, v in chunked.state_dict().items()},
                     {k: v.numpy() for k, v in whole.state_dict().items()}) == 0.0
    for m in (converted, direct):
        for sub in m.modules():
            if callable(getattr(sub, "close", None)):
                sub.close()


@pytest.mark.slow
def test_dlrm_with_the_picasso_block_cache_and_interleave_on_two_ranks(tmp_path):
    """--model dlrm: cache on = off bit for bit, interleaving 2 micro-batches = 1 up to rounding; plain DLRM trains."""
    runs = {}
    cache = {"cache": {"rows": 1200, "policy": "lfu", "store": "mmap"}}
    for name, extra in (("off", {}), ("on", cache), ("inter", {**cache, "interleave": {"micro_batches": 2}})):
        cfg = _config(tmp_path / name, {**BLOCK, **extra})
        runs[name] = run_distributed(_run, 2, args=([*SMALL, "--model", "dlrm", "--steps", "3", "--config", cfg,
                                                      "--out", str(tmp_path / f"out_{name}")],),
                                     timeout_s=55, init_process_group=False)
    off, on, inter = (runs[n][0] for n in ("off", "on", "inter"))
    assert not any(k.startswith("interaction") for k in off["state"])  # its index buffers are not state
    assert any(k.startswith("embeddings.collection.emb") for k in on["state"])  # the tables are compared too
    assert _max_diff(on["state"], off["state"]) == 0.0
    assert _max_diff(inter["state"], off["state"]) < 1e-5
    assert _max_diff(runs["inter"][0]["state"], runs["inter"][1]["state"]) == 0.0
    assert 0.0 < on["summary"]["picasso"]["cache_hit_rate"] < 1.0
    plain_cfg = json.loads(Path(_config(tmp_path / "plain", {})).read_text())
    del plain_cfg["picasso"]
    (tmp_path / "plain" / "cfg.json").write_text(json.dumps(plain_cfg))
    plain = run_distributed(_run, 1, args=([*SMALL, "--model", "dlrm", "--steps", "3", "--config",
                                            str(tmp_path / "plain" / "cfg.json"), "--out", str(tmp_path / "out_plain")],),
                            timeout_s=55, init_process_group=False)[0]
    assert any(k.startswith("embeddings.bags.0") for k in plain["state"])  # one nn.EmbeddingBag per field
    assert 0.0 <= plain["summary"]["auc"] <= 1.0 and np.isfinite(plain["summary"]["log_loss"])
