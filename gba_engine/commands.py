"""The first worker's side of the server loop: numbered commands, their acknowledgements, save requests.

Every wait here ends within ``timeout_s``: a server whose heartbeat stops for the lease (dead or
frozen) or that does not answer in time raises :class:`~gba_engine.ps.runtime.ServerLostError`
naming it and the command, and aborts the job; an abort found by another rank ends it too.

Example::

    commands = ServerCommands(rt)
    seq = commands.send(PutState(src=rt.rank))
    commands.wait_acks(seq)                        # one Ack per server
    commands.save_during_phase("ckpt/global_step10", min_version=10)
"""
from __future__ import annotations

import time
from typing import Sequence

from .protocol import (Ack, Command, SaveRequest, ack_key, command_key, decode_command, encode_command,
                       save_done_key, save_request_key)
from .ps import PSRuntime
from .ps.runtime import Liveness, late

POLL_S = 0.02


class ServerCommands:
    """Sends commands in sequence (``gba/cmd/0, 1, ...``) and waits for every server's acknowledgement."""

    def __init__(self, rt: PSRuntime, next_seq: int = 0) -> None:
        self.rt = rt
        self.next_seq = next_seq
        self._save_id = 0

    @classmethod
    def continuing(cls, rt: PSRuntime) -> "ServerCommands":
        """A restarted first worker continues the job's command sequence after the last one sent."""
        seq = 0
        while rt.store.check([command_key(seq)]):
            seq += 1
        return cls(rt, seq)

    def send(self, command: Command) -> int:
        """Post ``command``; returns its sequence number."""
        seq = self.next_seq
        self.rt.store.set(command_key(seq), encode_command(command))
        self.next_seq += 1
        return seq

    def wait_acks(self, seq: int, timeout_s: float | None = None) -> list[Ack]:
        """Every server's acknowledgement of command ``seq`` (ServerLostError after ``timeout_s``, default the job's)."""
        keys = [ack_key(seq, s) for s in range(self.rt.layout.num_servers)]
        op = getattr(decode_command(self.rt.store.get(command_key(seq))), "op", "?")
        self._wait(keys, f"the acknowledgement of command #{seq} ({op})", timeout_s or self.rt.timeout_s)
        return [Ack.decode(self.rt.store.get(k)) for k in keys]

    def save_during_phase(self, folder: str, min_version: int) -> None:
        """Ask the serving servers to save their shards to ``folder`` once at ``min_version``; wait until they did."""
        self._save_id += 1
        self.rt.store.set(save_request_key(), SaveRequest(self._save_id, min_version, folder).encode())
        keys = [save_done_key(self._save_id, s) for s in range(self.rt.layout.num_servers)]
        self._wait(keys, f"its shard of the checkpoint {folder}", self.rt.timeout_s)

    def _wait(self, keys: Sequence[str], what: str, timeout_s: float) -> None:
        """Wait until every server ``i`` set ``keys[i]``; a lost or late server is a ServerLostError."""
        since, deadline = time.time(), time.monotonic() + timeout_s
        servers = self.rt.layout.servers
        live = Liveness(self.rt, servers)  # its poll also raises once the job is aborted
        next_poll = time.monotonic()
        while not self.rt.store.check(list(keys)):
            now = time.monotonic()
            if now >= next_poll or now > deadline:  # the heartbeats once a period: a frozen server is not a slow one
                next_poll = now + self.rt.heartbeat_s
                missing = [s for s, k in zip(servers, keys) if not self.rt.store.check([k])]
                lost = live.poll() & set(missing)
                if lost:
                    s = min(lost)
                    raise self.rt.server_lost(s, live.silence(s), what, since)
                if now > deadline and missing:
                    raise self.rt.server_lost(missing[0], late(timeout_s), what, since)
            time.sleep(POLL_S)
