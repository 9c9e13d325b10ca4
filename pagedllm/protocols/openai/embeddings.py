"""OpenAI's /v1/embeddings shapes: the request, its inputs, and a vector as the client asked."""

from __future__ import annotations

import base64
from typing import Any, Literal

import torch
from pydantic import Field

from ..common.errors import ApiError
from .models import Int, _Model

MAX_INPUTS = 2048  # OpenAI's limit on inputs per request


class EmbeddingRequest(_Model):
    model: str | None = None
    input: str | list[str] | list[Int] | list[list[Int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Int | None = Field(default=None, ge=1)
    user: str | None = None
    prompt_name: str | None = None  # sentence-transformers' prompt (e.g. "query"); an extension


def embedding_inputs(inp: Any) -> list[str | list[int]]:
    if isinstance(inp, str):
        return [inp]
    if not inp:
        raise ApiError("input is empty: give a string, a list of strings or token ids", param="input")
    if all(isinstance(x, int) for x in inp):
        return [list(inp)]
    return list(inp)


def encode_vector(vec: torch.Tensor, fmt: str) -> list[float] | str:
    if fmt == "base64":  # little-endian float32, as OpenAI sends it
        return base64.b64encode(vec.to(torch.float32).numpy().astype("<f4").tobytes()).decode("ascii")
    return vec.tolist()
