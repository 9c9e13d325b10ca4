"""mistral.rs's ways of naming a model (`plain -m DIR -t TOK`, `gguf -m DIR -f FILE -t TOK`) as
the engine's load options, for the CLI and `Runner` alike."""

from __future__ import annotations

import logging
from pathlib import Path

logger = logging.getLogger(__name__)


class UnsupportedOption(ValueError):
    """An engine option this build does not implement yet."""


def _local_tokenizer_dir(tok: str | None) -> str | None:
    """A tokenizer given as a local folder or tokenizer.json file, or None (a hub id is ignored:
    the checkpoint's own tokenizer is used instead)."""
    if not tok:
        return None
    path = Path(tok).expanduser()
    if path.is_dir():
        if (path / "tokenizer.json").is_file():
            return str(path)
        logger.info("%s has no tokenizer.json; using the model's own tokenizer", path)
        return None
    if path.is_file() and path.name.endswith(".json"):
        return str(path.parent)
    logger.info("tokenizer %r is not a local folder; using the model's own tokenizer", tok)
    return None


def gguf_source(model_id: str, filename: str, tok: str | None) -> tuple[str, str | None, str | None]:
    """mistral.rs's `gguf -m MODEL -f FILE [-t TOK]` as (model, gguf_file, tokenizer) for `LLM`."""
    if ";" in filename:
        raise UnsupportedOption("several GGUF files (FILE1;FILE2) are not supported; give one")
    tok_dir = _local_tokenizer_dir(tok)
    folder = Path(model_id).expanduser()
    if folder.is_dir() and tok_dir is None and not (folder / "tokenizer.json").is_file():
        # No tokenizer folder to pair with: load the file on its own, with the GGUF's tokenizer.
        path = folder / filename
        if not path.is_file():
            raise FileNotFoundError(f"{path} does not exist")
        return str(path), None, None
    return model_id, filename, tok_dir
