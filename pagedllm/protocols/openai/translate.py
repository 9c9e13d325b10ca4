"""OpenAI's requests to engine inputs: checks, sampling parameters, chat messages to the
neutral chat seam (pagedllm/protocols/common/chat.py), text-completion prompts.

Nothing here touches the engine itself, so it is safe to call from any thread; prompts are
tokenized here (off the engine thread), once."""

from __future__ import annotations

from typing import Any

from ...sampling.params import SamplingParams, SamplingParamsError
from ...structured import tools as tool_api
from ..common import chat as neutral
from ..common.context import ServingContext
from ..common.errors import ApiError
from .. import fim
from .models import ChatCompletionRequest, ChatMessage, CompletionRequest

MAX_STOP_STRINGS = 16
CHAT_ROLES = {"system", "user", "assistant", "tool", "developer"}


def _common_checks(req: ChatCompletionRequest | CompletionRequest, ctx: ServingContext, count: int) -> None:
    if req.n * count > ctx.max_n:
        what = f"n={req.n}" if count == 1 else f"n={req.n} x {count} prompts"
        raise ApiError(
            f"{what} asks for {req.n * count} completions; this server allows at most {ctx.max_n} per request",
            param="n",
        )
    for k in req.logit_bias or {}:
        tid = int(k) if k.strip().lstrip("-").isdigit() else None
        if tid is None or tid < 0 or (ctx.vocab_size is not None and tid >= ctx.vocab_size):
            where = f"[0, {ctx.vocab_size})" if ctx.vocab_size else "the vocabulary"
            raise ApiError(
                f"logit_bias key {k!r} is not a token id in {where}; keys are token ids "
                'as strings, e.g. {"50256": -100}',
                param="logit_bias",
            )
    if req.stream_options is not None and not req.stream:
        raise ApiError("stream_options is only allowed when stream is true", param="stream_options")
    stops = [req.stop] if isinstance(req.stop, str) else (req.stop or [])
    if len(stops) > MAX_STOP_STRINGS:
        raise ApiError(f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(stops)}", param="stop")
    if any(not s for s in stops):
        raise ApiError("stop strings must be non-empty", param="stop")


def structured_outputs(req: ChatCompletionRequest | CompletionRequest):
    rf = req.response_format.model_dump() if req.response_format is not None else None
    extra = dict(req.model_extra or {})
    extra["structured_outputs"] = req.structured_outputs
    return neutral.structured_spec(rf, extra)


def check_context(ctx: ServingContext, prompt_len: int, max_tokens: int | None, where: str) -> int | None:
    """The max_tokens a request runs with. One the context could hold by itself, but not after
    this prompt, is the client's output budget, not a demand: coding agents send the model's
    whole context or their own default (qwen-code 32,768, opencode 32,000 when it cannot look the
    model up) whatever the prompt, so it is served up to the room the prompt leaves and ends
    with finish_reason "length". One larger than the whole context can never be met: OpenAI's
    refusal (and message), as for a prompt that leaves no room."""
    if max_tokens is None or prompt_len + max_tokens <= ctx.max_model_len:
        return max_tokens
    if max_tokens <= ctx.max_model_len and prompt_len < ctx.max_model_len:
        return ctx.max_model_len - prompt_len
    raise ApiError(
        f"This model's maximum context length is {ctx.max_model_len} tokens. However, "
        f"you requested {prompt_len + max_tokens} tokens ({prompt_len} in the {where}, "
        f"{max_tokens} in the completion). Please reduce the length of the {where} "
        "or completion.",
        param="max_tokens",
        code="context_length_exceeded",
    )


def sampling_params(
    req: ChatCompletionRequest | CompletionRequest,
    ctx: ServingContext,
    prompt_len: int,
    max_tokens: int | None,
    default_max_tokens: int | None,
    logprobs: int | None,
    prompt_logprobs: int | None = None,
) -> SamplingParams:
    if max_tokens is None:
        max_tokens = default_max_tokens or ctx.default_max_tokens(prompt_len, req.n)
    structured = structured_outputs(req)
    top_k = req.top_k if req.top_k is not None else -1
    try:
        return SamplingParams(
            n=req.n,
            max_tokens=max_tokens,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_k=-1 if top_k == 0 else top_k,
            top_p=1.0 if req.top_p is None else req.top_p,
            min_p=req.min_p or 0.0,
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            seed=req.seed,
            stop=req.stop,
            stop_token_ids=list(req.stop_token_ids or []),
            ignore_eos=req.ignore_eos,
            logprobs=logprobs,
            structured=structured,
            prompt_logprobs=prompt_logprobs,
            logit_bias=req.logit_bias,
        )
    except SamplingParamsError as e:
        raise ApiError(e.message, param=e.param) from None


def _message_text(msg: Any, i: int, ctx: ServingContext | None = None) -> str | list[dict]:
    """The message's text; with image parts (a vision-language model), its parts as dicts."""
    content = msg.content
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    images = False
    for j, part in enumerate(content):
        if part.type == "image_url":
            if ctx is None:
                raise ApiError(
                    "image_url parts are taken on /v1/chat/completions only", param=f"messages.{i}.content.{j}"
                )
            if ctx.processor is None:
                raise ApiError(
                    f"model {ctx.model_name!r} is text-only: it takes no images (image_url "
                    "parts); send text, or serve a vision-language model",
                    param=f"messages.{i}.content.{j}",
                )
            images = True
            continue
        if part.type != "text" or part.text is None:
            raise ApiError(
                f"content part type {part.type!r} is not supported: use text or image_url parts",
                param=f"messages.{i}.content.{j}",
            )
    if images:
        return [p.model_dump(exclude_none=True) for p in content]
    for part in content:
        parts.append(part.text)
    return "".join(parts)


def chat_messages(messages: list[ChatMessage], ctx: ServingContext | None = None, strict: bool = True) -> list[dict]:
    """OpenAI chat messages as the neutral messages of the chat seam (`developer` is a system
    message). Without `ctx`, image parts are refused; `strict=False` (/tokenize) lets a tool
    message go without its tool_call_id and passes any message's tool_call_id on."""
    if not messages:
        raise ApiError("messages must hold at least one message", param="messages")
    out = []
    for i, m in enumerate(messages):
        if m.role not in CHAT_ROLES:
            raise ApiError(f"unknown role {m.role!r}; use one of {sorted(CHAT_ROLES)}", param=f"messages.{i}.role")
        msg: dict[str, Any] = {
            "role": "system" if m.role == "developer" else m.role,
            "content": _message_text(m, i, ctx),
        }
        if m.name:
            msg["name"] = m.name
        if m.tool_calls:
            msg["tool_calls"] = m.tool_calls
        if strict and m.role == "tool" and not m.tool_call_id:
            raise ApiError(
                "a tool message needs tool_call_id (the id of the call it answers)", param=f"messages.{i}.tool_call_id"
            )
        if m.tool_call_id and (m.role == "tool" or not strict):
            msg["tool_call_id"] = m.tool_call_id
        out.append(msg)
    return out


def prepare_chat(req: ChatCompletionRequest, ctx: ServingContext) -> tuple[list[int], SamplingParams]:
    ids, params, _ = prepare_chat_plan(req, ctx)
    return ids, params


def prepare_chat_plan(
    req: ChatCompletionRequest, ctx: ServingContext
) -> tuple[list[int] | Any, SamplingParams, tool_api.ToolPlan | None]:
    """The prompt, sampling parameters and tool plan of a chat request (raises ApiError)."""
    _common_checks(req, ctx, 1)
    if req.top_logprobs is not None and not req.logprobs:
        raise ApiError("top_logprobs needs logprobs to be true", param="top_logprobs")
    plan = neutral.tool_plan(ctx, req.tools, req.tool_choice, req.parallel_tool_calls)
    ids = neutral.chat_prompt(
        ctx,
        chat_messages(req.messages, ctx),
        plan,
        **neutral.template_kwargs(req.chat_template_kwargs, "chat_template_kwargs"),
    )
    n_ids = neutral.prompt_len(ids)
    max_tokens = check_context(ctx, n_ids, req.max_completion_tokens or req.max_tokens, "messages")
    lp = (req.top_logprobs or 0) if req.logprobs else None
    params = sampling_params(req, ctx, n_ids, max_tokens, None, lp)
    neutral.constrain_to_tools(params, plan)
    return ids, params, plan


def completion_prompts(req: CompletionRequest) -> list[str | list[int]]:
    p = req.prompt
    if isinstance(p, str):
        return [p]
    if not p:
        raise ApiError("prompt is empty", param="prompt")
    if all(isinstance(x, int) for x in p):
        return [list(p)]
    return list(p)


def prepare_completion(
    req: CompletionRequest, ctx: ServingContext
) -> tuple[list[str | list[int]], list[list[int]], list[SamplingParams]]:
    """The prompts as sent (echo repeats them), their token ids (text tokenized here, once,
    so the engine thread never does) and each one's sampling parameters."""
    prompts = completion_prompts(req)
    _common_checks(req, ctx, len(prompts))
    if req.suffix is not None and (len(prompts) != 1 or not isinstance(prompts[0], str)):
        raise ApiError("suffix (fill-in-the-middle) takes one text prompt, the code before the cursor", param="suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise ApiError("best_of is not supported (other than best_of == n)", param="best_of")
    if req.max_tokens == 0 and not req.echo:
        raise ApiError("max_tokens 0 only makes sense with echo (to score the prompt)", param="max_tokens")
    if req.suffix is None and any(isinstance(p, str) and not p for p in prompts):
        raise ApiError("prompt is empty: give at least one character or token id", param="prompt")
    if req.suffix is not None:  # fill-in-the-middle: the prompt is the code before the cursor
        ids = [fim.infill_ids(ctx, prompts[0], req.suffix)]
    else:
        ids = [list(p) if isinstance(p, list) else ctx.tokenizer.encode(p) for p in prompts]
    limits = [check_context(ctx, len(p), req.max_tokens, "prompt") for p in ids]
    # OpenAI's default of 16 tokens for text completions, so the prompt length is not needed.
    # Echo with logprobs scores the prompt too (how evaluation harnesses get loglikelihoods).
    scored = req.echo and (req.logprobs is not None or req.max_tokens == 0)
    params = [
        sampling_params(req, ctx, 0, limit, 16, req.logprobs, prompt_logprobs=(req.logprobs or 0) if scored else None)
        for limit in limits
    ]
    return prompts, ids, params
