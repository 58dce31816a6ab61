"""The four own scripts of examples/ through the real deepspeed launcher: each learns, tables on 2 ranks agree.

Each test runs ``deepspeed --num_gpus N --master_port P examples/X.py --steps S --out OUT`` from an empty
working folder, with a deadline, and reads the ``OUT/result.json`` that the script's rank 0 writes. The
bars are the scripts' own (held-out AUC >= 0.75, or held-out loss <= 0.75 x its value before training),
checked again here; with lr 0 every script misses its bar and exits 1.
"""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"
DEEPSPEED = Path(sys.executable).parent / "deepspeed"
RUN_DEADLINE_S = 45.0  # one launch once DeepSpeed's comm op is built (12-25 s on 2 idle cores)
WARMUP_DEADLINE_S = 240.0  # DeepSpeed's first init JIT-builds its shm comm op (~40-60 s on 2 busy cores)
# Variables a launcher sets per rank: stale copies in the test's own env would leak into the ranks.
_LAUNCHER_VARS = re.compile(r"^(RANK|WORLD_SIZE|LOCAL_RANK|LOCAL_WORLD_SIZE|LOCAL_SIZE|CROSS_RANK|MASTER_PORT|"
                            r"TORCHELASTIC_.*|PMI_.*|PMIX_.*|MPI_LOCAL.*|OMPI_.*|SLURM_.*|OMP_NUM_THREADS)$")


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not _LAUNCHER_VARS.match(k)}
    env.update(MASTER_ADDR="127.0.0.1", GLOO_SOCKET_IFNAME="lo", WANDB_MODE="offline", PYTHONUNBUFFERED="1")
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(cmd: list[str], cwd: Path, deadline_s: float) -> tuple[int, str, float]:
    """Run ``cmd`` in its own process group, killed whole at the deadline; ``(rc, output, seconds)``."""
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=cwd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=deadline_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"`{' '.join(cmd)}` passed its {deadline_s:.0f} s deadline; output:\n{_tail(out)}")
    return proc.returncode, out, time.monotonic() - t0


def _tail(text: str, lines: int = 40) -> str:
    return "\n".join(text.splitlines()[-lines:])


@pytest.fixture(scope="session")
def deepspeed_built(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Pay for DeepSpeed's one-time comm-op build (cached in ~/.cache/torch_extensions) outside the run deadlines."""
    rc, out, _ = _run([sys.executable, "-c", "from deepspeed.comm.torch import build_shm_op; build_shm_op()"],
                      tmp_path_factory.mktemp("build"), WARMUP_DEADLINE_S)
    assert rc == 0, _tail(out)


def run_example(tmp_path: Path, script: str, ranks: int, *args: str, launcher: str = "deepspeed") -> dict:
    """Launch examples/``script`` on ``ranks`` ranks; its ``result.json`` after checking rc 0 and no stray files."""
    cwd, out = tmp_path / "cwd", tmp_path / "out"
    cwd.mkdir()
    port = str(_free_port())
    if launcher == "mpirun":  # MPICH's Hydra from pip: the script maps PMI_* through sparse_scale.distenv
        cmd = [str(DEEPSPEED.parent / "mpirun"), "-n", str(ranks), "-launcher", "fork", "-genv", "MASTER_ADDR",
               "127.0.0.1", "-genv", "MASTER_PORT", port, "-genv", "GLOO_SOCKET_IFNAME", "lo", sys.executable, "-u",
               str(EXAMPLES / script), *args, "--out", str(out)]
    else:
        cmd = [str(DEEPSPEED), "--num_gpus", str(ranks), "--master_addr", "127.0.0.1", "--master_port", port,
               str(EXAMPLES / script), *args, "--out", str(out)]
    rc, output, secs = _run(cmd, cwd, RUN_DEADLINE_S)
    said = [line for line in output.splitlines() if line.startswith(script.removesuffix(".py") + ":")]
    print(f"{script} on {ranks} ranks, {secs:.1f} s: {said[-1] if said else 'no result line'}")
    assert rc == 0, f"{script} exited {rc}:\n{_tail(output)}"
    assert "Traceback" not in output and "terminate called" not in output, _tail(output)
    assert list(cwd.iterdir()) == [], f"{script} wrote outside --out: {list(cwd.iterdir())}"
    path = out / "result.json"
    assert path.is_file(), f"rank 0 of {script} wrote no {path}:\n{_tail(output)}"
    return json.loads(path.read_text())


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["deepspeed", pytest.param("mpirun", marks=pytest.mark.soak)])
def test_dlrm_kjt_learns_and_its_table_replicas_agree(deepspeed_built, tmp_path, launcher):
    r = run_example(tmp_path, "dlrm_kjt.py", 2, "--steps", "60", "--eval-samples", "2048", launcher=launcher)
    assert r["world_size"] == 2 and r["auc"] >= 0.75 and r["learned"], r
    assert r["loss_last"] < r["loss_first"], r
    assert len(r["table_checksums"]) == 2 and r["table_checksums"][0] == r["table_checksums"][1], r
    assert r["replicas_agree"], r
    assert r["read_ahead"] == 0, r  # data-parallel tables: engine.pipeline hands the batches back


@pytest.mark.soak  # a launcher run of 10 s or more: make soak (CI runs it)
@pytest.mark.slow
def test_dlrm_kjt_with_row_wise_tables_trains_through_the_pipeline(deepspeed_built, tmp_path):
    r = run_example(tmp_path, "dlrm_kjt.py", 2, "--steps", "60", "--eval-samples", "2048", "--sharding", "row_wise")
    assert r["sharding"] == "row_wise" and r["replicas_agree"] is None, r
    assert r["auc"] >= 0.75 and r["learned"] and r["loss_last"] < r["loss_first"], r
    assert r["read_ahead"] >= 59, r  # every batch after the first was prepared on the pipeline's thread


@pytest.mark.slow
def test_moe_lm_learns_and_reloads_to_the_same_eval_loss(deepspeed_built, tmp_path):
    r = run_example(tmp_path, "moe_lm.py", 2, "--steps", "40")
    assert r["eval_loss"] <= 0.75 * r["eval_loss_before"] and r["learned"], r
    assert r["checkpoint"] and Path(r["checkpoint"]).is_dir(), r
    assert abs(r["fresh_eval_loss"] - r["eval_loss"]) > 0.1, r  # the fresh model differs until it is reloaded
    assert r["reloaded_eval_loss"] == pytest.approx(r["eval_loss"], abs=1e-5) and r["reload_matches"], r


def _check_gba(r: dict) -> None:
    assert r["workers"] == 2 and r["auc"] >= 0.75 and r["learned"], r
    assert r["loss_last"] < r["loss_first"], r
    to_gba = [s for s in r["switches"] if s["dst"] == "gba"]
    assert to_gba and "slow workers [1]" in to_gba[0]["reason"], r["switches"]  # the slowed worker moved the job
    assert r["steps_per_mode"].get("gba", 0) > 0, r


@pytest.mark.soak  # a launcher run of 10 s or more: make soak (CI runs it)
@pytest.mark.slow
def test_dlrm_gba_switches_to_gba_for_the_slowed_worker_and_learns(deepspeed_built, tmp_path):
    r = run_example(tmp_path, "dlrm_gba.py", 3, "--steps", "50", "--slow-rank", "1", "--slow-factor", "4",
                    "--slow-steps", "10-25", "--eval-samples", "2048")
    _check_gba(r)


@pytest.mark.soak  # a launcher run of 10 s or more: make soak (CI runs it)
@pytest.mark.slow
def test_all_blocks_in_one_script(deepspeed_built, tmp_path):
    r = run_example(tmp_path, "all_blocks.py", 3, "--steps", "50", "--slow-steps", "10-25", "--eval-samples", "2048")
    assert (r["tables"], r["moe"]) == ("ServerPackedFieldEmbeddings", "ReplicatedMoE"), r
    _check_gba(r)
