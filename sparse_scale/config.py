"""Load a DeepSpeed JSON/hjson config and validate the plugin blocks in it.

    >>> job = load_config("ds_configs/demo_cpu.json")
    >>> job.ds["train_micro_batch_size_per_gpu"], job.blocks["gba"].mode
    (256, 'sync')

DeepSpeed keeps unknown top-level keys silently (DeepSpeed #653), so a misspelt
plugin block would be ignored; here it is an error that names the file, the key
and the nearest valid name. Each package validates its own block with a pydantic
model (``extra="forbid"``); this module only finds the models and turns
pydantic's errors into one readable message.
"""
from __future__ import annotations

import dataclasses
import difflib
import importlib
import json
import logging
import os
import types
import typing
from pathlib import Path
from typing import Any, Mapping

import hjson
import pydantic

logger = logging.getLogger(__name__)

# block name -> "module:Model"; imported lazily so a package's block is only checked when present.
PLUGIN_BLOCKS: dict[str, str] = {
    "picasso": "picasso_ops.config:PicassoConfig",
    "moe_proto": "moe_proto.config:MoEProtoConfig",
    "moe_model": "moe_proto.models.config:MoEModelConfig",
    "gba": "gba_engine.config:GBAConfig",
}

# Top-level keys DeepSpeed itself reads (0.19.8); used only to tell a typo from a DeepSpeed key.
DEEPSPEED_KEYS = frozenset({
    "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
    "optimizer", "scheduler", "fp16", "bf16", "amp", "gradient_clipping", "prescale_gradients",
    "gradient_predivide_factor", "sparse_gradients", "zero_optimization", "zero_allow_untested_optimizer",
    "zero_force_ds_cpu_optimizer", "steps_per_print", "wall_clock_breakdown", "dump_state",
    "memory_breakdown", "flops_profiler", "activation_checkpointing", "communication_data_type",
    "seq_parallel_communication_data_type", "tensorboard", "wandb", "csv_monitor", "comet",
    "aio", "elasticity", "pipeline", "checkpoint", "data_types", "data_efficiency", "curriculum_learning",
    "compression_training", "autotuning", "nebula", "eigenvalue", "progressive_layer_drop",
    "sparse_attention", "disable_allgather", "zero_quantized_weights", "zero_quantized_gradients",
    "compile", "timers", "comms_logger", "weight_quantization", "hybrid_engine", "use_data_before_expert_parallelism",
    "graph_harvesting", "torch_autocast", "tensor_parallel", "train_batch_size_per_gpu", "mics_shard_size",
    "mics_hierarchical_params_gather", "load_universal_checkpoint", "use_node_local_storage",
    "checkpoint_parallel_write_pipeline", "dataloader_drop_last", "quantize_training",
})


class ConfigError(ValueError):
    """A config file is unreadable or a value in it is invalid; the message says where."""


@dataclasses.dataclass(frozen=True)
class JobConfig:
    """A loaded job: the dict for ``deepspeed.initialize`` and the validated plugin blocks."""

    source: str
    ds: dict[str, Any]  # DeepSpeed's part, without the plugin blocks
    blocks: Mapping[str, pydantic.BaseModel]  # only the blocks present in the file

    def block(self, name: str, default: pydantic.BaseModel | None = None) -> Any:
        """The validated block ``name``, or ``default`` when the file has none."""
        if name not in PLUGIN_BLOCKS:
            raise KeyError(f"unknown plugin block {name!r}; known: {sorted(PLUGIN_BLOCKS)}")
        return self.blocks.get(name, default)


def _reject_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ConfigError(f"duplicate key {key!r}")
        out[key] = value
    return out


def read_config_file(path: str | os.PathLike) -> dict[str, Any]:
    """Parse a JSON or hjson file (as DeepSpeed does), rejecting duplicate keys."""
    p = Path(path)
    try:
        text = p.read_text()
    except FileNotFoundError:
        raise ConfigError(f"{p}: config file not found") from None
    except OSError as e:
        raise ConfigError(f"{p}: cannot read config file: {e.strerror}") from None
    try:
        if p.suffix == ".json":
            data = json.loads(text, object_pairs_hook=_reject_duplicates)
        else:
            data = hjson.loads(text, object_pairs_hook=_reject_duplicates)
    except ConfigError as e:
        raise ConfigError(f"{p}: {e}") from None
    except (json.JSONDecodeError, hjson.HjsonDecodeError) as e:
        raise ConfigError(f"{p}: not valid {p.suffix.lstrip('.') or 'hjson'}: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: top level must be an object, got {type(data).__name__}")
    return data


def _nearest(word: str, candidates: typing.Iterable[str]) -> str | None:
    hits = difflib.get_close_matches(word.strip().lower(), list(candidates), n=1, cutoff=0.6)
    return hits[0] if hits else None


def _model_class(spec: str) -> type[pydantic.BaseModel]:
    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name)


def _submodel(annotation: Any) -> type[pydantic.BaseModel] | None:
    """The pydantic model inside an annotation such as ``Optional[CacheConfig]``."""
    if isinstance(annotation, type) and issubclass(annotation, pydantic.BaseModel):
        return annotation
    if typing.get_origin(annotation) in (typing.Union, types.UnionType, typing.Annotated):
        for arg in typing.get_args(annotation):
            found = _submodel(arg)
            if found is not None:
                return found
    return None


def _fields_at(model: type[pydantic.BaseModel], loc: tuple) -> list[str]:
    """The valid field names of the model found by walking ``loc`` from ``model``."""
    current: type[pydantic.BaseModel] | None = model
    for part in loc:
        if current is None or not isinstance(part, str) or part not in current.model_fields:
            return []
        current = _submodel(current.model_fields[part].annotation)
    return list(current.model_fields) if current is not None else []


def _describe(source: str, block: str, model: type[pydantic.BaseModel], err: pydantic.ValidationError) -> str:
    lines = []
    for e in err.errors():
        loc = tuple(x for x in e["loc"] if not isinstance(x, str) or not x.startswith("function-"))
        path = ".".join([block, *map(str, loc)])
        if e["type"] == "extra_forbidden":
            near = _nearest(str(loc[-1]), _fields_at(model, loc[:-1]))
            hint = f"; did you mean {near!r}?" if near else f"; valid keys: {_fields_at(model, loc[:-1])}"
            lines.append(f"{source}: {path}: unknown key{hint}")
        else:
            lines.append(f"{source}: {path}: {e['msg']} (got {e.get('input')!r})")
    return "\n".join(lines)


def validate_block(name: str, raw: Any, source: str = "<dict>") -> pydantic.BaseModel:
    """Validate one plugin block with its package's model; errors name ``source`` and the key path."""
    model = _model_class(PLUGIN_BLOCKS[name])
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: {name}: must be an object, got {raw!r}")
    try:
        return model.model_validate(raw)
    except pydantic.ValidationError as e:
        raise ConfigError(_describe(source, name, model, e)) from None


def parse_config(data: Mapping[str, Any], source: str = "<dict>") -> JobConfig:
    """Split a config dict into DeepSpeed's part and the validated plugin blocks."""
    ds: dict[str, Any] = {}
    blocks: dict[str, pydantic.BaseModel] = {}
    for key, value in data.items():
        if key in PLUGIN_BLOCKS:
            blocks[key] = validate_block(key, value, source)
            continue
        if key not in DEEPSPEED_KEYS:
            near_plugin = _nearest(key, PLUGIN_BLOCKS)
            if near_plugin is not None:
                raise ConfigError(
                    f"{source}: top-level key {key!r} is not a known block; did you mean {near_plugin!r}? "
                    "(DeepSpeed would ignore it silently)"
                )
            near_ds = _nearest(key, DEEPSPEED_KEYS)
            if near_ds is not None:
                raise ConfigError(f"{source}: top-level key {key!r} is not a DeepSpeed key; did you mean {near_ds!r}?")
            logger.warning("%s: top-level key %r is neither a DeepSpeed key nor a sparse-scale block", source, key)
        ds[key] = value
    return JobConfig(source=source, ds=ds, blocks=blocks)


def load_config(path: str | os.PathLike) -> JobConfig:
    """Read and validate a DeepSpeed config file with sparse-scale plugin blocks."""
    return parse_config(read_config_file(path), source=str(path))
