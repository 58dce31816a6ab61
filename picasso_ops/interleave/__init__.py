"""Interleaving (PICASSO): D-interleaving of micro-batch stages on threads, K-interleaving of pack exchanges.

Example::

    >>> from picasso_ops.interleave import InterleavedTrainer, Timeline
    >>> tl = Timeline()
    >>> with InterleavedTrainer(model, dense_opt, micro_batches=4, timeline=tl) as trainer:
    ...     trainer.train(iter(stream), num_steps=10)
    >>> tl.write_chrome_trace("trace.json")   # chrome://tracing or ui.perfetto.dev
"""
from picasso_ops.interleave.forward import InterleavedForward
from picasso_ops.interleave.kgroups import AsyncExchange, KInterleavedRowShardedCollection, interleaved_sparse_step
from picasso_ops.interleave.pipeline import (
    BatchPrefetcher,
    InterleavedTrainer,
    PipelineTimeout,
    StagedModel,
    StageError,
    ThreadPipeline,
    stages_for,
)
from picasso_ops.interleave.trace import Span, Timeline, profile_to_chrome_trace

__all__ = [
    "InterleavedTrainer",
    "InterleavedForward",
    "ThreadPipeline",
    "BatchPrefetcher",
    "StageError",
    "PipelineTimeout",
    "StagedModel",
    "stages_for",
    "AsyncExchange",
    "interleaved_sparse_step",
    "KInterleavedRowShardedCollection",
    "Timeline",
    "Span",
    "profile_to_chrome_trace",
]
