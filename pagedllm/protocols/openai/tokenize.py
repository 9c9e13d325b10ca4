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


def detokenize(req: DetokenizeRequest, ctx: ServingContext) -> DetokenizeResponse:
    vocab = len(ctx.tokenizer)
    bad = next((t for t in req.tokens if not 0 <= t < vocab), None)
    if bad is not None:
        raise ApiError(f"token id {bad} is outside the vocabulary [0, {vocab})", param="tokens")
    return DetokenizeResponse(prompt=ctx.tokenizer.decode(req.tokens, skip_special_tokens=False))
