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
import importlib
import os
from typing import Any, Mapping

import pydantic

from sparse_core.config_file import (DEEPSPEED_KEYS, PLUGIN_BLOCK_NAMES, ConfigError, read_config_file,  # noqa: F401
                                           split_config, validate_model)

# block name -> "module:Model"; imported lazily so a package's block is only checked when present.
PLUGIN_BLOCKS: dict[str, str] = {
    "picasso": "picasso_ops.config:PicassoConfig",
    "moe_proto": "moe_proto.config:MoEProtoConfig",
    "moe_model": "moe_proto.models.config:MoEModelConfig",
    "gba": "gba_engine.config:GBAConfig",
}
if tuple(PLUGIN_BLOCKS) != PLUGIN_BLOCK_NAMES:  # the foundation splits blocks by name; both lists must agree
    raise RuntimeError(f"PLUGIN_BLOCKS {tuple(PLUGIN_BLOCKS)} != sparse_core PLUGIN_BLOCK_NAMES {PLUGIN_BLOCK_NAMES}")


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


def _model_class(spec: str) -> type[pydantic.BaseModel]:
    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name)


def validate_block(name: str, raw: Any, source: str = "<dict>") -> pydantic.BaseModel:
    """Validate one plugin block with its package's model; errors name ``source`` and the key path."""
    return validate_model(name, _model_class(PLUGIN_BLOCKS[name]), raw, source)


def parse_config(data: Mapping[str, Any], source: str = "<dict>") -> JobConfig:
    """Split a config dict into DeepSpeed's part and the validated plugin blocks."""
    ds, raw = split_config(data, source)
    blocks = {name: validate_block(name, value, source) for name, value in raw.items()}
    return JobConfig(source=source, ds=ds, blocks=blocks)


def load_config(path: str | os.PathLike) -> JobConfig:
    """Read and validate a DeepSpeed config file with sparse-scale plugin blocks."""
    return parse_config(read_config_file(path), source=str(path))
