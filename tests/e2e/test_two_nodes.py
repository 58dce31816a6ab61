"""Two-node launches on one machine: two network namespaces as two hosts (tests/infra/netns.py).

Each node has its own address and sees only its own interfaces, so the rendezvous, gloo and MPI's
proxies cross between hosts for real. The launches are the ones a user runs on a cluster:

* ``deepspeed --hostfile`` with its multi-node runner in ``--no_ssh`` mode: the same command on
  each node with ``--node_rank`` (what DeepSpeed documents for clusters without passwordless ssh);
* MPICH's ``mpiexec -hosts A,B`` starting its proxy on the second host through an rsh-style agent
  (``-launcher rsh -launcher-exec``: ssh's place, here a script that enters the other namespace);
* train_rec in sync and gba mode with the parameter server on the second node; the MoE LM with its
  expert-parallel group spanning both nodes;
* ``sbatch --nodes=2`` on a two-node Slurm cluster: one slurmd per namespace, started with
  ``slurmd -N NODE`` (Debian's build runs one slurmd per network namespace fine).
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Sequence

import pytest

from tests.infra import netns
from tests.e2e.test_launchers import PY, REPO, _tail, find_mpirun, launch_env

pytestmark = [pytest.mark.slow, pytest.mark.soak, pytest.mark.skipif(netns.unavailable() is not None,
                                                   reason=f"two nodes need network namespaces: {netns.unavailable()}")]
DEADLINE_S = 55.0
DEEPSPEED = str(Path(PY).parent / "deepspeed")
REC_STEPS = 3
REC_ARGS = ("--steps", str(REC_STEPS), "--eval-samples", "1024", "--vocab", "200", "--threads", "1")


@pytest.fixture(scope="module")
def nodes(tmp_path_factory: pytest.TempPathFactory):
    pair = netns.TwoNodes.create(tmp_path_factory.mktemp("nodes"))
    try:
        yield pair
    finally:
        pair.close()


def _env(master: netns.Node, port: int) -> dict[str, str]:
    return launch_env(MASTER_ADDR=master.addr, MASTER_PORT=str(port), GLOO_SOCKET_IFNAME=netns.IFACE,
                      OMP_NUM_THREADS="1")


def _port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def _wait_all(procs: Sequence[tuple[str, subprocess.Popen, Path]]) -> dict[str, int]:
    """Wait for every node's launcher; at the deadline kill them all and fail with their logs."""
    end = time.monotonic() + DEADLINE_S
    codes = {}
    for name, proc, log in procs:
        try:
            codes[name] = proc.wait(timeout=max(end - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            for _, p, _ in procs:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            logs = "\n".join(f"--- {n}\n{_tail(lg.read_text(errors='replace'))}" for n, _, lg in procs)
            pytest.fail(f"two-node launch passed its {DEADLINE_S:.0f}s deadline\n{logs}")
    return codes


def _logs(procs) -> str:
    return "\n".join(f"--- {n}\n{_tail(lg.read_text(errors='replace'))}" for n, _, lg in procs)


def _deepspeed_on_both(pair: netns.TwoNodes, slots: tuple[int, int], script: str, script_args: Sequence[str],
                       out: Path) -> dict:
    """The same ``deepspeed --hostfile H --no_ssh --node_rank R`` command on each node; rank 0's summary."""
    a, b = pair.nodes
    hostfile = out.parent / f"{out.name}.hostfile"
    hostfile.write_text(f"{a.host} slots={slots[0]}\n{b.host} slots={slots[1]}\n")
    port = _port()
    procs = []
    for rank, node in enumerate(pair.nodes):
        cmd = [DEEPSPEED, "--hostfile", str(hostfile), "--no_ssh", "--node_rank", str(rank),
               "--master_addr", a.addr, "--master_port", str(port), script, *script_args, "--out", str(out)]
        log = out.parent / f"{out.name}.{node.host}.log"
        procs.append((node.host, node.popen(cmd, _env(a, port), REPO, log), log))
    codes = _wait_all(procs)
    assert codes == {a.host: 0, b.host: 0}, f"exit codes {codes}\n{_logs(procs)}"
    return json.loads((out / "summary.json").read_text())


def test_the_two_nodes_are_separate_hosts(nodes):
    """Node B cannot reach node A's loopback, only its address: the launches below really cross hosts."""
    a, b = nodes.nodes
    probe = "import socket,sys; s=socket.socket(); s.settimeout(2); sys.exit(s.connect_ex((sys.argv[1], 9)))"
    listener = subprocess.Popen(a.command([PY, "-c", "import socket,time; s=socket.socket(); "
                                           f"s.bind(('0.0.0.0', 9)); s.listen(); time.sleep(20)"]))
    try:
        time.sleep(1.0)
        over_the_link = subprocess.run(b.command([PY, "-c", probe, a.addr]), timeout=10).returncode
        own_loopback = subprocess.run(b.command([PY, "-c", probe, "127.0.0.1"]), timeout=10).returncode
    finally:
        listener.kill()
        listener.wait()
    assert over_the_link == 0 and own_loopback != 0


def test_deepspeed_hostfile_two_nodes_sync(nodes, tmp_path):
    summary = _deepspeed_on_both(nodes, (1, 1), "launch/train_rec.py",
                                 ["--config", "ds_configs/demo_cpu.json", *REC_ARGS], tmp_path / "sync")
    assert summary["world_size"] == 2 and summary["launcher"] == "deepspeed" and summary["steps"] == REC_STEPS


@pytest.mark.parametrize("mode", ["sync", "gba"])
def test_train_rec_with_the_parameter_server_on_the_second_node(nodes, tmp_path, mode):
    """2 workers on node A, the job's one parameter server (the last rank) on node B."""
    cfg = json.loads((REPO / "ds_configs" / "gba_cpu.json").read_text())
    cfg["gba"].update(mode=mode, timeout_s=30)
    cfg["wandb"] = {"enabled": False}
    path = tmp_path / "gba.json"
    path.write_text(json.dumps(cfg))
    summary = _deepspeed_on_both(nodes, (2, 1), "launch/train_rec.py", ["--config", str(path), *REC_ARGS],
                                 tmp_path / mode)
    assert summary["world_size"] == 3
    assert summary["gba"]["steps_per_mode"] == {mode: summary["steps"]}
    if mode == "gba":  # the job's --steps x 2 workers batches, first come: each one's gradient reached node B
        assert sum(summary["gba"]["staleness_histogram"].values()) == REC_STEPS * 2


def test_moe_lm_with_expert_parallelism_across_the_nodes(nodes, tmp_path):
    """ep_size 2 with one rank per node: every MoE layer's all-to-all crosses the link."""
    data = tmp_path / "texts"
    data.mkdir()
    for f in sorted((REPO / "moe_proto").glob("*.py")):
        (data / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((REPO / "ds_configs" / "moe_lm_cpu.json").read_text())
    cfg.update(train_micro_batch_size_per_gpu=2, wandb={"enabled": False})
    cfg["moe_model"] = {"num_layers": 2, "d_model": 32, "num_heads": 2, "ffn_hidden_size": 64, "seq_len": 32}
    cfg["moe_proto"].update(moe_every=1, num_experts=4, ep_size=2)
    path = tmp_path / "moe.json"
    path.write_text(json.dumps(cfg))
    summary = _deepspeed_on_both(nodes, (1, 1), "launch/train_moe_lm.py",
                                 ["--config", str(path), "--data", str(data), "--steps", "3", "--threads", "1",
                                  "--eval-tokens", "2000", "--heldout-fraction", "0.2"], tmp_path / "moe")
    assert summary["world_size"] == 2 and summary["num_experts"] == 4 and summary["steps"] == 3


def test_mpirun_with_two_hosts(nodes, tmp_path):
    """MPICH's mpiexec on node A starts its proxy on node B through the rsh agent, one rank per host."""
    mpirun = find_mpirun()
    if mpirun is None:
        pytest.fail("no mpirun in the venv: make venv installs mpich")
    a, b = nodes.nodes
    port, out = _port(), tmp_path / "mpi"
    cmd = [mpirun, "-launcher", "rsh", "-launcher-exec", str(nodes.rsh_script), "-hosts", f"{a.addr},{b.addr}",
           "-n", "2", "-ppn", "1", "-iface", netns.IFACE,
           "-genv", "MASTER_ADDR", a.addr, "-genv", "MASTER_PORT", str(port),
           "-genv", "GLOO_SOCKET_IFNAME", netns.IFACE, "-genv", "OMP_NUM_THREADS", "1",
           PY, "launch/train_rec.py", "--config", "ds_configs/demo_cpu.json", *REC_ARGS, "--out", str(out)]
    log = tmp_path / "mpi.log"
    procs = [("mpiexec", a.popen(cmd, _env(a, port), REPO, log), log)]
    codes = _wait_all(procs)
    assert codes == {"mpiexec": 0}, _logs(procs)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["launcher"] == "mpi"


def test_sbatch_on_a_two_node_slurm_cluster(nodes, tmp_path):
    """``sbatch --nodes=2``: one slurmd per namespace (``slurmd -N``), slurmctld and the clients on node A;
    launch/train_rec.sbatch takes the rendezvous address from the first node's NodeAddr."""
    from tests.infra.slurm_cluster import SlurmClusterError, start_cluster, unavailable_reason

    reason = unavailable_reason()
    if reason:
        pytest.skip(reason)
    cluster = start_cluster(tmp_path / "slurm", deadline_s=40.0, pair=nodes)
    try:
        out = tmp_path / "run"
        env = launch_env(SLURM_CONF=str(cluster.conf), GLOO_SOCKET_IFNAME=netns.IFACE)
        job = cluster.submit([f"--output={tmp_path}/slurm-%j.out", "--nodes=2", "--ntasks-per-node=1",
                              "--time=00:05:00", "launch/train_rec.sbatch", "ds_configs/demo_cpu.json", *REC_ARGS,
                              "--out", str(out)], cwd=REPO, env=env)
        job_out = tmp_path / f"slurm-{job}.out"
        try:
            info = cluster.wait_job(job, DEADLINE_S)
        except SlurmClusterError as e:
            pytest.fail(f"{e}\njob output:\n{_tail(job_out.read_text()) if job_out.exists() else '(none)'}")
        output = job_out.read_text() if job_out.exists() else ""
        assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), f"{_tail(output)}\n{cluster.logs()}"
        a = nodes.nodes[0]
        assert f"2 tasks on 2 node(s) [nodeA,nodeB], master {a.addr}:" in output, output
        summary = json.loads((out / "summary.json").read_text())
        assert summary["world_size"] == 2 and summary["launcher"] == "slurm"
    finally:
        cluster.stop()
