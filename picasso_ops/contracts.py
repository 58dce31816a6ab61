"""The contracts of picasso_ops that several classes implement, declared as ``typing.Protocol``s.

* :class:`FieldEmbeddingLookup`: ``forward(values, lengths) -> [B, F, D]``, the
  field embeddings a CTR model is built over. Implemented by
  ``picasso_ops.models.FieldEmbeddings`` (one ``nn.EmbeddingBag`` per field),
  ``picasso_ops.models.PackedFieldEmbeddings`` (packed tables),
  ``picasso_ops.cache.CachedFieldEmbeddings`` (hot-row cache over a store) and,
  structurally, ``gba_engine.tables.ServerFieldEmbeddings`` (rows on parameter servers).
* :class:`SparseStepModule`: a module whose tables take their optimizer step
  outside DeepSpeed's (``sparse_step`` / ``discard_pending``);
  ``picasso_ops.distributed.sparse_modules`` finds them by ``isinstance``.
  Implemented by the data-parallel and row-sharded collections and
  ``CachedFieldEmbeddings``.
* :class:`SparseBackwardQueue`: a module that may still run embedding
  backwards on another thread (``InterleavedForward``); waited for before a sparse step.
* :class:`FieldRowPrefetcher`: a field-embedding module that can start reading
  the rows of a coming micro-batch (``CachedFieldEmbeddings``); ``InterleavedForward``
  finds them by ``isinstance``.
* :class:`StagedModel` / :class:`StageableModel`: a CTR model cut at its
  embeddings for interleaving; the reference models cut themselves
  (``pipeline_stages()``), so ``picasso_ops.interleave`` imports no model.
* :class:`RowStore`: the slow tier behind a cache, one table's rows and
  optimizer state (``HostRowStore``, ``MmapRowStore``, ``TableRowStore``).
* :class:`TableRowService`: a multi-table row service such as
  ``gba_engine.ps.PSClient`` (``get_rows(table, ids)``), which ``TableRowStore``
  adapts to a :class:`RowStore`. (gba_engine has its own, different engine-side
  protocol for its bound collections; the names differ on purpose.)

Example::

    >>> import torch
    >>> from picasso_ops.cache import HostRowStore
    >>> isinstance(HostRowStore(10, 2), RowStore)
    True
    >>> isinstance(torch.nn.Linear(2, 2), SparseStepModule)
    False
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Mapping, NamedTuple, Optional, Protocol, Sequence, runtime_checkable

from torch import Tensor

if TYPE_CHECKING:  # for annotations only: the contracts import no implementation
    from picasso_ops.data.batch import CTRBatch

__all__ = [
    "FieldEmbeddingLookup",
    "FieldRowPrefetcher",
    "RowStore",
    "SparseBackwardQueue",
    "SparseStepModule",
    "StageableModel",
    "StagedModel",
    "StoredRows",
    "TableRowService",
]


class FieldEmbeddingLookup(Protocol):
    """Pooled field embeddings: ``(values, lengths [F, B]) -> [B, F, D]`` on the field-major jagged batch.

    ``values`` holds every id of field 0's ``B`` samples, then field 1's, ...;
    ``lengths[f, b]`` is how many ids sample ``b`` has in field ``f``. Not
    runtime-checkable: every ``nn.Module`` has a ``forward``, so an
    ``isinstance`` would say nothing; conformance is checked by type checkers
    and by the tests (the models annotate their ``embeddings`` with it).

    Example::

        >>> from picasso_ops.models import FieldEmbeddings
        >>> emb: FieldEmbeddingLookup = FieldEmbeddings([10, 20], 4, "sum", 0.01)
        >>> emb(torch.tensor([1, 2, 3]), torch.tensor([[1, 1], [1, 0]])).shape  # doctest: +SKIP
        torch.Size([2, 2, 4])
    """

    def forward(self, values: Tensor, lengths: Tensor) -> Tensor:
        """Pooled rows ``[B, F, D]``."""
        ...

    def __call__(self, values: Tensor, lengths: Tensor) -> Tensor:
        """``nn.Module.__call__``: runs :meth:`forward` with the module's hooks."""
        ...


@runtime_checkable
class SparseStepModule(Protocol):
    """A module that owns deferred sparse tables: their gradients wait for :meth:`sparse_step`.

    Implementers subclass it to declare the contract (a class with both
    methods also passes ``isinstance`` structurally).

    Example::

        >>> from picasso_ops.distributed import DataParallelEmbeddingCollection
        >>> issubclass(DataParallelEmbeddingCollection, SparseStepModule)
        True
    """

    def sparse_step(self, grad_scale: float = 1.0) -> None:
        """Apply the accumulated row gradients times ``grad_scale``, one optimizer step (a collective when distributed)."""
        ...

    def discard_pending(self) -> None:
        """Drop the accumulated row gradients (local)."""
        ...


@runtime_checkable
class SparseBackwardQueue(Protocol):
    """A module that may have embedding backwards queued on another thread (``InterleavedForward``).

    Example::

        >>> isinstance(torch.nn.Linear(2, 2), SparseBackwardQueue)
        False
    """

    def wait_sparse_backward(self) -> None:
        """Return once every queued embedding backward has finished."""
        ...


@runtime_checkable
class FieldRowPrefetcher(Protocol):
    """A field-embedding module that reads a coming batch's rows ahead (``CachedFieldEmbeddings``).

    Example::

        >>> isinstance(torch.nn.Linear(2, 2), FieldRowPrefetcher)
        False
    """

    def prefetch_ids(self, values: Tensor, lengths: Tensor) -> None:
        """Start reading the rows the field-major batch ``(values, lengths)`` will look up."""
        ...


class StagedModel(Protocol):
    """A model cut at its embeddings: ``lookup`` runs the sparse part, ``dense`` the rest on its outputs.

    Example::

        >>> st = model.pipeline_stages()  # doctest: +SKIP
        >>> logits = st.dense(batch, st.lookup(batch))  # = model(batch.dense, batch.values, batch.lengths)
    """

    def lookup(self, batch: CTRBatch) -> list[Tensor]:
        """Embedding outputs of ``batch`` (their autograd graph leads to the tables)."""
        ...

    def dense(self, batch: CTRBatch, embedded: Sequence[Tensor]) -> Tensor:
        """Logits ``[B]`` from the batch's dense features and the embeddings ``lookup`` returned."""
        ...


@runtime_checkable
class StageableModel(Protocol):
    """A model that knows how to cut itself into a :class:`StagedModel` (``WideAndDeep``, ``DLRM``).

    Example::

        >>> from picasso_ops.models import DLRM, DLRMArgs
        >>> isinstance(DLRM(DLRMArgs(vocab_sizes=[5], num_dense=2, embedding_dim=4)), StageableModel)
        True
    """

    def pipeline_stages(self) -> StagedModel:
        """The adapter running this model's forward as lookup then dense (same math)."""
        ...


class StoredRows(NamedTuple):
    """Rows read from a store: ``rows [n, dim]`` and each state column block ``[n, width]``."""

    rows: Tensor
    state: dict[str, Tensor]


@runtime_checkable
class RowStore(Protocol):
    """What a cache needs from its slow tier: one table's rows and named optimizer-state columns.

    Example::

        >>> from picasso_ops.cache import HostRowStore
        >>> isinstance(HostRowStore(10, 2), RowStore)
        True
    """

    num_rows: int
    dim: int
    state_dims: Mapping[str, int]

    def get_rows(self, ids: Tensor) -> StoredRows:
        """Rows and state of unique int64 ``ids``."""
        ...

    def put_rows(self, ids: Tensor, rows: Tensor, state: Optional[Mapping[str, Tensor]] = None) -> None:
        """Overwrite rows (and state columns, when given) of unique int64 ``ids``."""
        ...


@runtime_checkable
class TableRowService(Protocol):
    """A multi-table row service, e.g. ``gba_engine.ps.PSClient``: rows by table name and id.

    Example::

        >>> class Fake:
        ...     def get_rows(self, table, ids): return torch.zeros(len(ids), 2)
        ...     def put_rows(self, table, ids, rows): pass
        >>> isinstance(Fake(), TableRowService)
        True
    """

    def get_rows(self, table: str, ids: Tensor) -> Tensor:
        """Rows of ``table`` for ``ids``: ``ids.shape + (dim,)``."""
        ...

    def put_rows(self, table: str, ids: Tensor, rows: Tensor) -> None:
        """Overwrite rows of ``table``."""
        ...
