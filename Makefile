# Two entry points, each creating/refreshing the virtual environment first:
#   make demo   - the main job on the embedded default (local, CPU, tiny model)
#   make test   - lint, type-check and the test suite
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.kvmove-installed
# torch is pinned to the CPU build that lies on these machines' disk; a bare `torch` would pull CUDA.
TORCH ?= torch==2.13.0

.PHONY: venv demo test test-all lint clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[dev,serve,plots,nixl]" "$(TORCH)"
	# NIXL's `nixl._api` import path (used by kvmove, Ray and vLLM) lives in the `nixl` meta package;
	# without --no-deps it would also pull nixl-cu12.
	$(PY) -m pip install -q --no-deps "nixl==1.5.1"
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/kvmove sync-weights --strategy v1,v2,v3,broadcast --syncs 2 --verify
	$(VENV)/bin/kvmove sync-weights --dry-run --model kimi-k2 --trainer tp=8,pp=8,ep=32 --engine tp=32,ep=32 --replicas 4

lint: $(STAMP)
	$(VENV)/bin/ruff check kvmove tests
	$(VENV)/bin/mypy

# the default suite leaves out tests marked slow (end-to-end runs with timing-dependent workloads);
# `make test-all` runs them too
test: lint
	$(VENV)/bin/pytest -q -m "not slow"

test-all: lint
	$(VENV)/bin/pytest -q

clean:
	rm -rf $(VENV)
