"""The control-plane TCPStore in a small process of its own, so that no rank's freeze freezes the store.

A TCPStore answers from a thread of the process that hosts it. Hosted inside a parameter
server, a ``kill -STOP`` of that server froze every store operation of every rank, timeouts
included (the client waits on a TCP connection that stays open). So the first server starts
this process (``python -m gba_engine.ps.store_host``) and only connects to it as a client,
like every other rank. The process serves the store and nothing else; it exits:

* when every rank of the launch has closed its runtime or is presumed lost (its heartbeat
  has not moved for the lease): the job is over;
* when its parent (the first server) is gone and either the above holds or ``timeout_s`` plus
  the lease have passed since: every other rank's waits end within ``timeout_s``, and they need
  the store until then to learn why the job stops (the ``abort`` key);
* on SIGTERM/SIGKILL from a launcher that stops the process group (it is in its parent's group).

It never outlives the job: no rank heartbeats once the job is over.

Example::

    host = start_store_host("127.0.0.1", world_size=3, timeout_s=30.0, heartbeat_s=1.0)
    store = TCPStore(host.host, host.port, is_master=False)
    host.pid                  # the store process (a child of this one)
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import logging
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

from ..config import HEARTBEAT_LEASE
from ..protocol import closed_key, heartbeat_key

logger = logging.getLogger(__name__)


class StoreHostError(RuntimeError):
    """The control-plane store process did not start."""


@dataclasses.dataclass
class StoreHost:
    """A running store process: where it listens, and its process (a child of the caller)."""

    host: str
    port: int
    process: subprocess.Popen

    @property
    def pid(self) -> int:
        """The store process's pid."""
        return self.process.pid


def start_store_host(host: str, world_size: int, timeout_s: float, heartbeat_s: float) -> StoreHost:
    """Start the store process on ``host`` (a port the OS picks) and wait, at most ``timeout_s``, for its port.

    Raises :class:`StoreHostError` with the process's output when it exits or stays silent.

    Example::

        host = start_store_host("127.0.0.1", world_size=4, timeout_s=60.0, heartbeat_s=2.0)
        host.port          # e.g. 41873
    """
    package_root = str(Path(__file__).resolve().parents[2])  # the folder holding gba_engine, for a fresh interpreter
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH", "")) if p)
    cmd = [sys.executable, "-m", "gba_engine.ps.store_host", "--host", host, "--world-size", str(world_size),
           "--timeout-s", repr(float(timeout_s)), "--heartbeat-s", repr(float(heartbeat_s)),
           "--parent-pid", str(os.getpid())]
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, env=env)
    deadline = time.monotonic() + max(timeout_s, 30.0)  # a fresh interpreter imports torch: give it room
    line = b""
    while not line.endswith(b"\n"):
        remaining = deadline - time.monotonic()
        if remaining <= 0 or proc.poll() is not None:
            if proc.poll() is None:
                proc.kill()
            raise StoreHostError(f"the control-plane store process ({' '.join(cmd)}) did not report its port within "
                                 f"{max(timeout_s, 30.0):.0f}s (exit code {proc.poll()}); its errors are on stderr")
        ready, _, _ = select.select([proc.stdout], [], [], min(remaining, 0.1))
        if ready:
            chunk = os.read(proc.stdout.fileno(), 64)
            if not chunk:
                continue  # end of file: the process is exiting, poll() says so next round
            line += chunk
    proc.stdout.close()
    port = int(line.strip())
    logger.info("control-plane store: pid %d at %s:%d", proc.pid, host, port)
    return StoreHost(host=host, port=port, process=proc)


class _Ranks:
    """Which ranks of the launch are done: closed, or heartbeat unmoved for the lease (never-seen ranks are not)."""

    def __init__(self, store, world_size: int, lease_s: float) -> None:
        self._store, self._lease_s = store, lease_s
        self._seen: dict[int, tuple[int, float]] = {}  # rank -> (last counter, when it last changed)
        self._ranks = range(world_size)

    def all_done(self) -> bool:
        now = time.monotonic()
        done = True
        for r in self._ranks:
            if self._store.check([closed_key(r)]):
                continue
            if not self._store.check([heartbeat_key(r)]):
                done = False  # not connected yet
                continue
            beat = self._store.add(heartbeat_key(r), 0)
            last = self._seen.get(r)
            if last is None or last[0] != beat:
                self._seen[r] = (beat, now)
                done = False
            elif now - last[1] <= self._lease_s:
                done = False
        return done


def serve(host: str, world_size: int, timeout_s: float, heartbeat_s: float, parent_pid: int) -> int:
    """Host the store until the job is over (see the module docstring); returns the exit code (0).

    Example::

        serve("127.0.0.1", world_size=3, timeout_s=30.0, heartbeat_s=1.0, parent_pid=os.getppid())
    """
    from torch.distributed import TCPStore

    store = TCPStore(host, 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=timeout_s))
    sys.stdout.write(f"{store.port}\n")
    sys.stdout.flush()
    lease_s = HEARTBEAT_LEASE * heartbeat_s
    ranks = _Ranks(store, world_size, lease_s)
    orphaned_at = None
    poll_s = min(heartbeat_s, 0.5)
    while True:
        time.sleep(poll_s)
        if ranks.all_done():
            logger.info("control-plane store at %s:%d: every rank closed or is gone; exiting", host, store.port)
            return 0
        if orphaned_at is None and os.getppid() != parent_pid:  # reparented: the first server is gone
            orphaned_at = time.monotonic()
            logger.info("control-plane store at %s:%d: its parent (pid %d) is gone; serving the other ranks at "
                        "most %.1fs more", host, store.port, parent_pid, timeout_s + lease_s)
        if orphaned_at is not None and time.monotonic() - orphaned_at > timeout_s + lease_s:
            logger.warning("control-plane store at %s:%d: exiting %.1fs after its parent died", host, store.port,
                           timeout_s + lease_s)
            return 0


def main(argv: list[str] | None = None) -> int:
    """The store process's command line (started by :func:`start_store_host`)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--timeout-s", type=float, required=True)
    parser.add_argument("--heartbeat-s", type=float, required=True)
    parser.add_argument("--parent-pid", type=int, required=True)
    args = parser.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # Ctrl-C in the launch's terminal: end quietly, like the ranks
    logging.basicConfig(level=logging.WARNING, format="[gba store host %(process)d] %(message)s")
    return serve(args.host, args.world_size, args.timeout_s, args.heartbeat_s, args.parent_pid)


if __name__ == "__main__":
    sys.exit(main())
