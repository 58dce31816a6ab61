"""A lightweight timeline of pipeline stages: per stage, step and micro-batch, start/end on each thread.

Spans are recorded with ``time.perf_counter`` under a lock (a few microseconds
each) and written as a Chrome trace (the JSON "trace event" format that
chrome://tracing and https://ui.perfetto.dev open): one complete (``"ph": "X"``)
event per span, one row per thread. :meth:`Timeline.overlaps` lists the pairs
of spans of *different* micro-batches that ran at the same time, which is what
interleaving is meant to produce.

Example::

    >>> from picasso_ops.interleave.trace import Timeline
    >>> tl = Timeline()
    >>> with tl.span("dense", micro_batch=0, step=0):
    ...     pass
    >>> tl.write_chrome_trace("/tmp/trace.json")   # open in chrome://tracing or Perfetto
    >>> [s.stage for s in tl.spans()]
    ['dense']
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Union

import torch

__all__ = ["Span", "Timeline", "profile_to_chrome_trace"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Span:
    """One stage's run on one micro-batch (``micro_batch`` is ``None`` for whole-batch stages such as ``load``)."""

    stage: str
    step: int
    micro_batch: Optional[int]
    thread: str
    tid: int
    start_s: float
    end_s: float

    @property
    def duration_s(self) -> float:
        """``end_s - start_s``."""
        return self.end_s - self.start_s


class Timeline:
    """Thread-safe recorder of stage spans; disabled timelines record nothing (the ``span`` call stays cheap).

    Args:
        enabled: record spans (``False``: ``span`` is a no-op context).
        profiler_labels: also open a ``torch.profiler.record_function`` per span,
            so a ``torch.profiler`` trace shows the stage names.

    Example::

        >>> tl = Timeline()
        >>> with tl.span("lookup", micro_batch=1):
        ...     pass
        >>> tl.to_chrome()["traceEvents"][-1]["name"]
        'lookup'
    """

    def __init__(self, enabled: bool = True, profiler_labels: bool = True) -> None:
        self.enabled = enabled
        self.profiler_labels = profiler_labels
        self._lock = threading.Lock()
        self._spans: list[Span] = []
        self._origin = time.perf_counter()

    @contextlib.contextmanager
    def span(self, stage: str, micro_batch: Optional[int] = None, step: int = 0) -> Iterator[None]:
        """Record the body's start and end as one span of ``stage`` on the calling thread."""
        if not self.enabled:
            yield
            return
        label = f"{stage}[{step}.{micro_batch}]" if micro_batch is not None else f"{stage}[{step}]"
        ctx = torch.profiler.record_function(label) if self.profiler_labels else contextlib.nullcontext()
        start = time.perf_counter()
        try:
            with ctx:
                yield
        finally:
            end = time.perf_counter()
            thread = threading.current_thread()
            span = Span(stage, step, micro_batch, thread.name, threading.get_ident(), start, end)
            with self._lock:
                self._spans.append(span)

    def spans(self) -> list[Span]:
        """A copy of the recorded spans, in start order."""
        with self._lock:
            return sorted(self._spans, key=lambda s: s.start_s)

    def clear(self) -> None:
        """Forget every span (e.g. after warm-up) and restart the clock."""
        with self._lock:
            self._spans.clear()
            self._origin = time.perf_counter()

    def overlaps(self) -> list[tuple[Span, Span]]:
        """Pairs of spans of different micro-batches (or steps) whose time intervals intersect.

        Example::

            >>> Timeline().overlaps()
            []
        """
        spans = self.spans()
        pairs: list[tuple[Span, Span]] = []
        for i, a in enumerate(spans):
            for b in spans[i + 1:]:
                if b.start_s >= a.end_s:
                    break  # sorted by start: nothing later can intersect a
                if (a.step, a.micro_batch) != (b.step, b.micro_batch):
                    pairs.append((a, b))
        return pairs

    def overlap_seconds(self) -> float:
        """Total time during which at least two micro-batches had a stage running (union of pairwise intersections)."""
        cuts = sorted((max(a.start_s, b.start_s), min(a.end_s, b.end_s)) for a, b in self.overlaps())
        total, cur_start, cur_end = 0.0, None, None
        for s, e in cuts:
            if cur_end is None or s > cur_end:
                if cur_end is not None:
                    total += cur_end - cur_start  # type: ignore[operator]
                cur_start, cur_end = s, e
            else:
                cur_end = max(cur_end, e)
        if cur_end is not None:
            total += cur_end - cur_start  # type: ignore[operator]
        return total

    def to_chrome(self) -> dict[str, Any]:
        """The spans as a Chrome trace-event dict (``{"traceEvents": [...]}``, times in microseconds)."""
        pid = os.getpid()
        spans = self.spans()
        events: list[dict[str, Any]] = []
        threads = {s.tid: s.thread for s in spans}
        for tid, name in threads.items():
            events.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": name}})
        for s in spans:
            events.append({
                "name": s.stage,
                "cat": "interleave",
                "ph": "X",
                "pid": pid,
                "tid": s.tid,
                "ts": (s.start_s - self._origin) * 1e6,
                "dur": s.duration_s * 1e6,
                "args": {"step": s.step, "micro_batch": s.micro_batch},
            })
        return {"traceEvents": events, "displayTimeUnit": "ms"}

    def write_chrome_trace(self, path: Union[str, Path]) -> Path:
        """Write :meth:`to_chrome` as JSON to ``path``; returns the path."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_chrome()))
        logger.info("wrote %d spans to %s", len(self._spans), path)
        return path


def profile_to_chrome_trace(fn: Callable[[], Any], path: Union[str, Path]) -> Any:
    """Run ``fn()`` under ``torch.profiler`` (CPU, plus CUDA when available) and export its Chrome trace to ``path``.

    Spans of a :class:`Timeline` with ``profiler_labels`` appear as named
    ranges in that trace, next to the torch ops of every thread.

    Example::

        >>> profile_to_chrome_trace(lambda: trainer.step(batch), "/tmp/profile.json")  # doctest: +SKIP
    """
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        result = fn()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(path))
    logger.info("wrote torch.profiler trace to %s", path)
    return result
