"""A gather over the control plane: every live worker's object, with no collective.

A dead worker is left out (its heartbeat stopped) and a restarted one (``gba_engine.rejoin``)
takes part, which a ``torch.distributed`` collective over the launch's group cannot do.

Example::

    parts = gather_live(rt, rt.layout.workers, Liveness(rt, rt.layout.workers), "eval/scores", scores)
    scores = torch.cat([parts[w] for w in sorted(parts)])
"""
from __future__ import annotations

import time
from typing import Any, Sequence

from .protocol import decode_object, encode_object, gather_key
from .ps import PSRuntime
from .ps.runtime import Liveness

POLL_S = 0.02


def gather_live(rt: PSRuntime, workers: Sequence[int], live: Liveness, name: str, obj: Any,
                timeout_s: float | None = None) -> dict[int, Any]:
    """``obj`` of every live worker, by worker rank; every live worker calls it with the same (new) ``name``.

    Waits while a missing worker's heartbeat moves, at most ``timeout_s`` (default
    ``rt.timeout_s``), then raises TimeoutError naming the workers that never answered.
    """
    store = rt.store
    store.set(gather_key(name, rt.rank), encode_object(obj))
    deadline = time.monotonic() + (rt.timeout_s if timeout_s is None else timeout_s)
    waiting = set(workers)
    while True:
        waiting = {w for w in waiting if not store.check([gather_key(name, w)])}
        if waiting <= live.poll():
            break
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank {rt.rank}: live workers {sorted(waiting)} did not reach gather "
                               f"{name!r} within {timeout_s or rt.timeout_s:.0f}s")
        time.sleep(POLL_S)
    return {w: decode_object(store.get(gather_key(name, w))) for w in workers if store.check([gather_key(name, w)])}
