# Two entry points, each creating/refreshing the virtual environment first:
#   make demo   - the main job on the embedded default (local, CPU, tiny model)
#   make test   - lint, type-check and the test suite
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.kvmove-installed
# torch is pinned to the CPU build that lies on these machines' disk; a bare `torch` would pull CUDA.
TORCH ?= torch==2.13.0

.PHONY: venv demo test lint clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[dev,serve,plots]" "$(TORCH)"
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/kvmove sync-weights --dry-run --verify
	$(VENV)/bin/kvmove sync-weights --dry-run --model qwen3-235b-a22b --trainer tp=4,pp=2,ep=8,dp=2 --engine dp=16,ep=16

lint: $(STAMP)
	$(VENV)/bin/ruff check kvmove tests
	$(VENV)/bin/mypy

test: lint
	$(VENV)/bin/pytest -q

clean:
	rm -rf $(VENV)
