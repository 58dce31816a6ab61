"""Two "nodes" on one machine: two Linux network namespaces joined by a veth pair, each with its own address.

A process started in a node (``Node.popen``) sees only that node's interfaces: ``lo`` and ``ss0``
with the node's address, so a rendezvous, gloo's sockets and MPI's proxies really cross between
two hosts, unlike two loopback aliases that every process can bind. Both ends are named ``ss0``
inside their namespaces, so one ``GLOO_SOCKET_IFNAME=ss0`` serves every node, as on a cluster whose
nodes share an interface name. The file system is shared, like a cluster's shared home.

``rsh_script`` is an ``rsh``-style agent (``AGENT HOST COMMAND...``) that runs COMMAND in HOST's
namespace: MPICH's ``mpiexec -launcher rsh -launcher-exec AGENT`` uses it to start its proxies on the
other node, as it would use ssh between machines.

Needs root and ``ip`` (iproute2); :func:`unavailable` says why not where either is missing.

    with TwoNodes.create(tmp_path) as nodes:
        a, b = nodes
        b.popen(["python", "-c", "print(1)"]).wait()
"""
from __future__ import annotations

import dataclasses
import os
import random
import shutil
import subprocess
from pathlib import Path
from typing import Mapping, Optional, Sequence

IFACE = "ss0"


def unavailable() -> Optional[str]:
    """Why two namespaces cannot be made here (None: they can)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "nsenter"):
        if shutil.which(tool) is None:
            return f"no `{tool}` command (iproute2, util-linux)"
    probe = f"ssprobe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _ip(*args: str) -> None:
    out = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=10)
    if out.returncode:
        raise RuntimeError(f"`ip {' '.join(args)}` failed: {out.stderr.strip()}")


@dataclasses.dataclass(frozen=True)
class Node:
    """One namespace: its name, its address on the pair's subnet, and its host label."""

    netns: str
    addr: str
    host: str

    def command(self, argv: Sequence[str]) -> list[str]:
        # nsenter switches the network namespace only; `ip netns exec` also remounts /sys, hiding the
        # cgroup file system that slurmd needs
        return ["nsenter", f"--net=/var/run/netns/{self.netns}", "--", *argv]

    def popen(self, argv: Sequence[str], env: Mapping[str, str], cwd: str | Path, log: Path) -> subprocess.Popen:
        """Start ``argv`` in this node, output to ``log``, in its own process group (for cleanup)."""
        handle = open(log, "wb")
        try:
            return subprocess.Popen(self.command(argv), env=dict(env), cwd=str(cwd), stdout=handle,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        finally:
            handle.close()


class TwoNodes:
    """Two namespaces with a veth pair between them; removed on close (also after a failed create)."""

    def __init__(self, nodes: tuple[Node, Node], root: Path) -> None:
        self.nodes = nodes
        self.root = root
        self.rsh_script = root / "netns_rsh"
        hosts = "\n".join(f'    {n.addr}|{n.host}) ns={n.netns};;' for n in nodes)
        self.rsh_script.write_text(
            "#!/bin/bash\n# rsh-style agent: HOST COMMAND... runs COMMAND in HOST's network namespace\n"
            'host=$1; shift\ncase "$host" in\n' + hosts +
            '\n    *) echo "netns_rsh: unknown host $host" >&2; exit 255;;\nesac\n'
            'exec nsenter --net=/var/run/netns/"$ns" -- bash -c "$*"\n')
        self.rsh_script.chmod(0o755)

    @classmethod
    def create(cls, root: Path) -> "TwoNodes":
        tag = f"{os.getpid() % 10000}{random.randrange(100)}"
        subnet = f"10.{random.randrange(200, 250)}.{random.randrange(1, 250)}"
        nodes = (Node(f"ssA{tag}", f"{subnet}.1", "nodeA"), Node(f"ssB{tag}", f"{subnet}.2", "nodeB"))
        made = []
        try:
            for n in nodes:
                _ip("netns", "add", n.netns)
                made.append(n)
            _ip("link", "add", f"va{tag}", "type", "veth", "peer", "name", f"vb{tag}")
            for n, end in zip(nodes, (f"va{tag}", f"vb{tag}")):
                _ip("link", "set", end, "netns", n.netns)
                _ip("-n", n.netns, "link", "set", end, "name", IFACE)
                _ip("-n", n.netns, "addr", "add", f"{n.addr}/24", "dev", IFACE)
                _ip("-n", n.netns, "link", "set", IFACE, "up")
                _ip("-n", n.netns, "link", "set", "lo", "up")
        except Exception:
            for n in made:
                subprocess.run(["ip", "netns", "del", n.netns], capture_output=True)
            raise
        root.mkdir(parents=True, exist_ok=True)
        return cls(nodes, root)

    def close(self) -> None:
        """Kill what still runs in the namespaces, then delete them (the veth pair goes with them)."""
        for n in self.nodes:
            pids = subprocess.run(["ip", "netns", "pids", n.netns], capture_output=True, text=True).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), 9)
                except (ProcessLookupError, ValueError):
                    pass
            subprocess.run(["ip", "netns", "del", n.netns], capture_output=True)

    def __enter__(self) -> tuple[Node, Node]:
        return self.nodes

    def __exit__(self, *exc) -> None:
        self.close()
