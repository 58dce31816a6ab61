# Sourced by run_deepspeed.sh and run_mpirun.sh (needs REPO and PYTHON set): the entry script,
# rank count, rendezvous and per-rank thread settings shared by every single-node launch.
NPROC=${NPROC:-2}
TRAIN_SCRIPT=${TRAIN_SCRIPT:-launch/train_rec.py}
[[ -f "$TRAIN_SCRIPT" ]] || TRAIN_SCRIPT="$REPO/$TRAIN_SCRIPT"
[[ -f "$TRAIN_SCRIPT" ]] || { echo "$0: entry script ${TRAIN_SCRIPT#"$REPO/"} not found" >&2; exit 2; }
MASTER_PORT=${MASTER_PORT:-$("$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}

# `hostname -I` is not loopback on every machine: pin the rendezvous and gloo to lo for local runs.
export MASTER_ADDR=127.0.0.1 GLOO_SOCKET_IFNAME=lo
[[ -n "${WANDB_API_KEY:-}" ]] || export WANDB_MODE=${WANDB_MODE:-offline}
# One BLAS/OpenMP thread pool per core share, instead of every rank using every core.
CORES=$(nproc)
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( CORES / NPROC > 0 ? CORES / NPROC : 1 ))}
# The packages come from the installed project (make venv / pip install -e .), never from an edited import path.
# (checked from / : python -c would also find the packages in the current folder, an entry script would not)
py=$(command -v "$PYTHON") || py=$PYTHON; [[ "$py" == /* ]] || py="$PWD/$py"
(cd / && "$py" -c "import sparse_scale" 2>/dev/null) \
    || { echo "$0: $PYTHON cannot import sparse_scale: install the project first (make venv, or pip install -e .)" >&2; exit 2; }
