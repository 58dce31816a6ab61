"""Reading a DeepSpeed JSON/hjson file and checking its plugin blocks, without knowing any package.

    >>> data = read_config_file("ds_configs/demo_cpu.json")
    >>> ds, raw_blocks = split_config(data, source="ds_configs/demo_cpu.json")
    >>> sorted(raw_blocks)
    ['gba']

The packages use this to read their own block (``gba_engine.initialize`` takes a path);
``sparse_scale.config`` adds the registry that validates every block of a job. Block
names here are data (``PLUGIN_BLOCK_NAMES``): nothing in this module imports a package.
"""
from __future__ import annotations

import difflib
import json
import logging
import os
import re
import types
import typing
from pathlib import Path
from typing import Any, Mapping, TypeVar

import hjson
import pydantic

logger = logging.getLogger(__name__)

# The plugin blocks of this project, by name (sparse_scale.config maps each to its package's model).
PLUGIN_BLOCK_NAMES = ("picasso", "moe_proto", "moe_model", "gba")

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


_INTEGER_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


def _reject_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ConfigError(f"duplicate key {key!r}")
        out[key] = value
    return out


_NOT_READ = "DeepSpeed configs are JSON or hjson"
_YAML_SUFFIXES = (".yaml", ".yml")
# hjson reads a YAML block mapping ("optimizer:" then indented "type: AdamW") as the string "type: AdamW"
_YAML_NESTING = re.compile(r"^[A-Za-z_][\w.-]*\s*:(\s|$)")


def read_config_file(path: str | os.PathLike) -> dict[str, Any]:
    """Parse a JSON or hjson file (as DeepSpeed does), rejecting duplicate keys, YAML and non-object files."""
    p = Path(path)
    if p.suffix.lower() in _YAML_SUFFIXES:  # hjson would read it into strings DeepSpeed trips over later
        raise ConfigError(f"{p}: YAML is not read ({_NOT_READ}); convert the file to JSON with the same keys")
    try:
        text = p.read_text()
    except FileNotFoundError:
        raise ConfigError(f"{p}: config file not found") from None
    except OSError as e:
        raise ConfigError(f"{p}: cannot read config file: {e.strerror}") from None
    except UnicodeDecodeError as e:  # a binary or non-UTF-8 file: say so instead of a decoder traceback
        raise ConfigError(f"{p}: not a text (UTF-8) config file: byte {e.start} is {e.object[e.start:e.start + 1]!r}"
                          ) from None
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
        raise ConfigError(f"{p}: top level must be an object, got {type(data).__name__}: not a config in a format "
                          f"that is read ({_NOT_READ}, with {{...}} at the top)")
    if p.suffix != ".json":
        for key, value in data.items():
            if isinstance(value, str) and _YAML_NESTING.match(value):
                raise ConfigError(f"{p}: looks like YAML, which is not read ({_NOT_READ}): hjson reads the indented "
                                  f"block under {key!r} as the string {value!r}; write it as {key}: {{...}}")
    return data


def _nearest(word: str, candidates: typing.Iterable[str]) -> str | None:
    hits = difflib.get_close_matches(word.strip().lower(), list(candidates), n=1, cutoff=0.6)
    return hits[0] if hits else None


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


def describe_errors(source: str, block: str, model: type[pydantic.BaseModel], err: pydantic.ValidationError) -> str:
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



Model = TypeVar("Model", bound=pydantic.BaseModel)


def validate_model(name: str, model: type[Model], raw: Any, source: str = "<dict>") -> Model:
    """Validate block ``name`` with ``model``; errors name ``source``, the key path and the nearest valid key.

    Example::

        gba = validate_model("gba", GBAConfig, {"mode": "auto"}, source="job.json")
    """
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: {name}: must be an object, got {raw!r}")
    try:
        return model.model_validate(raw)
    except pydantic.ValidationError as e:
        raise ConfigError(describe_errors(source, name, model, e)) from None


def split_config(data: Mapping[str, Any], source: str = "<dict>") -> tuple[dict[str, Any], dict[str, Any]]:
    """DeepSpeed's part of a config and its raw plugin blocks; a key that looks like a misspelt block is an error.

    DeepSpeed keeps unknown top-level keys silently (DeepSpeed #653), so ``"picaso"`` would be
    ignored there; here it names the nearest block (or DeepSpeed key).
    """
    ds: dict[str, Any] = {}
    blocks: dict[str, Any] = {}
    for key, value in data.items():
        if key in PLUGIN_BLOCK_NAMES:
            blocks[key] = value
            continue
        if key not in DEEPSPEED_KEYS:
            near_plugin = _nearest(key, PLUGIN_BLOCK_NAMES)
            if near_plugin is not None:
                raise ConfigError(
                    f"{source}: top-level key {key!r} is not a known block; did you mean {near_plugin!r}? "
                    "(DeepSpeed would ignore it silently)"
                )
            near_ds = _nearest(key, DEEPSPEED_KEYS)
            if near_ds is not None:
                raise ConfigError(f"{source}: top-level key {key!r} is not a DeepSpeed key; did you mean {near_ds!r}?")
            logger.warning("%s: top-level key %r is neither a DeepSpeed key nor a sparse-scale block", source, key)
        if key in _INTEGER_KEYS and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            # DeepSpeed would fail later with a bare TypeError that names neither the file nor the key
            raise ConfigError(f"{source}: {key} must be a whole number >= 1, got {value!r}")
        ds[key] = value
    return ds, blocks
