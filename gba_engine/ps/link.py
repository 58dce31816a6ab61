"""A modelled network link between workers and parameter servers: one-way latency and bandwidth, per direction.

``tc netem`` is not available on every machine (the 2-core CI host has no netem qdisc), so the
slow link is modelled in the transport instead. A message is delivered to its receiver when its
doorbell is rung (``PSRuntime.ring``; wire.py: a receiver only reads data whose doorbell it
popped), so :class:`DelayedDoorbells` rings each doorbell no earlier than::

    start = max(now, end of the previous message on this link)       # one wire per direction
    delivered = start + nbytes * 8 / (mbit * 1e6) + latency_ms / 1e3

The gloo sends are posted at once and the doorbell is rung from a background thread, so the
sender goes on computing while its message "travels": what real asynchronous I/O overlaps,
the model overlaps too. Each process models its own outgoing direction of every link (a
worker its requests, a server its replies), so a pull pays the latency twice. The control
plane (claims, commands, heartbeats) is not delayed: it stands for the job's coordinator.

Example::

    model = LinkModel(latency_ms=0.5, mbit=1000)
    model.transfer_s(1_000_000)                      # 0.008 s on the wire
    bells = DelayedDoorbells(model, host, port, timeout_s=30)
    bells.ring(dst=3, key=inbox, message=raw, nbytes=4096)   # popped by rank 3 >= 0.53 ms later
    bells.close()
"""
from __future__ import annotations

import dataclasses
import datetime
import heapq
import itertools
import logging
import threading
import time

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class LinkModel:
    """One-way latency (ms) and bandwidth (Mbit/s, 0: unlimited) of every worker-server link.

    Example::

        LinkModel(latency_ms=2.0).enabled, LinkModel().enabled          # True, False
    """

    latency_ms: float = 0.0
    mbit: float = 0.0

    def __post_init__(self) -> None:
        for name in ("latency_ms", "mbit"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or value != value or value < 0 or value == float("inf"):
                raise ValueError(f"LinkModel.{name} must be a finite number >= 0, got {value!r}")

    @property
    def enabled(self) -> bool:
        """Whether the link delays anything (a zero model costs no thread)."""
        return self.latency_ms > 0 or self.mbit > 0

    def transfer_s(self, nbytes: int) -> float:
        """Seconds ``nbytes`` occupy the wire (0 with unlimited bandwidth)."""
        return 0.0 if self.mbit <= 0 else nbytes * 8.0 / (self.mbit * 1e6)


class DelayedDoorbells:
    """Rings doorbells at their modelled delivery time, in order per destination, on its own store client.

    Example::

        bells = DelayedDoorbells(LinkModel(latency_ms=1.0), "127.0.0.1", port, timeout_s=30.0)
        bells.ring(2, "inbox/2/0", b"...", nbytes=96)
        bells.close()
    """

    def __init__(self, model: LinkModel, host: str, port: int, timeout_s: float) -> None:
        from torch.distributed import TCPStore

        self.model = model
        self._store = TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=timeout_s))
        self._free_at: dict[int, float] = {}  # destination -> when its wire is free again
        self._heap: list[tuple[float, int, str, bytes]] = []
        self._order = itertools.count()  # ties keep send order
        self._cv = threading.Condition()
        self._closed = False
        self.delayed_s = 0.0  # summed modelled delay of every message (latency + wire time)
        self.messages = 0
        self._thread = threading.Thread(target=self._run, name="gba-link", daemon=True)
        self._thread.start()

    def ring(self, dst: int, key: str, message: bytes, nbytes: int) -> None:
        """Queue the doorbell ``message`` for store queue ``key`` of ``dst``; returns at once."""
        now = time.monotonic()
        with self._cv:
            if self._closed:
                raise RuntimeError("the modelled link is closed")
            start = max(now, self._free_at.get(dst, now))
            done = start + self.model.transfer_s(nbytes)
            self._free_at[dst] = done
            due = done + self.model.latency_ms / 1e3
            self.delayed_s += due - now
            self.messages += 1
            heapq.heappush(self._heap, (due, next(self._order), key, message))
            self._cv.notify()

    def close(self, timeout_s: float = 5.0) -> None:
        """Deliver what is queued (waiting for its time), then stop the thread."""
        with self._cv:
            self._closed = True
            self._cv.notify()
        self._thread.join(timeout=timeout_s)

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._heap and not self._closed:
                    self._cv.wait()
                if not self._heap:
                    return
                due, _, key, message = self._heap[0]
                wait = due - time.monotonic()
                if wait > 0:
                    self._cv.wait(timeout=wait)
                    continue
                heapq.heappop(self._heap)
            try:
                self._store.queue_push(key, message)
            except Exception as exc:  # the store host is gone after the job ended: nobody reads the inbox any more
                logger.debug("modelled link: doorbell for %s not delivered: %s", key, exc)
