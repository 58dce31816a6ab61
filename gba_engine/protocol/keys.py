"""Every TCPStore key of a GBA job and every monitor event name, each built by one function here.

The table of who writes and reads each key is in the package docstring (``gba_engine.protocol``).

Example::

    command_key(3)         # the first worker's command number 3
    ack_key(3, server=1)   # server 1's acknowledgement of it
"""
from __future__ import annotations

_ROOT = "gba"


def _key(*parts: object) -> str:
    return "/".join((_ROOT, *(str(p) for p in parts)))


# ---------------------------------------------------------------------------------------------- keys
def store_address_key(generation: int) -> str:
    """Where (on the launch's default store) the first server publishes the control plane's address."""
    return _key("ps_store", generation)


def layout_key() -> str:
    """The job's :class:`LayoutRecord` (read by a restarting worker)."""
    return _key("layout")


def heartbeat_key(rank: int) -> str:
    """The heartbeat counter of ``rank``."""
    return _key("hb", rank)


def closed_key(rank: int) -> str:
    """Set when ``rank`` closed its runtime (the store host waits for every rank)."""
    return _key("closed", rank)


def inbox_key(rank: int, incarnation: int = 0) -> str:
    """The doorbell queue of ``rank`` (a worker restarted k times reads its own, ``incarnation`` k)."""
    return _key("inbox", rank) if incarnation == 0 else _key("inbox", rank, incarnation)


def incarnation_key(rank: int) -> str:
    """The counter of restarts of worker ``rank`` (0: the process of the launch)."""
    return _key("incarnation", rank)


def pair_prefix(worker: int, server: int, incarnation: int) -> str:
    """The store prefix of the gloo rendezvous of a rejoined worker's pair group with ``server``."""
    return _key("pair", worker, server, incarnation) + "/"


def joinable_key() -> str:
    """Set (to the gba phase number) while the job accepts restarted workers: a gba phase it will not leave."""
    return _key("joinable")


def version_key(rank: int) -> str:
    """Where server ``rank`` publishes its model version after each update."""
    return _key("version", rank)


def norm_key(phase_id: int, version: int, server: int) -> str:
    """Server ``server``'s sum of squares of its dense shard's gradient for update ``version`` (clipping)."""
    return _key("norm", phase_id, version, server)


def command_key(seq: int) -> str:
    """The first worker's command number ``seq`` to the servers."""
    return _key("cmd", seq)


def ack_key(seq: int, server: int) -> str:
    """Server ``server``'s acknowledgement of command ``seq``."""
    return _key("ack", seq, server)


def done_key(rank: int) -> str:
    """Set when worker ``rank`` left the job (``GBAEngine.close``)."""
    return _key("done", rank)


def stats_key(server: int) -> str:
    """Server ``server``'s running stats."""
    return _key("stats", server)


def save_request_key() -> str:
    """The latest :class:`SaveRequest` (answered by the servers during a phase)."""
    return _key("save_req")


def save_done_key(request_id: int, server: int) -> str:
    """Set when server ``server`` wrote its shard of save request ``request_id``."""
    return _key("save_done", request_id, server)


def exhausted_key(phase: int) -> str:
    """Set when gba phase ``phase`` ran out of batches (no worker may wait for pushes)."""
    return _key("exhausted", phase)


def out_key(phase: int, rank: int) -> str:
    """Set when worker ``rank`` pushes nothing more in gba phase ``phase``."""
    return _key("out", phase, rank)


def end_key(phase: int) -> str:
    """The :class:`PhaseEnd` of gba phase ``phase``, set once by ``compare_set`` (whoever comes first wins)."""
    return _key("end", phase)


def step_time_key(rank: int) -> str:
    """Worker ``rank``'s :class:`StepTime` in a gba phase of auto mode."""
    return _key("t", rank)


def rate_key(rank: int) -> str:
    """Worker ``rank``'s local samples/s."""
    return _key("rate", rank)


def claims_counter_key(phase: int) -> str:
    """The TCPStore counter of gba phase ``phase``'s batch claims."""
    return _key("claims", phase)


def claims_base_key(phase: int) -> str:
    """The first batch number of gba phase ``phase`` (what a restarted worker starts its claims from)."""
    return _key("claims_base", phase)


def host_key(rank: int) -> str:
    """The host name of ``rank``, set at start-up, for the messages that name a lost rank."""
    return _key("host", rank)


def worker_lost_key() -> str:
    """``WORKER|HOST|REASON``, set once (``compare_set``) by the first survivor that finds a worker lost in a sync phase."""
    return _key("worker_lost")


def abort_key() -> str:
    """The job's :class:`AbortRecord`, set once (``compare_set``) by the first rank that finds a server lost."""
    return _key("abort")


def stuck_key() -> str:
    """The job's :class:`StuckRecord`, set once (``compare_set``) by the first worker found stuck in a collective
    that includes the server ranks (``gba_engine.collective_guard``)."""
    return _key("stuck")


def gather_key(name: str, rank: int) -> str:
    """Worker ``rank``'s part of the control-plane gather ``name``."""
    return _key("gather", name, rank)


# ---------------------------------------------------------------------------------------------- monitor events
MODE_IS_GBA_EVENT = _key("mode_is_gba")
SWITCH_SECONDS_EVENT = _key("switch_seconds")
SWITCH_MBYTES_EVENT = _key("switch_mbytes")
DROPPED_EVENT = _key("dropped")
DECAYED_EVENT = _key("decayed")


def samples_per_s_event(rank: int) -> str:
    """The monitor event of worker ``rank``'s samples/s."""
    return _key("samples_per_s", f"worker{rank}")


def staleness_event(tau: int) -> str:
    """The monitor event of the count of gradients of staleness ``tau``."""
    return _key("staleness", tau)
