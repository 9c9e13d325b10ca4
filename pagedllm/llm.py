"""The vLLM-style Python API: `LLM(...).generate / chat / stream`."""

from __future__ import annotations

import copy
import inspect
import logging
import operator
import re
import weakref
from contextlib import closing
from typing import TYPE_CHECKING, Iterator, Sequence as Seq

import torch
from tqdm.auto import tqdm

from .config import EngineConfig, engine_options
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
from .tokenizer.chat import read_chat_template, render_chat

if TYPE_CHECKING:
    from .engine.pooling import PoolingConfig

logger = logging.getLogger(__name__)


def _start_executor(config: EngineConfig, source, dt: torch.dtype, dev: torch.device):
    """rank 0's side of tensor or pipeline parallelism (None on one rank), its sizes checked
    against the model and the devices first. Under torchrun, a rank other than 0 serves its
    shard or stage here and exits the process."""
    par = config.parallel
    if not par.split:
        return None
    from .distributed.executor import check_size, local_ranks, torchrun_rank, usable_cores
    from .distributed.worker import WorkerSpec
    from .loading.loader import read_config
    from .models.parallel import check_tp

    pp, tp = par.pipeline_parallel_size, par.tensor_parallel_size
    if pp != 1:
        check_size(pp, dev, "pipeline")
    check_size(tp, dev)
    if dev.type == "cuda" and pp * tp > torch.cuda.device_count():  # one device a rank
        raise ValueError(
            f"pipeline_parallel_size={pp} x tensor_parallel_size={tp} needs {pp * tp} GPUs but this "
            f"machine has {torch.cuda.device_count()}; lower them or run several nodes under torchrun"
        )
    cfg = read_config(source)
    check_tp(cfg, tp)
    spec = WorkerSpec(
        source,
        dt,
        dev.type,
        config.load.max_model_len,
        config.load.dequantize_weights,
        config.load.isq,
        config.cache,
        threads=max(1, (config.device.threads or usable_cores()) // local_ranks(pp * tp)),  # among its ranks
        log_level=logging.getLogger("pagedllm").getEffectiveLevel(),
        max_rank_memory_mb=par.max_rank_memory_mb,
    )
    rank = torchrun_rank()
    if pp == 1:
        from .distributed.tensor_parallel import TPExecutor
        from .distributed.worker import worker_main

        if rank > 0:  # torchrun: this process is a worker for the rest of its life
            worker_main(rank, tp, None, spec)
        return TPExecutor.start(tp, spec)
    from .distributed.pipeline import PipelineExecutor
    from .distributed.stage import pipeline_worker_main
    from .distributed.stage_kv import check_cache
    from .models import model_class
    from .models.stages import check_pp

    check_pp(cfg.num_layers, pp)
    check_cache(config.cache)
    if not model_class(cfg.architecture).pipeline_stages:
        raise ValueError(
            f"pipeline parallelism runs causal language models; {cfg.architecture} is not split "
            "into stages yet (use pipeline_parallel_size=1)"
        )
    if rank > 0:  # torchrun: this process is a stage (or a shard of one) for the rest of its life
        pipeline_worker_main(rank, pp, None, spec, tp=tp)
    return PipelineExecutor.start(pp, spec, tp=tp)


def _draft_source(name: str, target_source):
    """Where the draft model of speculative method 'draft' comes from, checked before anything
    is loaded: it must exist and have the target's vocabulary size."""
    from .loading.loader import read_config
    from .engine.draft import check_vocab_size

    try:
        source = resolve(name)
    except (FileNotFoundError, ValueError) as e:
        raise ValueError(f"speculative draft model {name!r} cannot be loaded: {e}") from None
    check_vocab_size(
        target_source.short_name,
        read_config(target_source).vocab_size,
        source.short_name,
        read_config(source).vocab_size,
    )
    return source


def _load_draft(
    source, target, dt: torch.dtype, dev: torch.device, max_model_len: int, dequantize_weights: bool, isq: str | None
):
    """The draft model, loaded as the target is (same device and dtype; ISQ applies to a
    safetensors draft), and checked to share its tokenizer."""
    from .engine.draft import check_compatible

    loaded = load_model(
        source,
        dt,
        dev,
        max_positions=max_model_len,
        dequantize_weights=dequantize_weights,
        isq=isq if source.kind != "gguf" else None,
    )
    check_compatible(target, loaded)
    return loaded


def _resolve_task(task: str, source) -> tuple[str, "PoolingConfig | None"]:
    """("generate" or "embed", and for embed how to pool), checked before the slow load."""
    from .engine.pooling import PoolingConfig
    from .loading.loader import read_config

    pooling = PoolingConfig.from_folder(source.path) if source.kind != "gguf" else None
    arch = read_config(source).architecture
    headless = arch.endswith("Model")
    if task == "auto":
        task = "embed" if pooling is not None or headless else "generate"
    if task == "generate" and headless:
        raise ValueError(
            f"{source.short_name} is a base model without an LM head "
            f"({arch}): it cannot generate; load it with "
            "task='embed' (--task embed) for embeddings"
        )
    if task == "embed":
        pooling = pooling or PoolingConfig()  # Qwen3-Embedding's: last token, normalised
        logger.info(
            "embedding model: %s pooling%s (%s)",
            pooling.mode,
            ", normalised" if pooling.normalize else "",
            pooling.source,
        )
    return task, pooling


Prompt = str | list[int]


def _family(name: str) -> str:
    """A model family as one spelling: "Qwen2MoeForCausalLM", "qwen2_moe" and mistral.rs's
    "qwen2moe" all give "qwen2moe"."""
    for suffix in ("ForCausalLM", "ForConditionalGeneration"):
        name = name.removesuffix(suffix)
    return re.sub(r"[^a-z0-9]", "", name.lower())


def check_arch(expected: str, actual: str) -> None:
    """mistral.rs's architecture hint against the checkpoint's: a mismatch is logged (the
    checkpoint's is used)."""
    if _family(actual) != _family(str(expected)):
        logger.warning("arch %s was given but the checkpoint is %s; using the checkpoint's", expected, actual)


class LLM:
    """An engine in this process: `LLM("model", **options)` with any engine option by name
    (EngineConfig's fields: `pagedllm.config.engine_options()`, the docs' configuration page),
    or `LLM(config=EngineConfig(...))`. Parallel ranks (tensor_parallel_size,
    pipeline_parallel_size) run as processes that stop with `shutdown()`, `with LLM(...)`, or at
    exit. `runner_cls`: a ModelRunner subclass that runs each step another way (the planning
    benchmark's runner plans every step and skips the forward); None: the ModelRunner."""

    def __init__(
        self, model: str = "default", *, config: EngineConfig | None = None, runner_cls: type | None = None, **options
    ) -> None:
        if config is None:
            config = EngineConfig.from_kwargs(model=model, **options)
        elif options or model != "default":
            raise TypeError("LLM takes config= or the model and options by name, not both")
        else:  # a copy: the engine fills in what it resolves (the task, the ISQ type's name)
            config = copy.deepcopy(config)
            config.verify()
        self.config = config
        load, mm = config.load, config.multimodal
        from .multimodal.media import MediaPolicy

        self.media_policy = MediaPolicy(allowed_local_dir=mm.allowed_local_media_path, timeout_s=mm.media_fetch_timeout)
        self.processor = None
        spec_cfg = SpeculativeConfig.coerce(config.speculative.to_dict())
        if load.isq is not None:
            from .quant.isq import check_isq_type

            load.isq = check_isq_type(load.isq)
        dev = resolve_device(config.device.device)
        dt = resolve_dtype(config.device.dtype, dev)
        source = resolve(load.model, load.tokenizer, load.gguf_file, load.mmproj)
        self.task, self.pooling = _resolve_task(load.task, source)
        load.task = self.task
        from .loading.loader import read_config

        # Again, with "auto" resolved and against the model (its config alone, cheap to read):
        # before the slow load.
        config.verify(read_config(source))
        draft_source = (
            _draft_source(spec_cfg.model, source) if spec_cfg is not None and spec_cfg.method == "draft" else None
        )
        torch.manual_seed(load.seed)
        if config.device.threads:  # (a parallel run splits them among its ranks: _start_executor)
            torch.set_num_threads(config.device.threads)
        self._finalizer = None
        executor = _start_executor(config, source, dt, dev)
        try:
            self._build(source, dt, dev, executor, spec_cfg, draft_source, runner_cls)
        except BaseException:
            if executor is not None:
                executor.shutdown()
            raise
        if executor is not None:  # workers stop with this object, at the latest at exit
            self._finalizer = weakref.finalize(self, executor.shutdown)
        if load.chat_template:
            self.tokenizer.chat_template = read_chat_template(load.chat_template)
            self.tokenizer.chat_template_source = f"--chat-template {load.chat_template}"
        if load.arch:
            check_arch(load.arch, self.engine.model_config.architecture)
        # The engine may run on another thread (the server's, a user's): this one's OpenMP
        # workers would make its parallel regions sleep between steps (native/__init__.py).
        release_omp_threads()

    # help(LLM) and editors list every option as a keyword (they are EngineConfig's fields).
    __init__.__signature__ = inspect.Signature(
        [
            inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD),
            inspect.Parameter("model", inspect.Parameter.POSITIONAL_OR_KEYWORD, default="default"),
            *(
                inspect.Parameter(o.name, inspect.Parameter.KEYWORD_ONLY, default=o.default, annotation=o.type)
                for o in engine_options()
                if o.name != "model"
            ),
            inspect.Parameter("config", inspect.Parameter.KEYWORD_ONLY, default=None),
            inspect.Parameter("runner_cls", inspect.Parameter.KEYWORD_ONLY, default=None),
        ]
    )

    def _build(self, source, dt, dev, executor, spec_cfg, draft_source=None, runner_cls=None) -> None:
        config = self.config
        load = config.load
        loaded = load_model(
            source,
            dt,
            dev,
            max_positions=load.max_model_len,
            dequantize_weights=load.dequantize_weights,
            isq=load.isq,
            headless=self.task == "embed",
            keep_float_head=load.keep_float_head,
            **(executor.load_args() if executor is not None else {}),
        )
        # Rank 0's weights against the per-rank limit (the other ranks check their own as they load).
        par = config.parallel
        check_rank_memory(
            loaded.weight_bytes, par.max_rank_memory_mb, 0, par.pipeline_parallel_size, par.tensor_parallel_size
        )
        if executor is not None:
            executor.wait_loaded()
        max_model_len = load.max_model_len or loaded.config.max_position_embeddings
        sched_cfg = config.scheduler_for(max_model_len)
        if loaded.model.rope.cos.shape[0] < max_model_len:
            raise ValueError("internal: rope table shorter than max_model_len")
        draft = None
        if draft_source is not None:
            draft = _load_draft(draft_source, loaded, dt, dev, max_model_len, load.dequantize_weights, load.isq)
        self.engine = build_engine(
            loaded,
            config.cache,
            sched_cfg,
            dev,
            dt,
            load.seed,
            executor,
            spec_cfg,
            draft,
            max_lora_rank=config.lora.max_lora_rank,
            runner_cls=runner_cls or ModelRunner,
        )
        self.driver = EngineDriver(self.engine)  # every face drives the engine through it
        self.tokenizer = loaded.tokenizer
        self.model_name = source.short_name
        self.model_path = source.path  # the .gguf file or the model folder (its size for Ollama's /api/tags)
        if loaded.model.vision:
            from .multimodal.processor import ImageProcessor, gguf_processor

            hf = None
            if loaded.mmproj is not None:  # a GGUF model: its processor is made from the files' metadata
                hf = gguf_processor(loaded.mmproj.image_settings(), loaded.tokenizer, loaded.config.vision)
            self.processor = ImageProcessor(
                source.path,
                loaded.model.image_token_id,
                loaded.model.bidirectional_images,
                sched_cfg.limit_images,
                loaded.model.image_layout,
                hf=hf,
            )

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
            raise ValueError(
                "a dict prompt needs 'prompt' (the text) and optionally 'multi_modal_data', "
                "or 'prompt_token_ids' (token ids)"
            )
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

        return [v.tolist() for v in embed_prompts(self.driver, self.embed_ids(list(inputs), prompt_name), self.pooling)]

    def embed_ids(self, inputs: list[Prompt], prompt_name: str | None = None) -> list[list[int]]:
        """The token ids an embedding is computed over (texts tokenized after the prompt)."""
        if self.task != "embed":
            raise ValueError(
                f"{self.model_name} is a generative model; embeddings need an embedding model (task='embed')"
            )
        prefix = self.pooling.prompt(prompt_name)
        return [self.tokenizer.encode(prefix + p) if isinstance(p, str) else list(p) for p in inputs]

    def prompt_logits(self, token_ids: list[int], chunk_size: int | None = None, lora_request=None) -> torch.Tensor:
        """Logits [T, vocab] (float32, CPU) at every position of a token-id prompt, through the
        same KV cache, attention and scheduler as generation, `chunk_size` tokens a step
        (1 = token by token through the decode path; None = max_num_batched_tokens)."""
        return scoring.prompt_logits(self.driver, token_ids, chunk_size, lora_request)

    def score_prompts(
        self, prompts: Seq[list[int]], chunk_size: int | None = 1, top1: list[torch.Tensor] | None = None
    ) -> list[torch.Tensor]:
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
    def generate(
        self,
        prompts: Prompt | Seq[Prompt],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request=None,
    ) -> list[RequestOutput]:
        """`lora_request`: a LoRARequest for every prompt, or a list of one (or None) per prompt."""
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
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

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        lora_request=None,
        **template_kwargs,
    ) -> RequestOutput | list[RequestOutput]:
        """`lora_request` as in `generate` (one for every conversation, or one per conversation);
        other keywords go to the chat template."""
        single = bool(messages) and isinstance(messages[0], dict)
        convs = [messages] if single else messages
        # With a processor, content parts may hold images: the processor's template.
        prompts = [
            render_chat(
                self.tokenizer,
                c,
                processor=self.processor,
                media_policy=self.media_policy,
                add_generation_prompt=add_generation_prompt,
                **template_kwargs,
            )
            for c in convs
        ]
        outs = self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)
        return outs[0] if single else outs

    def stream(self, prompt: Prompt, sampling_params: SamplingParams | None = None) -> Iterator[str]:
        """Yields text deltas of one completion as they are produced (whole UTF-8 characters)."""
        [rid] = self.driver.add([Item(None, prompt, sampling_params)])
        with closing(self.driver.stream([rid])) as outs:  # leaving early aborts the request
            for out in outs:
                if out.outputs[0].delta_text:
                    yield out.outputs[0].delta_text
