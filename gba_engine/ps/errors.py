"""The errors of the parameter-server protocol: a peer that died or stopped answering, a lost server.

Example::

    try:
        client.pull()
    except ServerLostError as exc:
        exc.server, exc.index, exc.by        # 3, 0, 1
"""
from __future__ import annotations

__all__ = ["NO_REPLACEMENT", "PSConnectionError", "ServerLostError", "late"]

NO_REPLACEMENT = ("a replacement server is not supported (in a gba phase the servers hold the only current copy of "
                  "the dense state and the rows): restart the job from the last server checkpoint with --resume; "
                  "the updates since that checkpoint are lost")


class PSConnectionError(RuntimeError):
    """A peer of the parameter-server protocol died or stopped answering within its deadline."""


class ServerLostError(PSConnectionError):
    """A parameter server died, froze or did not answer within ``timeout_s``: the job stops.

    ``server`` is the server's rank, ``index`` its server index, ``by`` the rank that found it
    (another rank than the one raising when it learnt it from the job's ``abort`` record).
    A gloo error that revealed the loss is the ``__cause__``.

    Example::

        try:
            client.pull()
        except ServerLostError as exc:
            exc.server, exc.index, exc.by        # 3, 0, 1
    """

    def __init__(self, message: str, server: int, index: int, by: int) -> None:
        super().__init__(message)
        self.server, self.index, self.by = server, index, by

    def __reduce__(self):  # picklable with its fields (multiprocessing reports it)
        return (type(self), (str(self), self.server, self.index, self.by))


def late(timeout_s: float) -> str:
    """What a server that heartbeats but did not answer in time looks like, for a :meth:`PSRuntime.server_lost` state."""
    return f"is alive (its heartbeat moves) but did not answer within timeout_s={timeout_s:g}s (slow or stuck)"
