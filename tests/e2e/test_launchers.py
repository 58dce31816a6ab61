"""Launchers end to end (deepspeed, mpirun, Slurm sbatch+srun) and sparse_scale.distenv's env mapping.

The slow tests start ENTRY through each launch script on 2 ranks and read the summary.json that
rank 0 writes. The fast tests feed sparse_scale.distenv.resolve_dist_env plain env dicts.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Mapping, Sequence

import pytest

from sparse_scale.distenv import (
    DistEnvError,
    DistSpec,
    apply_to_environ,
    expand_tasks_per_node,
    is_loopback,
    resolve_dist_env,
)
from tests.infra.slurm_cluster import SlurmCluster, SlurmClusterError, slurm_cluster  # noqa: F401  (fixture)

REPO = Path(__file__).resolve().parents[2]
PY = sys.executable

# The job every launcher test starts: (entry script, DeepSpeed config, extra args); "--out DIR" is
# appended. Its rank 0 must write DIR/summary.json with at least "world_size" and "launcher"
# (DistContext.launcher): the real main job, on a few steps.
ENTRY: tuple[str, str, tuple[str, ...]] = (
    "launch/train_rec.py", "ds_configs/demo_cpu.json", ("--steps", "3", "--eval-samples", "2000", "--vocab", "200"))

NPROC = 2
# Per launch, once DeepSpeed's comm op is built (the warm-up fixture pays for that build).
LAUNCH_DEADLINE_S = 90.0  # typically 5-15 s; generous because the 2 cores are shared
# DeepSpeed's first init JIT-builds deepspeed_shm_comm (~40-60 s on 2 busy cores).
WARMUP_DEADLINE_S = 240.0
# Variables a launcher sets per rank: stale copies in the test's own env would leak into the ranks.
_LAUNCHER_VARS = re.compile(r"^(RANK|WORLD_SIZE|LOCAL_RANK|LOCAL_WORLD_SIZE|LOCAL_SIZE|CROSS_RANK|MASTER_PORT|"
                            r"TORCHELASTIC_.*|PMI_.*|PMIX_.*|MPI_LOCAL.*|OMPI_.*|HYDI_.*|SLURM_.*)$")


# ----------------------------------------------------------------------------- helpers


def launch_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not _LAUNCHER_VARS.match(k)}
    env.update(MASTER_ADDR="127.0.0.1", GLOO_SOCKET_IFNAME="lo", WANDB_MODE="offline",
               TRAIN_SCRIPT=ENTRY[0], NPROC=str(NPROC), PYTHONUNBUFFERED="1")
    env.update(extra)
    return env


def run_with_deadline(cmd: Sequence[str], env: Mapping[str, str], deadline_s: float,
                      cwd: Path = REPO) -> tuple[int, str, float]:
    """Run ``cmd`` in its own process group; kill the whole group at the deadline. Returns (rc, output, seconds)."""
    t0 = time.monotonic()
    proc = subprocess.Popen(list(cmd), cwd=cwd, env=dict(env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=deadline_s)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        out, _ = proc.communicate()
        pytest.fail(f"`{' '.join(cmd)}` passed its {deadline_s:.0f}s deadline; output:\n{_tail(out)}"
                    f"{_stale_lock_hint()}")
    finally:
        if proc.poll() is None:
            _kill_group(proc)
    return proc.returncode, out, time.monotonic() - t0


def _kill_group(proc: subprocess.Popen) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=5)
            return
        except subprocess.TimeoutExpired:
            continue


def _tail(text: str, lines: int = 60) -> str:
    return "\n".join(text.splitlines()[-lines:])


def _stale_lock_hint() -> str:
    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR", Path.home() / ".cache" / "torch_extensions"))
    locks = sorted(root.glob("*/*/lock")) if root.exists() else []
    return (f"\nstale JIT build lock(s), delete them if no build is running: {[str(p) for p in locks]}"
            if locks else "")


def entry_cmd_args(out_dir: Path) -> list[str]:
    return [*ENTRY[2], "--out", str(out_dir)]


def check_summary(out_dir: Path, launcher: str, output: str) -> dict:
    path = out_dir / "summary.json"
    assert path.is_file(), f"rank 0 wrote no {path}; output:\n{_tail(output)}"
    summary = json.loads(path.read_text())
    assert summary["world_size"] == NPROC, summary
    assert summary["launcher"] == launcher, summary
    assert summary["steps"] == 3 and summary["samples"] == 3 * NPROC * 256, summary
    assert summary["eval_samples"] >= 2000 and 0.0 < summary["auc"] < 1.0, summary
    assert Path(summary["checkpoint"]).is_dir(), summary
    assert "Traceback" not in output, _tail(output)
    return summary


def find_mpirun() -> str | None:
    for c in (REPO / ".venv" / "bin" / "mpirun", REPO / ".venv" / "bin" / "mpiexec"):
        if c.exists():
            return str(c)
    return shutil.which("mpirun") or shutil.which("mpiexec")


FAILING_SCRIPT = """\
import datetime, os, sys, time
sys.path.insert(0, {repo!r})
from sparse_scale.distenv import apply_to_environ, resolve_dist_env
import torch.distributed as dist
spec = resolve_dist_env(os.environ)
apply_to_environ(spec)
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
print(f"failing probe: rank {{spec.rank}}/{{spec.world_size}} via {{spec.launcher}}", flush=True)
dist.barrier()
if spec.rank == 1:
    os._exit(3)  # a crash: no cleanup, sockets closed by the kernel
dist.barrier()  # rank 0 must not wait for the 300 s timeout: gloo or the launcher has to end it
time.sleep(300)
"""


# ----------------------------------------------------------------------------- end to end


@pytest.fixture(scope="session")
def deepspeed_warm(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, float]:
    """Run ENTRY once as a plain single process; pays for DeepSpeed's one-time comm-op JIT build."""
    out = tmp_path_factory.mktemp("warm")
    env = launch_env()
    rc, output, secs = run_with_deadline([PY, ENTRY[0], "--config", ENTRY[1], *entry_cmd_args(out)], env,
                                         WARMUP_DEADLINE_S)
    assert rc == 0, f"single-process run failed (rc {rc}):\n{_tail(output)}"
    return json.loads((out / "summary.json").read_text()), secs


@pytest.mark.slow
@pytest.mark.timeout(WARMUP_DEADLINE_S + 60)
def test_single_process_without_launcher(deepspeed_warm: tuple[dict, float]) -> None:
    summary, secs = deepspeed_warm
    assert summary["world_size"] == 1 and summary["launcher"] == "single"
    print(f"single process (incl. any JIT build): {secs:.1f}s")


@pytest.mark.slow
@pytest.mark.timeout(WARMUP_DEADLINE_S + LAUNCH_DEADLINE_S + 60)
def test_deepspeed_launcher_two_ranks(deepspeed_warm: tuple[dict, float], tmp_path: Path) -> None:
    out = tmp_path / "run"
    rc, output, secs = run_with_deadline(
        ["bash", "launch/run_deepspeed.sh", ENTRY[1], *entry_cmd_args(out)], launch_env(), LAUNCH_DEADLINE_S)
    assert rc == 0, f"run_deepspeed.sh exited {rc}:\n{_tail(output)}"
    summary = check_summary(out, "deepspeed", output)
    if "ranks" in summary:  # the deepspeed launcher also passes --local_rank=N to each rank
        assert [r["argv_local_rank"] for r in summary["ranks"]] == list(range(NPROC))
    assert "--master_addr 127.0.0.1" in output
    print(f"deepspeed launcher, {NPROC} ranks: {secs:.1f}s")


@pytest.mark.slow
@pytest.mark.timeout(WARMUP_DEADLINE_S + LAUNCH_DEADLINE_S + 60)
def test_mpirun_two_ranks(deepspeed_warm: tuple[dict, float], tmp_path: Path) -> None:
    if find_mpirun() is None:
        pytest.skip("no mpirun/mpiexec: pip install mpich mpi4py (the [mpi] extra)")
    out = tmp_path / "run"
    rc, output, secs = run_with_deadline(
        ["bash", "launch/run_mpirun.sh", ENTRY[1], *entry_cmd_args(out)], launch_env(), LAUNCH_DEADLINE_S)
    assert rc == 0, f"run_mpirun.sh exited {rc}:\n{_tail(output)}"
    check_summary(out, "mpi", output)
    assert "-genv MASTER_ADDR 127.0.0.1" in output
    print(f"mpirun, {NPROC} ranks: {secs:.1f}s")


@pytest.mark.slow
@pytest.mark.timeout(WARMUP_DEADLINE_S + LAUNCH_DEADLINE_S + 120)
def test_sbatch_on_one_node_cluster(deepspeed_warm: tuple[dict, float], slurm_cluster: SlurmCluster,
                                    tmp_path: Path) -> None:
    out = tmp_path / "run"
    env = launch_env(SLURM_CONF=str(slurm_cluster.conf))
    t0 = time.monotonic()
    job = slurm_cluster.submit([f"--output={tmp_path}/slurm-%j.out", f"--ntasks={NPROC}", "--time=00:05:00",
                                "launch/train_rec.sbatch", ENTRY[1], *entry_cmd_args(out)], cwd=REPO, env=env)
    job_out = tmp_path / f"slurm-{job}.out"
    try:
        info = slurm_cluster.wait_job(job, LAUNCH_DEADLINE_S)
    except SlurmClusterError as e:
        pytest.fail(f"{e}\njob output:\n{_tail(job_out.read_text()) if job_out.exists() else '(none)'}")
    output = job_out.read_text() if job_out.exists() else ""
    secs = time.monotonic() - t0
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), (
        f"job {job}: {info['JobState']} exit {info['ExitCode']}\n{_tail(output)}\n{slurm_cluster.logs()}")
    assert f"job {job}: {NPROC} tasks on 1 node(s)" in output and "master 127.0.0.1:" in output, output
    check_summary(out, "slurm", output)
    print(f"sbatch + srun, {NPROC} ranks: {secs:.1f}s (incl. scheduling)")


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["deepspeed", "mpirun", "sbatch"])
def test_one_failing_rank_ends_the_launch(launcher: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    """Rank 1 crashes while rank 0 waits in a collective: the launch must end with an error, not hang.

    The deepspeed launcher and srun (--kill-on-bad-exit) kill the other ranks themselves; MPICH's
    Hydra does not for ranks that never called MPI_Init, so there rank 0 ends on gloo's peer error.
    """
    script = tmp_path / "fail_rank1.py"
    script.write_text(FAILING_SCRIPT.format(repo=str(REPO)))
    config = REPO / ENTRY[1]
    env = launch_env(TRAIN_SCRIPT=str(script))
    if launcher == "deepspeed":
        rc, output, secs = run_with_deadline(["bash", "launch/run_deepspeed.sh", str(config)], env, 45)
    elif launcher == "mpirun":
        if find_mpirun() is None:
            pytest.skip("no mpirun/mpiexec: pip install mpich mpi4py (the [mpi] extra)")
        rc, output, secs = run_with_deadline(["bash", "launch/run_mpirun.sh", str(config)], env, 45)
    else:
        cluster: SlurmCluster = request.getfixturevalue("slurm_cluster")
        env["SLURM_CONF"] = str(cluster.conf)
        log = tmp_path / "slurm.out"
        t0 = time.monotonic()
        job = cluster.submit([f"--output={log}", "--time=00:02:00", "launch/train_rec.sbatch", str(config)],
                             cwd=REPO, env=env)
        info = cluster.wait_job(job, 45)
        secs = time.monotonic() - t0
        rc = 0 if info["JobState"] == "COMPLETED" else 1
        output = log.read_text() if log.exists() else ""
    assert rc != 0, f"{launcher}: a rank exited 3 but the launch reported success:\n{_tail(output)}"
    assert "failing probe: rank 1/2" in output, _tail(output)
    print(f"{launcher}: failed rank ended the launch in {secs:.1f}s")


# ----------------------------------------------------------------------------- dist_env: env mapping


def _no_call(*_a: object) -> object:
    raise AssertionError("this look-up must not be needed")


def resolve(env: Mapping[str, str], **kw: object) -> DistSpec:
    kw.setdefault("slurm_hostnames", _no_call)
    kw.setdefault("mpi_query", _no_call)
    kw.setdefault("mpi_master_addr", _no_call)
    kw.setdefault("free_port", _no_call)
    return resolve_dist_env(env, **kw)  # type: ignore[arg-type]


TORCH = {"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29501"}


def test_deepspeed_launcher_env() -> None:
    s = resolve({**TORCH, "CROSS_RANK": "0", "LOCAL_SIZE": "2"})
    assert (s.rank, s.world_size, s.local_rank, s.launcher) == (1, 4, 1, "deepspeed")
    assert (s.local_world_size, s.master_addr, s.master_port) == (2, "10.0.0.1", 29501)
    assert s.torch_env() == {**TORCH, "LOCAL_WORLD_SIZE": "2", "LOCAL_SIZE": "2"}


def test_torchrun_env() -> None:
    s = resolve({**TORCH, "TORCHELASTIC_RUN_ID": "x", "LOCAL_WORLD_SIZE": "2"})
    assert (s.launcher, s.local_world_size) == ("torchrun", 2)


def test_plain_torch_env_is_launcher_env() -> None:
    assert resolve(TORCH).launcher == "env"


@pytest.mark.parametrize("present,missing", [("RANK", "WORLD_SIZE"), ("WORLD_SIZE", "RANK")])
def test_rank_without_world_size_is_an_error(present: str, missing: str) -> None:
    env = {k: v for k, v in TORCH.items() if k != missing}
    with pytest.raises(DistEnvError, match=rf"{present}='.+' is set but {missing} is missing"):
        resolve(env)


@pytest.mark.parametrize("drop", ["MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"])
def test_incomplete_torch_env_names_the_missing_variable(drop: str) -> None:
    with pytest.raises(DistEnvError, match=rf"but {drop} is missing"):
        resolve({k: v for k, v in TORCH.items() if k != drop})


@pytest.mark.parametrize("change,match", [
    ({"RANK": "one"}, r"RANK='one' is not an integer"),
    ({"RANK": "4"}, r"rank 4 is outside \[0, 4\)"),
    ({"RANK": "-1"}, r"rank -1 is outside"),
    ({"WORLD_SIZE": "0", "RANK": "0"}, r"world size 0 < 1"),
    ({"LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "2"}, r"local rank 2 is outside \[0, 2\)"),
    ({"LOCAL_WORLD_SIZE": "8"}, r"local world size 8 > world size 4"),
    ({"MASTER_PORT": "70000"}, r"master port 70000 is not a TCP port"),
])
def test_bad_torch_values(change: dict[str, str], match: str) -> None:
    with pytest.raises(DistEnvError, match=match):
        resolve({**TORCH, **change})


def test_stale_rank_contradicting_mpirun_is_an_error() -> None:
    env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1234",
           "PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"}
    with pytest.raises(DistEnvError, match=r"RANK=0 WORLD_SIZE=1 contradict PMI_RANK/PMI_SIZE .*rank 1 of 2"):
        resolve(env)


def test_stale_rank_contradicting_srun_is_an_error() -> None:
    env = {**TORCH, "RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "SLURM_STEP_ID": "0", "SLURM_PROCID": "1",
           "SLURM_NTASKS": "2", "SLURM_LOCALID": "1"}
    with pytest.raises(DistEnvError, match=r"contradict srun's SLURM_PROCID=1"):
        resolve(env)


def test_launcher_set_rank_wins_over_slurm_and_mpi() -> None:
    # torchrun started by srun (one per node): SLURM_PROCID is the node's task, RANK the process's rank.
    env = {**TORCH, "TORCHELASTIC_RUN_ID": "j", "SLURM_STEP_ID": "0", "SLURM_PROCID": "0", "SLURM_NTASKS": "2",
           "SLURM_LOCALID": "0", "PMI_RANK": "0", "PMI_SIZE": "2"}
    s = resolve(env)
    assert (s.rank, s.world_size, s.launcher) == (1, 4, "torchrun")


MPICH = {"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2", "PMI_FD": "9",
         "HYDI_CONTROL_FD": "7"}


def test_mpich_env_on_one_node_uses_loopback_and_default_port() -> None:
    s = resolve(MPICH)
    assert (s.rank, s.world_size, s.local_rank, s.local_world_size, s.launcher) == (1, 2, 1, 2, "mpi")
    assert (s.master_addr, s.master_port) == ("127.0.0.1", 29500)
    assert any("127.0.0.1" in n for n in s.notes) and any("29500" in n for n in s.notes)


def test_mpich_env_with_explicit_master() -> None:
    s = resolve({**MPICH, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "4321"})
    assert (s.master_addr, s.master_port, s.notes) == ("127.0.0.1", 4321, ())


def test_deepspeed_mpich_runner_env() -> None:
    # `deepspeed --launcher mpich` exports WORLD_SIZE and its launcher_helper adds RANK/LOCAL_RANK per rank.
    env = {**MPICH, "WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1", "LOCAL_SIZE": "2",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    s = resolve(env)
    assert (s.rank, s.world_size, s.local_rank, s.launcher) == (1, 2, 1, "env")


def test_multi_node_mpi_without_master_asks_mpi() -> None:
    env = {"PMI_RANK": "5", "PMI_SIZE": "8", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "4"}
    s = resolve(env, mpi_master_addr=lambda: "node1")
    assert (s.rank, s.world_size, s.local_rank, s.master_addr) == (5, 8, 1, "node1")


def test_open_mpi_env() -> None:
    env = {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
           "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "MASTER_ADDR": "n0", "MASTER_PORT": "7000"}
    s = resolve(env)
    assert (s.rank, s.world_size, s.local_rank, s.local_world_size, s.launcher) == (3, 4, 1, 2, "mpi")
    assert "Open MPI" in s.source


def test_pmi_rank_without_size_is_an_error() -> None:
    with pytest.raises(DistEnvError, match=r"PMI_RANK='0' is set but PMI_SIZE is missing"):
        resolve({"PMI_RANK": "0"})


def test_mpi_without_local_rank_on_many_nodes_is_an_error() -> None:
    with pytest.raises(DistEnvError, match="no local rank"):
        resolve({"PMI_RANK": "0", "PMI_SIZE": "4", "MPI_LOCALNRANKS": "2", "MASTER_ADDR": "a", "MASTER_PORT": "1"})


def test_mpi_rank_variables_win_over_slurm() -> None:
    # mpirun inside an sbatch job: Hydra's proxies run under srun, so both families are present.
    env = {**MPICH, "SLURM_STEP_ID": "0", "SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_LOCALID": "0"}
    s = resolve(env)
    assert (s.rank, s.world_size, s.launcher) == (1, 2, "mpi")


def test_process_manager_without_rank_variables_asks_mpi4py() -> None:
    s = resolve({"PMIX_RANK": "2", "PMIX_NAMESPACE": "job"}, mpi_query=lambda: (2, 4, 0, 2),
                mpi_master_addr=lambda: "n0")
    assert (s.rank, s.world_size, s.local_rank, s.local_world_size, s.master_addr, s.launcher) == (
        2, 4, 0, 2, "n0", "mpi")
    assert "mpi4py" in s.source


SRUN = {"SLURM_JOB_ID": "1234", "SLURM_STEP_ID": "0", "SLURM_PROCID": "3", "SLURM_NTASKS": "4",
        "SLURM_STEP_NUM_TASKS": "4", "SLURM_LOCALID": "1", "SLURM_NODEID": "1", "SLURM_STEP_TASKS_PER_NODE": "2(x2)",
        "SLURM_STEP_NODELIST": "node[07-08]", "SLURM_JOB_NODELIST": "node[07-08]"}


def test_srun_env_resolves_master_from_nodelist_and_port_from_job_id() -> None:
    calls = []
    s = resolve(SRUN, slurm_hostnames=lambda nl: calls.append(nl) or ["node07", "node08"])
    assert calls == ["node[07-08]"]
    assert (s.rank, s.world_size, s.local_rank, s.local_world_size, s.launcher) == (3, 4, 1, 2, "slurm")
    assert (s.master_addr, s.master_port) == ("node07", 15000 + 1234 % 20000)


def test_srun_env_with_master_from_sbatch_script() -> None:
    s = resolve({**SRUN, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "16234"})
    assert (s.master_addr, s.master_port, s.notes) == ("127.0.0.1", 16234, ())


def test_srun_step_smaller_than_allocation_uses_step_size() -> None:
    env = {**SRUN, "SLURM_STEP_NUM_TASKS": "1", "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODEID": "0",
           "SLURM_STEP_TASKS_PER_NODE": "1", "MASTER_ADDR": "a", "MASTER_PORT": "1"}
    s = resolve(env)
    assert (s.world_size, s.local_world_size) == (1, 1)


def test_srun_without_localid_is_an_error() -> None:
    with pytest.raises(DistEnvError, match="SLURM_LOCALID is missing"):
        resolve({k: v for k, v in SRUN.items() if k != "SLURM_LOCALID"})


def test_srun_without_task_count_is_an_error() -> None:
    env = {k: v for k, v in SRUN.items() if k not in ("SLURM_NTASKS", "SLURM_STEP_NUM_TASKS")}
    with pytest.raises(DistEnvError, match="none of SLURM_STEP_NUM_TASKS"):
        resolve(env)


def test_batch_script_without_srun_runs_one_process_and_warns() -> None:
    env = {"SLURM_JOB_ID": "9", "SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0"}
    s = resolve(env, free_port=lambda: 40000)
    assert (s.rank, s.world_size, s.launcher, s.master_port) == (0, 1, "single", 40000)
    assert any("not under srun" in w for w in s.warnings)


def test_no_launcher_is_one_process() -> None:
    s = resolve({"PATH": "/bin"}, free_port=lambda: 40001)
    assert (s.rank, s.world_size, s.local_rank, s.local_world_size, s.launcher) == (0, 1, 0, 1, "single")
    assert (s.master_addr, s.master_port) == ("127.0.0.1", 40001)
    s = resolve({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "40002"})
    assert s.master_port == 40002


def test_local_rank_alone_is_an_error() -> None:
    with pytest.raises(DistEnvError, match="LOCAL_RANK is set without RANK and WORLD_SIZE"):
        resolve({"LOCAL_RANK": "0"})


@pytest.mark.parametrize("spec,expected", [("2", [2]), ("2(x3)", [2, 2, 2]), ("2(x2),1", [2, 2, 1]),
                                           ("4,3,2", [4, 3, 2])])
def test_expand_tasks_per_node(spec: str, expected: list[int]) -> None:
    assert expand_tasks_per_node(spec) == expected


def test_expand_tasks_per_node_rejects_garbage() -> None:
    with pytest.raises(DistEnvError, match="cannot parse"):
        expand_tasks_per_node("2(y3)")


def test_apply_to_environ_pins_gloo_to_loopback_only_for_a_loopback_master() -> None:
    spec = resolve({**MPICH, "MASTER_PORT": "5000"})
    env: dict[str, str] = {}
    set_vars = apply_to_environ(spec, env)
    assert env == set_vars
    assert env["GLOO_SOCKET_IFNAME"] == "lo" and env["RANK"] == "1" and env["LOCAL_SIZE"] == "2"
    env = {"GLOO_SOCKET_IFNAME": "eth0"}
    apply_to_environ(spec, env)
    assert env["GLOO_SOCKET_IFNAME"] == "eth0"  # an explicit choice is kept
    env = {}
    apply_to_environ(resolve(TORCH), env)
    assert "GLOO_SOCKET_IFNAME" not in env


def test_is_loopback() -> None:
    assert is_loopback("127.0.0.1") and is_loopback("localhost") and is_loopback("::1")
    assert not is_loopback("10.0.0.1") and not is_loopback("node1")


def test_context_has_the_four_documented_fields() -> None:
    ctx = resolve(TORCH).context()
    assert (ctx.rank, ctx.world_size, ctx.local_rank, ctx.launcher) == (1, 4, 1, "env")
    assert not ctx.is_main
