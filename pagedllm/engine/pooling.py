"""Embeddings: prompts prefilled through the engine's model, KV cache and attention path, their
final-norm hidden states pooled into one vector each.

Each input is a pooling request (`LLMEngine.add_pooling_request`): the scheduler chunks its
prefill beside the step's other work, the runner's one `execute` keeps the final hidden states
of the positions the pooling needs (`ScheduledSeq.pool_range`), and the engine adds them to the
sequence as the chunks run (`pool_rows`); the vector is made when the prompt is done
(`pooled_vector`). A preempted request recomputes its prefill but pools no position twice.

How to pool comes from the model folder's sentence-transformers files, as sentence-transformers
reads them: modules.json (the module list: Transformer, Pooling, and Normalize or not),
1_Pooling/config.json (last token, CLS or mean) and config_sentence_transformers.json (the
instruction prompts, e.g. Qwen3-Embedding's "Instruct: ...\\nQuery:").
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from .sequence import Sequence

logger = logging.getLogger(__name__)

POOLING_MODES = ("last", "cls", "mean")
_ST_MODES = {"pooling_mode_lasttoken": "last", "pooling_mode_cls_token": "cls", "pooling_mode_mean_tokens": "mean"}


@dataclass
class PoolingConfig:
    mode: str = "last"  # "last" | "cls" | "mean"
    normalize: bool = True
    prompts: dict[str, str] = field(default_factory=dict)  # name -> text put before the input
    default_prompt_name: str | None = None
    source: str = "defaults"  # where it was read from (for the log)

    def prompt(self, name: str | None) -> str:
        """The text to put before an input: the named prompt, else the default one, else none."""
        name = name if name is not None else self.default_prompt_name
        if name is None:
            return ""
        if name not in self.prompts:
            known = ", ".join(sorted(self.prompts)) or "none"
            raise ValueError(f"unknown prompt name {name!r}; this model's prompts: {known}")
        return self.prompts[name]

    @classmethod
    def from_folder(cls, folder: Path) -> "PoolingConfig | None":
        """The folder's sentence-transformers pooling, or None when it has no modules.json."""
        modules_file = folder / "modules.json"
        if not modules_file.is_file():
            return None
        modules = _read(modules_file)
        if not isinstance(modules, list):
            raise ValueError(f"{modules_file} must hold a list of modules")
        types = [str(m.get("type", "")) for m in modules]
        cfg = cls(normalize=any(t.endswith(".Normalize") for t in types), source=str(modules_file))
        pooling = [m for m in modules if str(m.get("type", "")).endswith(".Pooling")]
        if pooling:
            path = folder / pooling[0].get("path", "1_Pooling") / "config.json"
            pcfg = _read(path) if path.is_file() else {}
            modes = [mode for key, mode in _ST_MODES.items() if pcfg.get(key)]
            others = [k for k, v in pcfg.items() if k.startswith("pooling_mode_") and v and k not in _ST_MODES]
            if others or len(modes) > 1:
                raise ValueError(
                    f"{path}: pooling {others or modes} is not supported; this server pools "
                    "by one of last token, CLS token or mean"
                )
            if modes:
                cfg.mode = modes[0]
            if pcfg.get("include_prompt") is False and cfg.mode == "mean":
                raise ValueError(f"{path}: mean pooling without the prompt (include_prompt: false) is not supported")
        st_file = folder / "config_sentence_transformers.json"
        if st_file.is_file():
            st = _read(st_file)
            cfg.prompts = {str(k): str(v) for k, v in (st.get("prompts") or {}).items()}
            cfg.default_prompt_name = st.get("default_prompt_name")
        return cfg


def _read(path: Path) -> Any:
    with open(path) as f:
        return json.load(f)


def check_pooling_input(ids: Any, max_len: int, vocab: int, name: str = "the input") -> list[int]:
    """The token ids of an embedding input, checked: not empty, within max_model_len (an embedding
    generates nothing, so the whole context is its) and the vocabulary."""
    if not ids:
        raise ValueError(f"{name} is empty: give at least one character or token id")
    if len(ids) > max_len:
        raise ValueError(f"{name} has {len(ids)} tokens but max_model_len is {max_len}; shorten it")
    bad = next((t for t in ids if not (isinstance(t, int) and 0 <= t < vocab)), None)
    if bad is not None:
        raise ValueError(f"{name}: token id {bad!r} is outside the vocabulary [0, {vocab})")
    return list(ids)


def pool_rows(seq: Sequence, first: int, rows: torch.Tensor) -> None:
    """Add a chunk's kept final hidden states (positions first.., float32) to seq's pooled value:
    summed for mean pooling, the one row for CLS and last-token pooling."""
    mean = seq.pooling.mode == "mean"
    part = rows.sum(0) if mean else rows[-1].clone()  # CLS and last keep one row: their position's
    seq.pooled = seq.pooled + part if mean and seq.pooled is not None else part
    seq.num_pooled = first + rows.shape[0]


def pooled_vector(seq: Sequence) -> torch.Tensor:
    """The finished request's embedding (float32, on the CPU): the mean taken, normalised if the
    model's pooling says so."""
    v = seq.pooled
    if seq.pooling.mode == "mean":
        v = v / seq.num_tokens
    if seq.pooling.normalize:
        v = F.normalize(v, dim=-1)
    return v.cpu()


def embed_prompts(driver: Any, prompts: list[list[int]], pooling: PoolingConfig) -> list[torch.Tensor]:
    """One float32 vector (on the CPU) per prompt: the prompts are added as pooling requests (all
    or none) and the driver's loop runs them, scheduled like any prefill; those the KV cache
    cannot hold together wait for others to finish. Leaving early aborts them."""
    engine = driver.engine
    for i, p in enumerate(prompts):  # each named by its place before any is added
        check_pooling_input(p, engine.sched_config.max_model_len, engine.model_config.vocab_size, f"input {i}")
    from .driver import Item

    rids = driver.add_pooling([Item(None, p) for p in prompts], pooling)
    return [out.embedding for out in driver.finals(rids)]
