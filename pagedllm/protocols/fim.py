"""Fill-in-the-middle: llama.cpp's `/infill` request and `suffix` on OpenAI's /v1/completions,
both laid out as the model was trained and run as a text completion (openai/calls.py).

The FIM tokens come from the model: GGUF's `tokenizer.ggml.fim_*_token_id` metadata where the
file has it, else the spellings the code-model families use, looked up in the vocabulary.
Nothing is assumed of one family; a model without the three tokens is refused with a 400.

Layout (prefix-suffix-middle, as Qwen2.5-Coder's card and llama.cpp's server write it):
    [<|repo_name|>REPO\\n (<|file_sep|>PATH\\nTEXT)* <|file_sep|>FILENAME\\n]
    <|fim_prefix|>PREFIX<|fim_suffix|>SUFFIX<|fim_middle|>
The repo-level block is written only when `input_extra` holds files (the model card's plain
format otherwise). Everything before the cursor comes first, so while a user types, the
other files and the current file's prefix up to the cursor are the same leading tokens from
one request to the next: the prefix cache keeps them, and only the tail is prefilled again.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from ..outputs import RequestOutput
from .common.call import SSE_KEEPALIVE
from .common.context import ServingContext
from .common.errors import ApiError
from .openai.models import CompletionRequest, CompletionResponse

# (prefix, suffix, middle, repo name, file separator) spellings by family; the first family
# whose three FIM tokens are all in the vocabulary is used. Repo and separator are optional.
_SPELLINGS = (
    ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", "<|repo_name|>", "<|file_sep|>"),  # Qwen2.5-Coder, CodeGemma
    ("<fim_prefix>", "<fim_suffix>", "<fim_middle>", "<repo_name>", "<file_sep>"),  # StarCoder(2), SantaCoder
    ("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>", None, None),  # DeepSeek-Coder
    ("▁<PRE>", "▁<SUF>", "▁<MID>", None, None),  # CodeLlama (SentencePiece spelling)
    ("<PRE>", "<SUF>", "<MID>", None, None),
)
GGUF_KEYS = ("pre", "suf", "mid", "rep", "sep")  # tokenizer.ggml.fim_{key}_token_id


@dataclass(frozen=True)
class FimTokens:
    prefix: int
    suffix: int
    middle: int
    repo: int | None = None
    file_sep: int | None = None


def fim_tokens(tokenizer: Any) -> FimTokens | None:
    """The model's FIM token ids; None when it has no FIM tokens."""
    meta = getattr(tokenizer, "fim_token_ids", None) or {}
    if all(meta.get(k) is not None for k in GGUF_KEYS[:3]):
        return FimTokens(meta["pre"], meta["suf"], meta["mid"], meta.get("rep"), meta.get("sep"))
    for spelling in _SPELLINGS:
        ids = [tokenizer.token_to_id(t) if t is not None else None for t in spelling]
        if None not in ids[:3]:
            return FimTokens(*ids)
    return None


class InfillFile(BaseModel):
    model_config = ConfigDict(extra="allow")
    filename: str = ""
    text: str = ""


class InfillRequest(BaseModel):
    """llama.cpp's /infill body: the code around the cursor, other files of the repository,
    and the usual sampling fields (llama.cpp's names, with OpenAI's accepted too)."""

    model_config = ConfigDict(extra="allow")
    model: str | None = None
    input_prefix: str = ""
    input_suffix: str = ""
    input_extra: list[InfillFile] = Field(default_factory=list)
    prompt: str = ""  # text after input_prefix, at the cursor (llama.cpp appends it to the prefix)
    n_predict: int | None = Field(default=None, ge=-1)
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    repeat_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    # Not in llama.cpp's body (it writes these two fixed): the repository's name and the
    # current file's path in the repo-level layout.
    repo_name: str = "myproject"
    filename: str = "filename"


def infill_ids(
    ctx: ServingContext,
    prefix: str,
    suffix: str,
    files: list[InfillFile] = (),
    repo_name: str = "myproject",
    filename: str = "filename",
) -> list[int]:
    """The FIM prompt's token ids (see the module docstring for the layout)."""
    tk = ctx.tokenizer
    fim = fim_tokens(tk)
    if fim is None:
        raise ApiError(
            f"model {ctx.model_name!r} has no fill-in-the-middle tokens (none of "
            "tokenizer.ggml.fim_*_token_id, <|fim_prefix|>, <fim_prefix>, <PRE> ...): serve a "
            "code model trained for infilling, or send a plain completion without suffix",
            param="suffix",
        )

    def enc(text: str) -> list[int]:
        return tk.encode(text, add_special_tokens=False) if text else []

    ids: list[int] = [tk.bos_token_id] if getattr(tk, "add_bos_token", False) else []
    if files:
        if fim.repo is not None:
            ids += [fim.repo, *enc(repo_name + "\n")]
        for f in files:
            if fim.file_sep is not None:
                ids += [fim.file_sep, *enc(f"{f.filename}\n{f.text}")]
            else:  # no separator token: the files as plain text, each under its name
                ids += enc(f"--- {f.filename} ---\n{f.text}\n")
        if fim.file_sep is not None:
            ids += [fim.file_sep, *enc(filename + "\n")]
    return ids + [fim.prefix, *enc(prefix), fim.suffix, *enc(suffix), fim.middle]


def completion_request(req: InfillRequest, ctx: ServingContext) -> CompletionRequest:
    """/infill as a text completion over the FIM prompt's ids."""
    ids = infill_ids(ctx, req.input_prefix + req.prompt, req.input_suffix, req.input_extra, req.repo_name, req.filename)
    max_tokens = req.max_tokens or (req.n_predict if req.n_predict not in (None, -1) else None)
    fields = {
        "prompt": ids,
        "max_tokens": max_tokens or ctx.default_max_tokens(len(ids), 1),
        "temperature": req.temperature,
        "top_k": req.top_k,
        "top_p": req.top_p,
        "min_p": req.min_p,
        "repetition_penalty": req.repeat_penalty,
        "presence_penalty": req.presence_penalty,
        "frequency_penalty": req.frequency_penalty,
        "seed": req.seed,
        "stop": req.stop,
        "stream": req.stream,
    }
    try:
        return CompletionRequest(**{k: v for k, v in fields.items() if v is not None})
    except ValueError as e:
        raise ApiError(f"invalid infill request: {e}") from None


def _ended(text: str, model: str, finish_reason: str | None, n_prompt: int, n_predicted: int) -> dict:
    """llama.cpp's last /infill object: the whole answer's, or a stream's closing event."""
    return {
        "content": text,
        "model": model,
        "stop": True,
        "stop_type": "eos" if finish_reason == "stop" else "limit",
        "tokens_predicted": n_predicted,
        "tokens_evaluated": n_prompt,
        "timings": {"prompt_n": n_prompt, "predicted_n": n_predicted},
    }


def infill_response(resp: CompletionResponse) -> dict:
    """llama.cpp's /infill answer from the completion's."""
    choice = resp.choices[0]
    return _ended(choice.text, resp.model, choice.finish_reason, resp.usage.prompt_tokens, resp.usage.completion_tokens)


def _event(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


class InfillStreamer:
    """llama.cpp's /infill stream (`stream: true`): an event per piece of the answer,
    {"content", "stop": false}, then the closing one with "stop": true and the counts, as
    llama.cpp's server sends them (no [DONE] on its own routes)."""

    media_type = "text/event-stream"

    def __init__(self, model: str) -> None:
        self.model = model

    def start(self) -> list[str]:
        return []

    def end(self, finals: list[RequestOutput]) -> list[str]:
        return []

    def events(self, out: RequestOutput) -> list[str]:
        c = out.outputs[0]
        n_prompt, n = len(out.prompt_token_ids), len(c.token_ids)
        lines = []
        if c.delta_text:
            lines.append(
                _event({"content": c.delta_text, "stop": False, "tokens_predicted": n, "tokens_evaluated": n_prompt})
            )
        if c.finish_reason is not None:
            lines.append(_event(_ended("", self.model, c.finish_reason, n_prompt, n)))
        return lines

    @staticmethod
    def keepalive() -> list[str]:
        return [SSE_KEEPALIVE]

    @staticmethod
    def error(exc: Exception) -> list[str]:
        return [_event({"error": {"code": 500, "message": str(exc), "type": "server_error"}})]
