"""A coding agent's recorded session (`pagedllm serve --record-requests DIR`), made ready to
replay against any OpenAI-compatible server: each model request rendered to its prompt by
pagedllm's own dialect code (the Anthropic, Responses or chat route's builder, with the served
model's chat template and tools), as token ids and as the text both engines tokenize alike.

Two sessions ship in sessions/: Claude Code's (4 requests: the first turn, 11.7k tokens of
system prompt and tools, and three turns after tool results) and Codex CLI's (2 requests), both
recorded against `pagedllm serve` on Qwen2.5-Coder-1.5B-Instruct Q4_K_M with the instruction
"Change 'a - b' to 'a + b' in calc.py.".
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SESSIONS = Path(__file__).parent / "sessions"
MODEL_ROUTES = ("/v1/messages", "/v1/responses", "/v1/chat/completions")


@dataclass
class Turn:
    """One recorded request: where it went, when (seconds into the session), and its prompt."""

    route: str
    at_s: float
    ids: list[int]
    text: str


def session_folder(name_or_path: str) -> Path:
    """A shipped session by name (`claude-code`, `codex`) or a folder of recorded requests."""
    shipped = SESSIONS / name_or_path
    folder = shipped if shipped.is_dir() else Path(name_or_path)
    if not folder.is_dir() or not any(folder.glob("*.json")):
        names = ", ".join(sorted(p.name for p in SESSIONS.iterdir() if p.is_dir()))
        raise ValueError(
            f"--session {name_or_path!r}: neither a shipped session ({names}) nor a folder of "
            "`pagedllm serve --record-requests` files"
        )
    return folder


def recorded_requests(folder: Path) -> list[dict]:
    """The folder's model requests in the order they came (other routes are left out)."""
    out = []
    for path in sorted(folder.glob("*.json")):
        rec = json.loads(path.read_text(encoding="utf-8"))
        if rec.get("method") == "POST" and rec.get("path", "").split("?")[0] in MODEL_ROUTES:
            out.append(rec)
    if not out:
        raise ValueError(f"{folder} holds no recorded request to {', '.join(MODEL_ROUTES)}")
    return out


def serving_context(tokenizer: Any, max_model_len: int):
    """What the dialects' builders read of a served model, for rendering only."""
    from ..protocols.common.context import ServingContext

    return ServingContext(tokenizer, "replay", max_model_len, 32, max_model_len // 32 + 1, 1, tokenizer.vocab_size)


def prompt_ids(rec: dict, ctx: Any, token_text: Any) -> list[int]:
    """The prompt pagedllm's server builds for recorded request `rec`."""
    from ..protocols.anthropic import messages as anthropic
    from ..protocols.openai.calls import chat_call
    from ..protocols.openai.models import ChatCompletionRequest
    from ..protocols.openai.response_tools import ResponseTools
    from ..protocols.openai.responses import ResponsesRequest, chat_request, input_messages

    route, body = rec["path"].split("?")[0], dict(rec["body"], stream=False)
    if route == "/v1/messages":
        call = anthropic.messages_call(anthropic.MessagesRequest(**body), ctx)
    elif route == "/v1/responses":
        req = ResponsesRequest(**body)
        tools = ResponseTools.of(req.tools)
        call = chat_call(chat_request(req, [], input_messages(req.input, tools), tools), ctx, token_text)
    else:
        call = chat_call(ChatCompletionRequest(**body), ctx, token_text)
    return list(call.items[0].prompt)


def load_turns(session: str, model: str, max_model_len: int) -> tuple[list[Turn], Any]:
    """The session's turns rendered for `model` (a GGUF file: its tokenizer and template only),
    and the tokenizer."""
    from ..loading.gguf.checkpoint import read_gguf
    from ..protocols.common.tokens import TokenText

    tok = read_gguf(model).tokenizer
    ctx, tt = serving_context(tok, max_model_len), TokenText(tok)
    turns = []
    for rec in recorded_requests(session_folder(session)):
        ids = prompt_ids(rec, ctx, tt)
        turns.append(Turn(rec["path"].split("?")[0], float(rec.get("at_s") or 0.0), ids, tok.decode(ids, False)))
    return turns, tok


def shared_prefix(a: list[int], b: list[int]) -> int:
    """How many leading token ids two prompts share."""
    return len(os.path.commonprefix([a, b]))
