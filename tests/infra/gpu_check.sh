#!/usr/bin/env bash
# Every CUDA test (pytest -m gpu) on a GPU machine without this project's .venv, e.g. the lent H200:
#   here:  bash tests/infra/gpu_wheels.sh        (once; fills .whl/)
#   there: bash tests/infra/gpu_check.sh         (carry .whl; the log goes to $OUT/gpu_check.log when OUT is set)
# Uses the machine's python3 (its CUDA torch and triton); the carried wheels go to /tmp/site, ahead on PYTHONPATH.
set -uo pipefail
cd "$(dirname "$0")/../.."
py=${PYTHON:-python3}
if compgen -G ".whl/*.whl" >/dev/null; then
    "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || { echo "gpu_check: installing the carried wheels failed" >&2; exit 2; }
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 MASTER_ADDR=127.0.0.1 GLOO_SOCKET_IFNAME=lo
log=${OUT:-/tmp}/gpu_check.log
{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
    "$py" -c 'import sys, torch, triton; print("torch", torch.__version__, "cuda", torch.version.cuda, "available",
torch.cuda.is_available(), "| triton", triton.__version__); sys.exit(0 if torch.cuda.is_available() else 3)' \
        || [ "${GPU_CHECK_ALLOW_CPU:-0}" = 1 ] || { echo "gpu_check: no CUDA device: nothing would run" >&2; exit 3; }
    timeout "${GPU_CHECK_TIMEOUT_S:-480}" "$py" -m pytest -q -m gpu -rs tests/gpu/test_gpu_paths.py
} 2>&1 | tee "$log"
exit "${PIPESTATUS[0]}"
