"""Ollama's API routes (/api/...): thin installers over protocols/ollama.py, run on the engine
like the OpenAI routes; streams are NDJSON lines."""

from __future__ import annotations

import functools
import json
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from ..protocols import ollama
from ..protocols.common.errors import ApiError
from ..protocols.openai.embeddings import EmbeddingRequest
from .embeddings import embed
from .generation import Generation
from .routes import Served, document_bodies


def ollama_errors(handler: Any) -> Any:
    """Ollama's error body, {"error": "..."}, for a refused request (its client reads that)."""

    @functools.wraps(handler)
    async def wrapped(*args: Any, **kwargs: Any) -> Response:
        try:
            return await handler(*args, **kwargs)
        except ApiError as e:
            return JSONResponse({"error": e.message}, status_code=e.status)

    return wrapped


def _family(llm: Any) -> str:
    return llm.engine.model_config.architecture


def install(app: FastAPI, s: Served, gen: Generation, names: list[str]) -> None:
    _install_models(app, s, names)
    _install_generation(app, s, gen)
    _refuse_model_management(app)
    document_bodies(
        app,
        {
            "/api/chat": ollama.ChatRequest,
            "/api/generate": ollama.GenerateRequest,
            "/api/embed": ollama.EmbedRequest,
            "/api/show": ollama.ShowRequest,
            "/api/pull": ollama.PullRequest,
        },
    )


def _install_models(app: FastAPI, s: Served, names: list[str]) -> None:
    """The routes that describe the served model (as Ollama's list, show and pull it)."""
    path = Path(s.llm.model_path)
    size = path.stat().st_size if path.is_file() else 0
    modified = datetime.fromtimestamp(path.stat().st_mtime if path.exists() else 0, timezone.utc).isoformat()
    family, task = _family(s.llm), s.llm.task

    @app.get("/api/version")
    async def version() -> Response:
        return JSONResponse({"version": ollama.OLLAMA_API_VERSION})

    @app.post("/api/pull")
    @ollama_errors
    async def pull(request: Request) -> Response:
        req: ollama.PullRequest = await s.read_body(request, ollama.PullRequest)
        name = req.model or req.name
        try:
            s.check_model(name)
        except ApiError:
            raise ApiError(
                ollama.MODEL_MANAGEMENT.format(what="pull") + f" (asked for {name!r}; "
                f"this server serves {', '.join(names)})",
                status=404,
            ) from None
        lines = ollama.pull_lines(req)
        if not req.stream:
            return JSONResponse(lines[-1])
        return Response("".join(json.dumps(line) + "\n" for line in lines), media_type="application/x-ndjson")

    @app.get("/api/tags")
    async def tags() -> Response:
        return JSONResponse({"models": [ollama.model_entry(n, s.ctx, family, size, modified) for n in names]})

    @app.get("/api/ps")
    async def ps() -> Response:
        return JSONResponse(
            {
                "models": [
                    {
                        **ollama.model_entry(n, s.ctx, family, size, modified),
                        "expires_at": "0001-01-01T00:00:00Z",
                        "size_vram": 0,
                        "context_length": s.ctx.max_model_len,
                    }
                    for n in names
                ]
            }
        )

    @app.post("/api/show")
    @ollama_errors
    async def show(request: Request) -> Response:
        req: ollama.ShowRequest = await s.read_body(request, ollama.ShowRequest)
        s.check_model(req.model or req.name)
        return JSONResponse(ollama.show(s.ctx, family, task, modified))


def _install_generation(app: FastAPI, s: Served, gen: Generation) -> None:
    """Chat, generate and embed, answered through the one serving sequence (server/generation.py)."""

    @app.post("/api/chat")
    @ollama_errors
    async def chat(request: Request) -> Response:
        req: ollama.ChatRequest = await s.read_request(request, ollama.ChatRequest)
        return await gen.answer(await s.run(ollama.chat_call, req, s.ctx), request)

    @app.post("/api/generate")
    @ollama_errors
    async def generate(request: Request) -> Response:
        req: ollama.GenerateRequest = await s.read_request(request, ollama.GenerateRequest)
        if not req.prompt and req.suffix is None:  # Ollama's way to load a model: nothing to do here
            return JSONResponse(
                {
                    "model": s.ctx.model_name,
                    "created_at": ollama.now_iso(),
                    "response": "",
                    "done": True,
                    "done_reason": "load",
                }
            )
        return await gen.answer(await s.run(ollama.generate_call, req, s.ctx), request)

    @app.post("/api/embed")
    @ollama_errors
    async def embed_route(request: Request) -> Response:
        req: ollama.EmbedRequest = await s.read_request(request, ollama.EmbedRequest)
        vecs, ids = await embed(s, EmbeddingRequest(input=req.input, dimensions=req.dimensions))
        return JSONResponse(
            {
                "model": s.ctx.model_name,
                "embeddings": [v.tolist() for v in vecs],
                "prompt_eval_count": sum(len(p) for p in ids),
            }
        )


def _refuse_model_management(app: FastAPI) -> None:
    """Ollama's create, delete, copy and push: this server serves the model it was started with."""
    for route, what in (
        ("/api/create", "create"),
        ("/api/delete", "delete"),
        ("/api/copy", "copy"),
        ("/api/push", "push"),
    ):

        def refuse(what: str = what) -> Any:
            @ollama_errors
            async def handler() -> Response:
                raise ApiError(ollama.MODEL_MANAGEMENT.format(what=what), status=400)

            return handler

        app.add_api_route(route, refuse(), methods=["DELETE"] if what == "delete" else ["POST"])
