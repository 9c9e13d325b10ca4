"""A mistral.rs-style Python API beside the vLLM-style `LLM`.

    from pagedllm import Runner, Which, ChatCompletionRequest, Architecture, PagedCacheType

    runner = Runner(which=Which.Plain(model_id="default", arch=Architecture.Llama),
                    pa_gpu_mem=256, pa_blk_size=32, pa_cache_type=PagedCacheType.Auto)
    res = runner.send_chat_completion_request(ChatCompletionRequest(
        model="default", messages=[{"role": "user", "content": "Hi"}], max_tokens=32))
    print(res.choices[0].message.content, res.usage)

It is a thin layer over the same engine: requests are validated and answered by
the protocol package the HTTP server uses (pagedllm/protocols/openai: `chat_call` /
`completion_call`), and driven by the same engine driver. Runner's mistral.rs-style arguments
(pa_blk_size, max_seqs, ...) are this face's aliases of the engine's options (EngineConfig,
pagedllm/config), which `LLM` takes by name.
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass
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

from .config import EngineConfig
from .options import UnsupportedOption, _local_tokenizer_dir, gguf_source

logger = logging.getLogger(__name__)

# The request models are pydantic's, and the response builders the protocol package's: both are loaded
# on first use, so `pagedllm generate` (which needs only the engine's config) starts ~0.4 s sooner.
_LAZY = {"ChatCompletionRequest": "protocols.openai.models", "CompletionRequest": "protocols.openai.models"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(f".{_LAZY[name]}", __package__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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


def _config_from_which(which: Which.Plain | Which.GGUF, **kw: Any) -> EngineConfig:
    kw = {k: v for k, v in kw.items() if v is not None}
    if isinstance(which, Which.Plain):
        arch = which.arch.value if isinstance(which.arch, Architecture) else which.arch
        return EngineConfig.from_kwargs(
            model=which.model_id,
            tokenizer=_local_tokenizer_dir(which.tokenizer_json),
            arch=arch,
            dtype=which.dtype,
            **kw,
        )
    if isinstance(which, Which.GGUF):
        model, gguf_file, tok = gguf_source(which.quantized_model_id, which.quantized_filename, which.tok_model_id)
        return EngineConfig.from_kwargs(model=model, gguf_file=gguf_file, tokenizer=tok, dtype=which.dtype, **kw)
    raise TypeError(f"which must be Which.Plain or Which.GGUF, got {type(which).__name__}")


class Runner:
    """Loads a model and answers requests in-process, mistral.rs style. Not thread-safe: use one
    Runner per thread, or the HTTP server for concurrent clients."""

    def __init__(
        self,
        which: Which.Plain | Which.GGUF,
        max_seqs: int = 16,
        prefix_cache_n: int | None = None,
        chat_template: str | None = None,
        in_situ_quant: str | None = None,
        pa_gpu_mem: float | None = None,
        pa_gpu_mem_usage: float | None = None,
        pa_ctxt_len: int | None = None,
        pa_blk_size: int | None = None,
        pa_cache_type: PagedCacheType | str | None = None,
        no_paged_attn: bool = False,
        paged_attn: bool | None = None,
        seed: int | None = None,
        device: str = "auto",
        max_model_len: int | None = None,
        token_source: str | None = None,
    ) -> None:
        del token_source  # mistral.rs's hub credential source; the hub client reads its own
        cache_type = pa_cache_type.value if isinstance(pa_cache_type, PagedCacheType) else pa_cache_type
        # mistral.rs's spellings (pa_*, max_seqs, in_situ_quant) are this face's aliases of
        # the engine's option names.
        config = _config_from_which(
            which,
            device=device,
            kv_cache_memory_mb=pa_gpu_mem,
            kv_cache_memory_fraction=pa_gpu_mem_usage,
            kv_cache_context_len=pa_ctxt_len,
            block_size=pa_blk_size,
            kv_cache_dtype=cache_type,
            paged_attention=not (no_paged_attn and not paged_attn),
            prefix_cache_n=prefix_cache_n,
            max_num_seqs=max_seqs,
            max_model_len=max_model_len,
            seed=seed,
            isq=in_situ_quant,
            chat_template=chat_template,
        )
        from .protocols.common.context import ServingContext
        from .protocols.common.tokens import TokenText

        from .llm import LLM

        self.llm = LLM(config=config)
        self._ctx = ServingContext.from_llm(self.llm)
        self._tt = TokenText(self.llm.tokenizer)

    @property
    def engine(self) -> Any:
        return self.llm.engine

    # -- chat -----------------------------------------------------------------------------
    def send_chat_completion_request(
        self, request: ChatCompletionRequest | dict
    ) -> ChatCompletionResponse | Iterator[ChatCompletionChunk]:
        """The answer, or with `stream=True` an iterator of chunks (closing it early aborts)."""
        from .protocols.openai.calls import chat_call
        from .protocols.openai.models import ChatCompletionRequest

        req = request if isinstance(request, ChatCompletionRequest) else ChatCompletionRequest(**request)
        return self._answer(self._call(chat_call, req))

    # -- text completion ----------------------------------------------------------------------
    def send_completion_request(
        self, request: CompletionRequest | dict
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


__all__ = [
    "Runner",
    "Which",
    "ChatCompletionRequest",
    "CompletionRequest",
    "Architecture",
    "PagedCacheType",
    "EngineConfig",
    "UnsupportedOption",
]
