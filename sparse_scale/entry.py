"""``sparse_scale.initialize``: ``deepspeed.initialize`` for a config with plugin blocks, from any user's script.

One call reads and validates the whole file (every block: file, key path, nearest key), refuses
every combination of blocks and model that cannot work, before step 1 and with the reason, and
returns one engine (:class:`sparse_scale.engine.SparseEngine`) whose ordinary methods do what
each block needs. What it does, in order:

1. threads: torch threads per rank from the cores and the ranks on the node, when the user set
   none (``sparse_scale.threads``);
2. the model against the blocks (:func:`check_model`): tables whose replicas would drift apart,
   blocks the model does not use, MoE layers that disagree with the ``moe_proto`` block, layers
   a gba engine cannot hold; a ZeRO stage 3 config makes the MoE layers its stage 3 class;
   ``picasso.interleave.micro_batches > 1`` wraps a model that cuts itself into stages;
3. the engine: DeepSpeed's, with the experts in their own parameter groups and an expert-aware
   gradient clip; with a ``gba`` block, ``gba_engine.initialize`` (server ranks serve the whole
   job inside it and get an engine with ``is_server``).

Example::

    engine, optimizer, _, scheduler = sparse_scale.initialize(model=model, config="ds_config.json")
    if not engine.is_server:
        for batch in loader:
            loss = loss_fn(engine(batch), batch.labels)
            engine.backward(loss)
            engine.step()
        engine.save_checkpoint("out/ckpt")
    engine.close()
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
import os
from typing import Any, Iterable, Iterator, Mapping

import torch
from torch import nn

from sparse_scale.block_rules import check_blocks
from sparse_scale.config import ConfigError, JobConfig, load_config, parse_config
from sparse_scale.engine import SparseEngine

logger = logging.getLogger(__name__)


class SetupError(ConfigError):
    """The model and the config cannot train together; the message names the module, the key and what to do."""


def load_job(config: Any = None, args: Any = None, config_params: Any = None) -> JobConfig:
    """The validated config from a path, a dict, a loaded :class:`JobConfig`, or ``args.deepspeed_config``.

    Example::

        job = load_job("ds_configs/rec_picasso_cpu.json"); job.blocks["picasso"].embedding_dim
    """
    given = [c for c in (config, config_params) if c is not None]
    from_args = getattr(args, "deepspeed_config", None) if args is not None else None
    if from_args is not None:
        given.append(from_args)
    if len(given) != 1:
        raise ConfigError(f"give the DeepSpeed config once (config=, config_params= or args.deepspeed_config); got "
                          f"{len(given)}")
    source = given[0]
    if isinstance(source, JobConfig):
        return source
    if isinstance(source, Mapping):
        return parse_config(dict(source), source="<config dict>")
    if isinstance(source, (str, os.PathLike)):
        return load_config(source)
    raise ConfigError(f"config must be a path, a dict or a sparse_scale.config.JobConfig, got {type(source).__name__}")


def _without_config(args: Any) -> Any:
    """``args`` with ``deepspeed_config`` cleared: DeepSpeed refuses a config given both there and as ``config``."""
    if args is None or getattr(args, "deepspeed_config", None) is None:
        return args
    return argparse.Namespace(**{**vars(args), "deepspeed_config": None})


# ----------------------------------------------------------------------------- the model against the blocks

def _table_classes() -> tuple[type, ...]:
    from gba_engine.packed_tables import ServerPackedFieldEmbeddings
    from gba_engine.tables import ServerEmbeddingBagCollection, ServerFieldEmbeddings
    from picasso_ops.cache.fields import CachedFieldEmbeddings
    from picasso_ops.distributed.row_sharded import RowShardedEmbeddingCollection
    from picasso_ops.embedding.packed import PackedEmbeddingCollection

    return (PackedEmbeddingCollection, RowShardedEmbeddingCollection, CachedFieldEmbeddings,
            ServerPackedFieldEmbeddings, ServerFieldEmbeddings, ServerEmbeddingBagCollection)


def _table_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The embedding-table modules of this project in ``model`` by path, outermost only (``<model>``: itself)."""
    classes, found = _table_classes(), []
    if isinstance(model, classes):
        return [("<model>", model)]
    for name, module in model.named_modules():
        if isinstance(module, classes) and not any(name.startswith(f"{outer}.") for outer, _ in found):
            found.append((name, module))
    return found


def _moe_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    from moe_proto.layer import MoEBase
    from moe_proto.replicated import ReplicatedMoE

    return [(name or "<model>", m) for name, m in model.named_modules() if isinstance(m, (MoEBase, ReplicatedMoE))]


def _check_moe_layers(model: nn.Module, job: JobConfig) -> None:
    from moe_proto.layer import MoEBase

    block, layers = job.blocks.get("moe_proto"), _moe_layers(model)
    if block is not None and not layers:
        raise SetupError(f"{job.source}: a moe_proto block, but {type(model).__name__} has no moe_proto MoE layer, "
                         "so the block would do nothing: build the layers with sparse_scale.moe_from_block(config, "
                         "hidden_size) (or remove the block)")
    if block is not None:
        for name, layer in layers:
            inner = getattr(layer, "layer", layer)
            got = {"num_experts": inner.num_experts, "num_prototypes": inner.args.num_prototypes,
                   "top_k": inner.args.k, "ep_size": inner.ep_size}
            diff = {k: v for k, v in got.items() if v != getattr(block, k)}
            if diff:
                raise SetupError(f"{job.source}: MoE layer {name} has {diff}, the moe_proto block says "
                                 f"{ {k: getattr(block, k) for k in diff} }: build it with "
                                 "sparse_scale.moe_from_block(config, hidden_size) so the block and the model agree")
    if "gba" in job.blocks:
        plain = [name for name, m in layers if isinstance(m, MoEBase)]
        if plain:
            raise SetupError(f"{job.source}: MoE layer(s) {plain} with a gba block: DeepSpeed would make expert groups "
                             "over ranks that include the parameter servers, and the servers aggregate only dense "
                             "parameters; build them with sparse_scale.moe_from_block(config, hidden_size), which "
                             "holds every expert on every worker (moe_proto.replicated.ReplicatedMoE)")


def _check_tables(model: nn.Module, job: JobConfig, world_size: int) -> None:
    block, tables = job.blocks.get("picasso"), _table_modules(model)
    if block is not None and not tables:
        raise SetupError(f"{job.source}: a picasso block, but {type(model).__name__} has no sparse-scale embedding "
                         "tables, so the block would do nothing: build them with sparse_scale.tables_from_block("
                         "config, vocab_sizes) (or remove the block)")
    if "gba" in job.blocks or not tables:
        return  # gba_engine.initialize refuses tables it cannot serve, on every rank
    from picasso_ops.distributed import replica_problems

    problems = replica_problems(model, world_size)
    if problems:
        raise SetupError(f"{job.source}: on {world_size} data-parallel ranks these tables would train apart (each "
                         f"rank updates its own copy): {'; '.join(problems)}. Build them with "
                         "sparse_scale.tables_from_block(config, vocab_sizes) (the class picasso.sharding names), or "
                         "use picasso_ops.distributed.DataParallelEmbeddingCollection / RowShardedEmbeddingCollection")
    if block is not None:
        _check_table_optimizers(tables, job)


def _check_table_optimizers(tables: list[tuple[str, nn.Module]], job: JobConfig) -> None:
    want = job.blocks["picasso"].optimizer.type
    for name, module in tables:
        for spec in getattr(module, "specs", ()):  # packed and row-sharded collections; caches take the block's
            if spec.optimizer != want:
                raise SetupError(f"{job.source}: table {spec.name!r} of {name} uses sparse optimizer "
                                 f"{spec.optimizer!r}, picasso.optimizer.type is {want!r}: build the tables with "
                                 "sparse_scale.tables_from_block(config, vocab_sizes)")


def _interleaved(model: nn.Module, job: JobConfig) -> nn.Module:
    block = job.blocks.get("picasso")
    k = block.interleave.micro_batches if block is not None else 1
    if k <= 1:
        return model
    from picasso_ops.contracts import StageableModel
    from picasso_ops.interleave.forward import InterleavedForward

    if isinstance(model, InterleavedForward):
        return model  # wrapped by the caller (picasso_ops.block.apply_picasso_block)
    if not isinstance(model, StageableModel):
        raise SetupError(f"{job.source}: picasso.interleave.micro_batches={k} overlaps the stages of a model that "
                         f"cuts itself into them (picasso_ops.contracts.StageableModel: pipeline_stages()); "
                         f"{type(model).__name__} does not: set micro_batches to 1 or give the model "
                         "pipeline_stages()")
    return InterleavedForward(model, k)


def check_model(model: nn.Module, job: JobConfig, world_size: int) -> nn.Module:
    """Refuse a model that cannot train under ``job`` on ``world_size`` ranks; returns the model to train.

    Pure of collectives, so every rank decides alone and alike. Returns ``model`` itself, or an
    ``InterleavedForward`` around it (``picasso.interleave.micro_batches > 1``). Under ZeRO stage 3
    the model's ``moe_proto.MoE`` layers become ``ZeRO3MoE`` in place (same weights).

    Example::

        model = check_model(model, load_job("cfg.json"), world_size=2)   # SetupError names what is wrong
    """
    if not isinstance(model, nn.Module):
        raise SetupError(f"{job.source}: model must be a torch.nn.Module, got {type(model).__name__}")
    check_blocks(job)
    _check_tables(model, job, world_size)
    _check_moe_layers(model, job)
    if (job.ds.get("zero_optimization") or {}).get("stage", 0) == 3:
        from moe_proto.layer import MoE
        from moe_proto.zero3 import to_zero3

        for name, layer in _moe_layers(model):
            if isinstance(layer, MoE):
                to_zero3(layer)
    return _interleaved(model, job)


# ----------------------------------------------------------------------------- the data


class PrefetchingLoader:
    """A re-iterable loader whose every pass is read ``depth`` batches ahead on a thread (``picasso.interleave``)."""

    def __init__(self, loader: Iterable[Any], depth: int) -> None:
        self.loader, self.depth = loader, depth

    def __iter__(self) -> Iterator[Any]:
        from picasso_ops.data.prefetch import Prefetcher

        return iter(Prefetcher(self.loader, depth=self.depth))

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or "loader" not in self.__dict__:
            raise AttributeError(name)
        return getattr(self.loader, name)


def _prefetching(loader: Any, job: JobConfig) -> Any:
    block = job.blocks.get("picasso")
    depth = block.interleave.prefetch_batches if block is not None else 0
    if depth <= 0:
        return loader
    if loader is None:
        logger.warning("%s: picasso.interleave.prefetch_batches=%d reads the training data ahead, but no "
                       "training_data was given to sparse_scale.initialize: wrap your own loader in "
                       "picasso_ops.data.prefetch.Prefetcher", job.source, depth)
        return None
    return PrefetchingLoader(loader, depth)


# ----------------------------------------------------------------------------- the entry point


def _dist_place(dist_init_required: bool | None) -> tuple[int, int, str]:
    """``(world size, ranks on this node, master address)`` of this launch, torch.distributed started for it."""
    import torch.distributed as dist

    from sparse_scale.distenv import DistEnvError, init_distributed, resolve_dist_env

    if dist.is_available() and dist.is_initialized():
        from sparse_scale.deepspeed_shm import release_shm_segment

        release_shm_segment()  # started by the user's deepspeed.init_distributed: its /dev/shm segment too
        world = dist.get_world_size()
        try:
            spec = resolve_dist_env(os.environ)
        except DistEnvError:  # started by the user from variables of their own: take what torch knows
            return world, int(os.environ.get("LOCAL_WORLD_SIZE", world)), os.environ.get("MASTER_ADDR", "127.0.0.1")
        return world, spec.local_world_size or world, spec.master_addr
    if dist_init_required is False:
        return 1, 1, "127.0.0.1"
    ctx = init_distributed(backend="nccl" if torch.cuda.is_available() else "gloo")
    return ctx.world_size, ctx.local_world_size or ctx.world_size, ctx.master_addr


def initialize(args: Any = None, model: nn.Module | None = None, optimizer: Any = None,
               model_parameters: Iterable[Any] | None = None, training_data: Any = None, lr_scheduler: Any = None,
               mpu: Any = None, dist_init_required: bool | None = None, collate_fn: Any = None,
               config: str | os.PathLike | Mapping[str, Any] | JobConfig | None = None,
               config_params: Mapping[str, Any] | None = None, *, threads: int = 0,
               gba_link: Any = None) -> tuple[SparseEngine, Any, Any, Any]:
    """``deepspeed.initialize`` with the plugin blocks of ``config`` applied; ``(engine, optimizer, loader, scheduler)``.

    Takes DeepSpeed's arguments. ``config``: a JSON/hjson path, a dict or a loaded
    ``JobConfig``. ``threads``: torch threads per rank (0: one per core over the ranks on this
    node unless ``OMP_NUM_THREADS`` is set). ``gba_link``: a modelled slow link to the parameter
    servers (``gba_engine.ps.link.LinkModel``), for experiments. Raises
    :class:`~sparse_scale.config.ConfigError` for a bad file and :class:`SetupError` for a model
    and config that cannot train together, before step 1, on every rank.

    Example::

        engine, optimizer, _, scheduler = sparse_scale.initialize(model=net, config="ds_configs/rec_picasso_cpu.json")
        loss = loss_fn(engine(dense, values, lengths), labels); engine.backward(loss); engine.step()
    """
    if model is None:
        raise SetupError("sparse_scale.initialize needs model=")
    job = load_job(config, args, config_params)
    world, ranks_on_node, master = _dist_place(dist_init_required)
    from sparse_scale.threads import set_default_threads

    set_default_threads(ranks_on_node, requested=threads)
    gba = job.blocks.get("gba")
    data_parallel = world - (gba.num_servers if gba is not None else 0)
    model = check_model(model, job, data_parallel)
    sparse_lr = _sparse_lr(model, job)
    if gba is not None:
        return _initialize_gba(job, model, model_parameters, master, gba_link, sparse_lr,
                               training_data=training_data, collate_fn=collate_fn, lr_scheduler=lr_scheduler,
                               optimizer=optimizer, dist_init_required=dist_init_required)
    import deepspeed

    from moe_proto.clipping import bind_expert_aware_clipping
    from moe_proto.param_groups import has_moe_layers, moe_param_groups

    params = moe_param_groups(model, model_parameters) if optimizer is None or model_parameters is not None else None
    ds_engine, ds_optimizer, loader, scheduler = deepspeed.initialize(
        args=_without_config(args), model=model, optimizer=optimizer, model_parameters=params,
        training_data=training_data, lr_scheduler=lr_scheduler, mpu=mpu, dist_init_required=dist_init_required,
        collate_fn=collate_fn, config=job.ds)
    if has_moe_layers(model):
        bind_expert_aware_clipping(ds_engine)  # DeepSpeed's fp32 clip counts replicated experts once per rank
    engine = SparseEngine(ds_engine, gba=False, sparse_lr=sparse_lr, picasso=job.blocks.get("picasso"))
    return engine, ds_optimizer, _prefetching(loader, job), scheduler


def _sparse_lr(model: nn.Module, job: JobConfig) -> float | None:
    """The tables' peak lr for DeepSpeed's schedule; with ``lr_schedule: "constant"`` the block's lr is set once."""
    from picasso_ops.block import scheduled_sparse_lr
    from picasso_ops.distributed.step import set_sparse_lr

    block = job.blocks.get("picasso")
    if block is None or scheduled_sparse_lr(block) is not None:
        return scheduled_sparse_lr(block)

    set_sparse_lr(model, float(block.optimizer.lr))
    return None


def _initialize_gba(job: JobConfig, model: nn.Module, model_parameters: Any, master: str, link: Any,
                    sparse_lr: float | None, **deepspeed_kwargs: Any) -> tuple[SparseEngine, Any, Any, Any]:
    import gba_engine

    if deepspeed_kwargs.get("optimizer") is not None or deepspeed_kwargs.get("lr_scheduler") is not None:
        raise SetupError(f"{job.source}: with a gba block the optimizer and lr schedule come from the config (the "
                         "servers run them too); pass neither optimizer= nor lr_scheduler=")
    kwargs = {k: v for k, v in deepspeed_kwargs.items() if v is not None and k not in ("optimizer", "lr_scheduler")}
    picasso = job.blocks.get("picasso")
    cache = picasso.cache if picasso is not None and picasso.cache is not None and picasso.cache.store == "ps" else None
    config = {**job.ds, "gba": job.blocks["gba"].model_dump()}
    engine = gba_engine.initialize(model=model, config=config, model_parameters=model_parameters,
                                   control_host=master, row_cache=cache, link=link, **kwargs)
    wrapped = SparseEngine(engine, gba=True, sparse_lr=sparse_lr, picasso=picasso)
    ds = getattr(engine, "ds_engine", None)
    return (wrapped, getattr(ds, "optimizer", None), getattr(ds, "training_dataloader", None),
            getattr(ds, "lr_scheduler", None))


def with_block(job: JobConfig, name: str, block: Any) -> JobConfig:
    """``job`` with its block ``name`` replaced (a job layer's own settings, e.g. the gba control file)."""
    return dataclasses.replace(job, blocks={**job.blocks, name: block})
