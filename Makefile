# Tandem. Quick start: `make run`, `make test`.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
MODELS_DIR := models
DEFAULT_GGUF := $(MODELS_DIR)/SmolLM2-135M-Instruct.Q4_1.gguf
THREADS ?= 2
PROMPT ?= What is the capital of France? Answer in one sentence.

.PHONY: setup run test test-fast bench bench-gpu bench-peers bench-spec bench-costfit clean

setup: $(STAMP) $(DEFAULT_GGUF)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[test]'
	touch $(STAMP)

$(DEFAULT_GGUF): | $(STAMP)
	$(BIN)/python -m tandem.core.loading.resolve fetch smollm2 --dir $(MODELS_DIR)

# The whole pipeline on the default model: profile + plan for this machine (reused when valid), then
# hybrid sparse + quantized generation from the plan.
run: setup
	@set -e; plan=$$($(BIN)/tandem prepare --model smollm2 --threads $(THREADS) --print-plan-path); \
	$(BIN)/tandem generate --model smollm2 --plan "$$plan" --chat --prompt "$(PROMPT)" --max-new-tokens 64 --threads $(THREADS)

# Test files spread over TEST_WORKERS processes (pytest-xdist, --dist loadfile: each file whole in one process, the
# biggest first). Every process collects, so imports, all the test modules in the suite's order before any test
# runs, as a serial run does: test_gpu_kernels sets up Triton's interpreter at its import, before any other module
# imports Triton.
TEST_WORKERS ?= 2
test: setup
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=15 tests

test-fast: setup
	$(BIN)/python -m pytest -q -m "not slow" tests

bench: setup
	$(BIN)/python -m bench.run --threads $(THREADS)

# On a CUDA machine: dense on the GPU, layer offload and plans at 10/25/50/100% -> bench/gpu.md
# (without CUDA the same rows run on the CPU tier and are labelled so).
# SPARSE=llama-350m (any `tandem synth` shape) adds plans with predictors on a 90%-sparse synthetic model
# -> .dev/sparse-<shape>/gpu_sparse.md
bench-gpu: setup
	SPARSE=$(SPARSE) bash bench/gpu.sh

# The cost model check (issue 13): modeled (by packed format) vs measured tok/s of the CPU plans -> bench/costfit.md
bench-costfit: setup
	$(BIN)/python -m bench.costfit --threads $(THREADS)

bench-spec: setup
	$(BIN)/python -m bench.speculative --threads $(THREADS) $(if $(PLAN),--plan $(PLAN),)

bench-peers: setup
	bash bench/build_peers.sh

clean:
	rm -rf $(VENV) build *.egg-info
