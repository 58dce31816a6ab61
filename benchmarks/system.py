"""The whole system against what a user would pick instead, and the cache behind a slow link (issue 13 items 3, 6).

Section ``rivals``: our rec job against torchrec at several shapes (default F=26 x 100,000, F=200 x
10,000 and F=1,000 x 1,000 rows, ``--shapes``), every variant of :data:`RIVAL_VARIANTS` (torchrec
table-wise, column-wise and row-wise with ``TrainPipelineSparseDist``; ours with the planner's
choice, ``picasso.sharding: "auto"``, and with data-parallel tables) run ``--reps`` times,
alternated (A B C ... A B C ...); the table gives medians and ranges, each of ours against the
fastest torchrec sharding of its shape (paired by repetition), and the AUC of every run. The
model, stream, initialisation and optimizers are those of the section ``stragglers`` below.

Section ``waits``: the same alternated plan over our job alone (:data:`WAIT_VARIANTS`): DeepSpeed's
ZeRO stage, ``overlap_comm``, ``contiguous_gradients`` and bucket sizes for the dense all-reduce,
and the data stream read ahead on a thread (``picasso.interleave.prefetch_batches``), each against
the rivals' setting (ZeRO 0, no prefetch).

Section ``stragglers`` (was ``rivals``): on one synthetic stream (``picasso_ops.data.synthetic``, planted teacher, one
seed), one model shape (DLRM: bottom 13-64-16, dot interactions, top 367-128-64-1; F fields of
``vocab`` x 16 rows, sum pooling, 1-3 ids per field) and one optimizer pair (tables: row-wise
Adagrad at ``--table-lr``; dense layers: AdamW at ``--dense-lr``, no schedule, no clipping), 2
ranks over gloo, 1 torch thread each:

* ``torchrec <sharding>``: torchrec's ``DistributedModelParallel`` over an ``EmbeddingBagCollection``
  (fused ``EXACT_ROWWISE_ADAGRAD`` kernel; data-parallel tables are dense parameters under AdamW:
  torchrec has no fused kernel for them), driven by ``TrainPipelineSparseDist``, dense AdamW
  through ``KeyedOptimizerWrapper``; one run per sharding type the planner is pinned to.
* ``deepspeed per-field``: ``launch/train_rec.py`` without a picasso block: one ``nn.EmbeddingBag``
  per field, every parameter (tables too: DeepSpeed has no row-wise optimizer) under DeepSpeed's AdamW.
* ``ours packed``: ``launch/train_rec.py`` with a packing-only picasso block (fused row-wise Adagrad).
* ``ours packed, gba <mode>``: the same with a gba block (packed tables on the parameter server,
  2 workers + 1 server), once the rec job accepts the combination; until then the row says why not.

Each runs without a straggler and with rank 1 four times slower: train_rec's ``--straggler 1:4``
(sleeps 3 x its median forward+backward time of the first 3 steps before each backward); torchrec's
rank 1 sleeps 3 x its median pipeline step of steps 1-3 before each later step. samples/s is the
job's training samples over the training loop's wall time (data generation included everywhere);
AUC is exact over the same held-out set (torchrec's model is scored on it the same way).

Section ``cache``: 2 workers + 1 server, F fields, packed tables on the server (picasso + gba blocks,
sync mode), the picasso cache (``store: "ps"``) at 10% of the rows against no cache, at one-way link latencies of 0, 0.5
and 2 ms (train_rec's ``--ps-link-latency-ms``); samples/s, AUC and bytes moved of each.

Section ``profile``: where train_rec's step goes (``--profile-variant``, one of ours; 2 ranks): each rank under
``py-spy record --idle`` (waits in collectives count), the samples inside ``train_loop`` split by
:data:`STEP_PARTS` (data generation, the table kernels and their exchange, DeepSpeed's engine, the
dense all-reduce, the loop itself). py-spy is not a dependency: ``pip install --target /tmp/pyspy
py-spy`` and pass ``--py-spy /tmp/pyspy/bin/py-spy``.

Run::

    .venv/bin/python benchmarks/system.py                      # rivals and cache, writes RESULTS.md
    .venv/bin/python benchmarks/system.py --sections rivals --reps 3    # three shapes, alternated
    .venv/bin/python benchmarks/system.py --sections rivals --shapes 200x10000:100 --only "torchrec table_wise" "ours auto"
    .venv/bin/python benchmarks/system.py --sections profile --py-spy /tmp/pyspy/bin/py-spy
    .venv/bin/python benchmarks/system.py --quick --sections rivals   # a minute, tiny shapes, prints only
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import os
import platform
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator, Sequence

ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).resolve().parent / "RESULTS.md"
RIVALS_SECTION = "## One system against torchrec and plain DeepSpeed (issue 13 item 6)"
PROFILE_SECTION = "## Where train_rec's step goes (issue 13 item 6)"
PROFILE_SECTION_29 = "## Where train_rec's step goes, rerun for the sharded and pipelined step (issue 29)"
CACHE_SECTION = "## The cache in front of the parameter servers behind a slow link (issue 13 item 3)"
TORCHREC_SHARDINGS = ("row_wise", "table_wise", "column_wise", "data_parallel")
SLOW_VARIANTS = ("torchrec data_parallel", "deepspeed per-field")  # dense 100k-row tables: run fewer steps
LINK_LATENCIES_MS = (0.0, 0.5, 2.0)
STRAGGLER_RANK, STRAGGLER_FACTOR = 1, 4.0
RUN_TIMEOUT_S = 1800.0

logger = logging.getLogger("benchmarks.system")


@dataclasses.dataclass(frozen=True)
class Shape:
    """What every variant of a section trains: data, model shape, optimizers, steps."""

    fields: int = 26
    vocab: int = 100_000
    dim: int = 16
    micro_batch: int = 256  # per rank
    steps: int = 600
    slow_steps: int = 60  # SLOW_VARIANTS: tables as dense parameters (seconds per step)
    eval_samples: int = 131_072  # a multiple of 2 x micro_batch: both ranks score the same number of batches
    seed: int = 1234
    table_lr: float = 0.05
    dense_lr: float = 0.001


def synthetic_config(shape: Shape) -> Any:
    """The stream train_rec builds from ``--fields/--vocab/--seed`` (its defaults: Zipf 1.1, 1-3 ids, 13 dense)."""
    from picasso_ops.data.synthetic import SyntheticConfig

    return SyntheticConfig(num_fields=shape.fields, vocab_sizes=shape.vocab, zipf_exponent=1.1,
                           max_ids_per_field=3, num_dense=13, seed=shape.seed)


# --------------------------------------------------------------------------------------------- torchrec


def _torchrec_batch(batch: Any, keys: list[str]) -> Any:
    """A CTRBatch as torchrec's ``Batch``: lengths ``[F, B]`` are already a KJT's key-major order."""
    from torchrec.datasets.utils import Batch
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    kjt = KeyedJaggedTensor(keys=keys, values=batch.values, lengths=batch.lengths.reshape(-1).to(batch.values.dtype))
    return Batch(dense_features=batch.dense, sparse_features=kjt, labels=batch.labels)


def _delayed(batches: Iterator[Any], sleep_s: list[float]) -> Iterator[Any]:
    """``batches``, sleeping ``sleep_s[0]`` before each one (the straggler's injected delay, set after calibration)."""
    for b in batches:
        if sleep_s[0] > 0:
            time.sleep(sleep_s[0])
        yield b


def torchrec_rank(rank: int, world_size: int, shape: Shape, sharding: str, steps: int,
                  straggler: bool) -> dict[str, Any]:
    """Train torchrec's DLRM on this rank (``run_distributed`` started gloo); its samples/s and the scores."""
    import itertools

    import torch
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
    from torchrec.distributed.train_pipeline import TrainPipelineSparseDist
    from torchrec.distributed.types import ShardingEnv
    from torchrec.models.dlrm import DLRM, DLRMTrain
    from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
    from torchrec.modules.embedding_modules import EmbeddingBagCollection
    from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    from picasso_ops.data.synthetic import SyntheticCTRStream

    t_setup = time.perf_counter()
    torch.manual_seed(shape.seed)
    keys = [f"f{i}" for i in range(shape.fields)]
    tables = [EmbeddingBagConfig(num_embeddings=shape.vocab, embedding_dim=shape.dim, name=f"t{i}",
                                 feature_names=[k], pooling=PoolingType.SUM,
                                 init_fn=lambda w: torch.nn.init.normal_(w, std=0.01))  # train_rec's init
              for i, k in enumerate(keys)]
    ebc = EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
    net = DLRMTrain(DLRM(embedding_bag_collection=ebc, dense_in_features=13, dense_arch_layer_sizes=[64, shape.dim],
                         over_arch_layer_sizes=[128, 64, 1]))
    fused = {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": shape.table_lr, "eps": 1e-8}
    sharder = _sharder(EmbeddingBagCollectionSharder, fused, sharding)
    kernel = "dense" if sharding == "data_parallel" else "fused"
    constraints = {t.name: ParameterConstraints(sharding_types=[sharding], compute_kernels=[kernel]) for t in tables}
    env = ShardingEnv.from_process_group(torch.distributed.group.WORLD)
    planner = EmbeddingShardingPlanner(topology=Topology(world_size=world_size, compute_device="cpu"),
                                       constraints=constraints)
    plan = planner.collective_plan(net, [sharder], torch.distributed.group.WORLD)
    model = DistributedModelParallel(module=net, device=torch.device("cpu"), env=env, plan=plan, sharders=[sharder])
    dense = KeyedOptimizerWrapper(dict(in_backward_optimizer_filter(model.named_parameters())),
                                  lambda params: torch.optim.AdamW(params, lr=shape.dense_lr, weight_decay=0.0))
    optimizer = CombinedOptimizer([model.fused_optimizer, dense])
    pipeline = TrainPipelineSparseDist(model, optimizer, torch.device("cpu"))

    cfg = synthetic_config(shape)
    train = SyntheticCTRStream(cfg, shape.micro_batch, rank=rank, world_size=world_size, split="train")
    sleep_s = [0.0]
    batches = _delayed((_torchrec_batch(b, keys) for b in itertools.islice(train, steps)), sleep_s)
    step_times: list[float] = []
    model.train()
    t0 = time.perf_counter()
    setup_s = t0 - t_setup
    for step in range(steps):
        ts = time.perf_counter()
        try:
            pipeline.progress(batches)
        except StopIteration:
            break
        step_times.append(time.perf_counter() - ts)
        if straggler and rank == STRAGGLER_RANK and step == 3:  # calibrated on steps 1-3 (step 0 fills the pipe)
            sleep_s[0] = (STRAGGLER_FACTOR - 1.0) * statistics.median(step_times[1:4])
    train_s = time.perf_counter() - t0
    scores, labels = _torchrec_scores(pipeline.detach(), cfg, shape, rank, world_size, keys)
    return {"samples": len(step_times) * shape.micro_batch, "train_s": train_s, "scores": scores, "labels": labels,
            "delay_s": sleep_s[0], "setup_s": setup_s, "peak_rss_mb": peak_rss_mb()}


def peak_rss_mb() -> float:
    """This process's peak resident memory so far, MB (Linux reports ru_maxrss in KiB)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _sharder(base: type, fused: dict[str, Any], sharding: str) -> Any:
    """torchrec's EBC sharder; for ``row_wise`` one that also offers it on CPU (torchrec lists it for CUDA only)."""
    if sharding != "row_wise":
        return base(fused_params=fused)

    class CPURowWiseSharder(base):  # type: ignore[misc, valid-type]
        def sharding_types(self, compute_device_type: str) -> list[str]:
            return [*super().sharding_types(compute_device_type), "row_wise"]

    return CPURowWiseSharder(fused_params=fused)


def _torchrec_scores(model: Any, cfg: Any, shape: Shape, rank: int, world_size: int,
                     keys: list[str]) -> tuple[Any, Any]:
    """This rank's share of the held-out split scored by the sharded model (a collective: all ranks in step)."""
    import math

    import torch

    from picasso_ops.data.synthetic import SyntheticCTRStream

    held_out = SyntheticCTRStream(cfg, shape.micro_batch, rank=rank, world_size=world_size, split="eval",
                                  num_batches=math.ceil(shape.eval_samples / shape.micro_batch))
    model.eval()
    scores, labels = [], []
    with torch.no_grad():
        for b in held_out:
            _, (_, logits, y) = model(_torchrec_batch(b, keys))
            scores.append(torch.sigmoid(logits).float())
            labels.append(y.float())
    return torch.cat(scores), torch.cat(labels)


def run_torchrec(shape: Shape, sharding: str, steps: int, straggler: bool) -> dict[str, Any]:
    """One torchrec run on 2 gloo ranks: samples/s (the slowest rank's loop) and AUC over the whole held-out set."""
    import torch

    from picasso_ops.data.metrics import auc
    from sparse_scale.multiproc import run_distributed

    ranks = run_distributed(torchrec_rank, 2, args=(shape, sharding, steps, straggler), timeout_s=RUN_TIMEOUT_S)
    samples, slowest = sum(r["samples"] for r in ranks), max(r["train_s"] for r in ranks)
    scores, labels = torch.cat([r["scores"] for r in ranks]), torch.cat([r["labels"] for r in ranks])
    return {"samples": samples, "samples_per_s": samples / slowest, "auc": auc(scores, labels),
            "eval_samples": int(labels.numel()), "delay_s": max(r["delay_s"] for r in ranks),
            "setup_s": max(r["setup_s"] for r in ranks), "peak_rss_mb": max(r["peak_rss_mb"] for r in ranks)}


# --------------------------------------------------------------------------------------------- train_rec


def ds_config(shape: Shape, picasso: bool, gba: dict[str, Any] | None = None,
              cache_rows: int | None = None) -> dict[str, Any]:
    """train_rec's DeepSpeed JSON for this benchmark: AdamW at ``dense_lr``, no schedule, no clipping, wandb off."""
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": shape.micro_batch, "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": shape.dense_lr, "weight_decay": 0.0, "torch_adam": True}},
        "zero_optimization": {"stage": 0}, "gradient_clipping": 0.0, "steps_per_print": 1_000_000,
        "wandb": {"enabled": False},
    }
    if picasso:
        cfg["picasso"] = {"packing": True, "embedding_dim": shape.dim,
                          "optimizer": {"type": "rowwise_adagrad", "lr": shape.table_lr, "lr_schedule": "constant"}}
        if cache_rows is not None:
            cfg["picasso"]["cache"] = {"rows": cache_rows, "policy": "lfu", "store": "ps", "prefetch": True}
    if gba is not None:
        cfg["gba"] = gba
    return cfg


def train_rec_argv(config: Path, out: Path, shape: Shape, steps: int, straggler: bool,
                   extra: Sequence[str] = ()) -> list[str]:
    """train_rec's flags for one run of this benchmark."""
    argv = ["--config", str(config), "--out", str(out), "--model", "dlrm", "--fields", str(shape.fields),
            "--vocab", str(shape.vocab), "--embedding-dim", str(shape.dim), "--steps", str(steps),
            "--eval-samples", str(shape.eval_samples), "--seed", str(shape.seed), "--threads", "1", *extra]
    if straggler:
        argv += ["--straggler", f"{STRAGGLER_RANK}:{STRAGGLER_FACTOR:g}"]
    return argv


class _Capture(logging.Handler):
    """Keeps the messages of one logger (the sharding planner's plan, logged once on rank 0)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def train_rec_rank(rank: int, world_size: int, argv: list[str]) -> dict[str, Any]:
    """``train_rec.train`` on this rank (``run_distributed`` set the launcher's environment).

    The summary, with the planner's logged plan (``plan_log``, rank 0) and this rank's peak memory.
    """
    os.environ.setdefault("WANDB_MODE", "disabled")
    logging.getLogger("sparse_scale.rec.notice").setLevel(logging.WARNING)
    planner_log, capture = logging.getLogger("picasso_ops.distributed.planner"), _Capture()
    planner_log.setLevel(logging.INFO)
    planner_log.addHandler(capture)
    from sparse_scale.rec import cli

    summary = dict(cli.train(cli.parse_args(argv)))
    return summary | {"plan_log": capture.messages, "peak_rss_mb": peak_rss_mb()}


def run_train_rec(workdir: Path, name: str, cfg: dict[str, Any], shape: Shape, steps: int, straggler: bool,
                  world_size: int = 2, extra: Sequence[str] = ()) -> dict[str, Any]:
    """One train_rec job on ``world_size`` processes; rank 0's summary (the job's samples/s and exact AUC)."""
    from sparse_scale.multiproc import run_distributed

    slug = name.replace(" ", "_").replace(",", "")
    config = workdir / f"{slug}.json"
    config.write_text(json.dumps(cfg, indent=1))
    argv = train_rec_argv(config, workdir / slug, shape, steps, straggler, extra)
    started = time.time() - 1.0
    try:
        results = run_distributed(train_rec_rank, world_size, args=(argv,), timeout_s=RUN_TIMEOUT_S,
                                  init_process_group=False)
    finally:
        remove_leaked_shm(started)
    summary = results[0]
    return {"samples": summary["samples"], "samples_per_s": summary["samples_per_s"], "auc": summary["auc"],
            "eval_samples": int(summary["eval_samples"]), "bayes_auc": summary.get("bayes_auc"),
            "gba": summary.get("gba"), "picasso": summary.get("picasso"), "plan_log": summary.get("plan_log"),
            "peak_rss_mb": max(r.get("peak_rss_mb", 0.0) for r in results if r),
            "command": "launch/train_rec.py " + " ".join(a for a in argv)}


def remove_leaked_shm(since: float) -> None:
    """Remove DeepSpeed's CPU all-reduce buffers (66 MB of /dev/shm per rank) created since ``since`` and mapped
    by no process any more: DeepSpeed leaves them behind when its ranks exit, and many runs fill the tmpfs."""
    import glob

    paths = [p for p in glob.glob("/dev/shm/deepspeed_allreduce_buffer_*") if _mtime(p) >= since]
    if not paths:
        return
    mapped: set[str] = set()
    for maps in glob.glob("/proc/[0-9]*/maps"):
        try:
            mapped.update(ln.split(None, 5)[-1].strip() for ln in open(maps) if "deepspeed_allreduce_buffer_" in ln)
        except OSError:
            continue
    for path in paths:
        if path not in mapped:
            try:
                os.unlink(path)
            except OSError:
                pass


def _mtime(path: str) -> float:
    try:
        return os.stat(path).st_mtime
    except OSError:
        return -math.inf


def gba_refusal(shape: Shape, mode: str) -> str | None:
    """Why the rec job refuses packed tables under a gba block today (None: it accepts them)."""
    from sparse_scale.rec.combinations import refusals
    from sparse_scale.rec.config import RecJobConfig

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "probe.json"
        path.write_text(json.dumps(ds_config(shape, True, gba_block(mode))))
        found = refusals(RecJobConfig(config=str(path), model="dlrm", fields=shape.fields, vocab=shape.vocab))
    return str(found[0]).replace(str(path), "CONFIG") if found else None


def gba_block(mode: str) -> dict[str, Any]:
    """A gba block with one parameter server (ranks: 2 workers + 1 server)."""
    return {"mode": mode, "num_servers": 1}


# --------------------------------------------------------------------------------------------- sections


@dataclasses.dataclass
class Row:
    """One line of a section's table."""

    variant: str
    straggler: bool
    steps: int
    result: dict[str, Any] | None = None
    failed: str | None = None
    shape: str = ""  # "F x rows" of the run (sections that cover several shapes)
    rep: int = 0  # repetition of an alternated plan
    wall_s: float = math.nan  # the whole run: start of the ranks, setup, training, scoring

    @property
    def ok(self) -> bool:
        return self.result is not None


RENDEZVOUS_TIMEOUT = "DistStoreError: wait timeout"  # a rank that started too late on a loaded machine


def _attempt(row: Row, fn: Any, *args: Any, **kwargs: Any) -> Row:
    t0 = time.perf_counter()
    for attempt in range(2):  # one retry, only when the ranks did not meet in time (load, not the variant)
        try:
            row.result, row.failed = fn(*args, **kwargs), None
            break
        except Exception as exc:  # a variant that cannot run is a row of the table, not the end of the benchmark
            first = str(exc).strip().splitlines()
            tail = [ln for ln in first if "Error" in ln or "error" in ln][-1:] or first[-1:]
            row.failed = (tail[0] if tail else type(exc).__name__)[:300]
            if RENDEZVOUS_TIMEOUT not in row.failed:
                break
            print(f"{row.variant}: the ranks did not meet in time ({row.failed}); trying once more", flush=True)
    row.wall_s = time.perf_counter() - t0
    state = f"{row.result['samples_per_s']:,.0f} samples/s, AUC {row.result['auc']:.4f}" if row.ok else \
        f"failed: {row.failed}"
    where = f" [{row.shape}, rep {row.rep}]" if row.shape else ""
    print(f"{row.variant}{' (straggler)' if row.straggler else ''}{where}: {state} [{row.wall_s:.0f} s]", flush=True)
    return row


def stragglers(shape: Shape, workdir: Path, shardings: Sequence[str], with_straggler: bool,
               only: Sequence[str] = ()) -> list[Row]:
    """Section ``stragglers``: every variant once without, then (``with_straggler``) with the straggler.

    ``only``: run just the variants of these names (e.g. ``["ours packed, gba sync", "ours packed, gba auto"]``).
    """
    plan: list[tuple[Row, Any, tuple[Any, ...], dict[str, Any]]] = []
    for straggler in (False, True) if with_straggler else (False,):
        for sharding in shardings:
            name = f"torchrec {sharding}"
            steps = shape.slow_steps if name in SLOW_VARIANTS else shape.steps
            plan.append((Row(name, straggler, steps), run_torchrec, (shape, sharding, steps, straggler), {}))
        plan.append((Row("deepspeed per-field", straggler, shape.slow_steps), run_train_rec,
                     (workdir, f"deepspeed{int(straggler)}", ds_config(shape, False), shape, shape.slow_steps,
                      straggler), {}))
        plan.append((Row("ours packed", straggler, shape.steps), run_train_rec,
                     (workdir, f"ours{int(straggler)}", ds_config(shape, True), shape, shape.steps, straggler), {}))
        for mode in ("sync", "gba", "auto") if straggler else ("sync",):
            plan.append((Row(f"ours packed, gba {mode}", straggler, shape.steps), run_train_rec,
                         (workdir, f"gba_{mode}{int(straggler)}", ds_config(shape, True, gba_block(mode)), shape,
                          shape.steps, straggler), {"world_size": 3}))
    rows: list[Row] = []
    for row, fn, args, kwargs in plan:
        if only and row.variant not in only:
            continue
        mode = row.variant.rpartition("gba ")[2] if ", gba " in row.variant else None
        refused = gba_refusal(shape, mode) if mode else None
        if refused is not None:
            row.failed = f"not run: the rec job refuses it ({refused})"
            rows.append(row)
            continue
        rows.append(_attempt(row, fn, *args, **kwargs))
    return rows

# --------------------------------------------------------------------------------------------- alternated matrix

THREE_SHAPES_SECTION = "## Three shapes against torchrec, variants alternated (issue 29 item 4)"
WAITS_SECTION = "## The other waits of the rec job's step: dense all-reduce and data stream (issue 29 item 3)"
# "F x rows : steps : held-out samples" (held-out: a multiple of 2 x 256; DLRM's interactions grow as F^2)
RIVAL_SHAPES = ("26x100000:300:16384", "200x10000:20:4096", "1000x1000:5:1024")  # ~40 min on 2 shared cores
WAIT_SHAPES = ("26x100000:300:8192",)


@dataclasses.dataclass(frozen=True)
class Variant:
    """One column of an alternated plan: a torchrec sharding, or the rec job with overrides of its blocks."""

    name: str
    torchrec: str | None = None  # torchrec's sharding type (None: our rec job)
    picasso: dict[str, Any] = dataclasses.field(default_factory=dict)  # merged into the picasso block
    deepspeed: dict[str, Any] = dataclasses.field(default_factory=dict)  # merged into the DeepSpeed JSON


RIVAL_VARIANTS = (
    Variant("torchrec table_wise", torchrec="table_wise"),
    Variant("torchrec column_wise", torchrec="column_wise"),
    Variant("torchrec row_wise", torchrec="row_wise"),
    Variant("ours auto", picasso={"sharding": "auto"}),  # the planner's choice (picasso.pipeline's default)
    Variant("ours auto, pipeline all", picasso={"sharding": "auto", "pipeline": "all"}),  # data-parallel tables too
)
OPTIONAL_VARIANTS = (  # by name through --only
    Variant("ours data_parallel", picasso={"sharding": "data_parallel"}),  # = "ours auto" where the plan is all dp
    Variant("ours row_wise", picasso={"sharding": "row_wise"}),
    Variant("ours row_wise, pipeline off", picasso={"sharding": "row_wise", "pipeline": "off"}),
)
WAIT_VARIANTS = (
    Variant("ZeRO 0", deepspeed={"zero_optimization": {"stage": 0}}),  # the rivals' setting
    Variant("ZeRO 1", deepspeed={"zero_optimization": {"stage": 1}}),  # ds_configs/rec_*_cpu.json
    Variant("ZeRO 1, overlap_comm, 20k buckets", deepspeed={"zero_optimization": {
        "stage": 1, "overlap_comm": True, "reduce_bucket_size": 20_000, "allgather_bucket_size": 20_000}}),
    Variant("ZeRO 2, overlap_comm, contiguous, 20k buckets", deepspeed={"zero_optimization": {
        "stage": 2, "overlap_comm": True, "contiguous_gradients": True, "reduce_bucket_size": 20_000,
        "allgather_bucket_size": 20_000}}),
    Variant("ZeRO 0, prefetch 2", picasso={"interleave": {"prefetch_batches": 2}}),
)
OPTIONAL_WAIT_VARIANTS = (  # by name through --only
    Variant("ZeRO 2, no overlap, 20k buckets", deepspeed={"zero_optimization": {
        "stage": 2, "overlap_comm": False, "contiguous_gradients": False, "reduce_bucket_size": 20_000,
        "allgather_bucket_size": 20_000}}),
)


def parse_shape(spec: str, base: Shape) -> Shape:
    """``"FxROWS"``, ``"FxROWS:STEPS"`` or ``"FxROWS:STEPS:EVAL"`` as a Shape (the rest from ``base``).

        >>> parse_shape("200x10000:200:32768", Shape()).fields
        200
    """
    parts = spec.split(":")
    try:
        fields, vocab = (int(x) for x in parts[0].lower().split("x"))
        steps = int(parts[1]) if len(parts) > 1 else base.steps
        eval_samples = int(parts[2]) if len(parts) > 2 else base.eval_samples
    except ValueError:
        raise SystemExit(f"benchmarks/system.py: shape {spec!r} is not FxROWS[:STEPS[:EVAL]] (e.g. 26x100000:600)")
    if len(parts) > 3 or min(fields, vocab, steps, eval_samples) < 1 or eval_samples % (2 * base.micro_batch):
        raise SystemExit(f"benchmarks/system.py: shape {spec!r}: positive F, rows and steps, and held-out samples a "
                         f"multiple of {2 * base.micro_batch} (2 ranks x micro-batch) expected")
    return dataclasses.replace(base, fields=fields, vocab=vocab, steps=steps, eval_samples=eval_samples)


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """``base`` with ``extra`` merged in, nested dicts merged key by key."""
    out = dict(base)
    for k, v in extra.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def variant_config(shape: Shape, v: Variant) -> dict[str, Any]:
    """The rec job's DeepSpeed JSON for ``v``: :func:`ds_config` with the variant's overrides."""
    cfg = ds_config(shape, True)
    cfg["picasso"] = _merge(cfg["picasso"], v.picasso)
    return _merge(cfg, v.deepspeed)


def oom_kills_since(uptime_s: float) -> list[str]:
    """The kernel's OOM-kill lines logged after ``uptime_s`` (seconds since boot); [] where dmesg is unreadable."""
    import subprocess

    try:
        text = subprocess.run(["dmesg"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    out = []
    for line in text.splitlines():
        if "Out of memory: Killed process" in line and line.startswith("["):
            stamp = line[1:line.index("]")].strip()
            if stamp.replace(".", "", 1).isdigit() and float(stamp) >= uptime_s:
                out.append(line[line.index("]") + 1:].strip())
    return out


def _uptime_s() -> float:
    try:
        return float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return math.inf


def matrix(shapes: Sequence[Shape], variants: Sequence[Variant], reps: int, workdir: Path) -> list[Row]:
    """Every variant at every shape, ``reps`` times, alternated (A B C A B C ...): one Row per run.

    A variant that failed at a shape for another reason than a late rendezvous is not rerun there
    (its later repetitions are rows that say so).
    """
    rows: list[Row] = []
    for shape in shapes:
        where = f"{shape.fields} x {shape.vocab:,}"
        broken: dict[str, str] = {}
        for rep in range(reps):
            for v in variants:
                row = Row(v.name, False, shape.steps, shape=where, rep=rep)
                if v.name in broken:
                    row.failed = f"not rerun: {broken[v.name]}"
                    rows.append(row)
                    continue
                since = _uptime_s()
                if v.torchrec is not None:
                    _attempt(row, run_torchrec, shape, v.torchrec, shape.steps, False)
                else:
                    slug = f"{v.name}_{shape.fields}_{rep}".replace(" ", "_").replace(",", "")
                    _attempt(row, run_train_rec, workdir, slug, variant_config(shape, v), shape, shape.steps, False)
                if not row.ok:
                    kills = oom_kills_since(since)
                    if kills:
                        row.failed = f"{row.failed} (kernel: {kills[-1][:160]})"
                    broken[v.name] = f"failed in repetition {rep + 1}"
                rows.append(row)
    return rows


def _spread(vals: Sequence[float], fmt: str) -> str:
    if not vals:
        return "-"
    med = format(statistics.median(vals), fmt)
    return med if len(vals) == 1 else f"{med} ({format(min(vals), fmt)}-{format(max(vals), fmt)})"


def matrix_table(rows: Sequence[Row], anchor: str, target: float | None) -> str:
    """Markdown: per shape and variant, medians and ranges over the repetitions; then each ours against the anchor.

    ``anchor``: a variant name, or a prefix ending in ``*`` (the fastest of those variants at each
    shape by median samples/s, e.g. ``"torchrec *"``). ``target``: the samples/s ratio each other
    variant should reach, with |dAUC| <= 0.001 (None: no verdict, the ratio only).
    """
    head = ["F x rows", "variant", "runs", "steps", "samples/s, median (range)", "x anchor, paired (range)", "AUC, median (range)",
            "dAUC vs anchor", "setup s", "peak MB/rank", "note"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    verdict: list[str] = []
    for where in dict.fromkeys(r.shape for r in rows):
        at = [r for r in rows if r.shape == where]
        by: dict[str, list[Row]] = {}
        for r in at:
            by.setdefault(r.variant, []).append(r)
        rate = {n: [r.result["samples_per_s"] for r in g if r.ok] for n, g in by.items()}
        if anchor.endswith("*"):
            pool = [n for n in by if n.startswith(anchor[:-1]) and rate[n]]
            best = max(pool, key=lambda n: statistics.median(rate[n])) if pool else None
        else:
            best = anchor if rate.get(anchor) else None
        base_by_rep = {r.rep: r.result for r in by.get(best, []) if r.ok} if best else {}
        base_auc = statistics.median([x["auc"] for x in base_by_rep.values()]) if base_by_rep else math.nan
        for name, group in by.items():
            ok = [r for r in group if r.ok]
            paired = [r.result["samples_per_s"] / base_by_rep[r.rep]["samples_per_s"] for r in ok
                      if r.rep in base_by_rep]
            aucs = [r.result["auc"] for r in ok]
            dauc = statistics.median(aucs) - base_auc if aucs and base_auc == base_auc else math.nan
            setup = [r.result["setup_s"] for r in ok if r.result.get("setup_s") is not None]
            rss = [r.result["peak_rss_mb"] for r in ok if r.result.get("peak_rss_mb")]
            notes = list(dict.fromkeys(r.failed for r in group if not r.ok))
            plans = list(dict.fromkeys(_plan_text(r.result) for r in ok if _plan_text(r.result)))
            tag = " (anchor)" if name == best else ""
            lines.append("| " + " | ".join([
                where, name + tag, f"{len(ok)}/{len(group)}", str(group[0].steps), _spread(rate[name], ",.0f"),
                _spread(paired, ".2f") if name != best else "1", _spread(aucs, ".4f"),
                f"{dauc:+.4f}" if dauc == dauc and name != best else "-", _spread(setup, ".1f"),
                f"{max(rss):,.0f}" if rss else "-", "; ".join(plans + notes)]) + " |")
            if name == best or name.startswith("torchrec") or not ok or not rate.get(best or ""):
                continue
            speed = statistics.median(rate[name]) / statistics.median(rate[best])
            if target is None:
                verdict.append(f"- {where}, {name} / {best}: **{speed:.2f}x** samples/s (medians; paired "
                               f"{_spread(paired, '.2f')}), AUC {dauc:+.4f}.")
            else:
                hit = speed >= target and abs(dauc) <= 0.001
                verdict.append(f"- {where}, {name} / {best}: **{speed:.2f}x** samples/s (medians; paired "
                               f"{_spread(paired, '.2f')}), AUC {dauc:+.4f} (target >= {target:g}x at |dAUC| <= "
                               f"0.001): **{'hit' if hit else 'miss'}**.")
        if best is None:
            verdict.append(f"- {where}: no {anchor} run finished; no ratio.")
    return "\n".join(lines + ["", *verdict])


def _plan_text(result: dict[str, Any]) -> str:
    """The planner's counts from the job's logged plan, e.g. ``"plan: 26 data_parallel, 0 row_wise"``."""
    import re

    for msg in result.get("plan_log") or []:
        found = re.search(r"\((\d+ data_parallel, \d+ row_wise)\)", msg.split("\n")[0])
        if msg.startswith("sharding plan") and found:
            return "plan: " + found.group(1)
    return ""


def matrix_header(command: str, shapes: Sequence[Shape], reps: int, started: str, load_before: tuple[float, ...],
                  load_after: tuple[float, ...], minutes: float) -> str:
    """The section's command, machine, load and setup."""
    import torch

    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), platform.processor() or "?")
    sizes = "; ".join(f"{s.fields} x {s.vocab:,} rows: {s.steps} steps, {s.eval_samples:,} held-out samples"
                      for s in shapes)
    b = shapes[0]
    return (f"Command: `{command}` ({platform.machine()} {cpu}, {os.cpu_count()} cores, torch {torch.__version__}; "
            f"{started}, {minutes:.1f} min; load average (1/5/15 min) before "
            f"{'/'.join(f'{x:.1f}' for x in load_before)}, after {'/'.join(f'{x:.1f}' for x in load_after)}; other "
            f"helpers' jobs shared the machine).\n\nSetup: DLRM (bottom 13-64-{b.dim}, dot interactions, top 128-64-1), "
            f"dim {b.dim}, micro-batch {b.micro_batch} per rank, 2 gloo ranks x 1 torch thread, seed {b.seed}, the same "
            f"synthetic stream and N(0, 0.01) table init for every variant; tables row-wise Adagrad lr "
            f"{b.table_lr:g} (eps 1e-8), dense AdamW lr {b.dense_lr:g} (no schedule, no clipping; ours: DeepSpeed "
            f"ZeRO 0 unless the variant says); torchrec 1.8 `DistributedModelParallel` + `TrainPipelineSparseDist` "
            f"(row_wise through a sharder that offers it on CPU). {sizes}. {reps} repetitions, variants alternated "
            f"in the order of the table; samples/s = training samples over the slowest rank's training-loop wall "
            f"time (batch generation included, setup and scoring not); \"x anchor, paired\" = each run over the "
            f"anchor's run of the same repetition; setup s = torchrec's sharding plan and model build (ours: -).")


def cache_flags_missing() -> list[str]:
    """train_rec's slow-link flags this section needs that the CLI does not have (yet)."""
    from sparse_scale.rec.cli import parse_args

    known = set(vars(parse_args(["--config", "x"])))
    return [f"--{f.replace('_', '-')}" for f in ("ps_link_latency_ms", "ps_link_mbit") if f not in known]


def cache_section(shape: Shape, workdir: Path, latencies: Sequence[float], steps: int, mbit: float) -> list[Row]:
    """Section ``cache``: packed tables on the server in gba mode, with and without the cache (10% of the rows).

    gba mode, because there the consistency rule lets a cached row serve for up to
    ``staleness.threshold`` versions; in sync mode every row a worker reads was updated by the
    global batch before, so the cache can only validate (docs/gba.md). ``mbit`` > 0 also limits
    the link's bandwidth (0: latency only).
    """
    missing = cache_flags_missing()
    if missing:
        raise SystemExit(f"benchmarks/system.py --sections cache: train_rec has no {' or '.join(missing)} flag yet "
                         "(issue 13 item 3: the slow-link injector); run --sections rivals, or add the flags first")
    rows: list[Row] = []
    cache_rows = max(1, shape.vocab * shape.fields // 10)
    for latency in latencies:
        for cached in (False, True):
            cfg = ds_config(shape, True, gba_block("gba"), cache_rows=cache_rows if cached else None)
            name = f"{latency:g} ms, {'cache' if cached else 'no cache'}"
            extra = ["--ps-link-latency-ms", f"{latency:g}", "--ps-link-mbit", f"{mbit:g}"]
            rows.append(_attempt(Row(name, False, steps), run_train_rec, workdir, f"cache_{latency:g}_{cached}",
                                 cfg, shape, steps, False, world_size=3, extra=extra))
    return rows


# --------------------------------------------------------------------------------------------- profile

# (what, frame-name fragments any of which puts a sample there): first match wins, in this order
STEP_PARTS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("data: synthetic batch generation (ids, teacher, labels)", ("SyntheticCTRGenerator.", "SyntheticCTRStream.")),
    ("data: samples per step (RankStream.step_samples)", ("RankStream.step_samples",)),
    ("sparse-dist pipeline: waits for the next batch's exchange, hand-over", ("SparseDistPipeline.",)),
    ("tables: fused lookup (forward kernel)", ("_PooledLookup.forward",)),
    ("tables: row-gradient sums (backward kernel)", ("_PooledLookup.backward",)),
    ("tables: row exchange between ranks (all_gather, all_to_all)", ("all_gather", "all_to_all")),
    ("tables: dedup of exchanged rows", ("coalesce_rows", "unpack_rows")),
    ("tables: row-wise Adagrad update kernel", ("apply_rows",)),
    ("tables: rest of the sparse step", ("sparse_step",)),
    ("dense: DeepSpeed gradient all-reduce", ("allreduce_gradients",)),
    ("dense: DeepSpeed AdamW step", ("Adam.step", "_single_tensor_adam")),
    ("dense: model forward (MLPs, interactions)", ("DLRM.forward",)),
    ("dense: autograd backward", ("Tensor.backward",)),
    ("DeepSpeed engine wrappers (forward/backward/step bookkeeping)", ("deepspeed/",)),
)
LOOP_REST = "train loop itself (loss.item, timers, tqdm, fault hooks, Python)"


def step_breakdown(raw_lines: Sequence[str], rest: dict[str, int] | None = None) -> dict[str, int]:
    """py-spy ``--format raw`` stacks inside ``train_loop``, counted per :data:`STEP_PARTS` (rest: the loop).

    ``rest``: where given, the innermost frame of each stack counted as the loop's own, with its samples.
    """
    counts = {name: 0 for name, _ in STEP_PARTS} | {LOOP_REST: 0}
    for line in raw_lines:
        stack, _, n = line.rstrip().rpartition(" ")
        frames = stack.split(";")
        inside = [i for i, f in enumerate(frames) if f.startswith("train_loop ")]
        if not inside or not n.isdigit():
            continue
        below = frames[inside[0] + 1:]
        part = next((name for name, keys in STEP_PARTS if any(k in f for f in below for k in keys)), LOOP_REST)
        counts[part] += int(n)
        if part == LOOP_REST and rest is not None:
            leaf = frames[-1]
            rest[leaf] = rest.get(leaf, 0) + int(n)
    return counts


def profile_train_rec(shape: Shape, workdir: Path, py_spy: str, steps: int, cfg: dict[str, Any] | None = None,
                      variant: str = "ours packed") -> dict[str, Any]:
    """train_rec (``cfg``: default a packing-only picasso block; 2 ranks) with each rank under ``py-spy record
    --idle``: the breakdown."""
    import subprocess

    from sparse_scale.multiproc import free_port

    config = workdir / "profile.json"
    config.write_text(json.dumps(cfg if cfg is not None else ds_config(shape, True)))
    argv = train_rec_argv(config, workdir / "profile", shape, steps, straggler=False)
    port, procs = free_port(), []
    for rank in range(2):
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
               "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "GLOO_SOCKET_IFNAME": "lo",
               "WANDB_MODE": "disabled"}
        cmd = [py_spy, "record", "--idle", "-r", "100", "-f", "raw", "-o", str(workdir / f"rank{rank}.txt"), "--",
               sys.executable, str(ROOT / "launch" / "train_rec.py"), *argv]
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                      text=True))
    errors = [p.communicate(timeout=RUN_TIMEOUT_S)[1] for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError(f"profiled train_rec failed: {errors[0][-2000:]}")
    summary = json.loads((workdir / "profile" / "summary.json").read_text())
    rest: dict[str, int] = {}
    per_rank = [step_breakdown((workdir / f"rank{r}.txt").read_text().splitlines(), rest) for r in range(2)]
    top = sorted(rest.items(), key=lambda kv: -kv[1])[:6]
    return {"samples_per_s": summary["samples_per_s"], "steps": steps, "ranks": per_rank, "loop_rest_top": top,
            "command": "launch/train_rec.py " + " ".join(argv), "variant": variant,
            "config": json.loads(config.read_text())}


def profile_table(prof: dict[str, Any]) -> str:
    """Markdown: the share of each part of the training loop's samples, per rank."""
    totals = [max(1, sum(r.values())) for r in prof["ranks"]]
    lines = ["| part of the step | rank 0 | rank 1 |", "|---|---|---|"]
    for name in prof["ranks"][0]:
        lines.append(f"| {name} | " + " | ".join(f"{100 * r[name] / t:.1f}%" for r, t in zip(prof["ranks"], totals))
                     + " |")
    lines.append(f"| (py-spy samples in the loop, 100/s) | {totals[0]:,} | {totals[1]:,} |")
    if prof.get("loop_rest_top"):
        lines += ["", "The loop's own samples, innermost frames (both ranks): " + "; ".join(
            f"`{leaf}` {n:,}" for leaf, n in prof["loop_rest_top"]) + "."]
    lines += ["", f"Variant {prof.get('variant', 'ours packed')!r}; samples/s of the profiled run: "
              f"{prof['samples_per_s']:,.0f} (py-spy slows it a little); `{prof['command']}`; its DeepSpeed JSON's "
              f"picasso block `{json.dumps((prof.get('config') or {}).get('picasso'))}`, zero_optimization "
              f"`{json.dumps((prof.get('config') or {}).get('zero_optimization'))}`."]
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------- report


# --------------------------------------------------------------------------------------------- section auto

AUTO_SECTION = "## GBA auto mode side by side: sync phases at plain speed, a straggler in each of five places (issue 28)"
SLOW_PLACES = ("data", "forward", "backward", "between", "optimizer")
AUTO_WORKERS = 2


class _Slowdown:
    """Worker 1's injected straggler of one run (set in its process by :func:`auto_rank`).

    The sleep is calibrated in the run itself: (factor - 1) x the worker's median wall time per step
    over job steps [start / 2, start), so the worker's step takes factor x what it took just before.
    """

    place: str | None = None
    factor = STRAGGLER_FACTOR
    sleep_s: float | None = None
    start = end = 0  # job steps [start, end)
    engine: Any = None  # the rec job's engine, caught at its first forward
    stamps: list = []  # (job step, perf_counter) at every step() of this worker

    @classmethod
    def job_step(cls) -> int:
        eng = getattr(cls.engine, "engine", None)
        if eng is None:
            return -1
        return int(eng.job_step) if hasattr(eng, "job_step") else int(eng.global_steps)

    @classmethod
    def sleep(cls, place: str) -> None:
        if cls.place != place or not cls.start <= cls.job_step() < cls.end:
            return
        if cls.sleep_s is None:
            before = wall_steps(cls.stamps, cls.start // 2, cls.start)
            cls.sleep_s = (cls.factor - 1.0) * (statistics.median(before) if before else 0.0)
        time.sleep(cls.sleep_s)


def wall_steps(stamps: Sequence[tuple[int, float]], lo: int, hi: int) -> list[float]:
    """Wall seconds between successive ``step()`` calls whose job step is in [lo, hi)."""
    return [t1 - t0 for (_, t0), (j, t1) in zip(stamps, stamps[1:]) if lo <= j < hi]


def _install_slowdown(place: str | None, start: int, end: int) -> None:
    """Patch this process's rec job so that it sleeps in ``place`` for job steps [start, end).

    The five places of a step: ``data`` (the stream's batch accounting right after the batch is read),
    ``forward`` (before the engine's forward), ``backward`` (inside autograd's backward: a hook on the
    loss), ``between`` (after ``backward()``, before ``step()``) and ``optimizer`` (inside the optimizer
    step: DeepSpeed's, or the gba phase's push). Every rank records when each of its steps ends.
    """
    import deepspeed.runtime.engine as ds_engine_mod

    from gba_engine.phases import GBAPhase
    from sparse_scale.rec import data, engines

    _Slowdown.place, _Slowdown.start, _Slowdown.end, _Slowdown.sleep_s = place, start, end, None
    _Slowdown.stamps = []

    def wrap(cls: Any, name: str, before: Any, after: Any = None) -> None:
        original = getattr(cls, name)

        def patched(self: Any, *args: Any, **kwargs: Any) -> Any:
            before(self, *args)
            out = original(self, *args, **kwargs)
            if after is not None:
                after(self)
            return out
        setattr(cls, name, patched)

    def catch(self: Any, *args: Any) -> None:
        _Slowdown.engine = self
        _Slowdown.sleep("forward")

    def hook_loss(self: Any, loss: Any, *args: Any) -> None:
        if loss.requires_grad:
            loss.register_hook(lambda g: (_Slowdown.sleep("backward"), g)[1])

    def stamp(self: Any) -> None:
        _Slowdown.stamps.append((_Slowdown.job_step(), time.perf_counter()))

    for cls in (engines.DeepSpeedRecEngine, engines.GBARecEngine):
        wrap(cls, "__call__", catch)
        wrap(cls, "backward", hook_loss)
        wrap(cls, "step", lambda self, *a: _Slowdown.sleep("between"), stamp)
    for cls in (data.RankStream, data.ClaimedBatches):
        wrap(cls, "step_samples", lambda self, *a: _Slowdown.sleep("data"))
    for cls in (ds_engine_mod.DeepSpeedEngine, GBAPhase):  # sync phases and the plain job step DeepSpeed's optimizer
        wrap(cls, "step", lambda self, *a: _Slowdown.sleep("optimizer"))


def auto_rank(rank: int, world_size: int, argv: list[str], place: str | None, start: int, end: int) -> dict[str, Any]:
    """``train_rec.train`` on this rank, worker 1 slowed in ``place``; its summary, step stamps and sleep."""
    os.environ.setdefault("WANDB_MODE", "disabled")
    logging.getLogger("sparse_scale.rec.notice").setLevel(logging.WARNING)
    _install_slowdown(place if rank == STRAGGLER_RANK else None, start, end)
    from sparse_scale.rec import cli

    summary = cli.train(cli.parse_args(argv))
    return {"summary": summary, "stamps": list(_Slowdown.stamps), "sleep_s": _Slowdown.sleep_s}


def auto_run(workdir: Path, name: str, cfg: dict[str, Any], shape: Shape, place: str | None,
             window: tuple[int, int], world_size: int) -> dict[str, Any]:
    """One job of the auto section: rank 0's summary, worker 1's sleep and its measured slowdown k.

    k: worker 1's median wall time per step in the window over worker 0's there (auto: the workers run
    apart in gba), or over its own just before the window (the plain job runs in lockstep).
    """
    from sparse_scale.multiproc import run_distributed

    slug = name.replace(" ", "_").replace(",", "").replace("(", "").replace(")", "")
    config = workdir / f"{slug}.json"
    config.write_text(json.dumps(cfg, indent=1))
    argv = train_rec_argv(config, workdir / slug, shape, shape.steps, False)
    results = run_distributed(auto_rank, world_size, args=(argv, place, *window), timeout_s=RUN_TIMEOUT_S,
                              init_process_group=False)
    summary = results[0]["summary"]
    gba = summary.get("gba") or {}
    k = math.nan
    if place is not None:
        slow = wall_steps(results[1]["stamps"], *window)
        ref = (wall_steps(results[0]["stamps"], *window) if gba else
               wall_steps(results[1]["stamps"], window[0] // 2, window[0]))
        if slow and ref:
            k = statistics.median(slow) / statistics.median(ref)
    return {"samples_per_s": summary["samples_per_s"], "auc": summary["auc"],
            "eval_samples": int(summary["eval_samples"]), "switches": gba.get("switches"),
            "switch_seconds": gba.get("switch_seconds"), "switch_bytes": gba.get("switch_bytes"),
            "k": k, "sleep_s": results[1]["sleep_s"], "window": window,
            "command": "launch/train_rec.py " + " ".join(argv)}


def auto_plan(shape: Shape, places: Sequence[str]) -> list[tuple[str, str | None, bool]]:
    """(variant, straggler place, gba) of every run of one repetition, in the order they alternate."""
    plan: list[tuple[str, str | None, bool]] = [("plain packed", None, False), ("auto", None, True)]
    for place in places:
        plan += [("auto", place, True), ("plain packed", place, False)]
    return plan


def auto_section(shape: Shape, workdir: Path, reps: int, places: Sequence[str] = SLOW_PLACES) -> list[Row]:
    """Section ``auto``: the plain packed job and auto mode (2 workers + 1 server), without and with a straggler.

    Worker 1 is slowed ``STRAGGLER_FACTOR`` x for the middle half of the job steps, in one place per
    run (a sleep calibrated in the run, :class:`_Slowdown`). Every run of the plan is repeated
    ``reps`` times, alternating; one Row per run.
    """
    window = (shape.steps // 4, 3 * shape.steps // 4)
    plain_cfg = ds_config(shape, True)
    auto_cfg = ds_config(shape, True, gba_block("auto"))
    rows: list[Row] = []
    for rep in range(reps):
        for variant, place, gba in auto_plan(shape, places):
            row = Row(f"{variant}, {place or 'none'}", place is not None, shape.steps)
            name = f"{variant}_{place or 'none'}_{rep}"
            _attempt(row, auto_run, workdir, name, auto_cfg if gba else plain_cfg, shape, place, window,
                     AUTO_WORKERS + (1 if gba else 0))
            if row.ok:
                row.result["rep"] = rep
                if place is not None:
                    print(f"  worker 1 slept {row.result['sleep_s'] * 1e3:.1f} ms a step in {place} for job steps "
                          f"{window[0]}-{window[1] - 1}: k = {row.result['k']:.2f}", flush=True)
            rows.append(row)
    return rows


def _median(rows: Sequence[Row], key: str) -> float:
    vals = [r.result[key] for r in rows if r.ok and r.result.get(key) is not None]
    return statistics.median(vals) if vals else math.nan


def auto_table(rows: list[Row]) -> str:
    """Markdown: medians per variant, k, the asynchronous ceiling, AUC against plain, switches; then the targets."""
    by: dict[str, list[Row]] = {}
    for r in rows:
        by.setdefault(r.variant, []).append(r)
    plain = by.get("plain packed, none", [])
    base, base_auc = _median(plain, "samples_per_s"), _median(plain, "auc")
    n = AUTO_WORKERS
    head = ["variant, straggler place", "runs", "samples/s (median)", "x plain (paired, median)", "k (median)",
            "ceiling (window / whole run)", "x ceiling", "AUC (median)", "dAUC vs plain", "switches per run",
            "switch s / MB (median)", "note"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    verdict = []
    plain_by_rep = {r.result.get("rep"): r.result["samples_per_s"] for r in plain if r.ok}
    for variant, group in by.items():
        ok = [r for r in group if r.ok]
        rate, auc = _median(group, "samples_per_s"), _median(group, "auc")
        # each run against the plain run of its own repetition (adjacent in time: the machine's load drifts)
        paired = [r.result["samples_per_s"] / plain_by_rep[r.result.get("rep")] for r in ok
                  if r.result.get("rep") in plain_by_rep]
        x_plain = statistics.median(paired) if paired else rate / base
        place = variant.rpartition(", ")[2]
        k = ceiling = c = math.nan
        if place != "none":
            k = _median(ok, "k")
        if place != "none" and k == k and ok:
            c = (n - 1 + 1 / k) / n  # one worker k x slower, the others at full speed: the asynchronous ceiling
            lo, hi = ok[0].result["window"]
            f = (hi - lo) / ok[0].steps  # the window's share of the job steps
            ceiling = base / ((1 - f) + f / c)
        switches = [len(r.result["switches"] or []) for r in ok] if variant.startswith("auto") else []
        secs = _median(ok, "switch_seconds") if switches else math.nan
        mbytes = _median(ok, "switch_bytes") / 1e6 if switches else math.nan
        fails = "; ".join(r.failed for r in group if not r.ok)
        lines.append("| " + " | ".join([
            variant, f"{len(ok)}/{len(group)}", f"{rate:,.0f}", f"{x_plain:.2f}",
            f"{k:.2f}" if k == k else "-",
            f"{base * c:,.0f} / {ceiling:,.0f}" if ceiling == ceiling else "-",
            f"{rate / ceiling:.2f}" if ceiling == ceiling and variant.startswith("auto") else "-",
            f"{auc:.4f}", f"{auc - base_auc:+.4f}", ", ".join(map(str, switches)) or "-",
            f"{secs:.2f} / {mbytes:,.0f}" if secs == secs else "-", fails]) + " |")
        if variant == "auto, none" and ok:
            verdict.append(f"- auto without a straggler: **{x_plain:.2f}x** plain (paired by repetition; target >= "
                           f"0.9x: **{'hit' if x_plain >= 0.9 else 'miss'}**), dAUC {auc - base_auc:+.4f}, switches "
                           f"{switches} (target 0).")
        elif variant.startswith("auto") and ceiling == ceiling:
            verdict.append(f"- auto, straggler in {place}: **{rate / ceiling:.2f}x** the asynchronous ceiling of the "
                           f"run (target >= 0.85x: **{'hit' if rate / ceiling >= 0.85 else 'miss'}**), dAUC "
                           f"{auc - base_auc:+.4f} (target |dAUC| <= 0.001: "
                           f"**{'hit' if abs(auc - base_auc) <= 0.001 else 'miss'}**), switches {switches} "
                           "(target 2: one round trip).")
    return "\n".join(lines + ["", *verdict])


def rivals_table(rows: list[Row]) -> str:
    """Markdown: one line per run, then the targets against what was measured."""
    head = ["variant", "straggler", "steps", "samples/s", "AUC", "held-out samples", "note"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        note = r.failed or ""
        if r.ok and r.variant in SLOW_VARIANTS:
            note = f"AUC after {r.steps} steps only: not comparable"
        if r.ok and r.result.get("delay_s"):
            note = (note + "; " if note else "") + f"rank 1 sleeps {r.result['delay_s'] * 1e3:.1f} ms/step"
        cells = [r.variant, f"rank {STRAGGLER_RANK} x{STRAGGLER_FACTOR:g}" if r.straggler else "-", str(r.steps),
                 f"{r.result['samples_per_s']:,.0f}" if r.ok else "-", f"{r.result['auc']:.4f}" if r.ok else "-",
                 f"{r.result['eval_samples']:,}" if r.ok else "-", note]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", *verdicts(rows)]
    return "\n".join(lines)


def _find(rows: list[Row], variant: str, straggler: bool) -> Row | None:
    got = [r for r in rows if r.variant == variant and r.straggler == straggler and r.ok]
    return got[0] if got else None


def verdicts(rows: list[Row]) -> list[str]:
    """The issue's targets, each as measured: hit, miss, or not measured."""
    out = []
    anchors = [r for r in rows if r.variant.startswith("torchrec") and not r.straggler and r.ok
               and r.variant not in SLOW_VARIANTS]
    ours = _find(rows, "ours packed", False)
    if anchors and ours:
        best = max(anchors, key=lambda r: r.result["samples_per_s"])
        speed = ours.result["samples_per_s"] / best.result["samples_per_s"]
        dauc = ours.result["auc"] - best.result["auc"]
        hit = speed >= 2.0 and abs(dauc) <= 0.001
        out.append(f"- ours packed vs the best torchrec ({best.variant}): **{speed:.2f}x** samples/s, AUC "
                   f"{dauc:+.4f} (target >= 2x at |dAUC| <= 0.001): **{'hit' if hit else 'miss'}**.")
    sync = _find(rows, "ours packed, gba sync", True)
    for mode in ("gba", "auto"):
        r = _find(rows, f"ours packed, gba {mode}", True)
        if r and sync:
            speed = r.result["samples_per_s"] / sync.result["samples_per_s"]
            dauc = r.result["auc"] - sync.result["auc"]
            hit = speed >= 2.4 and abs(dauc) <= 0.001
            out.append(f"- straggler, gba {mode} vs our sync: **{speed:.2f}x** samples/s, AUC {dauc:+.4f} "
                       f"(target >= 2.4x at |dAUC| <= 0.001): **{'hit' if hit else 'miss'}**.")
        else:
            out.append(f"- straggler, gba {mode} vs our sync (target >= 2.4x): not measured (the rows above say why).")
    return out


def cache_table(rows: list[Row]) -> str:
    """Markdown: one line per (latency, cache), then cache / no cache per latency."""
    head = ["link (one-way)", "cache", "samples/s", "AUC", "hit rate", "MB pulled (worker 0)", "MB pushed (worker 0)",
            "row MB saved (worker 0)", "note"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        lat, cached = r.variant.split(", ")
        stats = (r.result or {}).get("gba") or {}
        cache, moved = stats.get("row_cache") or {}, stats.get("ps_bytes") or {}
        mb = (lambda d, k: f"{d[k] / 1e6:,.1f}" if k in d else "-")
        lines.append("| " + " | ".join([
            lat, cached, f"{r.result['samples_per_s']:,.0f}" if r.ok else "-", f"{r.result['auc']:.4f}" if r.ok else "-",
            f"{cache['hit_rate']:.3f}" if "hit_rate" in cache else "-", mb(moved, "pulled"), mb(moved, "pushed"),
            mb(cache, "row_bytes_saved"), r.failed or ""]) + " |")
    lines.append("")
    for lat in dict.fromkeys(r.variant.split(", ")[0] for r in rows):
        off, on = _find(rows, f"{lat}, no cache", False), _find(rows, f"{lat}, cache", False)
        if off and on:
            speed = on.result["samples_per_s"] / off.result["samples_per_s"]
            dauc = on.result["auc"] - off.result["auc"]
            target = "" if lat.startswith("0 ") else \
                f" (target >= 2x at |dAUC| <= 0.001: **{'hit' if speed >= 2 and abs(dauc) <= 0.001 else 'miss'}**)"
            lines.append(f"- {lat}: cache / no cache **{speed:.2f}x** samples/s, AUC {dauc:+.4f}{target}.")
    return "\n".join(lines)


def header(command: str, shape: Shape, started: str, load_before: tuple[float, ...],
           load_after: tuple[float, ...], minutes: float) -> str:
    import torch

    return (f"Command: `{command}` ({platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}; "
            f"{started}, {minutes:.1f} min; load average (1/5/15 min) before "
            f"{'/'.join(f'{x:.1f}' for x in load_before)}, after {'/'.join(f'{x:.1f}' for x in load_after)}; other "
            f"jobs shared the machine).\n\nShape: DLRM, {shape.fields} fields x {shape.vocab:,} rows x {shape.dim}, "
            f"micro-batch {shape.micro_batch} per rank, 2 ranks (gba: 2 workers + 1 server) over gloo, 1 torch "
            f"thread each, seed {shape.seed}; tables row-wise Adagrad lr {shape.table_lr:g} (eps 1e-8), dense "
            f"AdamW lr {shape.dense_lr:g} (no schedule, no clipping, DeepSpeed ZeRO 0).")


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--sections", nargs="+", choices=["rivals", "waits", "stragglers", "cache", "profile", "auto"],
                   default=["rivals", "cache"])
    p.add_argument("--shapes", nargs="+", default=None, metavar="FxROWS[:STEPS[:EVAL]]",
                   help=f"rivals / waits: shapes (default rivals {' '.join(RIVAL_SHAPES)}, waits {' '.join(WAIT_SHAPES)})")
    p.add_argument("--steps", type=int, default=Shape.steps)
    p.add_argument("--slow-steps", type=int, default=Shape.slow_steps,
                   help=f"steps of {', '.join(SLOW_VARIANTS)} (dense tables: slow)")
    p.add_argument("--shardings", nargs="+", choices=TORCHREC_SHARDINGS, default=list(TORCHREC_SHARDINGS))
    p.add_argument("--only", nargs="+", default=[], metavar="VARIANT",
                   help='rivals, waits, stragglers: only these variants (e.g. "torchrec table_wise" "ours auto"; '
                        f'rivals also knows {", ".join(repr(v.name) for v in OPTIONAL_VARIANTS)})')
    p.add_argument("--no-straggler", action="store_true", help="skip the straggler runs")
    p.add_argument("--cache-fields", type=int, default=200, help="fields of the cache section")
    p.add_argument("--cache-vocab", type=int, default=10_000, help="rows per field of the cache section")
    p.add_argument("--cache-steps", type=int, default=200, help="steps of each cache-section run")
    p.add_argument("--cache-mbit", type=float, default=1000.0,
                   help="bandwidth of the modelled link in the cache section, Mbit/s (0: latency only)")
    p.add_argument("--py-spy", default="py-spy", help="py-spy executable (--sections profile)")
    p.add_argument("--profile-steps", type=int, default=400)
    p.add_argument("--profile-variant", default="ours data_parallel",
                   help="profile: which of the rivals' or waits' variants of ours to profile")
    p.add_argument("--reps", type=int, default=None,
                   help="auto, rivals, waits: repetitions of the alternating plan (medians; default 2 auto, 3 else)")
    p.add_argument("--places", nargs="+", choices=SLOW_PLACES, default=list(SLOW_PLACES),
                   help="auto: where worker 1 is slowed, one run per place")
    p.add_argument("--quick", action="store_true", help="tiny shapes, a few steps, prints only (smoke test)")
    p.add_argument("--json", default=None, help="also write the rows here")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    known = {v.name: v for v in (*RIVAL_VARIANTS, *OPTIONAL_VARIANTS, *WAIT_VARIANTS, *OPTIONAL_WAIT_VARIANTS)}
    if args.profile_variant not in known or known[args.profile_variant].torchrec:
        p.error(f"--profile-variant {args.profile_variant!r}: one of ours: "
                f"{', '.join(n for n, v in known.items() if not v.torchrec)}")
    unknown = [n for n in args.only if n not in known and not n.startswith(("torchrec ", "ours packed", "deepspeed"))]
    if unknown:
        p.error(f"--only: unknown variant(s) {unknown}; known: {', '.join(known)}")
    reps = 1 if args.quick else (args.reps or 0)
    if args.quick:
        shape = Shape(vocab=100, steps=30, slow_steps=30, eval_samples=4096)
        cache_shape = dataclasses.replace(shape, fields=26)
    else:
        shape = Shape(steps=args.steps, slow_steps=args.slow_steps)
        cache_shape = dataclasses.replace(shape, fields=args.cache_fields, vocab=args.cache_vocab)
    command = shlex.join([".venv/bin/python", "benchmarks/system.py", *(sys.argv[1:] if argv is None else argv)])
    out: dict[str, Any] = {}
    sections = [("rivals", THREE_SHAPES_SECTION, shape, lambda rows: matrix_table(rows, "torchrec *", 1.5)),
                ("waits", WAITS_SECTION, shape, lambda rows: matrix_table(rows, WAIT_VARIANTS[0].name, None)),
                ("stragglers", RIVALS_SECTION, shape, rivals_table), ("cache", CACHE_SECTION, cache_shape, cache_table),
                ("profile", PROFILE_SECTION_29, shape, profile_table), ("auto", AUTO_SECTION, shape, auto_table)]
    if {"rivals", "waits"} & set(args.sections):  # many short runs: fork the ranks from one server that imported once
        from sparse_scale.multiproc import start_ranks_from_forkserver

        start_ranks_from_forkserver(["torch", "torch.distributed", "numpy", "deepspeed", "torchrec",
                                     "picasso_ops", "sparse_scale.rec.cli"])
    with tempfile.TemporaryDirectory(prefix="system_bench_") as tmp:
        for name, heading, sec_shape, table in sections:
            if name not in args.sections:
                continue
            started, load0, t0 = time.strftime("%Y-%m-%d %H:%M"), os.getloadavg(), time.perf_counter()
            shapes: list[Shape] = []
            if name in ("rivals", "waits"):
                rivals_run = name == "rivals"
                specs = args.shapes or (["26x100:30:4096"] if args.quick else RIVAL_SHAPES if rivals_run else WAIT_SHAPES)
                shapes = [parse_shape(spec, shape) for spec in specs]
                optional = OPTIONAL_VARIANTS if rivals_run else OPTIONAL_WAIT_VARIANTS
                pool = (RIVAL_VARIANTS if rivals_run else WAIT_VARIANTS) + optional
                chosen = [v for v in pool if (v.name in args.only if args.only else v not in optional)
                          and (v.torchrec is None or v.torchrec in args.shardings)]
                out[name] = matrix(shapes, chosen, reps or 3, Path(tmp))
            elif name == "stragglers":
                out[name] = stragglers(sec_shape, Path(tmp), args.shardings, not args.no_straggler, args.only)
            elif name == "profile":
                cfg = variant_config(sec_shape, known[args.profile_variant])
                out[name] = profile_train_rec(sec_shape, Path(tmp), args.py_spy, args.profile_steps, cfg,
                                              args.profile_variant)
            elif name == "auto":
                out[name] = auto_section(sec_shape, Path(tmp), reps or 2, args.places)
            else:
                out[name] = cache_section(sec_shape, Path(tmp), LINK_LATENCIES_MS, args.cache_steps if not args.quick
                                          else sec_shape.steps, args.cache_mbit)
            print(table(out[name]), flush=True)
            if args.json:
                Path(args.json).write_text(json.dumps({k: v if isinstance(v, dict) else [dataclasses.asdict(r) for r in v]
                                                       for k, v in out.items()},
                                                      indent=1, default=str))
            if args.quick:
                continue
            from embedding import write_section  # benchmarks/embedding.py

            minutes = (time.perf_counter() - t0) / 60
            head = (matrix_header(command, shapes, reps or 3, started, load0, os.getloadavg(), minutes) if shapes
                    else header(command, sec_shape, started, load0, os.getloadavg(), minutes))
            write_section(RESULTS, heading, f"{head}\n\n{table(out[name])}", title=f"{started}, benchmarks/system.py")
            print(f"wrote {RESULTS} ({heading})", flush=True)


if __name__ == "__main__":
    main()
