"""The engine's configuration: `EngineConfig`, made of one sub-config per concern, each option
declared once (config/option.py) with its type, default and help. `LLM(**kwargs)`, `Runner` and
every command build it; `verify()` holds every rule of which options combine; the engine's
parts receive it (or the sub-config they own) and nothing else."""

from __future__ import annotations

import dataclasses
import difflib
import logging
from dataclasses import dataclass, field
from typing import Any, ClassVar, Iterator

from .. import settings
from .model import ModelConfig
from .option import Option, option, options_of

logger = logging.getLogger(__name__)

SUPPORTED_BLOCK_SIZES = (8, 16, 32, 64, 128)
# KV cache element types; pagedllm/kv/quant.py says what each one stores.
KV_CACHE_DTYPES = ("auto", "bf16", "f16", "f8e4m3", "int8")


def normalize_kv_cache_dtype(value: Any) -> str:
    """'int8', 'INT8' or an enum whose value is 'int8' -> 'int8' (unknown names pass through)."""
    return str(getattr(value, "value", value)).strip().lower()


@dataclass
class LoadConfig:
    """Which model, and how its weights are read."""

    title: ClassVar[str] = "model"  # the CLI's group of flags, the docs' section

    model: str = option(
        "default", "'default' (the embedded SmolLM2-135M), a .gguf file, a model folder or a hub id", cli=False
    )
    tokenizer: str | None = option(None, "a tokenizer folder to use instead of the model's", cli=False)
    gguf_file: str | None = option(None, "the .gguf file inside the `model` folder or hub repo", cli=False)
    arch: str | None = option(
        None,
        "the architecture the caller expects (mistral.rs's -a); the checkpoint's is used, a mismatch is logged",
        cli=False,
    )
    mmproj: str | None = option(
        None,
        "a GGUF model's vision tower and projector: llama.cpp's multimodal projector file "
        "(convert_hf_to_gguf.py --mmproj; Gemma 3), as llama-server's --mmproj",
        metavar="FILE",
    )
    task: str = option(
        "auto",
        "embed: an embedding model for /v1/embeddings and `LLM.embed` (auto: a folder "
        "with sentence-transformers files or a head-less architecture is one)",
        choices=("auto", "generate", "embed"),
    )
    isq: str | None = option(
        None,
        "quantize a safetensors model's linear weights at load: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, "
        "Q5_K or Q6_K; or mistral.rs's bit count, resolved as it does on a CPU: 4 = Q4_K, 5 = Q5_K, "
        "6 = Q6_K, 8 = Q8_0 (2, 3 = Q2_K, Q3_K: not available yet). A weight the type's blocks do not tile "
        "falls back to the next type that does (logged)",
        metavar="TYPE",
    )
    dequantize_weights: bool = option(
        False,
        "dequantize GGUF weights to the compute dtype at load instead of running them quantized "
        "(the exact reference; more memory, slower decode)",
    )
    keep_float_head: bool = option(
        False,
        "a GPTQ / AWQ / compressed-tensors model's float LM head stays float (by default it is "
        "quantized to Q8_0 at load, as llama.cpp keeps a 4-bit file's head)",
    )
    chat_template: str | None = option(
        None, "chat template (.jinja, or JSON with a chat_template key) to use instead of the model's", metavar="FILE"
    )
    max_model_len: int | None = option(
        None, "longest prompt + output in tokens (unset: the model's)", flags=("--max-seq-len",), metavar="N"
    )
    seed: int = option(0, "sampling seed of the engine", metavar="N")


@dataclass
class DeviceConfig:
    """Where the engine runs, in which float type."""

    title: ClassVar[str] = "device"  # the CLI's group of flags, the docs' section

    device: str = option("auto", "auto, cpu, cuda, cuda:N or mps")
    dtype: str = option("auto", "auto, float32, bfloat16 or float16")
    threads: int | None = option(
        None,
        "CPU threads the engine computes with, split among the ranks of a parallel run on this machine "
        "(llama.cpp's --threads; unset: every core this process may use)",
        metavar="N",
    )


@dataclass
class CacheConfig:
    """The paged KV cache: its blocks, its size (one of three ways), its element type and the
    prefix cache over it."""

    title: ClassVar[str] = "KV cache"  # the CLI's group of flags, the docs' section

    block_size: int = option(
        32, "tokens per KV cache block (8, 16, 32, 64, 128)", flags=("--pa-blk-size", "--pa-block-size"), metavar="N"
    )
    kv_cache_memory_mb: float | None = option(
        None, "KV cache size in MB", flags=("--pa-gpu-mem", "--pa-memory-mb"), metavar="MB"
    )
    kv_cache_memory_fraction: float | None = option(
        None,
        "KV cache size as a share of free device memory (0-1]",
        flags=("--pa-gpu-mem-usage", "--pa-memory-fraction"),
        metavar="F",
    )
    kv_cache_context_len: int | None = option(
        None, "KV cache sized to hold N tokens", flags=("--pa-ctxt-len", "--pa-context-len"), metavar="N"
    )
    kv_cache_dtype: str = option(
        "auto",
        "KV cache element type (auto: the compute dtype; bf16/f16 halve a float32 model's cache)",
        flags=("--pa-cache-type",),
        choices=KV_CACHE_DTYPES,
    )
    paged_attention: bool = option(
        True, "paged attention over KV blocks (off: a contiguous KV cache per sequence)", negative="--no-paged-attn"
    )
    enable_prefix_caching: bool = option(
        True, "prefix caching: the KV blocks of prompts seen before are reused", negative="--no-prefix-cache"
    )
    prefix_cache_n: int = option(
        16, "finished sequences kept as reusable prefixes (0 turns prefix caching off, as in mistral.rs)", metavar="N"
    )

    @property
    def prefix_caching(self) -> bool:
        """Whether prefix caching is asked for: `prefix_cache_n=0` turns it off, as the CLI's
        `--prefix-cache-n 0` does (mistral.rs's meaning), so the knob means one thing everywhere."""
        return self.enable_prefix_caching and self.prefix_cache_n > 0

    def validate(self) -> None:
        if self.block_size not in SUPPORTED_BLOCK_SIZES:
            raise ValueError(f"block_size={self.block_size} is not supported; use one of {SUPPORTED_BLOCK_SIZES}")
        given = [
            f"{n} ({flag})"
            for n, flag in (
                ("kv_cache_memory_mb", "--pa-gpu-mem"),
                ("kv_cache_memory_fraction", "--pa-gpu-mem-usage"),
                ("kv_cache_context_len", "--pa-ctxt-len"),
            )
            if getattr(self, n) is not None
        ]
        if len(given) > 1:
            raise ValueError(f"only one of {', '.join(given)} may size the KV cache: set at most one")
        if normalize_kv_cache_dtype(self.kv_cache_dtype) not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype={self.kv_cache_dtype!r} is not supported; use one of {'|'.join(KV_CACHE_DTYPES)}"
            )
        if self.kv_cache_memory_mb is not None and self.kv_cache_memory_mb <= 0:
            raise ValueError(f"kv_cache_memory_mb must be > 0, got {self.kv_cache_memory_mb}")
        f = self.kv_cache_memory_fraction
        if f is not None and not (0 < f <= 1):
            raise ValueError(f"kv_cache_memory_fraction must be in (0, 1], got {f}")
        if self.prefix_cache_n < 0:
            raise ValueError(f"prefix_cache_n must be >= 0, got {self.prefix_cache_n}")
        if self.kv_cache_context_len is not None and self.kv_cache_context_len < 1:
            raise ValueError(f"kv_cache_context_len must be >= 1, got {self.kv_cache_context_len}")


@dataclass
class SchedulerConfig:
    """What one engine step may hold. The fields after the options are filled in when the engine
    is built (EngineConfig.scheduler_for): the model's length and what the LoRA and multimodal
    configs ask of the scheduler."""

    title: ClassVar[str] = "scheduling"  # the CLI's group of flags, the docs' section

    max_num_seqs: int = option(64, "most sequences running at once", flags=("--max-seqs",), metavar="N")
    max_num_batched_tokens: int | None = option(
        None, "token budget of one engine step (unset: 1024, or max_num_seqs when that is more)", metavar="N"
    )
    decode_latency_factor: float = option(
        0.0,
        "while a sequence decodes, limit a step's prompt tokens so the step takes at most about F times "
        "a step of decodes alone: streams keep flowing beside a long prefill (0: off; `pagedllm serve` "
        "sets 2.5 unless given)",
        metavar="F",
    )
    max_model_len: int = 4096
    # LoRA: at most this many distinct adapters among the running sequences (their slots); 0: off.
    max_loras: int = 0
    # Vision-language models: image tokens the step may encode (None: max_num_batched_tokens, as
    # vLLM's max_num_encoder_input_tokens), image embedding rows the encoder cache holds, and
    # images one prompt may have (vLLM's limit_mm_per_prompt).
    max_num_encoder_tokens: int | None = None
    encoder_cache_tokens: int = 16384
    limit_images: int = 8

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens is None:
            self.max_num_batched_tokens = max(1024, self.max_num_seqs)

    @property
    def encoder_budget(self) -> int:
        return self.max_num_encoder_tokens or self.max_num_batched_tokens

    def validate(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.decode_latency_factor and self.decode_latency_factor <= 1:
            raise ValueError(f"decode_latency_factor must be 0 (off) or more than 1, got {self.decode_latency_factor}")


@dataclass
class ParallelConfig:
    """How the model is split over ranks (pagedllm/distributed)."""

    title: ClassVar[str] = "parallelism"  # the CLI's group of flags, the docs' section

    tensor_parallel_size: int = option(
        1,
        "split the model over N ranks (worker processes on this machine, or the ranks of torchrun)",
        flags=("-tp",),
        metavar="N",
    )
    pipeline_parallel_size: int = option(
        1,
        "cut the model into P stages of whole layers, balanced by weight bytes (stage processes on this "
        "machine, or the ranks of torchrun on several nodes: rank 0 serves, the others run their stage)",
        flags=("-pp",),
        metavar="P",
    )
    max_rank_memory_mb: float | None = option(
        None,
        "the most weight memory one rank may hold (the whole model on one rank, a stage under "
        "--pipeline-parallel-size, a shard under -tp): a model over it is refused with the -pp that fits "
        "it; the KV cache is sized apart (unset: no limit)",
        metavar="MB",
    )

    @property
    def split(self) -> bool:
        return self.tensor_parallel_size != 1 or self.pipeline_parallel_size != 1


@dataclass
class LoRAConfig:
    """LoRA adapters named by requests (pagedllm/lora)."""

    title: ClassVar[str] = "LoRA"  # the CLI's group of flags, the docs' section

    enable_lora: bool = option(
        False, "requests may name LoRA adapters (PEFT folders or llama.cpp GGUF LoRA files; see --lora-modules)"
    )
    max_loras: int = option(
        1,
        "with --enable-lora: adapters held in memory at once; others are read from disk when a request needs them",
        metavar="N",
    )
    max_lora_rank: int = option(16, "with --enable-lora: the highest adapter rank accepted", metavar="R")


@dataclass
class MultimodalConfig:
    """Images in prompts of vision-language models (pagedllm/multimodal)."""

    title: ClassVar[str] = "images"  # the CLI's group of flags, the docs' section

    allowed_local_media_path: str | None = option(
        None,
        "vision-language models: images may be read from local files under DIR (image_url parts with a "
        "path or file:// URL; unset: none)",
        metavar="DIR",
    )
    limit_mm_per_prompt: int = option(8, "vision-language models: images one prompt may hold", metavar="N")
    media_fetch_timeout: float = option(
        10.0, "vision-language models: seconds an image URL's fetch may take", metavar="S"
    )
    max_num_encoder_tokens: int | None = option(
        None, "vision-language models: image tokens encoded a step at most (unset: max_num_batched_tokens)", cli=False
    )


@dataclass
class SpecDecodeConfig:
    """Speculative decoding (pagedllm/speculative): the command line's four options, or the
    Python face's whole dict (`speculative`)."""

    title: ClassVar[str] = "speculative decoding"  # the CLI's group of flags, the docs' section

    speculative_ngram: int | None = option(
        None,
        "speculative decoding by prompt lookup: up to K tokens proposed from the sequence's own earlier "
        "text, verified in one forward; with --speculative-draft, the lookup where it matches and the draft "
        "elsewhere",
        metavar="K",
    )
    speculative_draft: str | None = option(
        None,
        "speculative decoding with a small draft model sharing the model's tokenizer (a folder, GGUF file "
        "or hub id; its own KV cache comes out of the same budget)",
        metavar="MODEL",
    )
    speculative_tokens: int | None = option(
        None, "with --speculative-draft: up to K draft tokens proposed a step (unset: 5)", metavar="K"
    )
    speculative_draft_weights: str | None = option(
        None,
        "with --speculative-draft: the format a quantized draft's weights run in: auto (unset: parts "
        "stored in more than 4.5 bits a weight requantized to Q4_0 at load, a cheaper draft), file (the "
        "file's own), or a type such as Q8_0",
        metavar="FORMAT",
    )
    speculative: dict | None = option(
        None,
        "speculative decoding as one dict of pagedllm.speculative.config.SpeculativeConfig's fields, "
        "e.g. {'method': 'ngram', 'num_tokens': 5}",
        cli=False,
    )

    def to_dict(self) -> dict[str, Any] | None:
        """What to speculate, as SpeculativeConfig's fields (None: no speculation). The options'
        combinations are checked by EngineConfig.verify."""
        if self.speculative is not None:
            return dict(self.speculative)
        if self.speculative_draft is not None:
            spec: dict[str, Any] = {"method": "draft", "model": self.speculative_draft}
            k = self.speculative_tokens if self.speculative_tokens is not None else self.speculative_ngram
            if k is not None:
                spec["num_tokens"] = k
            if self.speculative_ngram is not None:  # both: lookup where it matches, the draft elsewhere
                spec["ngram"] = True
            if self.speculative_draft_weights is not None:
                spec["draft_weights"] = self.speculative_draft_weights
            return spec
        if self.speculative_ngram is not None:
            return {"method": "ngram", "num_tokens": self.speculative_ngram}
        return None


SECTIONS: dict[str, type] = {
    "load": LoadConfig,
    "device": DeviceConfig,
    "cache": CacheConfig,
    "scheduler": SchedulerConfig,
    "parallel": ParallelConfig,
    "lora": LoRAConfig,
    "multimodal": MultimodalConfig,
    "speculative": SpecDecodeConfig,
}


def engine_options() -> list[Option]:
    """Every engine option, section by section."""
    return [o for name, cls in SECTIONS.items() for o in options_of(name, cls)]


@dataclass
class EngineConfig:
    load: LoadConfig = field(default_factory=LoadConfig)
    device: DeviceConfig = field(default_factory=DeviceConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    multimodal: MultimodalConfig = field(default_factory=MultimodalConfig)
    speculative: SpecDecodeConfig = field(default_factory=SpecDecodeConfig)

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> "EngineConfig":
        """`LLM`'s keywords (every option by its name) as a checked config; a name that is no
        option is a TypeError naming the closest one."""
        where = {o.name: o.section for o in engine_options()}
        parts: dict[str, dict[str, Any]] = {s: {} for s in SECTIONS}
        for name, value in kwargs.items():
            if name not in where:
                close = difflib.get_close_matches(name, where, n=1)
                raise TypeError(
                    f"{name!r} is not an engine option"
                    + (f"; did you mean {close[0]!r}?" if close else " (see pagedllm.EngineConfig)")
                )
            parts[where[name]][name] = value
        config = cls(**{s: SECTIONS[s](**kw) for s, kw in parts.items()})
        config.verify()
        return config

    def items(self) -> Iterator[tuple[str, Any]]:
        """(option name, value) of every option."""
        for o in engine_options():
            yield o.name, getattr(getattr(self, o.section), o.name)

    def verify(self, model: ModelConfig | None = None) -> None:
        """Each option's own range, then every rule of which options go together, one message
        each; with the `model`'s config (read before its weights), the rules that depend on it."""
        self.cache.validate()
        self.scheduler.validate()
        self._verify_values()
        self._verify_lora()
        self._verify_speculative()
        par = self.parallel
        if self.load.task == "embed" and (self.speculative.to_dict() is not None or par.split):
            raise ValueError(
                "an embedding model runs without speculative decoding, tensor or pipeline "
                "parallelism (use pipeline_parallel_size=1 and tensor_parallel_size=1)"
            )
        vision = self.load.mmproj is not None or (model is not None and model.vision is not None)
        if vision and par.pipeline_parallel_size != 1:
            raise ValueError(
                "pipeline parallelism runs causal language models; a model with a vision tower "
                "is not split into stages yet (use pipeline_parallel_size=1)"
            )
        if vision and par.tensor_parallel_size != 1:
            raise ValueError(
                "vision-language models do not run under tensor parallelism yet; use tensor_parallel_size=1"
            )
        if model is not None and (self.load.max_model_len or 0) > model.max_position_embeddings:
            _check_max_model_len(self.load.max_model_len, model.max_position_embeddings)

    def _verify_values(self) -> None:
        for name, value in (
            ("tensor_parallel_size", self.parallel.tensor_parallel_size),
            ("pipeline_parallel_size", self.parallel.pipeline_parallel_size),
            ("limit_mm_per_prompt", self.multimodal.limit_mm_per_prompt),
            ("threads", 1 if self.device.threads is None else self.device.threads),
        ):
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"{name} must be an integer, got {value!r}")
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        mb = self.parallel.max_rank_memory_mb
        if mb is not None and not (isinstance(mb, (int, float)) and not isinstance(mb, bool) and mb > 0):
            raise ValueError(f"max_rank_memory_mb must be a number of MB > 0, got {mb!r}")
        if self.load.task not in ("auto", "generate", "embed"):
            raise ValueError(f"task must be 'auto', 'generate' or 'embed', got {self.load.task!r}")

    def _verify_lora(self) -> None:
        lora, par = self.lora, self.parallel
        if not lora.enable_lora:
            if (lora.max_loras, lora.max_lora_rank) != (LoRAConfig.max_loras, LoRAConfig.max_lora_rank):
                raise ValueError(
                    "max_loras and max_lora_rank (--max-loras, --max-lora-rank) go with enable_lora (--enable-lora)"
                )
            return
        for name in ("max_loras", "max_lora_rank"):
            v = getattr(lora, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
        if par.tensor_parallel_size != 1:
            raise ValueError(
                "LoRA adapters do not run under tensor parallelism yet; use tensor_parallel_size=1 with enable_lora"
            )
        if par.pipeline_parallel_size != 1:
            raise ValueError(
                "LoRA adapters do not run under pipeline parallelism yet; use pipeline_parallel_size=1 with enable_lora"
            )

    def _verify_speculative(self) -> None:
        s, par = self.speculative, self.parallel
        flags = [
            n
            for n in ("speculative_ngram", "speculative_draft", "speculative_tokens", "speculative_draft_weights")
            if getattr(s, n) is not None
        ]
        if s.speculative is not None and flags:
            raise ValueError(f"give speculative (the dict) or {', '.join(flags)}, not both")
        if s.speculative_draft is None:
            if s.speculative_draft_weights is not None:
                raise ValueError(
                    "--speculative-draft-weights sets a draft model's weights; it needs --speculative-draft MODEL"
                )
            if s.speculative_tokens is not None:
                raise ValueError(
                    "--speculative-tokens goes with --speculative-draft; --speculative-ngram K takes its K itself"
                    if s.speculative_ngram is not None
                    else "--speculative-tokens needs --speculative-draft MODEL"
                )
        spec = s.to_dict()
        if spec is not None and spec.get("method") == "draft":
            if par.tensor_parallel_size != 1:
                raise ValueError(
                    "a speculative draft model does not run under tensor parallelism yet; use "
                    "tensor_parallel_size=1 or n-gram speculation"
                )
            if par.pipeline_parallel_size != 1:
                raise ValueError(
                    "a speculative draft model does not run under pipeline parallelism yet; use "
                    "n-gram speculation or pipeline_parallel_size=1"
                )

    def scheduler_for(self, max_model_len: int) -> SchedulerConfig:
        """The scheduler's config once the model's length is known, with what the LoRA and
        multimodal configs ask of it."""
        return dataclasses.replace(
            self.scheduler,
            max_model_len=max_model_len,
            max_loras=self.lora.max_loras if self.lora.enable_lora else 0,
            limit_images=self.multimodal.limit_mm_per_prompt,
            max_num_encoder_tokens=self.multimodal.max_num_encoder_tokens,
        )


ALLOW_LONG_ENV = settings.env_name("allow_long_max_model_len")


def _check_max_model_len(max_model_len: int, limit: int) -> None:
    """Refuse a max_model_len past the model's trained positions (as vLLM does), unless
    PAGEDLLM_ALLOW_LONG_MAX_MODEL_LEN=1: past them a model without rope scaling for that length
    gives garbage, with no error anywhere."""
    if settings.get("allow_long_max_model_len"):
        logger.warning(
            "max_model_len=%d exceeds the model's %d positions (allowed by %s=1): outputs past "
            "%d positions may be wrong",
            max_model_len,
            limit,
            ALLOW_LONG_ENV,
            limit,
        )
        return
    raise ValueError(
        f"max_model_len={max_model_len} exceeds the model's {limit} positions (max_position_embeddings). "
        f'To go past them, give the model rope scaling in its config.json (e.g. "rope_scaling": '
        f'{{"rope_type": "linear", "factor": 4.0}} and max_position_embeddings {4 * limit}), '
        f"or set {ALLOW_LONG_ENV}=1 to run past them anyway"
    )


def cdiv(a: int, b: int) -> int:
    return -(-a // b)
