#!/usr/bin/env bash
# Fills .whl/ with the wheels that the lent GPU machine's image (Python 3.12, its own CUDA torch and triton,
# no network) lacks for `tests/infra/gpu_check.sh`: pydantic and its needs, hjson, deepspeed (built here, pure
# Python). Run it here, then carry .whl to that machine. Versions follow constraints.txt.
set -euo pipefail
cd "$(dirname "$0")/../.."
out=.whl
mkdir -p "$out"
pin() { grep -E "^$1==" constraints.txt | cut -d= -f3; }
py=${PYTHON:-python3}
platforms=(--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
"$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${platforms[@]}" \
    -d "$out" "pydantic==$(pin pydantic)" "hjson==$(pin hjson)" annotated-types typing-inspection typing-extensions
core=$(unzip -p "$out"/pydantic-*.whl '*/METADATA' | sed -n 's/^Requires-Dist: pydantic-core==\([0-9.]*\).*/\1/p')
"$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${platforms[@]}" \
    -d "$out" "pydantic-core==$core"
# DeepSpeed ships an sdist only; its wheel is pure Python (ops JIT-build on first use, none are needed here)
DS_BUILD_OPS=0 "$py" -m pip wheel -q --no-deps -w "$out" "deepspeed==$(pin deepspeed)"
ls -l "$out"
