"""A mistral.rs-style Python API beside the vLLM-style `LLM`.

    from pagedllm import Runner, Which, ChatCompletionRequest, Architecture, PagedCacheType

    runner = Runner(which=Which.Plain(model_id="default", arch=Architecture.Llama),
                    pa_gpu_mem=256, pa_blk_size=32, pa_cache_type=PagedCacheType.Auto)
    res = runner.send_chat_completion_request(ChatCompletionRequest(
        model="default", messages=[{"role": "user", "content": "Hi"}], max_tokens=32))
    print(res.choices[0].message.content, res.usage)

It is a thin layer over the same engine: requests are validated and answered by
the protocol package the HTTP server uses (pagedllm/protocols/openai: `chat_call` /
`completion_call`), and driven by the same engine driver. `EngineOptions` maps mistral.rs's engine settings
(and the CLI flags of the same names) onto `LLM` keyword arguments.
"""
from __future__ import annotations

import enum
import inspect
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

if TYPE_CHECKING:
    from .protocols.common.call import Call
    from .protocols.openai.models import (
        ChatCompletionChunk,
        ChatCompletionRequest,
        ChatCompletionResponse,
        CompletionRequest,
        CompletionResponse,
    )

logger = logging.getLogger(__name__)

# The request models are pydantic's, and the response builders the protocol package's: both are loaded
# on first use, so `pagedllm generate` (which needs only EngineOptions) starts ~0.4 s sooner.
_LAZY = {"ChatCompletionRequest": "protocols.openai.models", "CompletionRequest": "protocols.openai.models"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(f".{_LAZY[name]}", __package__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

# The model families the engine implements, by the config.json architecture names.
_ARCH_NAMES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2"}


class Architecture(enum.Enum):
    """mistral.rs's architecture names. The engine reads the real one from the checkpoint, so
    this is only a hint: a mismatch is logged, not an error."""

    Mistral = "mistral"
    Llama = "llama"
    Qwen2 = "qwen2"
    Gemma = "gemma"
    Gemma2 = "gemma2"
    Mixtral = "mixtral"
    Phi2 = "phi2"
    Phi3 = "phi3"
    Starcoder2 = "starcoder2"


class PagedCacheType(enum.Enum):
    """The KV cache element type (mistral.rs's `--pa-cache-type`)."""

    Auto = "auto"
    BF16 = "bf16"
    F16 = "f16"
    F8E4M3 = "f8e4m3"
    Int8 = "int8"


class UnsupportedOption(ValueError):
    """An engine option this build does not implement yet."""


class Which:
    """Where the model comes from, mistral.rs style: `Which.Plain(...)` or `Which.GGUF(...)`."""

    @dataclass
    class Plain:
        model_id: str
        arch: Architecture | str | None = None
        tokenizer_json: str | None = None
        dtype: str = "auto"

    @dataclass
    class GGUF:
        quantized_model_id: str
        quantized_filename: str
        tok_model_id: str | None = None
        dtype: str = "auto"


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
    """Engine settings under mistral.rs's names; `llm_kwargs()` turns them into `LLM(...)` kwargs."""

    model: str = "default"
    tokenizer: str | None = None
    gguf_file: str | None = None
    arch: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    pa_gpu_mem: float | None = None  # KV cache MB
    pa_gpu_mem_usage: float | None = None  # KV cache share of free memory
    pa_ctxt_len: int | None = None  # KV cache sized for this many tokens
    pa_blk_size: int | None = None
    pa_cache_type: str | None = None
    no_paged_attn: bool = False
    prefix_cache_n: int | None = None
    no_prefix_cache: bool = False
    max_seqs: int | None = None
    max_model_len: int | None = None
    max_num_batched_tokens: int | None = None
    seed: int | None = None
    isq: str | None = None
    dequantize_weights: bool = False
    keep_float_head: bool = False
    chat_template: str | None = None
    tensor_parallel_size: int | None = None
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

    @classmethod
    def from_which(cls, which: Which.Plain | Which.GGUF, **kw: Any) -> "EngineOptions":
        if isinstance(which, Which.Plain):
            arch = which.arch.value if isinstance(which.arch, Architecture) else which.arch
            return cls(model=which.model_id, tokenizer=_local_tokenizer_dir(which.tokenizer_json),
                       arch=arch, dtype=which.dtype, **kw)
        if isinstance(which, Which.GGUF):
            model, gguf_file, tok = gguf_source(which.quantized_model_id, which.quantized_filename,
                                                which.tok_model_id)
            return cls(model=model, gguf_file=gguf_file, tokenizer=tok, dtype=which.dtype, **kw)
        raise TypeError(f"which must be Which.Plain or Which.GGUF, got {type(which).__name__}")

    def llm_kwargs(self) -> dict[str, Any]:
        from .llm import LLM

        accepted = inspect.signature(LLM.__init__).parameters
        sizes = [n for n, v in (("pa_gpu_mem", self.pa_gpu_mem), ("pa_gpu_mem_usage", self.pa_gpu_mem_usage),
                                ("pa_ctxt_len", self.pa_ctxt_len)) if v is not None]
        if len(sizes) > 1:
            raise ValueError(f"give only one of {', '.join(sizes)} to size the KV cache")
        kw: dict[str, Any] = dict(model=self.model, dtype=self.dtype, device=self.device,
                                  paged_attention=not self.no_paged_attn)
        optional = {"tokenizer": self.tokenizer, "gguf_file": self.gguf_file,
                    "kv_cache_memory_mb": self.pa_gpu_mem,
                    "kv_cache_memory_fraction": self.pa_gpu_mem_usage,
                    "kv_cache_context_len": self.pa_ctxt_len, "block_size": self.pa_blk_size,
                    "kv_cache_dtype": self.pa_cache_type, "max_num_seqs": self.max_seqs,
                    "max_model_len": self.max_model_len,
                    "max_num_batched_tokens": self.max_num_batched_tokens, "seed": self.seed,
                    "tensor_parallel_size": self.tensor_parallel_size, "task": self.task,
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
        if self.no_prefix_cache:
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
            if "prefix_cache_n" in accepted:
                kw["prefix_cache_n"] = n
            if "enable_prefix_caching" in accepted:
                kw["enable_prefix_caching"] = n > 0 and not self.no_prefix_cache
            elif "prefix_cache_n" not in accepted and n > 0:
                raise UnsupportedOption("--prefix-cache-n (prefix caching) is not supported yet; "
                                        "leave it out or pass 0")
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
        if _ARCH_NAMES.get(actual, actual).lower() != str(self.arch).lower():
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


class Runner:
    """Loads a model and answers requests in-process, mistral.rs style. Not thread-safe: use one
    Runner per thread, or the HTTP server for concurrent clients."""

    def __init__(self, which: Which.Plain | Which.GGUF, max_seqs: int = 16,
                 prefix_cache_n: int | None = None, chat_template: str | None = None,
                 in_situ_quant: str | None = None, pa_gpu_mem: float | None = None,
                 pa_gpu_mem_usage: float | None = None, pa_ctxt_len: int | None = None,
                 pa_blk_size: int | None = None, pa_cache_type: PagedCacheType | str | None = None,
                 no_paged_attn: bool = False, paged_attn: bool | None = None, seed: int | None = None,
                 device: str = "auto", max_model_len: int | None = None,
                 token_source: str | None = None) -> None:
        del token_source  # mistral.rs's hub credential source; the hub client reads its own
        cache_type = pa_cache_type.value if isinstance(pa_cache_type, PagedCacheType) else pa_cache_type
        opts = EngineOptions.from_which(
            which, device=device, pa_gpu_mem=pa_gpu_mem, pa_gpu_mem_usage=pa_gpu_mem_usage,
            pa_ctxt_len=pa_ctxt_len, pa_blk_size=pa_blk_size, pa_cache_type=cache_type,
            no_paged_attn=no_paged_attn and not paged_attn, prefix_cache_n=prefix_cache_n,
            max_seqs=max_seqs, max_model_len=max_model_len, seed=seed, isq=in_situ_quant,
            chat_template=chat_template)
        from .protocols.common.context import ServingContext
        from .protocols.common.tokens import TokenText

        self.llm = opts.load()
        self._ctx = ServingContext.from_llm(self.llm)
        self._tt = TokenText(self.llm.tokenizer)

    @property
    def engine(self) -> Any:
        return self.llm.engine

    # -- chat -----------------------------------------------------------------------------
    def send_chat_completion_request(self, request: ChatCompletionRequest | dict
                                     ) -> ChatCompletionResponse | Iterator[ChatCompletionChunk]:
        """The answer, or with `stream=True` an iterator of chunks (closing it early aborts)."""
        from .protocols.openai.calls import chat_call
        from .protocols.openai.models import ChatCompletionRequest

        req = request if isinstance(request, ChatCompletionRequest) else ChatCompletionRequest(**request)
        return self._answer(self._call(chat_call, req))

    # -- text completion ----------------------------------------------------------------------
    def send_completion_request(self, request: CompletionRequest | dict
                                ) -> CompletionResponse | Iterator[CompletionResponse]:
        from .protocols.openai.calls import completion_call
        from .protocols.openai.models import CompletionRequest

        req = request if isinstance(request, CompletionRequest) else CompletionRequest(**request)
        return self._answer(self._call(completion_call, req))

    # -- tokenizer helpers (mistral.rs has these too) ---------------------------------------------
    def tokenize_text(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.llm.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def detokenize_text(self, tokens: list[int], skip_special_tokens: bool = True) -> str:
        return self.llm.tokenizer.decode(tokens, skip_special_tokens=skip_special_tokens)

    # -- engine driving -------------------------------------------------------------------------
    def _call(self, fn: Any, req: Any) -> Call:
        from .protocols.common.errors import ApiError

        try:
            return fn(req, self._ctx, self._tt)
        except ApiError as e:
            raise ValueError(e.message) from None

    def _answer(self, call: Call) -> Any:
        """Run the call on the engine (the protocol package's response builder makes the answer)."""
        rids = self.llm.driver.add(call.items)
        if call.stream:
            return self._stream(call, rids)
        return call.response(self.llm.driver.finals(rids))

    def _stream(self, call: Call, rids: list[str]) -> Iterator[Any]:
        finals: dict[str, Any] = {}
        usage = call.usage_chunk()
        try:
            yield from call.streamer.start()
            for out in self.llm.driver.stream(rids):  # a failed request ends the stream with its error
                if out.finished:
                    finals[out.request_id] = out
                yield from call.streamer.update(out)
            if usage is not None:
                yield usage([finals[r] for r in rids])
        finally:  # closed early (or failed): what is left is aborted
            self.llm.driver.abort(r for r in rids if r not in finals)


__all__ = ["Runner", "Which", "ChatCompletionRequest", "CompletionRequest", "Architecture",
           "PagedCacheType", "EngineOptions", "UnsupportedOption"]
