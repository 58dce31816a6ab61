"""A private one-node Slurm cluster on this machine, for testing sbatch/srun launches for real.

    python tests/infra/slurm_cluster.py up      # prints `export SLURM_CONF=...`; then sbatch/srun/sinfo work
    python tests/infra/slurm_cluster.py down    # stops the daemons, removes the directory

In tests, use the ``slurm_cluster`` fixture (session scope), which skips only when Slurm or munge
is not installed (see tests/infra/install_sysdeps.sh) or the tests do not run as root.

Everything lives in one directory: slurm.conf, a fresh munge key, munged's socket, slurmctld and
slurmd state, spool and logs. Ports are picked free, so the cluster does not touch a system Slurm
or munge and several can run side by side. Every wait has a deadline; a failed start raises
``SlurmClusterError`` carrying the tails of the daemons' logs.
"""
from __future__ import annotations

import argparse
import ctypes
import dataclasses
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterator, Sequence

logger = logging.getLogger(__name__)

DEFAULT_CLI_DIR = Path(tempfile.gettempdir()) / "sparse-scale-slurm"
# Debian installs the daemons in /usr/sbin, which is not on every PATH.
_SBIN = ("/usr/sbin", "/usr/local/sbin", "/sbin")
CLIENT_TOOLS = ("sbatch", "srun", "sinfo", "squeue", "scontrol", "scancel")
DAEMON_TOOLS = ("slurmctld", "slurmd", "munged", "mungekey")
_DONE_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL",
                "DEADLINE", "PREEMPTED"}
_PIDFILES = ("munged.fg.pid", "slurmctld.fg.pid", "slurmd.fg.pid")


class SlurmClusterError(RuntimeError):
    """The cluster did not come up (or down) in time; the message holds the daemons' log tails."""


def find_tool(name: str) -> str | None:
    found = shutil.which(name)
    if found:
        return found
    for d in _SBIN:
        p = Path(d) / name
        if p.is_file() and os.access(p, os.X_OK):
            return str(p)
    return None


def unavailable_reason() -> str | None:
    """Why a local cluster cannot be started here, or None when it can."""
    missing = [t for t in CLIENT_TOOLS + DAEMON_TOOLS if find_tool(t) is None]
    if missing:
        return (f"Slurm/munge not installed (missing {', '.join(missing)}); "
                "run `bash tests/infra/install_sysdeps.sh` as root or `apt-get install slurm-wlm munge`")
    if os.geteuid() != 0:
        return "a local Slurm cluster needs root (slurmd starts job steps as the submitting user)"
    return None


def _free_ports(n: int) -> list[int]:
    socks = []
    try:
        for _ in range(n):  # hold all sockets open so the n ports differ
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _mem_mb() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) // 1024
    return 1024


def _die_with_parent() -> None:
    """preexec_fn: SIGTERM this child when the process that started it dies (no orphaned daemons)."""
    libc = ctypes.CDLL(None, use_errno=True)
    PR_SET_PDEATHSIG = 1
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def _tail(path: Path, lines: int = 30) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError as e:
        return f"  ({path}: {e})"
    return "\n".join("  " + line for line in text[-lines:]) or "  (empty)"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie still answers kill(0); it is dead for our purposes.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _wait_until(what: str, ok: Callable[[], bool], deadline_s: float, on_timeout: Callable[[], str]) -> None:
    end = time.monotonic() + deadline_s
    delay = 0.05
    while not ok():
        if time.monotonic() > end:
            raise SlurmClusterError(f"{what}: not ready after {deadline_s:.0f}s\n{on_timeout()}")
        time.sleep(delay)
        delay = min(delay * 2, 0.5)


@dataclasses.dataclass
class SlurmCluster:
    """A running one-node cluster; ``env`` is os.environ plus SLURM_CONF for client commands."""

    root: Path
    node: str
    cpus: int
    ctld_port: int
    slurmd_port: int
    procs: dict[str, subprocess.Popen | int] = dataclasses.field(default_factory=dict)
    # Two-node clusters (tests/infra/netns.py): the node names, and the prefix that runs a client on node A.
    nodes: tuple[str, ...] = ()
    client_prefix: tuple[str, ...] = ()

    @property
    def conf(self) -> Path:
        return self.root / "slurm.conf"

    @property
    def munge_socket(self) -> Path:
        return self.root / "munge" / "munge.socket"

    @property
    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env["SLURM_CONF"] = str(self.conf)
        return env

    def log_paths(self) -> list[Path]:
        names = ("munged", "slurmctld", *(f"slurmd-{n}" for n in self.nodes or ("",)))
        return [self.root / "log" / f"{n.rstrip('-')}.{ext}" for ext in ("log", "out") for n in names]

    def logs(self, lines: int = 30) -> str:
        return "\n".join(f"--- {p}\n{_tail(p, lines)}" for p in self.log_paths() if p.exists())

    def run(self, args: Sequence[str], timeout_s: float = 30.0, check: bool = True,
            **kw) -> subprocess.CompletedProcess[str]:
        """Run a Slurm client command against this cluster."""
        exe = find_tool(args[0]) or args[0]
        try:
            out = subprocess.run([*self.client_prefix, exe, *args[1:]], env=kw.pop("env", self.env), capture_output=True,
                                 text=True, timeout=timeout_s, **kw)
        except subprocess.TimeoutExpired as e:
            raise SlurmClusterError(f"`{' '.join(args)}` did not return within {timeout_s:.0f}s\n{self.logs()}") from e
        if check and out.returncode != 0:
            raise SlurmClusterError(f"`{' '.join(args)}` exited {out.returncode}: {out.stderr.strip()}\n{self.logs()}")
        return out

    def node_state(self, node: str | None = None) -> str:
        node = node or self.node
        out = self.run(["sinfo", "-h", "-N", "-o", "%N %t"], check=False, timeout_s=10)
        if out.returncode != 0:
            return f"sinfo failed: {out.stderr.strip()}"
        states = dict(line.split() for line in out.stdout.splitlines() if len(line.split()) == 2)
        return states.get(node, f"node {node} not listed: {out.stdout.strip()!r}")

    def submit(self, args: Sequence[str], cwd: Path | str | None = None, env: dict[str, str] | None = None) -> str:
        """``sbatch --parsable ARGS``; returns the job id."""
        out = self.run(["sbatch", "--parsable", *args], cwd=cwd, env=env or self.env)
        job = out.stdout.strip().split(";")[0]
        if not job.isdigit():
            raise SlurmClusterError(f"sbatch printed no job id: {out.stdout!r} {out.stderr!r}")
        return job

    def job_info(self, job: str, attempts: int = 5) -> dict[str, str]:
        """``scontrol show job`` as a dict (JobState, ExitCode, ...); finished jobs stay for MinJobAge.

        A client killed by a signal (seen: SIGPIPE, exit -13, when slurmctld drops the connection
        under load) or one that cannot reach the controller is retried; any other failure is not.
        """
        for attempt in range(attempts):
            out = self.run(["scontrol", "show", "job", "--oneliner", job], timeout_s=10, check=False)
            if out.returncode == 0:
                return dict(f.split("=", 1) for f in out.stdout.split() if "=" in f)
            transient = out.returncode < 0 or "Unable to contact" in out.stderr or "timed out" in out.stderr
            if not transient or attempt == attempts - 1:
                break
            time.sleep(0.5 * (attempt + 1))
        raise SlurmClusterError(f"`scontrol show job {job}` exited {out.returncode} ({attempt + 1} tries): "
                                f"{out.stderr.strip()}\n{self.logs()}")

    def wait_job(self, job: str, deadline_s: float) -> dict[str, str]:
        """Poll until the job ends (sbatch --wait sleeps up to 32 s between polls); cancel it at the deadline."""
        end = time.monotonic() + deadline_s
        while True:
            info = self.job_info(job)
            if info.get("JobState") in _DONE_STATES:
                return info
            if time.monotonic() > end:
                self.run(["scancel", job], check=False)
                queue = self.run(["squeue", "-a"], check=False).stdout
                raise SlurmClusterError(f"job {job} still {info.get('JobState')} after {deadline_s:.0f}s "
                                        f"(cancelled)\nsqueue:\n{queue}\n{self.logs()}")
            time.sleep(0.25)

    def stop(self, deadline_s: float = 15.0) -> None:
        """SIGTERM every daemon, SIGKILL what is left at the deadline, then delete the directory."""
        pids = {name: (p.pid if isinstance(p, subprocess.Popen) else p) for name, p in self.procs.items()}
        slurmds = sorted(n for n in pids if n.startswith("slurmd"))
        for name in (*slurmds, "slurmctld", "munged"):  # clients first, so none logs a lost controller
            if name in pids and _alive(pids[name]):
                try:
                    os.kill(pids[name], signal.SIGTERM)
                except ProcessLookupError:
                    pass
        end = time.monotonic() + deadline_s
        for name, pid in pids.items():
            p = self.procs[name]
            while time.monotonic() < end:
                if isinstance(p, subprocess.Popen):
                    if p.poll() is not None:
                        break
                elif not _alive(pid):
                    break
                time.sleep(0.1)
            else:
                logger.warning("slurm cluster: %s (pid %d) ignored SIGTERM for %.0fs; killing it", name, pid, deadline_s)
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                if isinstance(p, subprocess.Popen):
                    p.wait(timeout=5)
        self.procs.clear()
        shutil.rmtree(self.root, ignore_errors=True)


def write_config(root: Path, node: str, cpus: int, ctld_port: int, slurmd_port: int, mem_mb: int,
                 nodes: Sequence[tuple[str, str]] = ()) -> Path:
    """slurm.conf of a one-node cluster on loopback, or, with ``nodes`` ((name, address) each), of several
    nodes whose slurmd daemons each live in their own network namespace (the controller on the first)."""
    ctld_addr = nodes[0][1] if nodes else "127.0.0.1"
    node_lines = "\n".join(f"NodeName={n} NodeAddr={a} CPUs={cpus} RealMemory={mem_mb} State=UNKNOWN"
                            for n, a in (nodes or [(node, "127.0.0.1")]))
    names = ",".join(n for n, _ in nodes) or node
    per_node = "-%n" if nodes else ""  # several slurmd daemons share the directory
    conf = f"""\
# Written by tests/infra/slurm_cluster.py: a private cluster; see that file.
ClusterName=sparsescale
SlurmctldHost={node}({ctld_addr})
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={root}/munge/munge.socket
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool{per_node}
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd{per_node}.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd{per_node}.log
SlurmctldDebug=info
SlurmdDebug=info
# No cgroups in containers/sandboxes: track processes by parent pid and do not bind tasks.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/builtin
MpiDefault=none
PropagateResourceLimits=NONE
ReturnToService=2
# Keep finished jobs visible to scontrol for 5 minutes (there is no accounting database for sacct).
MinJobAge=300
KillWait=5
InactiveLimit=0
# Trust the CPUs/memory below even if slurmd counts differently (it counts sockets oddly in VMs).
SlurmdParameters=config_overrides
{node_lines}
PartitionName=debug Nodes={names} Default=YES MaxTime=INFINITE State=UP
"""
    path = root / "slurm.conf"
    path.write_text(conf)
    return path


def start_cluster(root: Path | None = None, deadline_s: float = 60.0, die_with_parent: bool = True,
                  pair=None) -> SlurmCluster:
    """Start munged, slurmctld and slurmd in ``root`` (a new temp dir by default); return when the node is idle.

    ``pair`` (a ``tests.infra.netns.TwoNodes``): a two-node cluster instead, nodeA and nodeB, one slurmd
    in each namespace and slurmctld on node A; client commands (``cluster.run``) then run on node A.
    """
    reason = unavailable_reason()
    if reason:
        raise SlurmClusterError(reason)
    root = Path(root) if root else Path(tempfile.mkdtemp(prefix="slurm-"))
    root = root.resolve()
    hosts = [(n.host, n.addr) for n in pair.nodes] if pair is not None else []
    for sub in ("munge", "state", "log", *(f"spool-{h}" for h, _ in hosts or [("", "")])):
        (root / sub.rstrip("-")).mkdir(parents=True, exist_ok=True)
    # munged refuses group/world-writable key directories; the socket directory must be searchable by all.
    os.chmod(root, 0o755)
    os.chmod(root / "munge", 0o755)
    node = socket.gethostname().split(".")[0]
    cpus = os.cpu_count() or 1
    ctld_port, slurmd_port = _free_ports(2)
    write_config(root, node, cpus, ctld_port, slurmd_port, max(256, int(_mem_mb() * 0.9)), hosts)
    on_a = tuple(pair.nodes[0].command([])) if pair is not None else ()
    cluster = SlurmCluster(root, node, cpus, ctld_port, slurmd_port, nodes=tuple(h for h, _ in hosts),
                           client_prefix=on_a)
    env = cluster.env
    preexec = _die_with_parent if die_with_parent else None

    def spawn(name: str, argv: list[str], where: Sequence[str] = ()) -> None:
        out = open(root / "log" / f"{name}.out", "wb")
        # A new session: a Ctrl-C in the terminal that ran `up` must not reach the daemons.
        p = subprocess.Popen([*where, *argv], env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                             start_new_session=True, preexec_fn=preexec)
        out.close()
        cluster.procs[name] = p
        (root / f"{name}.fg.pid").write_text(str(p.pid))

    def check_running(name: str) -> None:
        p = cluster.procs[name]
        if isinstance(p, subprocess.Popen) and p.poll() is not None:
            raise SlurmClusterError(f"{name} exited with code {p.returncode} during start-up\n{cluster.logs()}")

    try:
        key = root / "munge" / "munge.key"
        subprocess.run([find_tool("mungekey"), "--create", "--keyfile", str(key), "--bits", "1024"],
                       check=True, capture_output=True, timeout=30)
        os.chmod(key, 0o600)
        spawn("munged", [find_tool("munged"), "--foreground", "--force", f"--socket={cluster.munge_socket}",
                         f"--key-file={key}", f"--log-file={root / 'log' / 'munged.log'}",
                         f"--pid-file={root / 'munge' / 'munged.pid'}", f"--seed-file={root / 'munge' / 'munged.seed'}"])

        def munge_ok() -> bool:
            check_running("munged")
            if not cluster.munge_socket.exists():
                return False
            return subprocess.run([find_tool("munge") or "munge", "-n", "-S", str(cluster.munge_socket)],
                                  capture_output=True, timeout=10).returncode == 0

        _wait_until("munged", munge_ok, deadline_s, cluster.logs)
        # -D: stay in the foreground so we own the pid; -i: ignore (absent) saved state.
        spawn("slurmctld", [find_tool("slurmctld"), "-D", "-i"], on_a)
        daemons = [(f"slurmd-{n.host}", n.host, n.command([])) for n in pair.nodes] if pair is not None else [
            ("slurmd", node, [])]
        for name, nodename, where in daemons:
            spawn(name, [find_tool("slurmd"), "-D", "-N", nodename], where)

        def idle() -> bool:
            check_running("slurmctld")
            for name, _, _ in daemons:
                check_running(name)
            return all(cluster.node_state(n) in ("idle", "mix", "alloc") for _, n, _ in daemons)

        _wait_until(f"node(s) {[n for _, n, _ in daemons]} idle in sinfo", idle, deadline_s,
                    lambda: f"last sinfo state: {cluster.node_state()}\n{cluster.logs()}")
    except BaseException:
        cluster.stop()
        raise
    logger.info("slurm cluster up in %s (node %s, %d CPUs, slurmctld :%d, slurmd :%d)",
                root, node, cpus, ctld_port, slurmd_port)
    return cluster


def stop_cluster_dir(root: Path, deadline_s: float = 15.0) -> bool:
    """Stop a cluster started by ``up`` in another process, from its pid files. False if none was there."""
    if not (root / "slurm.conf").exists():
        return False
    cluster = SlurmCluster(root, "", 0, 0, 0)
    for name, pidfile in zip(("munged", "slurmctld", "slurmd"), _PIDFILES):
        try:
            cluster.procs[name] = int((root / pidfile).read_text())
        except (OSError, ValueError):
            pass
    cluster.stop(deadline_s)
    return True


# ----------------------------------------------------------------------------- pytest fixture

try:
    import pytest
except ImportError:  # the CLI works without pytest
    pytest = None  # type: ignore[assignment]

if pytest is not None:

    @pytest.fixture(scope="session")
    def slurm_cluster() -> Iterator[SlurmCluster]:
        """A running one-node cluster for the session; skips only when Slurm/munge are not installed."""
        reason = unavailable_reason()
        if reason:
            pytest.skip(reason)
        cluster = start_cluster()
        try:
            yield cluster
        finally:
            cluster.stop()


# ----------------------------------------------------------------------------- CLI


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Start or stop a private one-node Slurm cluster on this machine.")
    p.add_argument("action", choices=("up", "down", "status"))
    p.add_argument("--dir", type=Path, default=DEFAULT_CLI_DIR, help=f"cluster directory (default {DEFAULT_CLI_DIR})")
    p.add_argument("--deadline", type=float, default=60.0, help="seconds to wait for the node to be idle")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    root = args.dir.resolve()
    if args.action == "up":
        if (root / "slurm.conf").exists():
            print(f"a cluster directory already exists at {root}; run `{sys.argv[0]} down --dir {root}` first",
                  file=sys.stderr)
            return 1
        try:
            start_cluster(root, args.deadline, die_with_parent=False)
        except SlurmClusterError as e:
            print(f"slurm cluster failed to start: {e}", file=sys.stderr)
            return 1
        print(f"export SLURM_CONF={root / 'slurm.conf'}")
        print(f"# then: sbatch launch/train_rec.sbatch ds_configs/demo_cpu.json; squeue; "
              f"python {sys.argv[0]} down --dir {root}", file=sys.stderr)
        return 0
    if args.action == "status":
        if not (root / "slurm.conf").exists():
            print(f"no cluster at {root}")
            return 1
        env = dict(os.environ, SLURM_CONF=str(root / "slurm.conf"))
        return subprocess.run([find_tool("sinfo") or "sinfo"], env=env, timeout=30).returncode
    if not stop_cluster_dir(root):
        print(f"no cluster at {root}")
        return 1
    print(f"stopped the cluster in {root}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
