#!/usr/bin/env bash
# Train locally on NPROC CPU ranks (default 2) with the deepspeed launcher.
#
#   bash launch/run_deepspeed.sh ds_configs/demo_cpu.json [--steps 200 --out runs/demo ...]
#
# Environment knobs:
#   NPROC=4                     number of ranks (one "device" each; the CPU accelerator has no limit)
#   TRAIN_SCRIPT=launch/train_moe_lm.py   entry script (default launch/train_rec.py)
#   MASTER_PORT=29600           rendezvous port (default: a free one)
#   LAUNCHER_ARGS="--bind_cores_to_rank"  extra deepspeed launcher flags (that one needs numactl)
# Multi-node runs use a hostfile instead: see launch/hostfile.example.
set -euo pipefail

usage() { echo "usage: [NPROC=2] [TRAIN_SCRIPT=launch/train_rec.py] $0 CONFIG.json [script args...]" >&2; exit 2; }
[[ $# -ge 1 && "$1" != -* ]] || usage
CONFIG=$1; shift
[[ -f "$CONFIG" ]] || { echo "$0: config $CONFIG not found" >&2; exit 2; }

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# Prefer the project's venv so `make demo` works without activating it.
if [[ -x "$REPO/.venv/bin/python" ]]; then
    PYTHON=${PYTHON:-$REPO/.venv/bin/python}
    DEEPSPEED=${DEEPSPEED:-$REPO/.venv/bin/deepspeed}
else
    PYTHON=${PYTHON:-python3}
    DEEPSPEED=${DEEPSPEED:-deepspeed}
fi
command -v "$DEEPSPEED" >/dev/null || { echo "$0: $DEEPSPEED not found: pip install deepspeed" >&2; exit 127; }

# shellcheck source=launch/local_env.sh
source "$REPO/launch/local_env.sh"

# Without a hostfile the launcher runs on localhost; --num_gpus sets the rank count (CPU accelerator too).
# shellcheck disable=SC2206  # LAUNCHER_ARGS is meant to be word-split
cmd=("$DEEPSPEED" --num_gpus "$NPROC" --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT"
     ${LAUNCHER_ARGS:-} "$TRAIN_SCRIPT" --config "$CONFIG" "$@")
echo "+ ${cmd[*]}" >&2
exec "${cmd[@]}"
