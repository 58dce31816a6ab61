"""Read batches ahead on a background thread, so data loading overlaps the training step.

:class:`Prefetcher` wraps any iterable of batches. A daemon thread pulls up to
``depth`` batches ahead of the consumer; torch ops (the synthetic generator)
and the file parsers release the GIL for most of their work, so the next
batches are made on another core while the current one trains. What the
consumer sees is exactly the source's sequence:

* the same items in the same order, and the end of the source as ``StopIteration``;
* an exception raised by the source, re-raised by the consumer's ``next``
  with its own type and traceback (the frames of the producer thread) and a
  note naming the thread and the batch;
* :meth:`Prefetcher.state`: the source's resume state as it was right after the
  last *consumed* batch (the source's own ``state()`` runs ahead by up to
  ``depth`` batches); :attr:`Prefetcher.consumed` counts the batches handed out.

The consumer never blocks forever: each wait polls every ``poll_s`` whether the
thread is still alive (and, with ``timeout_s``, a deadline). :meth:`close`
(also on ``with`` exit, garbage collection or interpreter exit) stops the
thread after the batch it is reading and closes a generator source on that
thread, so its ``finally`` blocks (open files) run. At interpreter exit the
thread is also joined (up to ``EXIT_JOIN_S``): a daemon thread still inside a
torch op when the interpreter finalizes is killed by a forced unwind through
C++ frames, which aborts the process ("terminate called without an active
exception", rc -6) after training finished.

Example::

    >>> stream = SyntheticCTRStream(cfg, batch_size=4096)
    >>> with Prefetcher(stream, depth=2, state=stream.state) as batches:
    ...     for step, batch in zip(range(100), batches):
    ...         train_step(batch)
    ...     resume_at = batches.state()["next_batch"]   # the 101st batch, not the 103rd
"""
from __future__ import annotations

import atexit
import copy
import logging
import queue
import threading
import time
import weakref
from typing import Any, Callable, Generic, Iterable, Iterator, Optional, TypeVar

__all__ = ["Prefetcher", "PrefetchTimeout"]

logger = logging.getLogger(__name__)

T = TypeVar("T")

_ITEM, _END, _ERROR = "item", "end", "error"

EXIT_JOIN_S = 30.0  # longest wait at interpreter exit for producers to finish the item they are reading

# producer thread -> (stop, slots), for the exit hook; an entry goes with its thread
_producers: "weakref.WeakKeyDictionary[threading.Thread, tuple[threading.Event, threading.Semaphore]]" = \
    weakref.WeakKeyDictionary()


class PrefetchTimeout(TimeoutError):
    """The consumer waited ``timeout_s`` for a batch while the producer thread was still reading one."""


def _snapshot(state: Optional[Callable[[], Any]]) -> Any:
    return None if state is None else copy.deepcopy(state())


def _produce(source: Iterator[Any], out: "queue.Queue[tuple[str, Any, Any]]", slots: threading.Semaphore,
             stop: threading.Event, state: Optional[Callable[[], Any]], poll_s: float) -> None:
    """The producer thread: one slot per batch read ahead; ends after the end, an error or ``stop``.

    It holds no reference to the :class:`Prefetcher`, so dropping the prefetcher lets it be collected.
    """
    finished = False
    try:
        while not stop.is_set():
            if not slots.acquire(timeout=poll_s):
                continue
            if stop.is_set():
                return
            try:
                item = next(source)
                message = (_ITEM, item, _snapshot(state))
            except StopIteration:
                finished = True
                message = (_END, None, _snapshot(state))
            except BaseException as exc:  # noqa: BLE001 - handed to the consumer, who re-raises it
                finished = True
                message = (_ERROR, exc, None)
            out.put(message)  # unbounded queue: the slots bound it
            if finished:
                return
    except BaseException:  # noqa: BLE001 - a bug here must not pass silently; the consumer sees a dead thread
        logger.exception("prefetch thread %s failed outside the source", threading.current_thread().name)
        raise
    finally:
        close = getattr(source, "close", None)
        if not finished and callable(close):
            try:
                close()  # a generator source runs its finally blocks here, on the thread that ran it
            except Exception:  # noqa: BLE001 - closing is best effort; the consumer has stopped reading
                logger.warning("closing the source of %s failed", threading.current_thread().name, exc_info=True)


def _shutdown(stop: threading.Event, slots: threading.Semaphore) -> None:
    stop.set()
    slots.release()  # wake a producer waiting for a slot at once


@atexit.register
def _join_producers_at_exit() -> None:
    """Stop every producer still running and wait for it, while the interpreter can still run threads.

    atexit hooks run before finalization; a daemon thread that returns from a torch op after that
    is ended by ``pthread_exit``, whose unwind through torch's C++ frames calls ``std::terminate``.
    """
    running = [(t, *events) for t, events in list(_producers.items()) if t.is_alive()]
    for _, stop, slots in running:
        _shutdown(stop, slots)
    deadline = time.monotonic() + EXIT_JOIN_S
    for thread, _, _ in running:
        thread.join(timeout=max(0.0, deadline - time.monotonic()))
    stuck = [t.name for t, _, _ in running if t.is_alive()]
    if stuck:
        logger.warning("prefetch threads %s are still reading their source %.0f s into interpreter exit; the "
                       "process may abort when they return (close() the Prefetcher before exiting)", stuck,
                       EXIT_JOIN_S)


class Prefetcher(Generic[T]):
    """An iterator over ``source`` whose next ``depth`` items are read ahead on a daemon thread.

    Args:
        source: the batches (an iterable; ``iter(source)`` is taken here, its items are read on the thread).
        depth: most items read ahead of the consumer (``>= 1``); memory holds at most ``depth`` extra batches.
        state: the source's resume state, e.g. ``stream.state``; called on the producer thread after every
            item (and at the end) and deep-copied, so :meth:`state` can return the one of the last consumed item.
        timeout_s: longest wait for one item while the producer is alive (``None``: no limit, as reading
            the source directly); past it ``next`` raises :class:`PrefetchTimeout`.
        poll_s: how often a waiting consumer re-checks that the producer is alive (and the deadline).
        name: the thread's name (logs, tracebacks, :func:`threading.enumerate`).

    Example::

        >>> with Prefetcher(iter(range(5)), depth=2) as p:
        ...     [next(p), next(p)], p.consumed, list(p)
        ([0, 1], 2, [2, 3, 4])
    """

    def __init__(self, source: Iterable[T], depth: int = 2, *, state: Optional[Callable[[], Any]] = None,
                 timeout_s: Optional[float] = None, poll_s: float = 0.1, name: str = "prefetch") -> None:
        if depth < 1:
            raise ValueError(f"depth must be >= 1 (batches read ahead), got {depth}")
        if poll_s <= 0 or (timeout_s is not None and timeout_s <= 0):
            raise ValueError(f"need poll_s > 0 and timeout_s > 0 or None; got {poll_s}, {timeout_s}")
        self.depth, self.timeout_s, self.poll_s, self.name = depth, timeout_s, poll_s, name
        self._consumed = 0
        self._finished = False  # the end or an error reached the consumer
        self._closed = False
        self._state = _snapshot(state)  # before the first item: the source's starting point
        self._queue: "queue.Queue[tuple[str, Any, Any]]" = queue.Queue()
        self._slots = threading.Semaphore(depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=_produce, args=(iter(source), self._queue, self._slots, self._stop, state, poll_s),
            name=name, daemon=True)
        _producers[self._thread] = (self._stop, self._slots)
        self._thread.start()
        # garbage collection or interpreter exit without close(): stop the thread all the same
        self._finalizer = weakref.finalize(self, _shutdown, self._stop, self._slots)

    # ------------------------------------------------------------------ the consumer's side
    @property
    def consumed(self) -> int:
        """Items handed to the consumer so far: the index of the next one it will get."""
        return self._consumed

    @property
    def buffered(self) -> int:
        """Items read ahead and waiting (``<= depth``; approximate while the producer runs)."""
        return self._queue.qsize()

    def state(self) -> Any:
        """The source's ``state()`` right after the last consumed item (before any: at construction).

        After the end of the source: the source's state once it ended. ``None`` without a ``state`` callable.
        """
        return copy.deepcopy(self._state)

    def __iter__(self) -> "Prefetcher[T]":
        return self

    def __next__(self) -> T:
        if self._closed:
            raise RuntimeError(f"prefetcher {self.name!r} is closed (after {self._consumed} items)")
        if self._finished:
            raise StopIteration
        kind, payload, state = self._get()
        if kind == _ITEM:
            self._consumed += 1
            self._state = state
            self._slots.release()  # room for one more read-ahead
            return payload
        self._finished = True
        self._thread.join(timeout=max(1.0, 10 * self.poll_s))  # it returns right after its last message
        if kind == _END:
            self._state = state
            raise StopIteration
        exc: BaseException = payload
        exc.add_note(f"(raised in prefetch thread {self.name!r} while reading item {self._consumed} of its source; "
                     "the frames above the thread's _produce are the source's)")
        raise exc

    def _get(self) -> tuple[str, Any, Any]:
        deadline = None if self.timeout_s is None else time.monotonic() + self.timeout_s
        while True:
            try:
                return self._queue.get(timeout=self.poll_s)
            except queue.Empty:
                pass
            if not self._thread.is_alive():
                try:  # its last message may have landed between the wait and the check
                    return self._queue.get_nowait()
                except queue.Empty:
                    raise RuntimeError(f"prefetch thread {self.name!r} ended without an item, an end or an error "
                                       f"after {self._consumed} items (see the log)") from None
            if deadline is not None and time.monotonic() > deadline:
                raise PrefetchTimeout(f"prefetch thread {self.name!r}: no item within {self.timeout_s:g} s "
                                      f"(item {self._consumed} of the source is still being read)")

    # ------------------------------------------------------------------ stopping
    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the thread after the item it is reading (dropping what was read ahead) and join it; idempotent.

        A thread stuck inside the source for longer than ``timeout_s`` is left behind (a daemon) with a warning.
        """
        if self._closed:
            return
        self._closed = True
        self._finalizer()  # stop + wake; runs once
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=timeout_s)
        if self._thread.is_alive():
            logger.warning("prefetch thread %r still reading its source %.0f s after close", self.name, timeout_s)
        while True:  # drop the read-ahead batches now rather than with this object
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break

    def __enter__(self) -> "Prefetcher[T]":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"Prefetcher({self.name!r}, depth={self.depth}, consumed={self._consumed}, "
                f"alive={self._thread.is_alive()}, closed={self._closed})")
