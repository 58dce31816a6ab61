"""Generate the config reference (docs/config.md) from the plugin-block models.

    >>> text = render_config_reference()
    >>> "| `gba.staleness.threshold` |" in text
    True

Every block registered in ``sparse_scale.config.PLUGIN_BLOCKS`` is walked field by field,
nested models included: key path, JSON type, default, constraints and a description (the
field's ``Field(description=...)``, else the comment written beside or above the field in its
model's source, else the nested model's docstring). ``python -m sparse_scale.config_reference``
writes the file; ``--check`` exits 1 when the file on disk differs (tests/repo/test_docs.py runs it).
"""
from __future__ import annotations

import argparse
import ast
import dataclasses
import difflib
import importlib
import inspect
import io
import json
import logging
import re
import sys
import textwrap
import tokenize
import types
import typing
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

import annotated_types
import pydantic
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from sparse_scale.config import PLUGIN_BLOCKS

logger = logging.getLogger(__name__)

DEFAULT_OUTPUT = Path(__file__).resolve().parents[1] / "docs" / "config.md"

# the docs/ page that explains each block's behaviour (the reference only lists its keys)
BLOCK_PAGES: Mapping[str, str] = {
    "picasso": "picasso.md", "moe_proto": "moe.md", "moe_model": "moe.md", "gba": "gba.md",
}
NESTED_DEFAULT = "each key's default"  # a nested model's default is spelled out in its own rows
_JSON_TYPES = {bool: "boolean", int: "integer", float: "number", str: "string", type(None): "null"}
_BOUNDS = ((annotated_types.Gt, "gt", ">"), (annotated_types.Ge, "ge", ">="),
           (annotated_types.Lt, "lt", "<"), (annotated_types.Le, "le", "<="))


@dataclasses.dataclass(frozen=True)
class FieldRow:
    """One key of a block, as the reference table shows it.

        >>> FieldRow("gba.mode", '"sync" | "gba" | "auto"', '"sync"', "", "training mode").key
        'gba.mode'
    """

    key: str
    type: str
    default: str
    constraints: str
    description: str


def model_class(spec: str) -> type[pydantic.BaseModel]:
    """The model named by a ``"module:Class"`` spec, e.g. ``model_class("gba_engine.config:GBAConfig")``."""
    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name)


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _first_paragraph(doc: str | None) -> str:
    return _one_line(inspect.cleandoc(doc).split("\n\n")[0]) if doc else ""


def field_comments(model: type[pydantic.BaseModel]) -> dict[str, str]:
    """Field name -> the comment beside it or on the lines just above it in the class source.

        >>> field_comments(model_class("gba_engine.config:SwitchConfig"))["window"]
        'step times per worker in the robust statistic'
    """
    try:
        source = textwrap.dedent(inspect.getsource(model))
    except (OSError, TypeError):
        return {}
    comments: dict[int, str] = {}  # line number -> comment text
    code_lines: set[int] = set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string.lstrip("#").strip()
        elif tok.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER):
            code_lines.add(tok.start[0])
    class_def = ast.parse(source).body[0]
    out: dict[str, str] = {}
    for stmt in getattr(class_def, "body", []):
        if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
            continue
        above: list[str] = []
        line = stmt.lineno - 1
        while line in comments and line not in code_lines:  # a block of comment-only lines just above
            above.insert(0, comments[line])
            line -= 1
        beside = [comments[n] for n in range(stmt.lineno, stmt.end_lineno + 1) if n in comments]
        text = " ".join(above + beside)
        if text:
            out[stmt.target.id] = text
    return out


def _strip_annotated(annotation: Any) -> tuple[Any, list[Any]]:
    """``Annotated[int, Gt(0)]`` -> ``(int, [Gt(0)])``; other annotations come back with no metadata."""
    if typing.get_origin(annotation) is typing.Annotated:
        base, *metadata = typing.get_args(annotation)
        return base, list(metadata)
    return annotation, []


def _union_members(annotation: Any) -> list[Any]:
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return list(typing.get_args(annotation))
    return [annotation]


def _submodel(annotation: Any) -> type[pydantic.BaseModel] | None:
    for member in _union_members(annotation):
        base, _ = _strip_annotated(member)
        if isinstance(base, type) and issubclass(base, pydantic.BaseModel):
            return base
    return None


def _type_name(annotation: Any) -> str:
    parts = []
    for member in _union_members(annotation):
        base, _ = _strip_annotated(member)
        if typing.get_origin(base) is typing.Literal:
            parts.extend(json.dumps(v) for v in typing.get_args(base))
        elif isinstance(base, type) and issubclass(base, pydantic.BaseModel):
            parts.append(f"object ({base.__name__})")
        else:
            parts.append(_JSON_TYPES.get(base, getattr(base, "__name__", str(base))))
    return " | ".join(parts)


def _constraints(info: FieldInfo) -> str:
    metadata = list(info.metadata)
    for member in _union_members(info.annotation):
        metadata.extend(_strip_annotated(member)[1])
    found = []
    for meta in metadata:
        for kind, attr, symbol in _BOUNDS:
            if isinstance(meta, kind):
                found.append(f"{symbol} {getattr(meta, attr)}")
        if isinstance(meta, annotated_types.MultipleOf):
            found.append(f"multiple of {meta.multiple_of}")
        if isinstance(meta, annotated_types.MinLen):
            found.append(f"length >= {meta.min_length}")
        if isinstance(meta, annotated_types.MaxLen):
            found.append(f"length <= {meta.max_length}")
    return ", ".join(found)


def _default(info: FieldInfo) -> str:
    if info.default_factory is not None:
        value = info.default_factory()
    elif info.default is PydanticUndefined:
        return "required"
    else:
        value = info.default
    if isinstance(value, pydantic.BaseModel):
        return NESTED_DEFAULT
    return json.dumps(value)


def _describe_format(node: ast.expr) -> str:
    """Source of an f-string's ``{...}`` part, without ``self.``."""
    return ast.unparse(node).replace("self.", "")


def cross_field_checks(model: type[pydantic.BaseModel]) -> list[str]:
    """The rules a model's validators enforce: each one's docstring, else its ``raise`` messages.

        >>> cross_field_checks(model_class("gba_engine.config:SwitchConfig"))
        ['recover_ratio must be below slow_ratio']
    """
    checks = []
    for decorator in model.__pydantic_decorators__.model_validators.values():
        func = decorator.func
        if func.__doc__:
            checks.append(_first_paragraph(func.__doc__))
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(func)))
        except (OSError, TypeError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call) and node.exc.args:
                message = node.exc.args[0]
                if isinstance(message, ast.JoinedStr):
                    text = "".join(
                        part.value if isinstance(part, ast.Constant) else "{" + _describe_format(part.value) + "}"
                        for part in message.values
                    )
                elif isinstance(message, ast.Constant):
                    text = str(message.value)
                else:
                    continue
                text = re.sub(r"(\w+)=\{[^}]*\}", r"\1", text)  # "x={self.x}" -> "x"
                text = re.sub(r"\{([^}]*)\}", r"\1", text)
                checks.append(text)
    return checks


def field_rows(prefix: str, model: type[pydantic.BaseModel]) -> Iterator[FieldRow]:
    """Every key of ``model`` under ``prefix``, nested models expanded after their own row.

        >>> [r.key for r in field_rows("gba", model_class("gba_engine.config:GBAConfig"))][:3]
        ['gba.mode', 'gba.num_servers', 'gba.staleness']
    """
    comments = field_comments(model)
    nested: list[tuple[str, type[pydantic.BaseModel]]] = []
    for name, info in model.model_fields.items():
        key = f"{prefix}.{name}"
        sub = _submodel(info.annotation)
        description = info.description or comments.get(name, "") or (_first_paragraph(sub.__doc__) if sub else "")
        yield FieldRow(key, _type_name(info.annotation), _default(info), _constraints(info), _one_line(description))
        if sub is not None:
            nested.append((key, sub))
    for key, sub in nested:
        yield from field_rows(key, sub)


def _cell(text: str) -> str:
    return text.replace("|", "\\|") if text else ""


def _code(text: str) -> str:
    return f"`{text}`" if text and text != NESTED_DEFAULT else text


def _prose(doc: str | None) -> str:
    """A docstring without its doctest examples (``>>>`` lines, their continuations and outputs)."""
    kept: list[str] = []
    in_example = False
    for line in inspect.cleandoc(doc).splitlines() if doc else []:
        if line.lstrip().startswith(">>>"):
            in_example = True
        elif not line.strip():
            in_example = False
        if not in_example:
            kept.append(line)
    return re.sub(r"\n*Example::\s*$", "", "\n".join(kept).strip())


def _block_section(name: str, spec: str) -> list[str]:
    model = model_class(spec)
    module, _, cls = spec.partition(":")
    page = BLOCK_PAGES.get(name)
    explained = f" What the keys do: [{page}]({page})." if page else ""
    lines = [f"## `{name}`", "", f"Model: `{module}.{cls}`.{explained}", ""]
    for sub_model in [model, *_nested_models(model)]:
        doc = _prose(sub_model.__doc__)
        if doc:
            label = "" if sub_model is model else f"`{sub_model.__name__}`: "
            lines += [label + doc, ""]
    lines += ["| key | type | default | constraints | description |", "|---|---|---|---|---|"]
    for row in field_rows(name, model):
        lines.append(f"| `{row.key}` | {_cell(_code(row.type))} | {_cell(_code(row.default))} | "
                     f"{_cell(row.constraints)} | {_cell(row.description)} |")
    checks = [c for m in [model, *_nested_models(model)] for c in cross_field_checks(m)]
    if checks:
        lines += ["", "Checks across keys (each is an error when broken):", ""] + [f"- {c}" for c in checks]
    return lines + [""]


def _nested_models(model: type[pydantic.BaseModel]) -> list[type[pydantic.BaseModel]]:
    found: list[type[pydantic.BaseModel]] = []
    for info in model.model_fields.values():
        sub = _submodel(info.annotation)
        if sub is not None and sub not in found:
            found += [sub] + [m for m in _nested_models(sub) if m not in found]
    return found


def render_config_reference(blocks: Mapping[str, str] = PLUGIN_BLOCKS) -> str:
    """The Markdown text of docs/config.md for the registered plugin blocks (pure; deterministic)."""
    lines = [
        "# Config reference",
        "",
        "<!-- GENERATED by `python -m sparse_scale.config_reference` from the models in "
        "`sparse_scale.config.PLUGIN_BLOCKS`; do not edit by hand (tests/repo/test_docs.py fails on drift). -->",
        "",
        "A job is one DeepSpeed JSON (or hjson) file. DeepSpeed's own keys go to `deepspeed.initialize`"
        " unchanged; each block below is validated by its package's pydantic model (unknown keys are errors"
        " that name the file, the key path and the nearest valid key). Types are JSON types; a type with `null`"
        " accepts null, and a key whose default is `required` must be given when its block is present. Only"
        " the blocks present in the file are validated; what an absent block means is on each block's page.",
        "",
        "```python",
        "from sparse_scale.config import load_config",
        'job = load_config("ds_configs/demo_cpu.json")   # JobConfig(source, ds, blocks)',
        "job.ds                 # the dict for deepspeed.initialize, plugin blocks removed",
        'job.block("gba")       # the validated GBAConfig, or None when the file has no "gba" block',
        "```",
        "",
        "Duplicate keys are rejected in JSON and hjson (as DeepSpeed does), and a top-level key that looks like a"
        " misspelt block or DeepSpeed key is an error. Every file in `ds_configs/` is validated by the tests. CPU"
        ' configs set `"torch_adam": true` in the optimizer params: without it DeepSpeed JIT-builds its fused Adam'
        " on CPU, which takes minutes.",
        "",
        "Blocks: " + ", ".join(f"[`{name}`](#{name})" for name in blocks) + ".",
        "",
    ]
    for name, spec in blocks.items():
        lines += _block_section(name, spec)
    return "\n".join(lines).rstrip("\n") + "\n"


def check_config_reference(path: Path = DEFAULT_OUTPUT) -> list[str]:
    """Unified-diff lines between ``path`` and the freshly rendered reference; empty when they agree."""
    current = path.read_text() if path.exists() else ""
    fresh = render_config_reference()
    return list(difflib.unified_diff(current.splitlines(), fresh.splitlines(), str(path), "generated", lineterm=""))


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m sparse_scale.config_reference [--check] [--output PATH]``; returns the exit code."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, help="the reference file (docs/config.md)")
    parser.add_argument("--check", action="store_true", help="exit 1 when the file differs from the models")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.check:
        diff = check_config_reference(args.output)
        if diff:
            logger.error("%s is out of date; run python -m sparse_scale.config_reference\n%s",
                         args.output, "\n".join(diff))
            return 1
        logger.info("%s is up to date", args.output)
        return 0
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(render_config_reference())
    logger.info("wrote %s", args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
