#!/usr/bin/env bash
# Train locally on NPROC ranks (default 2) with MPICH's mpirun (pip package "mpich", in the venv).
#
#   bash launch/run_mpirun.sh ds_configs/demo_cpu.json [--steps 200 --out runs/demo ...]
#
# sparse_scale/distenv.py maps mpirun's PMI_RANK / PMI_SIZE / MPI_LOCALRANKID to RANK / WORLD_SIZE /
# LOCAL_RANK; MASTER_ADDR/PORT are passed explicitly because DeepSpeed's own MPI discovery takes
# the first address of `hostname -I`, which is not loopback everywhere.
# Environment knobs:
#   NPROC=4                     number of ranks
#   TRAIN_SCRIPT=launch/train_moe_lm.py   entry script (default launch/train_rec.py)
#   MPIRUN=/path/to/mpirun      another MPI launcher (default: the venv's, then PATH's mpirun/mpiexec)
#   MASTER_PORT=29600           rendezvous port (default: a free one)
#   LAUNCHER_ARGS="..."         extra mpirun flags
# Multi-node: mpirun -n 8 -ppn 4 -hosts node1,node2 -genv MASTER_ADDR node1 -genv MASTER_PORT 29500 \
#                 python launch/train_rec.py --config ds_configs/demo_cpu.json
set -euo pipefail

usage() { echo "usage: [NPROC=2] [TRAIN_SCRIPT=launch/train_rec.py] $0 CONFIG.json [script args...]" >&2; exit 2; }
[[ $# -ge 1 && "$1" != -* ]] || usage
CONFIG=$1; shift
[[ -f "$CONFIG" ]] || { echo "$0: config $CONFIG not found" >&2; exit 2; }

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
if [[ -x "$REPO/.venv/bin/python" ]]; then
    PYTHON=${PYTHON:-$REPO/.venv/bin/python}
else
    PYTHON=${PYTHON:-python3}
fi
if [[ -z "${MPIRUN:-}" ]]; then
    # The venv's mpirun belongs to the MPICH that mpi4py was built against; a system Open MPI would not match.
    for c in "$REPO/.venv/bin/mpirun" "$REPO/.venv/bin/mpiexec" mpirun mpiexec; do
        if command -v "$c" >/dev/null 2>&1; then MPIRUN=$c; break; fi
    done
fi
[[ -n "${MPIRUN:-}" ]] || { echo "$0: no mpirun/mpiexec found: pip install mpich mpi4py (or make venv)" >&2; exit 127; }

# shellcheck source=launch/local_env.sh
source "$REPO/launch/local_env.sh"

# Note: Hydra stops the other ranks when one dies only for ranks that called MPI_Init; ours use gloo,
# so after a crash the survivors end on gloo's "Connection closed by peer" instead.
# Hydra (MPICH, Intel MPI) forwards the whole environment (-genvall is its default); -genv makes the
# rendezvous explicit in the printed command. "-launcher fork": all ranks local, no ssh.
# Captured first: under pipefail, `mpirun --version | grep -q` fails when grep exits early and mpirun gets SIGPIPE.
MPI_VERSION="$("$MPIRUN" --version 2>/dev/null || true)"
if ! grep -qE "HYDRA|Intel\(R\) MPI" <<< "$MPI_VERSION"; then
    echo "$0: $MPIRUN is not MPICH/Intel MPI (Hydra); with Open MPI run it yourself, e.g." >&2
    echo "    mpirun -n $NPROC -x MASTER_ADDR=127.0.0.1 -x MASTER_PORT=$MASTER_PORT -x GLOO_SOCKET_IFNAME=lo $PYTHON $TRAIN_SCRIPT --config $CONFIG" >&2
    exit 2
fi
mpi_flags=(-launcher fork -genv MASTER_ADDR "$MASTER_ADDR" -genv MASTER_PORT "$MASTER_PORT" -genv GLOO_SOCKET_IFNAME lo)
# shellcheck disable=SC2206  # LAUNCHER_ARGS is meant to be word-split
cmd=("$MPIRUN" -n "$NPROC" "${mpi_flags[@]}" ${LAUNCHER_ARGS:-}
     "$PYTHON" -u "$TRAIN_SCRIPT" --config "$CONFIG" "$@")
echo "+ ${cmd[*]}" >&2
exec "${cmd[@]}"
