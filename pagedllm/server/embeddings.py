"""`POST /v1/embeddings` (OpenAI's shapes) for an embedding model (`--task embed`).

Texts are tokenized after the model's sentence-transformers prompt (`prompt_name`, an
extension, picks one; the folder's default_prompt_name applies otherwise), then prefilled
through the engine (engine/pooling.py). A generative model answers a clear 400.
"""

from __future__ import annotations

import math

import torch.nn.functional as F
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from ..protocols.common.errors import ApiError
from ..protocols.openai.embeddings import MAX_INPUTS, EmbeddingRequest, embedding_inputs, encode_vector
from . import limits
from .async_engine import EngineError
from .routes import Served, document_bodies


def install(app: FastAPI, s: Served) -> None:
    @app.post("/v1/embeddings")
    async def embeddings(request: Request) -> Response:
        req: EmbeddingRequest = await s.read_request(request, EmbeddingRequest)
        vecs, ids = await embed(s, req)
        n_tokens = sum(len(p) for p in ids)
        data = [
            {"object": "embedding", "index": i, "embedding": encode_vector(v, req.encoding_format)}
            for i, v in enumerate(vecs)
        ]
        return JSONResponse(
            {
                "object": "list",
                "data": data,
                "model": s.ctx.model_name,
                "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens},
            }
        )

    document_bodies(app, {"/v1/embeddings": EmbeddingRequest})


async def embed(s: Served, req: EmbeddingRequest) -> tuple[list, list[list[int]]]:
    """The vectors of `req`'s inputs and their token ids (OpenAI's checks; any route's face)."""
    llm = s.llm
    if llm.task != "embed":
        raise ApiError(
            f"the model `{s.ctx.model_name}` is a generative model, not an embedding "
            "model; serve an embedding model (e.g. a Qwen3-Embedding folder) with "
            "`pagedllm serve MODEL --task embed` for embeddings",
            param="model",
            code="model_not_supported",
        )
    inputs = embedding_inputs(req.input)
    if len(inputs) > MAX_INPUTS:
        raise ApiError(f"at most {MAX_INPUTS} inputs per request, got {len(inputs)}", param="input")
    try:
        for text in inputs:
            if isinstance(text, str):
                limits.check_prompt_chars(len(text), s.ctx.max_model_len, "input")
        ids = await s.run(llm.embed_ids, inputs, req.prompt_name)
    except ValueError as e:
        raise ApiError(str(e), param="prompt_name") from None
    for i, p in enumerate(ids):
        if not p:
            raise ApiError(f"input {i} is empty: it has no tokens", param="input")
        if len(p) > s.ctx.max_model_len:
            raise ApiError(
                f"input {i} has {len(p)} tokens, more than this model's maximum context "
                f"length of {s.ctx.max_model_len} tokens; shorten it",
                param="input",
                code="context_length_exceeded",
            )
    try:
        vecs = await s.engine.embed(ids, llm.pooling)
    except ValueError as e:
        raise ApiError(str(e), param="input") from None
    except EngineError as e:
        raise ApiError(str(e), status=503, type="server_error") from None
    hidden = vecs[0].shape[-1]
    if req.dimensions is not None:
        if req.dimensions > hidden:
            raise ApiError(f"dimensions {req.dimensions} is more than the model's {hidden}", param="dimensions")
        # Matryoshka: the leading dimensions, normalised again.
        vecs = [v[: req.dimensions] for v in vecs]
        if llm.pooling.normalize:
            vecs = [F.normalize(v, dim=-1) for v in vecs]
    if any(not math.isfinite(float(v.sum())) for v in vecs):
        raise ApiError(
            "the model produced non-finite embeddings (NaN or inf); check the model file",
            status=500,
            type="server_error",
        )
    return vecs, ids
