"""Embeddings: prompts prefilled through the engine's model, KV cache and attention path, their
final-norm hidden states pooled into one vector each.

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

from ..sampling.params import SamplingParams
from .scheduler import ScheduledSeq
from .sequence import Sequence

logger = logging.getLogger(__name__)

POOLING_MODES = ("last", "cls", "mean")
_ST_MODES = {"pooling_mode_lasttoken": "last", "pooling_mode_cls_token": "cls",
             "pooling_mode_mean_tokens": "mean"}


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
                raise ValueError(f"{path}: pooling {others or modes} is not supported; this server pools "
                                 "by one of last token, CLS token or mean")
            if modes:
                cfg.mode = modes[0]
            if pcfg.get("include_prompt") is False and cfg.mode == "mean":
                raise ValueError(f"{path}: mean pooling without the prompt (include_prompt: false) "
                                 "is not supported")
        st_file = folder / "config_sentence_transformers.json"
        if st_file.is_file():
            st = _read(st_file)
            cfg.prompts = {str(k): str(v) for k, v in (st.get("prompts") or {}).items()}
            cfg.default_prompt_name = st.get("default_prompt_name")
        return cfg


def _read(path: Path) -> Any:
    with open(path) as f:
        return json.load(f)


def embed_prompts(engine: Any, prompts: list[list[int]], pooling: PoolingConfig) -> list[torch.Tensor]:
    """One float32 vector (on the CPU) per prompt. The prompts are prefilled together, up to
    `max_num_batched_tokens` tokens a forward, in groups whose blocks the free KV cache holds;
    the blocks are returned at the end. Runs on the engine's thread, between steps."""
    max_len = engine.sched_config.max_model_len
    vocab = engine.model_config.vocab_size
    for i, ids in enumerate(prompts):
        if not ids:
            raise ValueError(f"input {i} is empty: give at least one character or token id")
        if len(ids) > max_len:
            raise ValueError(f"input {i} has {len(ids)} tokens but max_model_len is {max_len}; shorten it")
        bad = next((t for t in ids if not (isinstance(t, int) and 0 <= t < vocab)), None)
        if bad is not None:
            raise ValueError(f"input {i}: token id {bad!r} is outside the vocabulary [0, {vocab})")
    if engine.executor is not None:
        raise ValueError("embeddings under tensor parallelism are not supported; use tensor_parallel_size=1")
    bm, budget = engine.block_manager, engine.sched_config.max_num_batched_tokens
    params = SamplingParams(max_tokens=1)
    seqs = [Sequence("__embed__", list(p), params) for p in prompts]
    out: list[torch.Tensor | None] = [None] * len(seqs)
    start = 0
    while start < len(seqs):
        group, need = [], 0
        for s in seqs[start:]:  # as many as the free blocks hold (at least one)
            blocks = bm.max_blocks(s.num_tokens, budget)
            if group and need + blocks > bm.num_free_blocks:
                break
            group.append(s)
            need += blocks
        if need > bm.num_free_blocks:
            raise ValueError(f"an input of {group[0].num_tokens} tokens needs {need} KV blocks but "
                             f"{bm.num_free_blocks} are free; retry, or give the KV cache more memory")
        for i, vec in enumerate(_embed_group(engine, group, pooling, budget)):
            out[start + i] = vec
        start += len(group)
    return out  # type: ignore[return-value]


def _embed_group(engine: Any, seqs: list[Sequence], pooling: PoolingConfig, budget: int) -> list[torch.Tensor]:
    acc: list[torch.Tensor | None] = [None] * len(seqs)
    index = {s.seq_id: i for i, s in enumerate(seqs)}
    runner, bm = engine.runner, engine.block_manager
    try:
        while True:
            batch, left = [], budget
            for s in seqs:
                if s.num_uncomputed_tokens > 0 and left > 0:
                    n = min(s.num_uncomputed_tokens, left)
                    batch.append(ScheduledSeq(s, n))
                    left -= n
            if not batch:
                break
            batch.sort(key=lambda it: not it.is_decode)  # the plan's order: decodes first
            for it in batch:
                engine.scheduler.release_window(it.seq)
                bm.grow(it.seq, it.seq.num_computed_tokens + it.num_new_tokens)
            hidden = runner.hidden_states(runner.plan(batch))
            row = 0
            for it in batch:
                s, n = it.seq, it.num_new_tokens
                rows = hidden[row:row + n].float()
                row += n
                i = index[s.seq_id]
                if pooling.mode == "mean":
                    part = rows.sum(0)
                    acc[i] = part if acc[i] is None else acc[i] + part
                elif pooling.mode == "cls" and s.num_computed_tokens == 0:
                    acc[i] = rows[0].clone()
                elif pooling.mode == "last" and it.samples:
                    acc[i] = rows[-1].clone()
                it.ran()
    finally:
        for s in seqs:
            bm.free(s)
            engine.backend.free_seq(s.seq_id)
    vecs = []
    for s, v in zip(seqs, acc):
        if pooling.mode == "mean":
            v = v / s.num_tokens
        if pooling.normalize:
            v = F.normalize(v, dim=-1)
        vecs.append(v.cpu())
    return vecs
