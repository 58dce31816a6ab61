"""The first worker's side of the server loop: numbered commands, their acknowledgements, save requests.

Example::

    commands = ServerCommands(rt)
    seq = commands.send(PutState(src=rt.rank))
    commands.wait_acks(seq)                        # one Ack per server
    commands.save_during_phase("ckpt/global_step10", min_version=10)
"""
from __future__ import annotations

import time

from .protocol import Ack, Command, SaveRequest, ack_key, command_key, encode_command, save_done_key, save_request_key
from .ps import PSRuntime

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
        """Every server's acknowledgement of command ``seq`` (TimeoutError after ``timeout_s``, default the job's)."""
        deadline = time.monotonic() + (timeout_s or self.rt.timeout_s)
        keys = [ack_key(seq, s) for s in range(self.rt.layout.num_servers)]
        while not self.rt.store.check(keys):
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank {self.rt.rank}: servers did not acknowledge command {seq} within "
                                   f"{timeout_s or self.rt.timeout_s:.0f}s")
            time.sleep(POLL_S)
        return [Ack.decode(self.rt.store.get(k)) for k in keys]

    def save_during_phase(self, folder: str, min_version: int) -> None:
        """Ask the serving servers to save their shards to ``folder`` once at ``min_version``; wait until they did."""
        self._save_id += 1
        self.rt.store.set(save_request_key(), SaveRequest(self._save_id, min_version, folder).encode())
        keys = [save_done_key(self._save_id, s) for s in range(self.rt.layout.num_servers)]
        deadline = time.monotonic() + self.rt.timeout_s
        while not self.rt.store.check(keys):
            if time.monotonic() > deadline:
                raise TimeoutError(f"parameter servers did not save {folder} within {self.rt.timeout_s:.0f}s")
            time.sleep(POLL_S)
