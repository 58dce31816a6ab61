"""One entry point that starts torch.distributed / deepspeed.comm under every launcher we support.

    from sparse_scale.distenv import init_distributed
    ctx = init_distributed(backend="gloo", timeout_s=300)   # ctx.rank, ctx.world_size, ctx.local_rank, ctx.launcher

Each launcher describes the job in its own environment variables. ``resolve_dist_env`` maps
them to one ``DistSpec`` (a pure function of an env dict, plus two injectable look-ups that
only Slurm-without-MASTER_ADDR and the mpi4py fallback need); ``init_distributed`` writes the
result into os.environ as RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT, logs the
mapping once and calls ``deepspeed.init_distributed``.

Precedence, first match wins:

1. torch-style variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT): the
   ``deepspeed`` launcher (it also sets CROSS_RANK), torchrun (TORCHELASTIC_RUN_ID), or a user.
2. MPI variables: MPICH / Intel MPI Hydra (PMI_RANK, PMI_SIZE, MPI_LOCALRANKID,
   MPI_LOCALNRANKS) or Open MPI (OMPI_COMM_WORLD_RANK, _SIZE, _LOCAL_RANK, _LOCAL_SIZE).
3. A Slurm job step started by ``srun`` (SLURM_PROCID, SLURM_STEP_NUM_TASKS or SLURM_NTASKS,
   SLURM_LOCALID; master = first host of the step's node list).
4. An MPI process manager that exported no rank variables (PMIx, PMI_FD only): ask mpi4py.
5. Nothing: one process, world size 1, on 127.0.0.1 and a free port.

Incomplete or contradictory variables (RANK without WORLD_SIZE, a RANK that disagrees with
PMI_RANK, a rank outside the world, ...) raise ``DistEnvError`` naming the variables.
"""
from __future__ import annotations

import dataclasses
import datetime
import ipaddress
import logging
import os
import re
import shutil
import socket
import subprocess
from typing import Callable, Mapping

logger = logging.getLogger(__name__)

# DeepSpeed's and torch's default rendezvous port, used when an MPI launch names no MASTER_PORT.
DEFAULT_MASTER_PORT = 29500
# Slurm jobs without MASTER_PORT get one derived from the job id in [base, base + span), so
# two jobs sharing a node rarely collide and every rank of one job computes the same port.
SLURM_PORT_BASE = 15000
SLURM_PORT_SPAN = 20000

_TORCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
# Markers of a process manager that may not export rank variables (PMIx, a bare PMI fd).
_MPI_MARKERS = ("PMIX_RANK", "PMIX_NAMESPACE", "PMI_FD", "PMI_PORT", "HYDI_CONTROL_FD")


class DistEnvError(RuntimeError):
    """The launcher's environment is incomplete or contradicts itself."""


@dataclasses.dataclass(frozen=True)
class DistContext:
    """Where this process sits in the job, as returned by ``init_distributed``."""

    rank: int
    world_size: int
    local_rank: int
    launcher: str  # "deepspeed", "torchrun", "env", "mpi", "slurm" or "single"
    local_world_size: int | None = None
    master_addr: str = "127.0.0.1"
    master_port: int = DEFAULT_MASTER_PORT

    @property
    def is_main(self) -> bool:
        return self.rank == 0


@dataclasses.dataclass(frozen=True)
class DistSpec(DistContext):
    """A resolved ``DistContext`` plus the env it was read from (for the log line and errors)."""

    source: str = ""  # e.g. "PMI_RANK/PMI_SIZE (MPICH Hydra)"
    notes: tuple[str, ...] = ()  # defaults that were filled in, logged once with the mapping
    warnings: tuple[str, ...] = ()  # likely mistakes that still allow a run, logged as warnings

    def context(self) -> DistContext:
        return DistContext(self.rank, self.world_size, self.local_rank, self.launcher,
                           self.local_world_size, self.master_addr, self.master_port)

    def torch_env(self) -> dict[str, str]:
        """The variables torch.distributed's env:// rendezvous and DeepSpeed read."""
        env = {
            "RANK": str(self.rank),
            "WORLD_SIZE": str(self.world_size),
            "LOCAL_RANK": str(self.local_rank),
            "MASTER_ADDR": self.master_addr,
            "MASTER_PORT": str(self.master_port),
        }
        if self.local_world_size is not None:
            env["LOCAL_WORLD_SIZE"] = str(self.local_world_size)
            # DeepSpeed's CPU accelerator counts its "devices" from LOCAL_SIZE (else from NUMA nodes).
            env["LOCAL_SIZE"] = str(self.local_world_size)
        return env


# ----------------------------------------------------------------------------- parsing helpers


def _int(env: Mapping[str, str], name: str) -> int:
    raw = env[name]
    try:
        return int(raw.strip())
    except ValueError:
        raise DistEnvError(f"{name}={raw!r} is not an integer") from None


def _opt_int(env: Mapping[str, str], name: str) -> int | None:
    return _int(env, name) if env.get(name, "").strip() != "" else None


def _has(env: Mapping[str, str], name: str) -> bool:
    return env.get(name, "").strip() != ""


def _require_pair(env: Mapping[str, str], rank_var: str, size_var: str, who: str) -> bool:
    """True when both are set, False when neither; an error when only one is."""
    has_rank, has_size = _has(env, rank_var), _has(env, size_var)
    if has_rank != has_size:
        present, missing = (rank_var, size_var) if has_rank else (size_var, rank_var)
        raise DistEnvError(
            f"{present}={env[present]!r} is set but {missing} is missing: the {who} environment is "
            f"incomplete (set both, or unset {present} if it leaked from your shell)")
    return has_rank


def expand_tasks_per_node(spec: str) -> list[int]:
    """Slurm's compressed task counts, e.g. ``"2(x3),1"`` -> ``[2, 2, 2, 1]``."""
    counts: list[int] = []
    for part in spec.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if not m:
            raise DistEnvError(f"cannot parse Slurm tasks-per-node {spec!r}")
        counts.extend([int(m.group(1))] * int(m.group(2) or 1))
    return counts


def is_loopback(addr: str) -> bool:
    if addr == "localhost":
        return True
    try:
        return ipaddress.ip_address(addr).is_loopback
    except ValueError:
        return False


def _check_ranges(rank: int, world: int, local_rank: int, local_world: int | None, names: str) -> None:
    if world < 1:
        raise DistEnvError(f"world size {world} < 1 (from {names})")
    if not 0 <= rank < world:
        raise DistEnvError(f"rank {rank} is outside [0, {world}) (from {names})")
    if local_rank < 0 or (local_world is not None and not 0 <= local_rank < local_world):
        raise DistEnvError(f"local rank {local_rank} is outside [0, {local_world}) (from {names})")
    if local_world is not None and local_world > world:
        raise DistEnvError(f"local world size {local_world} > world size {world} (from {names})")


def _master_port(env: Mapping[str, str], default: int, note: str, notes: list[str]) -> int:
    if _has(env, "MASTER_PORT"):
        port = _int(env, "MASTER_PORT")
    else:
        port = default
        notes.append(note.format(port=port))
    if not 0 < port < 65536:
        raise DistEnvError(f"master port {port} is not a TCP port")
    return port


# ----------------------------------------------------------------------------- launcher families


def _mpi_vars(env: Mapping[str, str]) -> tuple[int, int, int | None, int | None, str] | None:
    """(rank, size, local_rank, local_size, source) from MPICH/Intel or Open MPI variables."""
    if _require_pair(env, "PMI_RANK", "PMI_SIZE", "MPICH/Intel MPI (PMI)"):
        return (_int(env, "PMI_RANK"), _int(env, "PMI_SIZE"), _opt_int(env, "MPI_LOCALRANKID"),
                _opt_int(env, "MPI_LOCALNRANKS"), "PMI_RANK/PMI_SIZE (MPICH Hydra)")
    if _require_pair(env, "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "Open MPI"):
        return (_int(env, "OMPI_COMM_WORLD_RANK"), _int(env, "OMPI_COMM_WORLD_SIZE"),
                _opt_int(env, "OMPI_COMM_WORLD_LOCAL_RANK"), _opt_int(env, "OMPI_COMM_WORLD_LOCAL_SIZE"),
                "OMPI_COMM_WORLD_RANK/SIZE (Open MPI)")
    return None


def _slurm_step(env: Mapping[str, str]) -> tuple[int, int, int, int | None] | None:
    """(rank, world, local_rank, local_world) for a task started by srun, else None."""
    in_step = _has(env, "SLURM_STEP_ID") or _has(env, "SLURM_STEPID")
    if not (in_step and _has(env, "SLURM_PROCID")):
        return None
    size_var = next((v for v in ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS") if _has(env, v)), None)
    if size_var is None:
        raise DistEnvError("SLURM_PROCID is set under srun but none of SLURM_STEP_NUM_TASKS, "
                           "SLURM_NTASKS, SLURM_NPROCS is: the Slurm environment is incomplete")
    if not _has(env, "SLURM_LOCALID"):
        raise DistEnvError("SLURM_PROCID is set under srun but SLURM_LOCALID is missing")
    local_world = None
    tpn = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
    if tpn and _has(env, "SLURM_NODEID"):
        per_node = expand_tasks_per_node(tpn)
        node = _int(env, "SLURM_NODEID")
        if node < len(per_node):
            local_world = per_node[node]
    return _int(env, "SLURM_PROCID"), _int(env, size_var), _int(env, "SLURM_LOCALID"), local_world


def _from_torch_vars(env: Mapping[str, str], notes: list[str]) -> DistSpec:
    missing = [v for v in _TORCH_VARS if not _has(env, v)]
    if missing:
        raise DistEnvError(
            f"RANK and WORLD_SIZE are set but {', '.join(missing)} "
            f"{'is' if len(missing) == 1 else 'are'} missing: the torch.distributed environment is "
            "incomplete (the deepspeed launcher and torchrun set all five; unset RANK/WORLD_SIZE "
            "if they leaked from your shell)")
    rank, world, local_rank = _int(env, "RANK"), _int(env, "WORLD_SIZE"), _int(env, "LOCAL_RANK")
    local_world = _opt_int(env, "LOCAL_WORLD_SIZE")
    if local_world is None:
        local_world = _opt_int(env, "LOCAL_SIZE")
    _check_ranges(rank, world, local_rank, local_world, "RANK/WORLD_SIZE/LOCAL_RANK")
    if _has(env, "TORCHELASTIC_RUN_ID"):
        launcher = "torchrun"
    elif _has(env, "CROSS_RANK"):
        launcher = "deepspeed"
    else:
        launcher = "env"
        # Variables no launcher vouches for may be stale exports; an MPI or srun rank that
        # disagrees means every process got the same RANK and the rendezvous would hang.
        other = _mpi_vars(env)
        if other is not None:
            orank, osize, _, _, source = other
            if (orank, osize) != (rank, world):
                raise DistEnvError(
                    f"RANK={rank} WORLD_SIZE={world} contradict {source}: rank {orank} of {osize}. "
                    "Unset RANK/WORLD_SIZE/LOCAL_RANK (probably exported in your shell) and let "
                    "the MPI variables define the job")
        step = _slurm_step(env)
        if step is not None and (step[0], step[1]) != (rank, world):
            raise DistEnvError(
                f"RANK={rank} WORLD_SIZE={world} contradict srun's SLURM_PROCID={step[0]} "
                f"(of {step[1]} tasks). Unset RANK/WORLD_SIZE/LOCAL_RANK (probably exported in "
                "your shell or sbatch script) and let srun define the job")
    return DistSpec(rank, world, local_rank, launcher, local_world, env["MASTER_ADDR"].strip(),
                    _master_port(env, DEFAULT_MASTER_PORT, "", notes),
                    source="RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT", notes=tuple(notes))


def _mpi_master_addr(env: Mapping[str, str], world: int, local_world: int | None,
                     mpi_master_addr: Callable[[], str], notes: list[str]) -> str:
    if _has(env, "MASTER_ADDR"):
        return env["MASTER_ADDR"].strip()
    if local_world is not None and local_world == world:
        notes.append("MASTER_ADDR unset and every rank is on this node: using 127.0.0.1")
        return "127.0.0.1"
    # DeepSpeed's mpi_discovery takes the first word of `hostname -I`, which may not be routable
    # (it is not loopback on our dev machines); rank 0's resolvable hostname is the safer default.
    addr = mpi_master_addr()
    notes.append(f"MASTER_ADDR unset: using rank 0's host {addr} (from mpi4py)")
    return addr


# ----------------------------------------------------------------------------- the pure resolver


def resolve_dist_env(
    env: Mapping[str, str],
    *,
    slurm_hostnames: Callable[[str], list[str]] | None = None,
    mpi_query: Callable[[], tuple[int, int, int, int]] | None = None,
    mpi_master_addr: Callable[[], str] | None = None,
    free_port: Callable[[], int] | None = None,
) -> DistSpec:
    """Map a launcher's environment to this process's place in the job.

    Reads only ``env`` except through the injected look-ups, which are called only when needed:
    ``slurm_hostnames(nodelist)`` (default: ``scontrol show hostnames``) for an srun task without
    MASTER_ADDR, ``mpi_query()`` -> (rank, size, local_rank, local_size) and ``mpi_master_addr()``
    (default: mpi4py) for MPI without rank variables or a multi-node MPI job without MASTER_ADDR,
    and ``free_port()`` for a single process without MASTER_PORT.
    """
    slurm_hostnames = slurm_hostnames or scontrol_hostnames
    mpi_query = mpi_query or mpi4py_query
    mpi_master_addr = mpi_master_addr or mpi4py_master_addr
    free_port = free_port or pick_free_port
    notes: list[str] = []

    # 1. torch-style variables.
    if _require_pair(env, "RANK", "WORLD_SIZE", "torch.distributed"):
        return _from_torch_vars(env, notes)
    stray = [v for v in ("LOCAL_RANK",) if _has(env, v)]

    # 2. MPI rank variables.
    mpi = _mpi_vars(env)
    if mpi is not None:
        rank, world, local_rank, local_world, source = mpi
        if local_rank is None:
            # Without a local rank only a job that fits on one node can be placed (local = global).
            if world > 1 and local_world != world:
                raise DistEnvError(f"{source} give no local rank (MPI_LOCALRANKID / "
                                   "OMPI_COMM_WORLD_LOCAL_RANK): cannot place this rank on its node")
            local_rank = rank
            notes.append(f"no local rank variable: local_rank={local_rank}")
        _check_ranges(rank, world, local_rank, local_world, source)
        addr = _mpi_master_addr(env, world, local_world, mpi_master_addr, notes)
        port = _master_port(env, DEFAULT_MASTER_PORT, "MASTER_PORT unset: using DeepSpeed's default {port}", notes)
        return DistSpec(rank, world, local_rank, "mpi", local_world, addr, port, source=source, notes=tuple(notes))

    # 3. A Slurm step.
    step = _slurm_step(env)
    if step is not None:
        rank, world, local_rank, local_world = step
        _check_ranges(rank, world, local_rank, local_world, "SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID")
        if _has(env, "MASTER_ADDR"):
            addr = env["MASTER_ADDR"].strip()
        else:
            nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
            if not nodelist:
                raise DistEnvError("srun task without MASTER_ADDR and without SLURM_STEP_NODELIST / "
                                   "SLURM_JOB_NODELIST: cannot find the master host")
            hosts = slurm_hostnames(nodelist)
            if not hosts:
                raise DistEnvError(f"Slurm node list {nodelist!r} expanded to no hosts")
            addr = hosts[0]
            notes.append(f"MASTER_ADDR unset: first host of {nodelist!r} = {addr}")
        if not _has(env, "MASTER_PORT") and not _has(env, "SLURM_JOB_ID"):
            raise DistEnvError("srun task without MASTER_PORT and without SLURM_JOB_ID to derive one from")
        derived = SLURM_PORT_BASE + _int(env, "SLURM_JOB_ID") % SLURM_PORT_SPAN if _has(env, "SLURM_JOB_ID") else 0
        port = _master_port(env, derived, "MASTER_PORT unset: {port} derived from SLURM_JOB_ID", notes)
        return DistSpec(rank, world, local_rank, "slurm", local_world, addr, port,
                        source="SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID (srun)", notes=tuple(notes))

    # 4. An MPI process manager without rank variables.
    marker = next((m for m in _MPI_MARKERS if _has(env, m)), None)
    if marker is not None:
        rank, world, local_rank, local_world = mpi_query()
        source = f"mpi4py (process manager marker {marker}, no rank variables)"
        _check_ranges(rank, world, local_rank, local_world, source)
        addr = _mpi_master_addr(env, world, local_world, mpi_master_addr, notes)
        port = _master_port(env, DEFAULT_MASTER_PORT, "MASTER_PORT unset: using DeepSpeed's default {port}", notes)
        return DistSpec(rank, world, local_rank, "mpi", local_world, addr, port, source=source, notes=tuple(notes))

    # 5. One plain process.
    if stray:
        raise DistEnvError(f"{', '.join(stray)} is set without RANK and WORLD_SIZE: the torch.distributed "
                           "environment is incomplete (unset it, or set RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)")
    warnings: list[str] = []
    if _has(env, "SLURM_PROCID") and _has(env, "SLURM_NTASKS") and _int(env, "SLURM_NTASKS") > 1:
        warnings.append(f"inside a Slurm job of {env['SLURM_NTASKS']} tasks but not under srun: running ONE "
                        "process; start the job with `srun python ...` to get all of its ranks")
    addr = env.get("MASTER_ADDR", "").strip() or "127.0.0.1"
    port = _master_port(env, 0, "", notes) if _has(env, "MASTER_PORT") else free_port()
    return DistSpec(0, 1, 0, "single", 1, addr, port, source="no launcher variables", notes=tuple(notes),
                    warnings=tuple(warnings))


# ----------------------------------------------------------------------------- default look-ups


def scontrol_hostnames(nodelist: str) -> list[str]:
    """Expand a Slurm node list (``node[01-03],gpu7``) with ``scontrol show hostnames``."""
    exe = shutil.which("scontrol")
    if exe is None:
        raise DistEnvError(f"cannot expand Slurm node list {nodelist!r}: scontrol is not on PATH "
                           "(set MASTER_ADDR in the sbatch script instead)")
    try:
        out = subprocess.run([exe, "show", "hostnames", nodelist], capture_output=True, text=True,
                             check=True, timeout=30).stdout
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as e:
        raise DistEnvError(f"`scontrol show hostnames {nodelist}` failed: {e}") from e
    return out.split()


def mpi4py_query() -> tuple[int, int, int, int]:
    """(rank, size, local_rank, local_size) from MPI itself, for launchers that export no rank variables."""
    try:
        from mpi4py import MPI
    except ImportError as e:
        raise DistEnvError("an MPI process manager started this process without rank variables and "
                           "mpi4py is not importable: pip install mpi4py mpich") from e
    world = MPI.COMM_WORLD
    node = world.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        return world.Get_rank(), world.Get_size(), node.Get_rank(), node.Get_size()
    finally:
        node.Free()


def mpi4py_master_addr() -> str:
    """Rank 0's hostname, broadcast over MPI (resolvable, unlike the first word of `hostname -I`)."""
    try:
        from mpi4py import MPI
    except ImportError as e:
        raise DistEnvError("multi-node MPI job without MASTER_ADDR and mpi4py is not importable: "
                           "pass `-genv MASTER_ADDR <host of rank 0>` to mpirun") from e
    return MPI.COMM_WORLD.bcast(socket.gethostname(), root=0)


def pick_free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ----------------------------------------------------------------------------- the entry point


def apply_to_environ(spec: DistSpec, environ: "os._Environ[str] | dict[str, str]" = os.environ) -> dict[str, str]:
    """Write the torch-style variables (and GLOO_SOCKET_IFNAME=lo for a loopback master); returns what was set."""
    updates = spec.torch_env()
    # Gloo binds to the interface of the hostname by default, which cannot reach a loopback master.
    if is_loopback(spec.master_addr) and not environ.get("GLOO_SOCKET_IFNAME"):
        updates["GLOO_SOCKET_IFNAME"] = "lo"
    environ.update(updates)
    return updates


def init_distributed(backend: str | None = "gloo", timeout_s: float = 1800.0,
                     env: Mapping[str, str] | None = None) -> DistContext:
    """Resolve the launcher's environment, export it torch-style, and start deepspeed.comm.

    ``backend=None`` lets DeepSpeed's accelerator choose (gloo or ccl on CPU, nccl on CUDA).
    Safe to call twice: a second call checks that the running process group agrees.
    """
    import deepspeed
    import torch.distributed as tdist

    spec = resolve_dist_env(os.environ if env is None else env)
    set_vars = apply_to_environ(spec)
    if tdist.is_available() and tdist.is_initialized():
        if (tdist.get_rank(), tdist.get_world_size()) != (spec.rank, spec.world_size):
            raise DistEnvError(f"torch.distributed already runs as rank {tdist.get_rank()} of "
                               f"{tdist.get_world_size()}, but {spec.source} say rank {spec.rank} of {spec.world_size}")
    else:
        logger.info("distributed: launcher=%s rank=%d/%d local_rank=%d master=%s:%d backend=%s (from %s)%s",
                    spec.launcher, spec.rank, spec.world_size, spec.local_rank, spec.master_addr,
                    spec.master_port, backend or "accelerator default", spec.source,
                    "".join(f"; {n}" for n in spec.notes))
        for w in spec.warnings:
            logger.warning("distributed: %s", w)
        logger.debug("distributed: exported %s", set_vars)
    # auto_mpi_discovery=False: DeepSpeed's mpi_discovery would overwrite MASTER_ADDR with `hostname -I`
    # (not loopback here) and MASTER_PORT with 29500; the env above is already complete.
    deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False,
                               timeout=datetime.timedelta(seconds=timeout_s), verbose=False)
    from sparse_scale.deepspeed_shm import release_shm_segment

    release_shm_segment()  # DeepSpeed's CPU all-reduce segment would outlive the run in /dev/shm
    return spec.context()
