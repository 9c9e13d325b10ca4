"""The small routes clients call beside generation: one model's card, vLLM's /tokenize and
/detokenize, /version, the OpenAPI document; and CORS.

`Served` carries what every route module needs from `create_app` (the model, its serving
context, the engine thread, the request helpers), so the route modules stay out of app.py.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable

from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel
from starlette.middleware.cors import CORSMiddleware

from .._version import __version__
from ..protocols.anthropic import messages as anthropic_dialect
from ..protocols.common.context import ServingContext
from ..protocols.openai.models import ModelCard
from ..protocols.openai.tokenize import DetokenizeRequest, TokenizeRequest, detokenize, tokenize, tokenizer_info
from . import limits
from .bodies import read_body


@dataclass
class Served:
    """What the route modules beside generation need from `create_app`."""

    llm: Any
    ctx: ServingContext
    engine: Any  # async_engine.AsyncEngine
    token_text: Any  # protocols.common.tokens.TokenText
    check_model: Callable[[str | None], None]  # refuses a name this server does not serve
    run: Callable  # async (fn, *args): tokenizing and templates off the event loop (limits.WorkPool.run)
    max_body_bytes: int

    async def read_body(self, request: Request, model: type[BaseModel]) -> Any:
        """The request's body within the size limit, as `model` (OpenAI's error for a bad field)."""
        return await read_body(request, model, self.max_body_bytes)

    async def read_request(self, request: Request, model: type[BaseModel]) -> Any:
        """`read_body`, for a body that names the model it asks for (refused if not served)."""
        req = await self.read_body(request, model)
        self.check_model(req.model)
        return req


# -- installing ----------------------------------------------------------------------------------


def install(app: FastAPI, s: Served) -> None:
    @app.get("/v1/models/{model_id:path}")
    async def model_card(model_id: str, request: Request) -> Response:
        s.check_model(model_id)
        if anthropic_dialect.wants_anthropic(request.headers):
            return JSONResponse(anthropic_dialect.model_info(model_id, s.ctx.started))
        return JSONResponse(ModelCard(id=model_id, max_model_len=s.ctx.max_model_len).model_dump())

    @app.post("/tokenize")
    async def tokenize_route(request: Request) -> Response:
        req: TokenizeRequest = await s.read_request(request, TokenizeRequest)
        if req.prompt is not None:
            limits.check_prompt_chars(len(req.prompt), s.ctx.max_model_len, "prompt")
        return JSONResponse((await s.run(tokenize, req, s.ctx)).model_dump())

    @app.get("/tokenizer_info")
    async def tokenizer_info_route() -> Response:
        return JSONResponse(tokenizer_info(s.ctx).model_dump())

    @app.post("/detokenize")
    async def detokenize_route(request: Request) -> Response:
        req: DetokenizeRequest = await s.read_request(request, DetokenizeRequest)
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
                    op["requestBody"] = {
                        "required": True,
                        "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}},
                    }
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi


def add_cors(app: FastAPI, origins: list[str] | tuple[str, ...]) -> None:
    """Browsers' cross-origin requests from `origins` ("*": any). Added after the API-key check,
    so it wraps it: a preflight (which carries no key) is answered here, and error answers
    carry the CORS headers too, so the page can read them."""
    if origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(origins),
            allow_methods=["*"],
            allow_headers=["*"],
            allow_credentials=False,
        )


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
