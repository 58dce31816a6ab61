import os

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
