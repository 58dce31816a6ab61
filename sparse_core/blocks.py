"""The strict pydantic base every plugin block of a DeepSpeed config is built on.

    >>> class MyBlock(StrictBlock):
    ...     rows: int = 1
    >>> MyBlock.model_validate({"rows": 2}).rows
    2

Unknown keys are errors (``extra="forbid"``, as DeepSpeed's own config models) and a
validated block is frozen: code that needs another value builds a new block with
``model_copy(update=...)`` instead of changing the caller's.
"""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class StrictBlock(BaseModel):
    """A frozen pydantic model that rejects unknown keys."""

    model_config = ConfigDict(extra="forbid", frozen=True)
