# Everything installs itself into a local .venv; nothing is needed beforehand
# but python3 (>= 3.10) with venv.  A GPU user picks another torch build, e.g.
#   make venv TORCH_SPEC="torch==2.6.0 --index-url <your CUDA wheel index>"
# (the stamp tracks pyproject.toml and the lock files: `make clean-venv` to change torch).
#
# .venv gets the exact versions CI tests (constraints.txt; constraints-torch.txt for torch's own
# requirements while TORCH_SPEC is the default). `make test-latest` builds .venv-latest with the
# newest versions pyproject.toml allows and runs the tiers that read library internals.

PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
LATEST := .venv-latest
# torch's requirements are pinned only for the default build: another build brings its own.
ifeq ($(origin TORCH_SPEC),file)
TORCH_LOCK := -c constraints-torch.txt
endif
# DeepSpeed picks its accelerator at import time; tests run on the CPU.
TEST_ENV := DS_ACCELERATOR=cpu

.PHONY: venv lock test-latest test test-unit test-distributed test-gpu train bench bench-seq bench-zero bench-auto bench-steady bench-offload bench-real bench-split bench-w-memory bench-host clean-venv

venv: $(STAMP)

# torch goes first so that deepspeed (built from source) and the rest see it
# and pip does not pull a different, CUDA-laden torch to satisfy `torch>=2.4`.
$(STAMP): pyproject.toml constraints.txt constraints-torch.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install $(TORCH_SPEC) $(TORCH_LOCK)
	$(BIN)/python -m pip install -c constraints.txt $(TORCH_LOCK) -e '.[dev]'
	touch $@

# The newest versions pyproject.toml allows (torch stays TORCH_SPEC's), in a venv of their own:
# the unit tier and the Hugging Face engine tiers, which are what an upstream change breaks first.
$(LATEST)/.installed: pyproject.toml
	rm -rf $(LATEST)
	$(PYTHON) -m venv $(LATEST)
	$(LATEST)/bin/python -m pip install $(TORCH_SPEC)
	$(LATEST)/bin/python -m pip install --upgrade --upgrade-strategy eager -e '.[dev]'
	touch $@

test-latest: $(LATEST)/.installed
	$(LATEST)/bin/python -m pip list --format=freeze | grep -iE '^(torch|deepspeed|transformers|pydantic)=='
	$(TEST_ENV) $(LATEST)/bin/pytest -q tests/unit tests/distributed/test_hf_pipeline.py tests/distributed/test_seq_chunks_engine.py

# Promote what test-latest ran with to the lock files (run test-latest first; review the diff).
lock: $(LATEST)/.installed
	bash .ci/lock.sh $(LATEST)/bin/python

# The slowest tests close the log: what CI shows of a run is its end.
test: venv
	$(TEST_ENV) $(BIN)/pytest -q --durations=15 tests

test-unit: venv
	$(TEST_ENV) $(BIN)/pytest -q tests/unit

test-distributed: venv
	$(TEST_ENV) $(BIN)/pytest -q -m distributed tests

# Real NCCL on CUDA devices (needs a CUDA torch, see TORCH_SPEC; skips without GPUs).
# No TEST_ENV: DeepSpeed must detect the CUDA accelerator itself.
test-gpu: venv
	$(BIN)/pytest -q -m gpu tests/gpu

# Default end-to-end training recipe.
train: venv
	PATH="$(abspath $(BIN)):$$PATH" bash recipes/run_default.sh

# Schedule benchmarks (see benchmarks/run.sh).
bench: venv
	PATH="$(abspath $(BIN)):$$PATH" bash benchmarks/run.sh

# Only the long-sequence table (Seq1F1B vs 1F1B, benchmarks/results/seq1f1b.md), about 4 minutes.
bench-seq: venv
	PATH="$(abspath $(BIN)):$$PATH" SYNC=0 SEQ=1 bash benchmarks/run.sh

# "schedule": "auto" against every fixed schedule on three cost profiles (emulated device), and V-Half/V-Min
# memory with partition_method profile (tiny Llama): benchmarks/results/auto.md, 4 CPU ranks, about 10 minutes.
bench-auto: venv
	PATH="$(abspath $(BIN)):$$PATH" bash benchmarks/run_auto.sh

# Steps back to back on the asynchronous emulated device: post-validation against DeepSpeed 1F1B and torch ZBV,
# with and without clipping (benchmarks/results/steady.md and steady_*.png), 4 CPU ranks, about 5 minutes.
bench-steady: venv
	mkdir -p benchmarks/results/raw && rm -f benchmarks/results/raw/steady.jsonl
	$(TEST_ENV) $(BIN)/python -m torch.distributed.run --nproc_per_node 4 --master_port 29537 benchmarks/bench_steady.py --out benchmarks/results/raw/steady.jsonl
	$(BIN)/python benchmarks/report_steady.py benchmarks/results/raw/steady.jsonl benchmarks/results

clean-venv:
	rm -rf $(VENV)

# ZeRO-2/3 in the pipeline: data-parallel bytes and calls per step, model states per rank
# (benchmarks/results/zero.md), 4 CPU ranks, about a minute.
bench-zero: venv
	$(TEST_ENV) $(BIN)/python -m torch.distributed.run --nproc_per_node 4 --master_port 29533 benchmarks/bench_zero.py

# Host cost where the host is the bottleneck (issue 28): one stage's F, B, W on tiny shapes, one thread, fused against
# torch's split and ds_vshape's (benchmarks/results/host_stage.md), the rotary embedding built per pass against taken
# from the latest pass (benchmarks/results/rotary_passes.md), then the engines at p=2, one core per rank, per
# instruction and per step against DeepSpeed's own (benchmarks/results/host_engine.md); a few minutes on 2 idle cores.
bench-host: venv
	$(TEST_ENV) OMP_NUM_THREADS=1 $(BIN)/python benchmarks/host_stage.py
	$(TEST_ENV) OMP_NUM_THREADS=1 $(BIN)/python benchmarks/rotary_passes.py
	mkdir -p benchmarks/results/raw && rm -f benchmarks/results/raw/host_engine.jsonl
	$(TEST_ENV) OMP_NUM_THREADS=1 $(BIN)/python -m torch.distributed.run --nproc_per_node 2 --master_port 29543 benchmarks/host_engine.py --out benchmarks/results/raw/host_engine.jsonl --md benchmarks/results/host_engine.md

# Activation offload (pipeline.offload) on the recipe's Llama at p=4: device and host activation bytes per rank
# against 1F1B (benchmarks/results/offload.md), 4 CPU ranks, about a minute.
# Real compute at p=2, one rank per core: every schedule against DeepSpeed 1F1B, measured and simulated,
# with where each rank's time went (benchmarks/results/real.md), about 10 minutes on 2 idle cores.
bench-real: venv
	PATH="$(abspath $(BIN)):$$PATH" bash benchmarks/run_real.sh

# Split backward on this machine (issue 19): what W keeps per layer kind against the GEMM floor
# (benchmarks/results/kept_share.md, seconds), and split F+B+W against plain F+B on bench-real's last stage,
# one thread, with a per-operator profile and a cold/hot GEMM control (benchmarks/results/split_cost.{md,json}),
# about a minute on an idle core.
bench-split: venv
	$(TEST_ENV) $(BIN)/python benchmarks/kept_share.py --size tiny compute --attn sdpa eager
	$(TEST_ENV) OMP_NUM_THREADS=1 $(BIN)/python benchmarks/split_cost.py

# Busiest-rank activation memory of the V schedules against 1F1B at p=4 by w_memory (which the engine holds
# W to) and weight_grads_in_b (benchmarks/results/w_in_b.md), under a minute.
bench-w-memory: venv
	mkdir -p benchmarks/results/raw && rm -f benchmarks/results/raw/w_in_b_p4.jsonl
	$(TEST_ENV) $(BIN)/python -m torch.distributed.run --nproc_per_node 4 --master_port 29541 benchmarks/bench_profile_memory.py --out benchmarks/results/raw/w_in_b_p4.jsonl --methods parameters --rounds 1 --schedules 1f1b v-half v-min v-zb --in-b '*self_attn*' --w-memory 0.5 0.77 1.0 --md benchmarks/results/w_in_b.md

bench-offload: venv
	mkdir -p benchmarks/results/raw && rm -f benchmarks/results/raw/offload.jsonl
	$(TEST_ENV) $(BIN)/python -m torch.distributed.run --nproc_per_node 4 --master_port 29539 benchmarks/bench_offload.py --out benchmarks/results/raw/offload.jsonl --md benchmarks/results/offload.md
