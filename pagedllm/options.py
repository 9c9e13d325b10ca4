"""The engine's settings as one object, `EngineOptions`, under `LLM`'s names: the CLI builds it
from its flags and `Runner` (api.py) from its mistral.rs-style arguments, so neither face
depends on the other to spell a setting.
"""
from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)


def _family(name: str) -> str:
    """A model family as one spelling: "Qwen2MoeForCausalLM", "qwen2_moe" and mistral.rs's
    "qwen2moe" all give "qwen2moe"."""
    for suffix in ("ForCausalLM", "ForConditionalGeneration"):
        name = name.removesuffix(suffix)
    return re.sub(r"[^a-z0-9]", "", name.lower())


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


@dataclass
class EngineOptions:
    """Engine settings under `LLM`'s names (the mistral.rs spellings of Runner and the CLI map onto
    them at those faces); `llm_kwargs()` turns them into `LLM(...)` kwargs."""

    model: str = "default"
    tokenizer: str | None = None
    gguf_file: str | None = None
    arch: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    kv_cache_memory_mb: float | None = None  # mistral.rs: pa_gpu_mem
    kv_cache_memory_fraction: float | None = None  # KV cache share of free memory (pa_gpu_mem_usage)
    kv_cache_context_len: int | None = None  # KV cache sized for this many tokens (pa_ctxt_len)
    block_size: int | None = None  # pa_blk_size
    kv_cache_dtype: str | None = None  # pa_cache_type
    paged_attention: bool = True  # not no_paged_attn
    prefix_cache_n: int | None = None
    enable_prefix_caching: bool = True  # not no_prefix_cache
    max_num_seqs: int | None = None  # max_seqs
    max_model_len: int | None = None
    max_num_batched_tokens: int | None = None
    decode_latency_factor: float | None = None  # prompt tokens beside decodes (engine/pacing.py)
    seed: int | None = None
    isq: str | None = None
    dequantize_weights: bool = False
    keep_float_head: bool = False
    chat_template: str | None = None
    tensor_parallel_size: int | None = None
    pipeline_parallel_size: int | None = None
    max_rank_memory_mb: float | None = None  # a rank's weights above it are refused (LLM's max_rank_memory_mb)
    speculative_ngram: int | None = None  # n-gram speculation with up to K proposals a step
    speculative_draft: str | None = None  # draft-model speculation with this model
    speculative_tokens: int | None = None  # the draft model's proposals a step (K)
    speculative_draft_weights: str | None = None  # "auto" | "file" | a quantized type (draft_weights)
    task: str | None = None  # "auto" | "generate" | "embed"
    enable_lora: bool = False  # requests may name LoRA adapters (pagedllm/lora)
    max_loras: int | None = None  # adapters held in memory at once (default 1)
    max_lora_rank: int | None = None  # the highest adapter rank accepted (default 16)
    allowed_local_media_path: str | None = None  # images may be read from files under this folder
    limit_mm_per_prompt: int | None = None  # images a prompt may hold (default 8)
    media_fetch_timeout: float | None = None  # seconds an image URL's fetch may take (default 10)
    mmproj: str | None = None  # a GGUF model's vision tower and projector (llama.cpp's mmproj file)


    def llm_kwargs(self) -> dict[str, Any]:
        sizes = [n for n, v in (("pa_gpu_mem", self.kv_cache_memory_mb),
                                ("pa_gpu_mem_usage", self.kv_cache_memory_fraction),
                                ("pa_ctxt_len", self.kv_cache_context_len)) if v is not None]
        if len(sizes) > 1:
            raise ValueError(f"give only one of {', '.join(sizes)} to size the KV cache")
        kw: dict[str, Any] = dict(model=self.model, dtype=self.dtype, device=self.device,
                                  paged_attention=self.paged_attention)
        optional = {"tokenizer": self.tokenizer, "gguf_file": self.gguf_file,
                    "kv_cache_memory_mb": self.kv_cache_memory_mb,
                    "kv_cache_memory_fraction": self.kv_cache_memory_fraction,
                    "kv_cache_context_len": self.kv_cache_context_len, "block_size": self.block_size,
                    "kv_cache_dtype": self.kv_cache_dtype, "max_num_seqs": self.max_num_seqs,
                    "max_model_len": self.max_model_len,
                    "max_num_batched_tokens": self.max_num_batched_tokens, "seed": self.seed,
                    "decode_latency_factor": self.decode_latency_factor,
                    "tensor_parallel_size": self.tensor_parallel_size,
                    "pipeline_parallel_size": self.pipeline_parallel_size,
                    "max_rank_memory_mb": self.max_rank_memory_mb, "task": self.task,
                    "allowed_local_media_path": self.allowed_local_media_path,
                    "limit_mm_per_prompt": self.limit_mm_per_prompt,
                    "media_fetch_timeout": self.media_fetch_timeout, "mmproj": self.mmproj}
        kw.update({k: v for k, v in optional.items() if v is not None})
        if self.isq:
            from .quant.isq import check_isq_type

            kw["isq"] = check_isq_type(self.isq)
        if self.dequantize_weights:
            kw["dequantize_weights"] = True
        if self.keep_float_head:
            kw["keep_float_head"] = True
        if not self.enable_prefix_caching:
            kw["enable_prefix_caching"] = False
        if self.enable_lora:
            kw["enable_lora"] = True
            kw.update({k: v for k, v in (("max_loras", self.max_loras), ("max_lora_rank", self.max_lora_rank))
                       if v is not None})
        elif self.max_loras is not None or self.max_lora_rank is not None:
            raise ValueError("--max-loras and --max-lora-rank go with --enable-lora")
        spec = self._speculative()
        if spec is not None:
            kw["speculative"] = spec
        if self.prefix_cache_n is not None:
            n = self.prefix_cache_n
            if n < 0:
                raise ValueError(f"prefix_cache_n must be >= 0, got {n}")
            kw["prefix_cache_n"] = n
            kw["enable_prefix_caching"] = n > 0 and self.enable_prefix_caching
        return kw

    def _speculative(self) -> dict[str, Any] | None:
        if self.speculative_draft is not None:
            spec: dict[str, Any] = {"method": "draft", "model": self.speculative_draft}
            k = self.speculative_tokens if self.speculative_tokens is not None else self.speculative_ngram
            if k is not None:
                spec["num_tokens"] = k
            if self.speculative_ngram is not None:  # both: lookup where it matches, the draft elsewhere
                spec["ngram"] = True
            if self.speculative_draft_weights is not None:
                from .speculative.config import SpeculativeConfig

                spec["draft_weights"] = self.speculative_draft_weights
                SpeculativeConfig.coerce(dict(spec))  # a bad format is refused before the slow load
            return spec
        if self.speculative_draft_weights is not None:
            raise ValueError("--speculative-draft-weights sets a draft model's weights; it needs "
                             "--speculative-draft MODEL")
        if self.speculative_ngram is not None:
            if self.speculative_tokens is not None:
                raise ValueError("--speculative-tokens goes with --speculative-draft; "
                                 "--speculative-ngram K takes its K itself")
            return {"method": "ngram", "num_tokens": self.speculative_ngram}
        if self.speculative_tokens is not None:
            raise ValueError("--speculative-tokens needs --speculative-draft MODEL")
        return None

    def load(self) -> Any:
        """Build the `LLM` (loading takes a few seconds)."""
        from .llm import LLM

        llm = LLM(**self.llm_kwargs())
        self._check_arch(llm)
        if self.chat_template:
            llm.tokenizer.chat_template = read_chat_template(self.chat_template)
            llm.tokenizer.chat_template_source = f"--chat-template {self.chat_template}"
        return llm

    def _check_arch(self, llm: Any) -> None:
        if not self.arch:
            return
        actual = llm.engine.model_config.architecture
        if _family(actual) != _family(str(self.arch)):
            logger.warning("arch %s was given but the checkpoint is %s; using the checkpoint's",
                           self.arch, actual)


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


def read_chat_template(path: str) -> str:
    """A chat template from a .jinja file or a JSON file with a "chat_template" key."""
    import json

    text = Path(path).expanduser().read_text()
    if path.endswith(".json"):
        data = json.loads(text)
        if not isinstance(data, dict) or not isinstance(data.get("chat_template"), str):
            raise ValueError(f"{path} has no \"chat_template\" string")
        return data["chat_template"]
    return text
