"""What a request is checked against as it arrives (LLMEngine.add_request): the model (its
vocabulary, head, images, adapters), the context length and the KV cache's room. Every check
raises ValueError with what was wrong and what to do, before anything is scheduled."""

from __future__ import annotations

from typing import Any

from ..multimodal import MultiModalInput
from ..sampling.params import SamplingParams


class RequestChecks:
    def __init__(self, engine: Any) -> None:
        """`engine`: the LLMEngine whose parts (model, configs, tokenizer, block manager, encoder
        cache, LoRA manager, executor) the checks read."""
        e = engine
        self.model, self.model_config, self.model_name, self.tokenizer = (
            e.model,
            e.model_config,
            e.model_name,
            e.tokenizer,
        )
        self.sched_config, self.cache_config, self.block_manager = e.sched_config, e.cache_config, e.block_manager
        self.encoder_cache, self.lora, self.executor = e.encoder_cache, e.lora, e.executor

    def can_generate(self, lora_request) -> None:
        if lora_request is not None:
            if self.lora is None:
                raise ValueError(
                    f"request names LoRA adapter {lora_request.lora_name!r} but LoRA is not "
                    "enabled: start the engine with enable_lora=True (--enable-lora)"
                )
            self.lora.check(lora_request)
        # (A pipeline's first stage has no head: the last stage's computes the logits.)
        if self.model.lm_head is None and self.executor is None:
            raise ValueError(
                f"{self.model_name} is an embedding model (no LM head): it cannot generate "
                "text; ask it for embeddings (/v1/embeddings, LLM.embed)"
            )

    def prompt_ids(self, prompt, prompt_token_ids: list[int] | None, params: SamplingParams, mm) -> list[int]:
        """The prompt's token ids (the text's, encoded), checked against the model and the cache."""
        if prompt_token_ids is None:
            if isinstance(prompt, str):
                if not prompt:
                    raise ValueError("prompt is empty: give at least one character or token id")
                prompt_token_ids = self.tokenizer.encode(prompt)
            elif prompt is None:
                raise ValueError("no prompt given: pass a string or a list of token ids")
            else:
                prompt_token_ids = list(prompt)
        prompt_token_ids = self.prompt(prompt_token_ids, params)
        if mm is None and self.encoder_cache is not None and self.model.image_token_id in prompt_token_ids:
            raise ValueError(
                f"the prompt holds the image placeholder token ({self.model.image_token_id}) but no "
                "image; send images as image parts (or multi_modal_data), not as their tokens"
            )
        return prompt_token_ids

    def images(self, mm: MultiModalInput) -> MultiModalInput:
        """A prompt with images, checked against what this model and the scheduler can take."""
        if self.encoder_cache is None:
            raise ValueError(
                f"model {self.model_name!r} is text-only ({self.model_config.architecture}); "
                "it takes no images: send text, or serve a vision-language model"
            )
        cfg = self.sched_config
        if len(mm.images) > cfg.limit_images:
            raise ValueError(
                f"{len(mm.images)} images in one prompt but at most {cfg.limit_images} are allowed "
                "(limit_mm_per_prompt)"
            )
        for im in mm.images:
            if im.num_embeds > cfg.encoder_budget:
                raise ValueError(
                    f"an image of {im.num_embeds} tokens does not fit the step's encoder budget of "
                    f"{cfg.encoder_budget} tokens; raise max_num_batched_tokens"
                )
            if mm.bidirectional and im.length > cfg.max_num_batched_tokens:
                raise ValueError(
                    f"an image of {im.length} tokens must be prefilled in one step, over "
                    f"max_num_batched_tokens={cfg.max_num_batched_tokens}; raise it"
                )
        if self.model.mrope and mm.images:  # M-RoPE: the prompt's own positions
            mm.rope_positions, mm.rope_delta = self.model.rope_index(mm)
        return mm

    def prompt(self, ids: list[int], params: SamplingParams) -> list[int]:
        if len(ids) == 0:
            raise ValueError("prompt is empty: give at least one character or token id")
        vocab = self.model_config.vocab_size
        if not all(isinstance(t, int) and 0 <= t < vocab for t in ids):
            bad = next(t for t in ids if not (isinstance(t, int) and 0 <= t < vocab))
            raise ValueError(f"prompt token id {bad!r} is outside the vocabulary [0, {vocab})")
        bad_bias = [t for t in params.logit_bias or () if t >= vocab]
        if bad_bias:
            raise ValueError(f"logit_bias token id {bad_bias[0]} is outside the vocabulary [0, {vocab})")
        max_len = self.sched_config.max_model_len
        if len(ids) >= max_len:
            raise ValueError(
                f"prompt has {len(ids)} tokens but max_model_len is {max_len}: it leaves no room "
                f"to generate; shorten the prompt or raise max_model_len"
            )
        need = min(len(ids) + params.max_tokens, max_len)
        blocks = self.block_manager.max_blocks(need, self.sched_config.max_num_batched_tokens)
        usable = self.block_manager.num_usable_blocks
        if blocks * params.n > usable:
            raise ValueError(
                f"request needs {need} tokens of KV cache ({blocks * params.n} blocks for n={params.n}) "
                f"but the cache holds {usable} blocks of {self.cache_config.block_size} tokens; "
                "lower max_tokens or give the KV cache more memory"
            )
        return list(ids)
