"""Which ranks of a launch are workers and which are parameter servers: the last ``num_servers`` ranks serve.

Example::

    lay = layout(world_size=4, num_servers=1)
    lay.workers, lay.servers, lay.role(3), lay.server_index(3)   # (0, 1, 2), (3,), 'server', 0
"""
from __future__ import annotations

import dataclasses

__all__ = ["Layout", "layout"]


@dataclasses.dataclass(frozen=True)
class Layout:
    """Which ranks of a launch are workers and which are parameter servers.

    Example::

        lay = layout(world_size=4, num_servers=1)
        lay.workers, lay.servers, lay.role(3), lay.server_index(3)   # (0, 1, 2), (3,), 'server', 0
    """

    world_size: int
    num_servers: int

    @property
    def workers(self) -> tuple[int, ...]:
        """Worker ranks (the first ``world_size - num_servers``)."""
        return tuple(range(self.world_size - self.num_servers))

    @property
    def servers(self) -> tuple[int, ...]:
        """Server ranks (the last ``num_servers``), in server-index order."""
        return tuple(range(self.world_size - self.num_servers, self.world_size))

    def role(self, rank: int) -> str:
        """``"worker"`` or ``"server"``."""
        self._check(rank)
        return "server" if rank >= self.world_size - self.num_servers else "worker"

    def server_index(self, rank: int) -> int:
        """Index 0..S-1 of a server rank (its dense range and its ids ``id % S``)."""
        if self.role(rank) != "server":
            raise ValueError(f"rank {rank} is a worker, not a server, in {self}")
        return rank - (self.world_size - self.num_servers)

    def worker_index(self, rank: int) -> int:
        """Index 0..N-1 of a worker rank (its data shard)."""
        if self.role(rank) != "worker":
            raise ValueError(f"rank {rank} is a server, not a worker, in {self}")
        return rank

    def _check(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside a launch of {self.world_size} ranks")


def layout(world_size: int, num_servers: int) -> Layout:
    """Validate and build the :class:`Layout` of a launch (raises a clear ValueError)."""
    if world_size < 1:
        raise ValueError(f"world size must be >= 1, got {world_size}")
    if num_servers < 1:
        raise ValueError(f"gba.num_servers must be >= 1, got {num_servers}")
    if num_servers >= world_size:
        raise ValueError(
            f"gba.num_servers={num_servers} leaves no worker in a launch of {world_size} ranks: the last "
            f"num_servers ranks become parameter servers, so launch at least {num_servers + 1} ranks "
            f"or lower gba.num_servers"
        )
    return Layout(world_size=world_size, num_servers=num_servers)
