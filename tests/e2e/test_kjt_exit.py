"""A run that reads batches ahead exits cleanly (issue 26, "torchrec input aborts at exit").

The abort: packed tables fed torchrec ``KeyedJaggedTensor`` s on 2 ranks finished training, then a rank died
with ``terminate called without an active exception`` (rc -6, the deepspeed launcher's rc 250). The cause is
``picasso_ops.data.Prefetcher``'s daemon producer thread: when the script ends it is still making the next
batch (reading ahead is its job), inside a torch op; once the interpreter finalizes, the thread's return to
Python ends in ``pthread_exit``, whose forced unwind through torch's C++ frames calls ``std::terminate``.
A slower source (building KJTs) makes that near certain. The Prefetcher now stops and joins its producers at
interpreter exit.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from sparse_scale.multiproc import free_port

REPO = Path(__file__).resolve().parents[2]
LAUNCH_DEADLINE_S = 60.0  # typically 10-20 s once DeepSpeed's comm op is built

# One process: the producer is inside a 0.5 s torch op when the script ends without close().
ONE_PROCESS = textwrap.dedent("""
    import sys, threading, torch
    sys.path.insert(0, {repo!r})
    from picasso_ops.data.prefetch import Prefetcher

    torch.set_num_threads(1)
    busy = threading.Event()

    def source():
        yield 0
        busy.set()
        a = torch.randn(2500, 2500)
        yield float((a @ a).sum())   # the read-ahead of a batch nobody takes

    p = Prefetcher(source(), depth=1)
    assert next(p) == 0
    busy.wait(30)
    print("consumed one batch; exiting while the producer computes", flush=True)
""")

# The user's case: an own DLRM on data-parallel packed tables, fed KJTs read ahead on a thread, on 2 ranks
# under the deepspeed launcher; the loop stops after STEPS batches and the script ends.
KJT_SCRIPT = textwrap.dedent("""
    import argparse, sys
    sys.path.insert(0, {repo!r})
    import deepspeed, torch
    from torch import nn
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
    from picasso_ops.data.prefetch import Prefetcher
    from picasso_ops.distributed import DataParallelEmbeddingCollection, engine_step
    from picasso_ops.embedding import TableSpec

    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=0)
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    torch.set_num_threads(1)
    deepspeed.init_distributed()
    rank = torch.distributed.get_rank()
    F, V, D, B = 8, 1000, 16, 64
    KEYS = [f"f{{i}}" for i in range(F)]

    def batches():  # raw 64-bit ids hashed into the vocabulary: slower than the step, as preprocessing often is
        g = torch.Generator().manual_seed(rank)
        while True:
            lengths = torch.randint(1, 3, (F * B,), generator=g)
            raw = torch.randint(0, 2**62, (int(lengths.sum()), 8192), generator=g)
            values = sum((raw[:, i::4] * 0x9E3779B97F4A7C15).sum(1) for i in range(4)).remainder(V)
            kjt = KeyedJaggedTensor(keys=KEYS, values=values, lengths=lengths)
            yield torch.randn(B, 13, generator=g), kjt, torch.randint(0, 2, (B,), generator=g).float()

    class DLRM(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = DataParallelEmbeddingCollection([TableSpec(k, V, D) for k in KEYS])
            self.top = nn.Sequential(nn.Linear(F * D + 13, 32), nn.ReLU(), nn.Linear(32, 1))

        def forward(self, dense, kjt):
            return self.top(torch.cat([self.emb(kjt).values, dense], 1)).squeeze(-1)

    model = DLRM()
    config = {{"train_micro_batch_size_per_gpu": B, "steps_per_print": 10**6,
               "optimizer": {{"type": "AdamW", "params": {{"lr": 0.001, "torch_adam": True}}}}}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    before = float(model.emb.table_weight("f0").double().sum())
    for step, (dense, kjt, labels) in zip(range(args.steps), Prefetcher(batches(), depth=2)):
        engine.backward(nn.functional.binary_cross_entropy_with_logits(engine(dense, kjt), labels))
        engine_step(engine)
    moved = abs(float(model.emb.table_weight("f0").double().sum()) - before)
    # a file per rank: the launcher interleaves the ranks' stdout, even within a line
    with open(f"kjt_exit_rank{{rank}}.txt", "w") as f:
        f.write(f"trained {{step + 1}} steps, table f0 moved {{moved:.3g}}")
    from sparse_scale import shutdown_distributed
    shutdown_distributed()  # the Prefetcher is left running on purpose: its exit is what this test checks
""")


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not re.match(r"^(RANK|WORLD_SIZE|LOCAL_RANK|LOCAL_WORLD_SIZE|MASTER_PORT)$", k)}
    env.update(MASTER_ADDR="127.0.0.1", GLOO_SOCKET_IFNAME="lo", PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    return env


def test_exit_while_the_producer_is_inside_a_torch_op_is_clean(tmp_path):
    script = tmp_path / "exit_mid_batch.py"
    script.write_text(ONE_PROCESS.format(repo=str(REPO)))
    proc = subprocess.run([sys.executable, str(script)], env=_env(), capture_output=True, text=True, timeout=60)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"the process ended with rc {proc.returncode} at exit:\n{out[-3000:]}"
    assert "consumed one batch" in out and "terminate called" not in out, out[-3000:]


@pytest.mark.soak  # a launcher run of 10 s or more: make soak (CI runs it)
@pytest.mark.slow
@pytest.mark.timeout(LAUNCH_DEADLINE_S + 240)  # + DeepSpeed's one-time comm-op build, if not built yet
def test_kjt_training_on_two_ranks_exits_with_rc_0(tmp_path):
    pytest.importorskip("torchrec", reason="torchrec is installed by make test (fbgemm-gpu-cpu, then torchrec)")
    script = tmp_path / "kjt_dlrm.py"
    script.write_text(KJT_SCRIPT.format(repo=str(REPO)))
    cmd = [str(Path(sys.executable).parent / "deepspeed"), "--num_gpus", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), str(script), "--steps", "8"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=_env(), capture_output=True, text=True,
                          timeout=LAUNCH_DEADLINE_S + 200)
    out = proc.stdout + proc.stderr
    assert "terminate called" not in out, f"a rank aborted at exit:\n{out[-4000:]}"
    assert proc.returncode == 0, f"the deepspeed launcher exited {proc.returncode}:\n{out[-4000:]}"
    for rank in (0, 1):
        report = tmp_path / f"kjt_exit_rank{rank}.txt"
        match = re.fullmatch(r"trained 8 steps, table f0 moved (\S+)", report.read_text()) if report.is_file() else None
        assert match, f"rank {rank} did not report its training:\n{out[-4000:]}"
        assert float(match.group(1)) > 0, f"rank {rank}: the tables did not train:\n{out[-4000:]}"
