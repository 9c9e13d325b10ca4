"""POST /infill: llama.cpp's fill-in-the-middle route, a thin face over protocols/fim.py and the
text-completion call (so it samples exactly as /v1/completions with `suffix`), answered whole
or streamed as llama.cpp streams it."""
from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from ..protocols import fim
from ..protocols.openai.calls import completion_call
from .generation import Generation, collect_or_fail
from .routes import Served, document_bodies
from .sse import SSEResponse, stream_lines


def install(app: FastAPI, s: Served, gen: Generation) -> None:
    @app.post("/infill")
    async def infill(request: Request) -> Response:
        req: fim.InfillRequest = await s.read_body(request, fim.InfillRequest)
        s.check_model(req.model)
        creq = await s.run(fim.completion_request, req, s.ctx)
        call = await s.run(completion_call, creq, s.ctx, s.token_text)
        sub = await gen.submit(call.items, request, call.grammar_param)
        if req.stream:
            streamer = fim.InfillStreamer(s.ctx.model_name)
            return SSEResponse(stream_lines(sub, [], streamer.events, list, streamer.error), sub.abort_unfinished)
        finals = await collect_or_fail(sub, request)
        if finals is None:
            return Response(status_code=499)
        return JSONResponse(fim.infill_response(call.response(finals)))

    document_bodies(app, {"/infill": fim.InfillRequest})
