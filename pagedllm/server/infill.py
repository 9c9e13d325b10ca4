"""POST /infill: llama.cpp's fill-in-the-middle route, a thin face over protocols/fim.py and the
text-completion call (so it samples exactly as /v1/completions with `suffix`), answered whole
or streamed as llama.cpp streams it."""

from __future__ import annotations

import dataclasses

from fastapi import FastAPI, Request
from fastapi.responses import Response

from ..protocols import fim
from ..protocols.openai.calls import completion_call
from .generation import Generation
from .routes import Served, document_bodies


def install(app: FastAPI, s: Served, gen: Generation) -> None:
    @app.post("/infill")
    async def infill(request: Request) -> Response:
        req: fim.InfillRequest = await s.read_request(request, fim.InfillRequest)
        creq = await s.run(fim.completion_request, req, s.ctx)
        call = await s.run(completion_call, creq, s.ctx, s.token_text)
        completion = call.respond
        call = dataclasses.replace(
            call,
            stream=req.stream,
            framing=fim.InfillStreamer(s.ctx.model_name),
            respond=lambda finals: fim.infill_response(completion(finals)),
        )
        return await gen.answer(call, request)

    document_bodies(app, {"/infill": fim.InfillRequest})
