"""The engine ``sparse_scale.initialize`` returns: DeepSpeed's (or GBA's) with each block's work in its own methods.

Everything DeepSpeed's engine has is reachable on it (``engine.global_steps``, ``engine.monitor``,
``engine.get_lr()``, ...); these methods do more:

* ``step()``: DeepSpeed's step, then at the accumulation boundary the sparse tables' step
  (``picasso_ops.distributed.engine_step``: their optimizer at DeepSpeed's lr schedule, dropped
  with a skipped fp16 step) and the MoE layers' expert-bias update from the step's loads;
  under a gba block the GBA engine's step (the servers own tables and dense state);
* ``pipeline(batches)``: the batches with each next one's ids read, deduplicated and exchanged
  on a thread while this one trains (``picasso.pipeline``); ``step()`` tells it the step is done;
* ``save_checkpoint`` / ``load_checkpoint``: hot-row caches flushed first; a model with
  ``moe_proto`` MoE layers goes through ``moe_proto.checkpoint`` (expert rows per global
  expert, reloads at any ep_size, ZeRO 0-3) plus each rank's other module state;
* ``close()``: a gba worker leaves the job (also at exit).

Example::

    engine, optimizer, _, scheduler = sparse_scale.initialize(model=model, config="ds_config.json")
    loss = loss_fn(engine(batch)); engine.backward(loss); engine.step()
    engine.save_checkpoint("ckpt")                 # tag global_step<N>, like DeepSpeed
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist

from moe_proto.balance import balance_modules, reset_expert_loads, update_expert_biases
from moe_proto.param_groups import has_moe_layers
from picasso_ops.block import flush_caches
from picasso_ops.distributed import engine_step

logger = logging.getLogger(__name__)

MODULE_STATE_FILE = "module_state_rank{rank}.pt"  # beside a moe_proto checkpoint: buffers, tables, client state


class SparseEngine:
    """A DeepSpeed (or GBA) engine whose ``step``, ``save_checkpoint`` and ``load_checkpoint`` serve every block.

    Built by :func:`sparse_scale.initialize`; ``inner`` is the engine it wraps (``deepspeed``'s
    ``DeepSpeedEngine`` or ``gba_engine.GBAEngine``). ``is_server``: this rank is a gba parameter
    server that served the whole job inside ``initialize``; skip the training loop there.

    Example::

        if engine.is_server:
            return
        out = engine(x); engine.backward(loss_fn(out, y)); engine.step()
    """

    _OWN = frozenset({"inner", "gba", "sparse_lr", "is_server", "module", "picasso", "_moe", "_balanced", "_loader"})

    def __init__(self, inner: Any, *, gba: bool, sparse_lr: float | None, picasso: Any = None) -> None:
        self.inner, self.gba, self.sparse_lr = inner, gba, sparse_lr
        self.picasso = picasso  # the config's picasso block (None: none)
        self.is_server = bool(getattr(inner, "is_server", False))
        self.module: torch.nn.Module = inner.module
        self._moe = has_moe_layers(self.module)
        self._balanced = bool(balance_modules(self.module))
        self._loader: Any = None  # the open engine.pipeline() pass, told of each step

    def __getattr__(self, name: str) -> Any:
        inner = self.__dict__.get("inner")
        if inner is None or name.startswith("__"):
            raise AttributeError(name)
        return getattr(inner, name)

    def __setattr__(self, name: str, value: Any) -> None:
        # the wrapper's own names stay here; the rest (engine.global_steps = ..., as DeepSpeed code does) go inside
        if name in self._OWN or "inner" not in self.__dict__ or hasattr(type(self), name):
            object.__setattr__(self, name, value)
        else:
            setattr(self.inner, name, value)

    def __repr__(self) -> str:
        return f"SparseEngine({type(self.inner).__name__}, module={type(self.module).__name__})"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.inner(*args, **kwargs)

    forward = __call__

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> Any:
        return self.inner.backward(loss, **kwargs)

    def step(self) -> None:
        """The optimizer step of every part of the model (at the gradient-accumulation boundary)."""
        if self.gba:
            self.inner.step()
            return
        boundary = engine_step(self.inner, sparse_lr=self.sparse_lr)
        if boundary and self._balanced:
            if self.inner.was_step_applied():
                update_expert_biases(self.module)  # collective over the world: every rank steps together
            else:
                reset_expert_loads(self.module)
        if self._loader is not None:
            self._loader.step_done()  # the tables are updated: the next batch's rows may be fetched

    def pipeline(self, batches: Iterable[Any], ids: Callable[[Any], tuple[torch.Tensor, ...]] | None = None,
                 *, timeout_s: float = 300.0) -> Iterable[Any]:
        """``batches``, each next one's sparse ids read and exchanged on a thread while this one trains.

        As ``picasso.pipeline`` says (``"row_wise"``, the default: the row-wise tables; ``"all"``: also
        the data-parallel ones; ``"off"``); where it does not apply (no such tables, a gba block,
        ``interleave.micro_batches > 1``, a cache) ``batches`` come back as they are, and rank 0 logs
        why. Results equal the unpipelined loop's bit for bit. A collective: every rank calls it and
        iterates in step, one ``engine.step()`` per batch. ``ids``: a batch's field-major ``(values,
        lengths)`` as the model's tables get them (default: the batch's torchrec ``KeyedJaggedTensor``).
        Calling it again ends the pass before.

        Example::

            for dense, kjt, labels in engine.pipeline(loader):
                engine.backward(loss_fn(engine(dense, kjt), labels)); engine.step()
        """
        from picasso_ops.distributed.pipelined_loader import PipelinedLoader, unpipelined_reason

        self.close_pipeline()
        block = self.picasso
        mode = block.pipeline if block is not None else "row_wise"
        why = "a gba block's tables live on the parameter servers" if self.gba else unpipelined_reason(
            mode, self.module, micro_batches=block.interleave.micro_batches if block is not None else 1,
            cache=block is not None and block.cache is not None)
        if why is not None:
            if _rank() == 0:
                logger.info("engine.pipeline: the batches run unpipelined (%s)", why)
            return batches
        self._loader = PipelinedLoader(self.module, batches, ids, data_parallel=mode == "all", timeout_s=timeout_s)
        return self._loader

    def close_pipeline(self) -> None:
        """End the open :meth:`pipeline` pass early (every rank); nothing when none is open."""
        loader, self._loader = self._loader, None
        if loader is not None:
            loader.close()

    def train(self, mode: bool = True) -> "SparseEngine":
        self.inner.train(mode)
        return self

    def eval(self) -> "SparseEngine":
        self.inner.eval()
        return self

    def close(self) -> None:
        """End an open :meth:`pipeline` pass; a gba worker leaves the job (the servers stop once every worker closed)."""
        self.close_pipeline()
        if self.gba:
            self.inner.close()

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, save_dir: str, tag: str | None = None, client_state: dict[str, Any] | None = None,
                        save_latest: bool = True, **kwargs: Any) -> Any:
        """Save the whole model where DeepSpeed would (``<save_dir>/<tag>``, ``latest``); every rank calls it."""
        flush_caches(self.module)  # a hot-row cache's dirty rows go to the stores the state is read from
        client_state = dict(client_state or {})
        if self.gba:
            return self.inner.save_checkpoint(save_dir, tag=tag, client_state=client_state)
        if not self._moe:
            from picasso_ops.distributed.shard_checkpoint import save_row_shards

            tag = tag or f"global_step{self.inner.global_steps}"  # DeepSpeed's default tag, needed here first
            # DeepSpeed keeps rank 0's module state only: every rank writes its row-wise shards first, and
            # DeepSpeed's save ends with a barrier, so they are on disk before "latest" names the tag
            save_row_shards(self.module, Path(save_dir) / tag, _rank())
            return self.inner.save_checkpoint(save_dir, tag=tag, client_state=client_state, save_latest=save_latest,
                                              **kwargs)
        _refuse_options("save_checkpoint", kwargs)
        from moe_proto.checkpoint import expert_buffers
        from moe_proto.checkpoint import save_checkpoint as save_moe
        from moe_proto.ds_layout import stacked_layout

        tag = tag or f"global_step{self.inner.global_steps}"
        save_moe(self.inner, save_dir, tag)  # collective; creates <save_dir>/<tag>
        in_moe_files = {name for name, _ in self.module.named_parameters()} | set(expert_buffers(self.module))
        with stacked_layout(self.module):  # the layers' own keys: the experts are in moe_proto's files
            state = {k: v for k, v in self.module.state_dict().items() if k not in in_moe_files}
        torch.save({"module_state": state, "client_state": client_state},
                   Path(save_dir) / tag / MODULE_STATE_FILE.format(rank=_rank()))
        if dist.is_initialized():
            dist.barrier()
        if save_latest and _rank() == 0:
            (Path(save_dir) / "latest").write_text(tag)  # last: a half-written checkpoint is never "latest"
        return True

    def load_checkpoint(self, load_dir: str, tag: str | None = None, **kwargs: Any) -> tuple[str | None, dict]:
        """Restore what :meth:`save_checkpoint` wrote; ``(path, client_state)``, ``(None, {})`` when there is none."""
        if self.gba:
            _refuse_options("load_checkpoint", kwargs)
            return self.inner.load_checkpoint(load_dir, tag=tag)
        if not self._moe:
            return self._load_with_row_shards(load_dir, tag, kwargs)
        _refuse_options("load_checkpoint", kwargs)
        from moe_proto.checkpoint import expert_buffers
        from moe_proto.checkpoint import load_checkpoint as load_moe

        if tag is None:
            latest = Path(load_dir) / "latest"
            if not latest.is_file():
                logger.warning("load_checkpoint: no 'latest' in %s; nothing loaded", load_dir)
                return None, {}
            tag = latest.read_text().strip()
        load_moe(self.inner, load_dir, tag)
        path = Path(load_dir) / tag / MODULE_STATE_FILE.format(rank=_rank())
        if not path.is_file():
            raise FileNotFoundError(f"{path} is missing: the checkpoint was saved by another world size or is "
                                    "incomplete (each rank saves its own module state)")
        saved = torch.load(path, map_location="cpu", weights_only=False)
        missing, unexpected = self.module.load_state_dict(saved["module_state"], strict=False)
        in_moe_files = {name for name, _ in self.module.named_parameters()} | set(expert_buffers(self.module))
        if unexpected or set(missing) - in_moe_files:
            raise ValueError(f"{path}: the checkpoint's module state does not fit the model "
                             f"(unexpected {unexpected}, missing {sorted(set(missing) - in_moe_files)})")
        return str(Path(load_dir) / tag), saved["client_state"]

    def _load_with_row_shards(self, load_dir: str, tag: str | None, kwargs: dict[str, Any]) -> tuple[str | None, dict]:
        """DeepSpeed's load, then every rank's row-wise shards from the shard files (at this or another world size).

        Rank 0's shards in DeepSpeed's module state are skipped (another rank's shard may have another number
        of rows); everything else of the module loads strictly, as DeepSpeed's own load does.
        """
        from picasso_ops.distributed.shard_checkpoint import load_row_shards, row_shard_keys

        skip = row_shard_keys(self.module)
        if not skip:
            return self.inner.load_checkpoint(load_dir, tag=tag, **kwargs)
        if "custom_load_fn" in kwargs:
            raise TypeError("load_checkpoint(custom_load_fn=...): not supported for models with row-wise tables "
                            "(their shards are loaded from each rank's shard file)")
        path, client = self.inner.load_checkpoint(load_dir, tag=tag, custom_load_fn=_loader_skipping(skip), **kwargs)
        if path is not None:  # DeepSpeed names its model-states file
            load_row_shards(self.module, Path(path) if Path(path).is_dir() else Path(path).parent)
        return path, client


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _refuse_options(what: str, kwargs: dict[str, Any]) -> None:
    if kwargs:
        raise TypeError(f"{what}({', '.join(f'{k}=' for k in sorted(kwargs))}): not supported for models with "
                        "moe_proto MoE layers or under a gba block (their checkpoints save and load everything)")


def _loader_skipping(skip: set[str]) -> Any:
    """DeepSpeed's ``custom_load_fn``: a strict module load of every key but ``skip`` (loaded from shard files)."""

    def load(src: dict[str, Any], dst: torch.nn.Module) -> None:
        missing, unexpected = dst.load_state_dict({k: v for k, v in src.items() if k not in skip}, strict=False)
        missing = [k for k in missing if k not in skip]
        if missing or unexpected:
            raise ValueError(f"load_checkpoint: the checkpoint's module state does not fit the model (missing "
                             f"{missing[:8]}, unexpected {unexpected[:8]})")

    return load
