"""vLLM's /tokenize and /detokenize: their request shapes and answers."""

from __future__ import annotations

import jinja2
from pydantic import BaseModel

from ...tokenizer.chat import render_chat
from ..common.context import ServingContext
from ..common.errors import ApiError
from .models import ChatMessage, Int, _Model
from .translate import chat_messages


class TokenizeRequest(_Model):
    """vLLM's: a `prompt`, or chat `messages` rendered with the model's template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True
    # vLLM's defaults: True for a prompt; False for messages (the template writes them).
    add_special_tokens: bool | None = None
    return_token_strs: bool = False


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class TokenizerInfo(BaseModel):
    """vLLM's GET /tokenizer_info: the served tokenizer's special tokens and chat template, what a
    client that tokenizes through the server (lm-evaluation-harness's remote tokenizer) reads."""

    tokenizer_class: str = "PreTrainedTokenizerFast"
    eos_token: str | None
    bos_token: str | None
    pad_token: str | None
    unk_token: str | None
    add_bos_token: bool
    chat_template: str | None
    model_max_length: int
    vocab_size: int


class DetokenizeRequest(_Model):
    model: str | None = None
    tokens: list[Int]


class DetokenizeResponse(BaseModel):
    prompt: str


def tokenize(req: TokenizeRequest, ctx: ServingContext) -> TokenizeResponse:
    tok = ctx.tokenizer
    if (req.prompt is None) == (req.messages is None):
        raise ApiError("give exactly one of `prompt` (a string) and `messages` (chat messages)", param="prompt")
    if req.messages is not None:
        # The chat route's message checks, without its image parts or tool_call_id demand.
        messages = chat_messages(req.messages, strict=False)
        try:
            text = render_chat(tok, messages, tokenize=False, add_generation_prompt=req.add_generation_prompt)
        except (ValueError, jinja2.TemplateError) as e:
            raise ApiError(
                f"cannot format the messages with the model's chat template: {e}", param="messages"
            ) from None
        ids = tok.encode(text, add_special_tokens=bool(req.add_special_tokens))
    else:
        special = True if req.add_special_tokens is None else req.add_special_tokens
        ids = tok.encode(req.prompt, add_special_tokens=special)
    strs = [tok.id_to_token(t) or "" for t in ids] if req.return_token_strs else None
    return TokenizeResponse(count=len(ids), max_model_len=ctx.max_model_len, tokens=ids, token_strs=strs)


def tokenizer_info(ctx: ServingContext) -> TokenizerInfo:
    tok = ctx.tokenizer
    return TokenizerInfo(
        eos_token=tok.eos_token,
        bos_token=tok.bos_token,
        pad_token=tok.pad_token,
        unk_token=tok.unk_token,
        add_bos_token=tok.add_bos_token,
        chat_template=tok.chat_template,
        model_max_length=ctx.max_model_len,
        vocab_size=len(tok),
    )


def detokenize(req: DetokenizeRequest, ctx: ServingContext) -> DetokenizeResponse:
    vocab = len(ctx.tokenizer)
    bad = next((t for t in req.tokens if not 0 <= t < vocab), None)
    if bad is not None:
        raise ApiError(f"token id {bad} is outside the vocabulary [0, {vocab})", param="tokens")
    return DetokenizeResponse(prompt=ctx.tokenizer.decode(req.tokens, skip_special_tokens=False))
