"""The small routes clients call beside generation: one model's card, vLLM's /tokenize and
/detokenize, /version, the OpenAPI document; and CORS.

`Served` carries what every route module needs from `create_app` (the model, its serving
context, the engine thread, the request helpers), so the route modules stay out of app.py.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable

import jinja2
from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel
from starlette.middleware.cors import CORSMiddleware

from .._version import __version__
from . import limits
from .protocol import ChatMessage, Int, ModelCard, _Model
from .serving import CHAT_ROLES, ApiError, ServingContext, _message_text


@dataclass
class Served:
    """The app's shared state, as the route modules see it."""

    llm: Any
    ctx: ServingContext
    config: Any  # app.ServerConfig
    names: list[str]  # the model's names; responses carry the first
    engine: Any  # async_engine.AsyncEngine
    token_text: Any  # serving.TokenText
    check_model: Callable[[str | None], None]
    submit: Callable  # async (items, request, grammar_param) -> Submission
    read_body: Callable  # async (request, model) -> a parsed request model
    sse: Callable  # app.SSEResponse: (events, on_close) -> a server-sent events response
    collect: Callable  # async (submission, request) -> final outputs, or None if the client left
    run: Callable  # async (fn, *args): tokenizing and templates off the event loop (limits.WorkPool.run)


# -- /tokenize and /detokenize (vLLM's shapes) -------------------------------------------------


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


def template_messages(messages: list[ChatMessage]) -> list[dict]:
    """Chat messages as the chat template takes them (the checks of /v1/chat/completions)."""
    out = []
    for i, m in enumerate(messages):
        if m.role not in CHAT_ROLES:
            raise ApiError(f"unknown role {m.role!r}; use one of {sorted(CHAT_ROLES)}",
                           param=f"messages.{i}.role")
        msg: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role,
                               "content": _message_text(m, i)}
        for key in ("name", "tool_calls", "tool_call_id"):
            if getattr(m, key):
                msg[key] = getattr(m, key)
        out.append(msg)
    return out


def tokenize(req: TokenizeRequest, ctx: ServingContext) -> TokenizeResponse:
    tok = ctx.tokenizer
    if (req.prompt is None) == (req.messages is None):
        raise ApiError("give exactly one of `prompt` (a string) and `messages` (chat messages)",
                       param="prompt")
    if req.messages is not None:
        if not req.messages:
            raise ApiError("messages must hold at least one message", param="messages")
        try:
            text = tok.apply_chat_template(template_messages(req.messages), tokenize=False,
                                           add_generation_prompt=req.add_generation_prompt)
        except (ValueError, jinja2.TemplateError) as e:
            raise ApiError(f"cannot format the messages with the model's chat template: {e}",
                           param="messages") from None
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


# -- installing ----------------------------------------------------------------------------------


def install(app: FastAPI, s: Served) -> None:
    @app.get("/v1/models/{model_id:path}")
    async def model_card(model_id: str) -> Response:
        s.check_model(model_id)
        return JSONResponse(ModelCard(id=model_id, max_model_len=s.ctx.max_model_len).model_dump())

    @app.post("/tokenize")
    async def tokenize_route(request: Request) -> Response:
        req: TokenizeRequest = await s.read_body(request, TokenizeRequest)
        s.check_model(req.model)
        if req.prompt is not None:
            limits.check_prompt_chars(len(req.prompt), s.ctx.max_model_len, "prompt")
        return JSONResponse((await s.run(tokenize, req, s.ctx)).model_dump())

    @app.post("/detokenize")
    async def detokenize_route(request: Request) -> Response:
        req: DetokenizeRequest = await s.read_body(request, DetokenizeRequest)
        s.check_model(req.model)
        return JSONResponse((await s.run(detokenize, req, s.ctx)).model_dump())

    @app.get("/version")
    async def version() -> Response:
        return JSONResponse({"version": __version__})

    document_bodies(app, {"/tokenize": TokenizeRequest, "/detokenize": DetokenizeRequest})


def document_bodies(app: FastAPI, bodies: dict[str, type[BaseModel]]) -> None:
    """Put request body schemas into /openapi.json for routes that read their body themselves
    (to bound its size and answer OpenAI's error shape); called once per route module."""
    documented: dict[str, type[BaseModel]] = getattr(app.state, "documented_bodies", {})
    documented.update(bodies)
    app.state.documented_bodies = documented

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for path, model in documented.items():
                body = model.model_json_schema(ref_template="#/components/schemas/{model}")
                components.update(body.pop("$defs", {}))
                components[model.__name__] = body
                for op in schema.get("paths", {}).get(path, {}).values():
                    op["requestBody"] = {"required": True, "content": {"application/json": {
                        "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi


def add_cors(app: FastAPI, origins: list[str] | tuple[str, ...]) -> None:
    """Browsers' cross-origin requests from `origins` ("*": any). Added after the API-key check,
    so it wraps it: a preflight (which carries no key) is answered here, and error answers
    carry the CORS headers too, so the page can read them."""
    if origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(origins), allow_methods=["*"],
                           allow_headers=["*"], allow_credentials=False)


def parse_origins(values: list[str] | None) -> tuple[str, ...]:
    """--allowed-origins: space-separated origins, or vLLM's JSON list ('["*"]')."""
    out: list[str] = []
    for v in values or []:
        v = v.strip()
        if v.startswith("["):
            try:
                items = json.loads(v)
            except json.JSONDecodeError as e:
                raise ValueError(f"--allowed-origins {v!r} is not a JSON list: {e}") from None
            if not isinstance(items, list) or not all(isinstance(x, str) for x in items):
                raise ValueError(f"--allowed-origins {v!r} must be a JSON list of strings")
            out += items
        elif v:
            out.append(v)
    return tuple(dict.fromkeys(out))

