"""Which column of a data file is the label, which are categorical and which dense: a `DataSchema`.

The file readers (`CriteoTSVReader` for delimited text, `ParquetCTRReader`) take one; without it
they read the Criteo layout (:meth:`DataSchema.criteo`: label, 13 integer and 26 hex categorical
columns). A column is named (a text file's header line, ``column_names`` for a headerless text
file, or a parquet column) or given by its 0-based position in the file::

    schema = DataSchema(label="clicked", categorical=["user", "item", {"column": "genres", "separator": "|"}],
                        dense=["age"], delimiter="comma", header=True)
    reader = CriteoTSVReader("ratings.csv", 4096, schema=schema)
    schema = DataSchema.load("movielens.json")     # or DataSchema.load("criteo"), the preset

Values: the label is 0 or 1; a categorical value is hashed from its text (``categorical_values``
"text"; "hex" parses it as a hex number, as Criteo's) into the field's vocabulary, and a column with
a ``separator`` holds several values per row (multi-hot); a dense value is a decimal number
(``dense_values`` "integer": digits only, as Criteo's) and goes through ``dense_transform`` (log1p of
the value clipped at 0, or as is). The checks on values are the same in both readers
(:mod:`picasso_ops.data.values`).
"""
from __future__ import annotations

import logging
import os
from typing import Any, Literal, Union

from pydantic import Field, StrictInt, StrictStr, field_validator, model_validator

from sparse_core.blocks import StrictBlock
from sparse_core.config_file import ConfigError, read_config_file, validate_model

logger = logging.getLogger(__name__)

__all__ = ["DataSchema", "CategoricalColumn", "ColumnRef", "PRESETS"]

ColumnRef = Union[StrictStr, StrictInt]  # a column's name, or its 0-based position in the file
DELIMITERS = {"tab": b"\t", "comma": b","}


def _describe(ref: ColumnRef) -> str:
    return f"column {ref!r}" if isinstance(ref, str) else f"column at position {ref}"


def _check_ref(ref: ColumnRef) -> ColumnRef:
    if isinstance(ref, str) and (not ref or ref != ref.strip()):
        raise ValueError(f"a column name must be non-empty without surrounding spaces, got {ref!r}")
    if isinstance(ref, int) and ref < 0:
        raise ValueError(f"a column position must be >= 0, got {ref}")
    return ref


def _check_separator(sep: str | None) -> str | None:
    if sep is not None and (len(sep) != 1 or len(sep.encode()) != 1 or sep in "\r\n\t,"):
        raise ValueError(f"a multi-hot separator must be one ASCII character other than tab, comma and newline, "
                         f"got {sep!r}")
    return sep


class CategoricalColumn(StrictBlock):
    """A categorical column, maybe multi-hot: ``{"column": "genres", "separator": "|"}``.

    ``separator``: the column holds several values per row split by this character (empty pieces
    are skipped); None: the schema's ``separator`` (None there too: one value per row).
    """

    column: ColumnRef
    separator: str | None = None

    @field_validator("column")
    @classmethod
    def _column(cls, value: ColumnRef) -> ColumnRef:
        return _check_ref(value)

    @field_validator("separator")
    @classmethod
    def _separator(cls, value: str | None) -> str | None:
        return _check_separator(value)


class DataSchema(StrictBlock):
    """Where a CTR file's label, categorical and dense columns are, and how their values read (module doc).

    Example::

        DataSchema(label=0, categorical=[1, 2, 3], dense=[4])            # a headerless TSV by position
        DataSchema.criteo().num_categorical, DataSchema.criteo().num_dense   # 26, 13
    """

    label: ColumnRef
    categorical: tuple[CategoricalColumn, ...] = Field(min_length=1)  # names/positions, or column objects
    dense: tuple[ColumnRef, ...] = ()
    separator: str | None = None  # multi-hot separator of every categorical column without its own
    delimiter: Literal["tab", "comma"] = "tab"  # text files: the field delimiter (no quoting)
    header: bool = False  # text files: the first line names the columns (it is no data row)
    column_names: tuple[StrictStr, ...] | None = None  # a headerless text file's columns, in order
    categorical_values: Literal["text", "hex"] = "text"
    dense_values: Literal["decimal", "integer"] = "decimal"
    dense_transform: Literal["log1p", "none"] = "log1p"

    @field_validator("categorical", mode="before")
    @classmethod
    def _columns(cls, value: Any) -> Any:
        if isinstance(value, (list, tuple)):  # plain names and positions become CategoricalColumns
            return tuple(CategoricalColumn(column=v) if isinstance(v, (str, int)) and not isinstance(v, bool) else v
                         for v in value)
        return value

    @field_validator("label")
    @classmethod
    def _label(cls, value: ColumnRef) -> ColumnRef:
        return _check_ref(value)

    @field_validator("dense")
    @classmethod
    def _dense(cls, value: tuple[ColumnRef, ...]) -> tuple[ColumnRef, ...]:
        return tuple(_check_ref(v) for v in value)

    @field_validator("separator")
    @classmethod
    def _separator(cls, value: str | None) -> str | None:
        return _check_separator(value)

    @model_validator(mode="after")
    def _consistent(self) -> "DataSchema":
        roles: dict[ColumnRef, str] = {}
        for ref, role in self.roles():
            if ref in roles:
                raise ValueError(f"{_describe(ref)} is listed twice ({roles[ref]} and {role})")
            roles[ref] = role
        if self.column_names is not None:
            if self.header:
                raise ValueError("give either header: true (the file names its columns) or column_names, not both")
            if len(set(self.column_names)) != len(self.column_names):
                twice = sorted({c for c in self.column_names if self.column_names.count(c) > 1})
                raise ValueError(f"column_names lists {twice} more than once")
            for ref in roles:
                if isinstance(ref, str) and ref not in self.column_names:
                    raise ValueError(f"{_describe(ref)} is not among column_names {list(self.column_names)}")
                if isinstance(ref, int) and ref >= len(self.column_names):
                    raise ValueError(f"{_describe(ref)} is past the {len(self.column_names)} column_names")
        return self

    def roles(self) -> list[tuple[ColumnRef, str]]:
        """Every referenced column with its role, in the order the readers use: label, dense, categorical."""
        out: list[tuple[ColumnRef, str]] = [(self.label, "label")]
        out += [(ref, "dense") for ref in self.dense]
        out += [(c.column, "categorical") for c in self.categorical_columns]
        return out

    @property
    def categorical_columns(self) -> tuple[CategoricalColumn, ...]:
        """The categorical columns, each a :class:`CategoricalColumn`."""
        return self.categorical

    @property
    def separators(self) -> tuple[str | None, ...]:
        """Each categorical column's multi-hot separator (None: one value per row)."""
        return tuple(c.separator if c.separator is not None else self.separator for c in self.categorical_columns)

    @property
    def num_categorical(self) -> int:
        """Categorical fields the model gets (its embedding tables): ``schema.num_categorical``."""
        return len(self.categorical)

    @property
    def num_dense(self) -> int:
        """Dense features the model gets: ``schema.num_dense``."""
        return len(self.dense)

    @property
    def delimiter_byte(self) -> int:
        """The text files' field delimiter as a byte value (9 or 44)."""
        return DELIMITERS[self.delimiter][0]

    @property
    def is_criteo(self) -> bool:
        """Whether this is the Criteo preset (the readers keep its column-by-column messages)."""
        return self == DataSchema.criteo()

    @classmethod
    def criteo(cls) -> "DataSchema":
        """The Criteo layout: ``label, I1..I13, C1..C26``, headerless TSV, integer dense and hex categorical values.

        The readers' default; a parquet file names the same columns.
        """
        dense = tuple(f"I{i}" for i in range(1, 14))
        cats = tuple(f"C{i}" for i in range(1, 27))
        return cls(label="label", dense=dense, categorical=cats, column_names=("label", *dense, *cats),
                   categorical_values="hex", dense_values="integer", delimiter="tab")

    @classmethod
    def load(cls, source: str | os.PathLike) -> "DataSchema":
        """A preset by name (``"criteo"``) or a JSON/hjson file holding one schema object.

        Errors (unreadable file, unknown key, a column listed twice, ...) are ``ConfigError``s naming
        the file and the key: ``DataSchema.load("schemas/movielens.json")``.
        """
        if isinstance(source, str) and source in PRESETS:
            return PRESETS[source]()
        if isinstance(source, str) and os.sep not in source and "." not in source:
            raise ConfigError(f"schema {source!r}: neither a preset ({', '.join(PRESETS)}) nor a schema file path")
        return validate_model("schema", cls, read_config_file(source), source=str(source))


PRESETS = {"criteo": DataSchema.criteo}
