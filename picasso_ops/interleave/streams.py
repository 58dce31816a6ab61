"""CUDA streams for the interleave stages: each stage thread issues its kernels on a stream of its own.

A stage thread that only queued kernels on the default stream would serialise
every micro-batch's kernels there, whatever the threads do. On CUDA tensors
:class:`CudaStageStreams` gives stage ``k`` its own stream and orders the
hand-offs with events, as DDP and FSDP do for their communication streams:

* the caller records an event on its current stream before the first stage
  (the batch and the tables' last update are ready);
* stage ``k`` makes its stream wait for the event its producer recorded on the
  item, runs, and records an event on its stream for the next stage;
* every CUDA tensor handed over is ``record_stream``-ed on the consumer's
  stream, so the caching allocator does not reuse its memory while the
  consumer's kernels may still read it;
* the caller's stream waits for the last stage's event of each result.

On CPU tensors :class:`StageStreams` is used: every hook does nothing, and
the stage threads overlap as torch's CPU ops release the GIL.

Example::

    >>> streams = stage_streams(torch.device("cpu"), stages=2)
    >>> token = streams.token()              # None on CPU
    >>> with streams.run(0):
    ...     streams.accept(0, token, payload)
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, ContextManager, Iterator

import torch
from torch import Tensor

__all__ = ["StageStreams", "CudaStageStreams", "stage_streams", "tensors_in"]


def tensors_in(obj: Any) -> Iterator[Tensor]:
    """Every tensor inside nested tuples, lists, dicts and dataclasses (such as ``CTRBatch``).

    Example::

        >>> [t.shape for t in tensors_in(([torch.ones(2)], {"x": torch.zeros(3)}))]
        [torch.Size([2]), torch.Size([3])]
    """
    if isinstance(obj, Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from tensors_in(item)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from tensors_in(item)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for field in dataclasses.fields(obj):
            yield from tensors_in(getattr(obj, field.name))


class StageStreams:
    """Stage streams on CPU: no streams, every hook a no-op (the interface :class:`CudaStageStreams` fills in)."""

    def token(self) -> Any:
        """A mark of the work queued so far on the calling thread's current stream (``None``: nothing to wait for)."""
        return None

    def run(self, stage: int) -> ContextManager[Any]:
        """The context stage ``stage``'s function runs in (its stream made current)."""
        return contextlib.nullcontext()

    def accept(self, stage: int, token: Any, payload: Any) -> None:
        """Before stage ``stage`` uses ``payload``: wait for ``token`` on its stream, mark the tensors used there."""

    def wait(self, token: Any, payload: Any) -> None:
        """Before the caller uses a result: wait for ``token`` on the caller's current stream, mark the tensors."""


class CudaStageStreams(StageStreams):
    """One CUDA stream per stage on ``device``; hand-offs ordered by events (see the module docstring).

    Example::

        >>> streams = CudaStageStreams(torch.device("cuda"), stages=2)   # doctest: +SKIP
    """

    def __init__(self, device: torch.device, stages: int) -> None:
        if stages < 1:
            raise ValueError(f"need at least one stage, got {stages}")
        self.device = torch.device(device)
        self.streams = [torch.cuda.Stream(device=self.device) for _ in range(stages)]

    def token(self) -> torch.cuda.Event:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def run(self, stage: int) -> ContextManager[Any]:
        return torch.cuda.stream(self.streams[stage])

    def accept(self, stage: int, token: Any, payload: Any) -> None:
        self._adopt(self.streams[stage], token, payload)

    def wait(self, token: Any, payload: Any) -> None:
        self._adopt(torch.cuda.current_stream(self.device), token, payload)

    @staticmethod
    def _adopt(stream: torch.cuda.Stream, token: Any, payload: Any) -> None:
        if token is not None:
            stream.wait_event(token)
        for t in tensors_in(payload):
            if t.is_cuda:
                t.record_stream(stream)


def stage_streams(device: torch.device, stages: int) -> StageStreams:
    """:class:`CudaStageStreams` for a CUDA device, else the no-op :class:`StageStreams`.

    Example::

        >>> type(stage_streams(torch.device("cpu"), 3)).__name__
        'StageStreams'
    """
    if torch.device(device).type == "cuda":
        return CudaStageStreams(device, stages)
    return StageStreams()
