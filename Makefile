# Everything installs itself into a local .venv; nothing is needed beforehand
# but python3 (>= 3.10) with venv.  A GPU user picks another torch build, e.g.
#   make venv TORCH_SPEC="torch==2.6.0 --index-url <your CUDA wheel index>"
# (the stamp only tracks pyproject.toml: `make clean-venv` to change torch).

PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# DeepSpeed picks its accelerator at import time; tests run on the CPU.
TEST_ENV := DS_ACCELERATOR=cpu

.PHONY: venv test test-unit test-distributed test-gpu train bench bench-seq bench-zero bench-auto bench-steady clean-venv

venv: $(STAMP)

# torch goes first so that deepspeed (built from source) and the rest see it
# and pip does not pull a different, CUDA-laden torch to satisfy `torch>=2.4`.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install $(TORCH_SPEC)
	$(BIN)/python -m pip install -e '.[dev]'
	touch $@

test: venv
	$(TEST_ENV) $(BIN)/pytest -q tests

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
