"""The MoE language-model job as a library: train the byte-level MoE LM with DeepSpeed, evaluate, checkpoint.

    from sparse_scale.lm import LMJobConfig, run
    summary = run(LMJobConfig(config="ds_configs/moe_lm_cpu.json", data="moe_proto", glob="*.py", steps=50))
    summary.eval_bits_per_byte          # held-out bits per byte, the same on every rank

``run`` works under every launcher ``sparse_scale.distenv`` knows (deepspeed, mpirun,
srun, one plain process); the command line around it is :mod:`sparse_scale.lm.cli`
(``python -m sparse_scale.lm``, console script ``sparse-train-moe-lm``).
"""
from .checkpoints import NoCheckpointError, Progress
from .job import LMJobConfig, run
from .model import model_args_from_config
from .summary import LMSummary, summary_rows

__all__ = ["LMJobConfig", "LMSummary", "NoCheckpointError", "Progress", "model_args_from_config",
           "run", "summary_rows"]
