"""Train the byte-level MoE transformer LM with DeepSpeed on any folder of text files.

The entry script the deepspeed/mpirun/Slurm launch scripts run; the job is the library
:mod:`sparse_scale.lm` (``python -m sparse_scale.lm`` and ``sparse-train-moe-lm`` are the same):

    TRAIN_SCRIPT=launch/train_moe_lm.py bash launch/run_deepspeed.sh ds_configs/moe_lm_cpu.json --data DIR
    deepspeed --num_gpus 2 launch/train_moe_lm.py --config ds_configs/moe_lm_cpu.json --data DIR --steps 300
    python launch/train_moe_lm.py --config ds_configs/moe_lm_cpu.json --data DIR --glob '*.py' --steps 50
"""
from sparse_scale.lm.cli import main

if __name__ == "__main__":
    main()
