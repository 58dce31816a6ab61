"""A worker's step time for the straggler detector, measured in one place: the whole step minus waits on peers.

What auto mode compares between workers is each one's **own** time per optimizer step: wall time from
the end of its previous update (after the switch policy ran) to the end of this one, so it holds the
data wait, the forward, the backward, whatever runs between ``backward()`` and ``step()``, the
optimizer step and any user work, **minus** the time this worker was blocked on its peers or on the
servers:

* DeepSpeed's collectives (the gradient all-reduce in ``backward``, ZeRO-1's all-gather in ``step``):
  :class:`PeerWaits` wraps the collectives of ``deepspeed.comm``'s backend while a clock is attached,
  and counts the time the training thread spends inside them;
* the engine's own waits on the servers (pulls, row fetches, pushes) go through :meth:`StepClock.blocked`.

A fast worker's wait for a slow one is therefore never its own time, wherever the slow one lost it.
The switch policy's exchange of step times and a hand-over run after :meth:`StepClock.lap` and before
:meth:`StepClock.restart`, outside every step.

Example::

    clock = StepClock()
    with clock.blocked():
        client.pull(...)              # not this worker's time
    own_s = clock.lap()               # at the end of an update: wall - blocked since the last restart
    clock.restart()                   # after the policy looked at own_s
"""
from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
from typing import Callable, Iterator

logger = logging.getLogger(__name__)

# deepspeed.comm backend methods that block until the peers take part (point-to-point is the servers' traffic)
_BLOCKING = ("all_reduce", "all_reduce_coalesced", "all_gather", "all_gather_into_tensor", "all_gather_coalesced",
             "reduce_scatter", "reduce_scatter_tensor", "broadcast", "barrier", "reduce", "all_to_all_single",
             "all_to_all", "gather", "scatter")


class StepClock:
    """One worker's own time per optimizer step (see the module docstring)."""

    def __init__(self) -> None:
        self._start = time.perf_counter()
        self.blocked_s = 0.0  # blocked on peers or servers since the last restart

    def restart(self) -> None:
        """Start a new step now (after an update and whatever the switch policy did after it)."""
        self._start, self.blocked_s = time.perf_counter(), 0.0

    def add_blocked(self, seconds: float) -> None:
        """Count ``seconds`` of waiting on peers or servers (not this worker's time)."""
        self.blocked_s += max(0.0, seconds)

    @contextlib.contextmanager
    def blocked(self) -> Iterator[None]:
        """The body's time is a wait on peers or servers."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.add_blocked(time.perf_counter() - t0)

    def lap(self) -> float:
        """This step's own seconds so far: wall since :meth:`restart` minus the blocked time."""
        return max(0.0, time.perf_counter() - self._start - self.blocked_s)


class PeerWaits:
    """Counts the training thread's time inside DeepSpeed's collectives into a :class:`StepClock`.

    The wrappers sit on ``deepspeed.comm``'s backend object (every DeepSpeed collective goes through
    it) from :meth:`attach` to :meth:`detach`, and count only calls from the attaching thread. An
    asynchronous collective (``async_op=True``) is counted until it returns its handle, not while it is
    waited on later.

    Example::

        waits = PeerWaits.attach(clock)      # the training thread, after deepspeed.comm is initialised
        ...
        waits.detach()
    """

    def __init__(self, clock: StepClock, backend, on_error: Callable[[str, BaseException], None] | None = None) -> None:
        self.clock, self.backend, self.on_error = clock, backend, on_error
        self.thread = threading.get_ident()
        self._wrapped: list[str] = []

    @classmethod
    def attach(cls, clock: StepClock, on_error: Callable[[str, BaseException], None] | None = None
               ) -> "PeerWaits | None":
        """Wrap the backend's collectives for ``clock``; None when deepspeed.comm has no backend (nothing to time).

        ``on_error(name, exc)`` runs when a collective of the training thread raises, before ``exc`` is
        re-raised: it may raise a named error instead (``sync_faults.explain_collective_failure``).
        """
        try:
            from deepspeed.comm import comm as ds_comm
        except ImportError:  # pragma: no cover - deepspeed is a dependency of the engine
            return None
        backend = getattr(ds_comm, "cdb", None)
        if backend is None:
            return None
        waits = cls(clock, backend, on_error)
        for name in _BLOCKING:
            original = getattr(backend, name, None)
            if callable(original) and name not in vars(backend):  # never wrap a wrapper of another engine
                setattr(backend, name, waits._timed(name, original))
                waits._wrapped.append(name)
        return waits

    def _timed(self, name: str, original: Callable) -> Callable:
        @functools.wraps(original)
        def timed(*args, **kwargs):
            if threading.get_ident() != self.thread:
                return original(*args, **kwargs)
            t0 = time.perf_counter()
            try:
                return original(*args, **kwargs)
            except Exception as exc:
                if self.on_error is not None:
                    self.on_error(name, exc)
                raise
            finally:
                self.clock.add_blocked(time.perf_counter() - t0)
        return timed

    def detach(self) -> None:
        """Give the backend its own methods back."""
        for name in self._wrapped:
            try:
                delattr(self.backend, name)
            except AttributeError:  # pragma: no cover - someone else removed it
                pass
        self._wrapped = []
