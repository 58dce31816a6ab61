import glob
import os
import time

import pytest
import torch

# Small ops stall for milliseconds when two torch threads share 2 busy cores; tests need no speed.
torch.set_num_threads(1)
os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
if not torch.cuda.is_available():
    # Triton kernels run in its CPU interpreter here; the variable must be set before anything imports triton.
    os.environ.setdefault("TRITON_INTERPRET", "1")

from sparse_scale.multiproc import start_ranks_from_forkserver  # noqa: E402  (after the variables above are set)

# Ranks fork from one server that imported these once (~6 s of CPU a rank otherwise); ranks still start clean.
# SPARSE_SCALE_TEST_SPAWN=1 spawns every rank afresh instead, to rule the server out when a test misbehaves.
if os.environ.get("SPARSE_SCALE_TEST_SPAWN") != "1":
    start_ranks_from_forkserver(["torch", "torch.distributed", "numpy", "deepspeed", "torch._dynamo",
                                 "torch._inductor.compile_fx", "wandb"])


@pytest.fixture(scope="session", autouse=True)
def _remove_leaked_deepspeed_shm_buffers():
    """DeepSpeed's CPU shm comm op leaves a 66 MB /dev/shm buffer per rank and port; ours fill the tmpfs otherwise."""
    start = time.time() - 1.0
    yield
    for path in glob.glob("/dev/shm/deepspeed_allreduce_buffer_*"):
        try:
            if os.stat(path).st_mtime >= start:  # created by this session's ranks, which have all exited
                os.unlink(path)
        except OSError:
            pass
