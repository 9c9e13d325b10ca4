"""The vLLM-style Python API: `LLM(...).generate / chat / stream`."""
from __future__ import annotations

import logging
import operator
import os
import weakref
from contextlib import closing
from typing import Iterator, Sequence as Seq

import torch
from tqdm.auto import tqdm

from . import settings
from .config import CacheConfig, SchedulerConfig
from .device import resolve_device, resolve_dtype
from .engine import scoring
from .engine.driver import EngineDriver, Item
from .engine.factory import build_engine
from .engine.model_runner import ModelRunner
from .loading.loader import check_rank_memory, load_model
from .loading.source import resolve
from .native import release_omp_threads
from .outputs import RequestOutput
from .sampling.params import SamplingParams
from .speculative.config import SpeculativeConfig
from .tokenizer.chat import render_chat

logger = logging.getLogger(__name__)


def _start_tp(size: int, source, dt: torch.dtype, dev: torch.device, max_model_len: int | None,
              dequantize_weights: bool, isq: str | None, cache_cfg: CacheConfig, max_rank_memory_mb: float | None):
    """Check the size against the model and the devices, then start the group (rank 0's
    executor). Under torchrun, a rank other than 0 serves its shard here and exits the process."""
    from .distributed.executor import TPExecutor, check_size, usable_cores
    from .distributed.worker import WorkerSpec, worker_main
    from .loading.loader import read_config
    from .models.parallel import check_tp

    check_size(size, dev)
    cfg = read_config(source)
    check_tp(cfg, size)
    spec = WorkerSpec(source, dt, dev.type, max_model_len, dequantize_weights, isq, cache_cfg,
                      threads=max(1, usable_cores() // size),
                      log_level=logging.getLogger("pagedllm").getEffectiveLevel(),
                      max_rank_memory_mb=max_rank_memory_mb)
    rank = int(os.environ.get("RANK", "0")) if int(os.environ.get("WORLD_SIZE", "1")) > 1 else 0
    if rank > 0:  # torchrun: this process is a worker for the rest of its life
        worker_main(rank, size, None, spec)
    return TPExecutor.start(size, spec)


def _start_pp(size: int, tp: int, source, dt: torch.dtype, dev: torch.device, max_model_len: int | None,
              dequantize_weights: bool, isq: str | None, cache_cfg: CacheConfig, max_rank_memory_mb: float | None):
    """Check the sizes and the options against the model, then start the pipeline of `size`
    stages of `tp` ranks each (rank 0's executor). Under torchrun, a rank other than 0 serves
    its stage (its shard of it) here and exits the process."""
    from .distributed.executor import check_size, usable_cores
    from .distributed.pipeline import PipelineExecutor, pipeline_worker_main
    from .distributed.stage_kv import check_cache
    from .distributed.worker import WorkerSpec
    from .loading.loader import read_config
    from .models import model_class
    from .models.parallel import check_tp
    from .models.stages import check_pp

    check_size(size, dev, "pipeline")
    check_size(tp, dev)
    if dev.type == "cuda" and size * tp > torch.cuda.device_count():  # one device a rank
        raise ValueError(f"pipeline_parallel_size={size} x tensor_parallel_size={tp} needs {size * tp} GPUs but this "
                         f"machine has {torch.cuda.device_count()}; lower them or run several nodes under torchrun")
    cfg = read_config(source)
    check_pp(cfg.num_layers, size)
    check_tp(cfg, tp)
    check_cache(cache_cfg)
    if source.mmproj is not None or not model_class(cfg.architecture).pipeline_stages:
        raise ValueError(f"pipeline parallelism runs causal language models; {cfg.architecture}"
                         f"{' with a vision tower' if source.mmproj is not None else ''} is not split into "
                         "stages yet (use pipeline_parallel_size=1)")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    # Under torchrun each node splits its own cores among its own ranks.
    local = int(os.environ.get("LOCAL_WORLD_SIZE", size * tp)) if world > 1 else size * tp
    spec = WorkerSpec(source, dt, dev.type, max_model_len, dequantize_weights, isq, cache_cfg,
                      threads=max(1, usable_cores() // local),
                      log_level=logging.getLogger("pagedllm").getEffectiveLevel(),
                      max_rank_memory_mb=max_rank_memory_mb)
    rank = int(os.environ.get("RANK", "0")) if world > 1 else 0
    if rank > 0:  # torchrun: this process is a stage (or a shard of one) for the rest of its life
        pipeline_worker_main(rank, size, None, spec, tp=tp)
    return PipelineExecutor.start(size, spec, tp=tp)


def _draft_source(name: str, target_source):
    """Where the draft model of speculative method 'draft' comes from, checked before anything
    is loaded: it must exist and have the target's vocabulary size."""
    from .loading.loader import read_config
    from .engine.draft import check_vocab_size

    try:
        source = resolve(name)
    except (FileNotFoundError, ValueError) as e:
        raise ValueError(f"speculative draft model {name!r} cannot be loaded: {e}") from None
    check_vocab_size(target_source.short_name, read_config(target_source).vocab_size,
                     source.short_name, read_config(source).vocab_size)
    return source


def _load_draft(source, target, dt: torch.dtype, dev: torch.device, max_model_len: int,
                dequantize_weights: bool, isq: str | None):
    """The draft model, loaded as the target is (same device and dtype; ISQ applies to a
    safetensors draft), and checked to share its tokenizer."""
    from .engine.draft import check_compatible

    loaded = load_model(source, dt, dev, max_positions=max_model_len, dequantize_weights=dequantize_weights,
                        isq=isq if source.kind != "gguf" else None)
    check_compatible(target, loaded)
    return loaded


def _resolve_task(task: str, source) -> tuple[str, "PoolingConfig | None"]:
    """("generate" or "embed", and for embed how to pool), checked before the slow load."""
    from .engine.pooling import PoolingConfig
    from .loading.loader import read_config

    if task not in ("auto", "generate", "embed"):
        raise ValueError(f"task must be 'auto', 'generate' or 'embed', got {task!r}")
    pooling = PoolingConfig.from_folder(source.path) if source.kind != "gguf" else None
    arch = read_config(source).architecture
    headless = arch.endswith("Model")
    if task == "auto":
        task = "embed" if pooling is not None or headless else "generate"
    if task == "generate" and headless:
        raise ValueError(f"{source.short_name} is a base model without an LM head "
                         f"({arch}): it cannot generate; load it with "
                         "task='embed' (--task embed) for embeddings")
    if task == "embed":
        pooling = pooling or PoolingConfig()  # Qwen3-Embedding's: last token, normalised
        logger.info("embedding model: %s pooling%s (%s)", pooling.mode,
                    ", normalised" if pooling.normalize else "", pooling.source)
    return task, pooling


Prompt = str | list[int]


ALLOW_LONG_ENV = settings.env_name("allow_long_max_model_len")


def check_max_model_len(max_model_len: int, limit: int) -> None:
    """Refuse a max_model_len past the model's trained positions (as vLLM does), unless
    PAGEDLLM_ALLOW_LONG_MAX_MODEL_LEN=1: past them a model without rope scaling for that length
    gives garbage, with no error anywhere."""
    if settings.get("allow_long_max_model_len"):
        logger.warning("max_model_len=%d exceeds the model's %d positions (allowed by %s=1): outputs past "
                       "%d positions may be wrong", max_model_len, limit, ALLOW_LONG_ENV, limit)
        return
    raise ValueError(
        f"max_model_len={max_model_len} exceeds the model's {limit} positions (max_position_embeddings). "
        f"To go past them, give the model rope scaling in its config.json (e.g. \"rope_scaling\": "
        f"{{\"rope_type\": \"linear\", \"factor\": 4.0}} and max_position_embeddings {4 * limit}), "
        f"or set {ALLOW_LONG_ENV}=1 to run past them anyway")


class LLM:
    def __init__(self, model: str = "default", dtype: str | torch.dtype = "auto", block_size: int = 32,
                 kv_cache_memory_mb: float | None = None, kv_cache_memory_fraction: float | None = None,
                 kv_cache_context_len: int | None = None, paged_attention: bool = True,
                 max_num_seqs: int = 64, max_model_len: int | None = None, seed: int = 0,
                 device: str | None = "auto", max_num_batched_tokens: int | None = None,
                 tokenizer: str | None = None, gguf_file: str | None = None,
                 kv_cache_dtype: str = "auto", enable_prefix_caching: bool = True,
                 prefix_cache_n: int = 16, dequantize_weights: bool = False,
                 isq: str | None = None, tensor_parallel_size: int = 1,
                 speculative: dict | None = None, task: str = "auto", keep_float_head: bool = False,
                 enable_lora: bool = False, max_loras: int = 1, max_lora_rank: int = 16,
                 limit_mm_per_prompt: int = 8, allowed_local_media_path: str | None = None,
                 max_num_encoder_tokens: int | None = None, media_fetch_timeout: float = 10.0,
                 mmproj: str | None = None, runner_cls: type | None = None,
                 pipeline_parallel_size: int = 1, max_rank_memory_mb: float | None = None,
                 decode_latency_factor: float = 0.0) -> None:
        """`tensor_parallel_size=N` splits the model over N ranks (pagedllm/distributed): on one
        machine the engine starts N - 1 worker processes and splits the cores among the ranks;
        under torchrun the N ranks are torchrun's. Call `shutdown()` (or use `with LLM(...)`)
        to stop them; they also stop when this process exits.
        `pipeline_parallel_size=P` cuts the model into P stages of whole layers, balanced by
        weight bytes (distributed/pipeline.py): this process schedules, runs the first stage and
        samples; the other stages run as P - 1 processes on this machine, or as torchrun's other
        ranks (on other nodes). Each stage's KV cache holds its own layers; the KV budget is per
        rank. With `tensor_parallel_size=T` too, each stage is split over T ranks (P x T in all).
        Not with LoRA, a draft model or embeddings yet.
        `max_rank_memory_mb`: the most weight bytes one rank may hold (each stage's, each shard's;
        the whole model's on one rank): a model over it is refused once loaded, before the KV
        cache is sized, with the pipeline_parallel_size that would fit it. None: no limit.
        `task`: "generate", "embed" (an embedding model: `embed()`, no LM head) or "auto"
        (embed for a folder with sentence-transformers files or a head-less architecture).
        `keep_float_head`: a GPTQ / AWQ / compressed-tensors checkpoint's float LM head (or tied
        embedding) stays float; by default it is quantized to Q8_0 at load (loading/loader.py).
        `enable_lora`: requests may name a LoRA adapter (`generate(..., lora_request=...)`); up to
        `max_loras` adapters of rank <= `max_lora_rank` are held in memory, others read from disk
        when needed (pagedllm/lora).
        Vision-language models (pagedllm/multimodal): `limit_mm_per_prompt` images a prompt at
        most, local image paths read only under `allowed_local_media_path`, and
        `max_num_encoder_tokens` image tokens encoded a step at most (None: max_num_batched_tokens);
        an image URL's fetch takes at most `media_fetch_timeout` seconds. `mmproj`: llama.cpp's
        multimodal projector file for a GGUF `model` (its vision tower and projector; Gemma 3), as
        llama-server's --mmproj. `runner_cls`: a ModelRunner subclass that runs each step another
        way (the planning benchmark's runner plans every step and skips the forward); None: the
        ModelRunner.
        `decode_latency_factor`: while a sequence decodes, a step's prompt tokens are limited so the
        step takes at most about this many times a step of decodes alone (engine/pacing.py), so a
        stream keeps flowing beside a long prefill; 0 (the default, for offline batches): prompts
        take the whole token budget. `pagedllm serve` sets 2.5."""
        from .multimodal.media import MediaPolicy

        self.media_policy = MediaPolicy(allowed_local_dir=allowed_local_media_path, timeout_s=media_fetch_timeout)
        self._mm_limits = (limit_mm_per_prompt, max_num_encoder_tokens)
        self.processor = None
        if enable_lora:
            for name, v in (("max_loras", max_loras), ("max_lora_rank", max_lora_rank)):
                if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                    raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
            if tensor_parallel_size != 1:
                raise ValueError("LoRA adapters do not run under tensor parallelism yet; use "
                                 "tensor_parallel_size=1 with enable_lora")
            if pipeline_parallel_size != 1:
                raise ValueError("LoRA adapters do not run under pipeline parallelism yet; use "
                                 "pipeline_parallel_size=1 with enable_lora")
        self._lora = (max_loras, max_lora_rank) if enable_lora else None
        if max_rank_memory_mb is not None and not (isinstance(max_rank_memory_mb, (int, float))
                                                   and not isinstance(max_rank_memory_mb, bool) and max_rank_memory_mb > 0):
            raise ValueError(f"max_rank_memory_mb must be a number of MB > 0, got {max_rank_memory_mb!r}")
        self._max_rank_memory_mb = max_rank_memory_mb
        self._ranks = (pipeline_parallel_size, tensor_parallel_size)
        cache_cfg = CacheConfig(block_size, kv_cache_memory_mb, kv_cache_memory_fraction,
                                kv_cache_context_len, kv_cache_dtype, paged_attention,
                                enable_prefix_caching, prefix_cache_n)
        cache_cfg.validate()
        spec_cfg = SpeculativeConfig.coerce(speculative)
        if spec_cfg is not None and spec_cfg.method == "draft" and tensor_parallel_size != 1:
            from .engine.draft import NO_TP

            raise ValueError(NO_TP)
        if spec_cfg is not None and spec_cfg.method == "draft" and pipeline_parallel_size != 1:
            raise ValueError("a speculative draft model does not run under pipeline parallelism yet; use "
                             "n-gram speculation or pipeline_parallel_size=1")
        if isq is not None:
            from .quant.isq import check_isq_type

            isq = check_isq_type(isq)
        dev = resolve_device(device)
        dt = resolve_dtype(dtype, dev)
        source = resolve(model, tokenizer, gguf_file, mmproj)
        if max_model_len is not None:  # before the load: the config alone is cheap to read
            from .loading.loader import read_config

            limit = read_config(source).max_position_embeddings
            if max_model_len > limit:
                check_max_model_len(max_model_len, limit)
        self.task, self.pooling = _resolve_task(task, source)
        if self.task == "embed" and (spec_cfg is not None or tensor_parallel_size != 1 or pipeline_parallel_size != 1):
            raise ValueError("an embedding model runs without speculative decoding, tensor or pipeline "
                             "parallelism (use pipeline_parallel_size=1 and tensor_parallel_size=1)")
        draft_source = (_draft_source(spec_cfg.model, source)
                        if spec_cfg is not None and spec_cfg.method == "draft" else None)
        torch.manual_seed(seed)
        self._finalizer = None
        self._keep_float_head = keep_float_head
        self._decode_latency_factor = decode_latency_factor
        executor = None
        if pipeline_parallel_size != 1:  # TP, if any, inside each stage
            executor = _start_pp(pipeline_parallel_size, tensor_parallel_size, source, dt, dev, max_model_len,
                                 dequantize_weights, isq, cache_cfg, max_rank_memory_mb)
        elif tensor_parallel_size != 1:
            executor = _start_tp(tensor_parallel_size, source, dt, dev, max_model_len, dequantize_weights,
                                 isq, cache_cfg, max_rank_memory_mb)
        try:
            self._build(source, dt, dev, max_model_len, dequantize_weights, isq, max_num_seqs,
                        max_num_batched_tokens, cache_cfg, seed, executor, spec_cfg, draft_source, runner_cls)
        except BaseException:
            if executor is not None:
                executor.shutdown()
            raise
        if executor is not None:  # workers stop with this object, at the latest at exit
            self._finalizer = weakref.finalize(self, executor.shutdown)
        # The engine may run on another thread (the server's, a user's): this one's OpenMP
        # workers would make its parallel regions sleep between steps (native/__init__.py).
        release_omp_threads()

    def _build(self, source, dt, dev, max_model_len, dequantize_weights, isq, max_num_seqs,
               max_num_batched_tokens, cache_cfg, seed, executor, spec_cfg, draft_source=None,
               runner_cls=None) -> None:
        loaded = load_model(source, dt, dev, max_positions=max_model_len,
                            dequantize_weights=dequantize_weights, isq=isq,
                            headless=self.task == "embed", keep_float_head=self._keep_float_head,
                            **(executor.load_args() if executor is not None else {}))
        # Rank 0's weights against the per-rank limit (the other ranks check their own as they load).
        check_rank_memory(loaded.weight_bytes, self._max_rank_memory_mb, 0, *self._ranks)
        if executor is not None:
            executor.wait_loaded()
        limit = loaded.config.max_position_embeddings
        if max_model_len is None:
            max_model_len = limit
        sched_cfg = SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens or max(1024, max_num_seqs),
            max_model_len=max_model_len, max_loras=self._lora[0] if self._lora else 0,
            limit_images=self._mm_limits[0], max_num_encoder_tokens=self._mm_limits[1],
            decode_latency_factor=self._decode_latency_factor)
        if loaded.model.rope.cos.shape[0] < max_model_len:
            raise ValueError("internal: rope table shorter than max_model_len")
        draft = None
        if draft_source is not None:
            draft = _load_draft(draft_source, loaded, dt, dev, max_model_len, dequantize_weights, isq)
        self.engine = build_engine(loaded, cache_cfg, sched_cfg, dev, dt, seed, executor, spec_cfg, draft,
                                   max_lora_rank=self._lora[1] if self._lora else 16,
                                   runner_cls=runner_cls or ModelRunner)
        self.driver = EngineDriver(self.engine)  # every face drives the engine through it
        self.tokenizer = loaded.tokenizer
        self.model_name = source.short_name
        self.model_path = source.path  # the .gguf file or the model folder (its size for Ollama's /api/tags)
        if hasattr(loaded.model, "encode_images"):
            from .multimodal.processor import ImageProcessor, gguf_processor

            hf = None
            if loaded.mmproj is not None:  # a GGUF model: its processor is made from the files' metadata
                hf = gguf_processor(loaded.mmproj.image_settings(), loaded.tokenizer, loaded.config.vision)
            self.processor = ImageProcessor(source.path, loaded.model.image_token_id,
                                            loaded.model.bidirectional_images, sched_cfg.limit_images,
                                            loaded.model.image_layout, hf=hf)

    def _prompt(self, p):
        """A prompt as the engine takes it: text or ids as they are; {"prompt_token_ids": ids}
        (vLLM's TokensPrompt) as those ids; {"prompt": text, "multi_modal_data": {"image": PIL
        image or list}} through the model's processor."""
        if not isinstance(p, dict):
            return p
        if "prompt_token_ids" in p and "prompt" not in p:
            ids = p["prompt_token_ids"]
            extra = set(p) - {"prompt_token_ids"}
            if extra:
                raise ValueError(f"a token-id prompt takes only 'prompt_token_ids'; it also has {sorted(extra)}")
            try:
                ids = [operator.index(t) for t in ids] if isinstance(ids, (list, tuple)) else None
            except TypeError:
                ids = None
            if not ids:
                raise ValueError("'prompt_token_ids' must be a non-empty list of token ids (ints)")
            return ids
        if "prompt" not in p:
            raise ValueError("a dict prompt needs 'prompt' (the text) and optionally 'multi_modal_data', "
                             "or 'prompt_token_ids' (token ids)")
        data = p.get("multi_modal_data") or {}
        unknown = set(data) - {"image"}
        if unknown:
            raise ValueError(f"multi_modal_data {sorted(unknown)} is not supported; this engine takes 'image'")
        images = data.get("image", [])
        images = list(images) if isinstance(images, (list, tuple)) else [images]
        if not images:
            return p["prompt"]
        if self.processor is None:
            raise ValueError(f"model {self.model_name!r} is text-only; it takes no images")
        from .multimodal.media import load_image

        return self.processor.process(p["prompt"], [load_image(im, self.media_policy) for im in images])

    def embed(self, inputs: Prompt | Seq[Prompt], prompt_name: str | None = None) -> list[list[float]]:
        """Embeddings (an embedding model, task="embed"): one vector per text or token-id list,
        texts after the named sentence-transformers prompt (or the model's default one)."""
        if isinstance(inputs, str) or (isinstance(inputs, list) and inputs and isinstance(inputs[0], int)):
            inputs = [inputs]
        from .engine.pooling import embed_prompts

        return [v.tolist() for v in embed_prompts(self.driver, self.embed_ids(list(inputs), prompt_name),
                                                  self.pooling)]

    def embed_ids(self, inputs: list[Prompt], prompt_name: str | None = None) -> list[list[int]]:
        """The token ids an embedding is computed over (texts tokenized after the prompt)."""
        if self.task != "embed":
            raise ValueError(f"{self.model_name} is a generative model; embeddings need an embedding "
                             "model (task='embed')")
        prefix = self.pooling.prompt(prompt_name)
        return [self.tokenizer.encode(prefix + p) if isinstance(p, str) else list(p) for p in inputs]

    def prompt_logits(self, token_ids: list[int], chunk_size: int | None = None,
                      lora_request=None) -> torch.Tensor:
        """Logits [T, vocab] (float32, CPU) at every position of a token-id prompt, through the
        same KV cache, attention and scheduler as generation, `chunk_size` tokens a step
        (1 = token by token through the decode path; None = max_num_batched_tokens)."""
        return scoring.prompt_logits(self.driver, token_ids, chunk_size, lora_request)

    def score_prompts(self, prompts: Seq[list[int]], chunk_size: int | None = 1,
                      top1: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
        """Per token-id prompt, log p(token[t+1] | tokens[:t+1]) for every t ([T-1] float32), all
        prompts advancing together `chunk_size` tokens a step (1 = every token through the decode
        path): perplexity over many windows. A list passed as `top1` receives each prompt's
        argmax predictions ([T-1] int64)."""
        return scoring.score_prompts(self.driver, prompts, chunk_size, top1)

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers or pipeline stages; the LLM cannot generate afterwards.
        Nothing to do on one rank (safe to call twice)."""
        if self._finalizer is not None:
            self._finalizer()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def kv_cache_trace(self):
        """What the KV cache is and does: layout, dtype, capacity, occupancy, prefix-cache
        hits, preemptions and waste (a `KVCacheTrace`; `.to_dict()`, `.table()`)."""
        return self.engine.kv_cache_trace()

    # -- batch generation --------------------------------------------------
    def generate(self, prompts: Prompt | Seq[Prompt],
                 sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool = True, lora_request=None) -> list[RequestOutput]:
        """`lora_request`: a LoRARequest for every prompt, or a list of one (or None) per prompt."""
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts
                                                and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(f"{len(prompts)} prompts but {len(params_list)} SamplingParams")
        if lora_request is None or not isinstance(lora_request, (list, tuple)):
            loras = [lora_request] * len(prompts)
        else:
            loras = list(lora_request)
            if len(loras) != len(prompts):
                raise ValueError(f"{len(prompts)} prompts but {len(loras)} LoRA requests")
        prompts = [self._prompt(p) for p in prompts]
        ids = self.driver.add([Item(None, p, sp, lr) for p, sp, lr in zip(prompts, params_list, loras)])
        # disable=None: a bar only when stderr is a terminal, never in logs or pipes.
        bar = tqdm(total=len(ids), desc="generating", unit="req", disable=None if use_tqdm else True)
        try:
            return self.driver.finals(ids, on_finished=lambda _: bar.update(1))
        finally:
            bar.close()

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | None = None, use_tqdm: bool = True,
             add_generation_prompt: bool = True, lora_request=None,
             **template_kwargs) -> RequestOutput | list[RequestOutput]:
        """`lora_request` as in `generate` (one for every conversation, or one per conversation);
        other keywords go to the chat template."""
        single = bool(messages) and isinstance(messages[0], dict)
        convs = [messages] if single else messages
        # With a processor, content parts may hold images: the processor's template.
        prompts = [render_chat(self.tokenizer, c, processor=self.processor, media_policy=self.media_policy,
                               add_generation_prompt=add_generation_prompt, **template_kwargs)
                   for c in convs]
        outs = self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)
        return outs[0] if single else outs

    def stream(self, prompt: Prompt, sampling_params: SamplingParams | None = None) -> Iterator[str]:
        """Yields text deltas of one completion as they are produced (whole UTF-8 characters)."""
        [rid] = self.driver.add([Item(None, prompt, sampling_params)])
        with closing(self.driver.stream([rid])) as outs:  # leaving early aborts the request
            for out in outs:
                if out.outputs[0].delta_text:
                    yield out.outputs[0].delta_text
