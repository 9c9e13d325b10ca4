"""`POST /v1/responses` and `GET /v1/responses/{id}`: the HTTP face of OpenAI's Responses API.

The translation (request to a chat request, chat answer and stream to response objects and
typed events, the `previous_response_id` store) is pagedllm/protocols/openai/responses.py.
"""

from __future__ import annotations

import dataclasses

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from ..protocols.common.errors import ApiError
from ..protocols.openai.calls import chat_call
from ..protocols.openai.responses import (
    DEFAULT_STORE_SIZE,
    ResponseEvents,
    ResponsesRequest,
    ResponseStore,
    ResponseTools,
    new_item_id,
    renamed_error,
    as_messages,
    chat_request,
    finish,
    input_messages,
    output_of,
    skeleton,
    usage_of,
)
from . import limits
from .generation import Generation
from .routes import Served, document_bodies


# -- the route -------------------------------------------------------------------------------


def install(app: FastAPI, s: Served, gen: Generation, store_size: int = DEFAULT_STORE_SIZE) -> None:
    store = ResponseStore(store_size)

    @app.post("/v1/responses")
    async def create_response(request: Request) -> Response:
        req: ResponsesRequest = await s.read_request(request, ResponsesRequest)
        history: list[dict] = []
        if req.previous_response_id is not None:
            prev = store.get(req.previous_response_id)
            if prev is None:
                raise ApiError(
                    f"Previous response with id '{req.previous_response_id}' not found (this "
                    f"server keeps the latest {store.size} responses in memory)",
                    status=404,
                    param="previous_response_id",
                )
            history = prev[0]
        tools = ResponseTools.of(req.tools)
        new = input_messages(req.input, tools)
        chat = chat_request(req, history, new, tools)
        try:
            limits.check_prompt_chars(limits.chat_chars(chat), s.ctx.max_model_len, "input")
            call = await s.run(chat_call, chat, s.ctx, s.token_text)  # the chat route's builder
        except ApiError as e:
            raise renamed_error(e) from None
        rid = new_item_id("resp")
        resp = skeleton(rid, s.ctx.model_name, req)

        def keep(done: dict) -> None:
            if req.store is not False:
                store.put(rid, history + new + as_messages(done["output"], tools), done)

        def respond(finals: list) -> dict:
            chat_resp = call.response(finals)
            output, reason = output_of(chat_resp, tools)
            finish(resp, output, reason, usage_of(chat_resp.usage))
            keep(resp)
            return resp

        answer = dataclasses.replace(
            call,
            framing=ResponseEvents(resp, call.streamer, tools, keep),
            respond=respond,
            grammar_param=call.grammar_param.replace("response_format", "text.format"),
        )
        return await gen.answer(answer, request)

    @app.get("/v1/responses/{response_id}")
    async def retrieve_response(response_id: str) -> Response:
        item = store.get(response_id)
        if item is None:
            raise ApiError(f"Response with id '{response_id}' not found", status=404, param="response_id")
        return JSONResponse(item[1])

    document_bodies(app, {"/v1/responses": ResponsesRequest})
