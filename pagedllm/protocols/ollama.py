"""Ollama's API (/api/chat, /api/generate, /api/embed, /api/show ...): its requests through the
neutral chat seam (common/chat.py) and the FIM layout (fim.py), its answers as Ollama's
objects, streamed as NDJSON lines.

`options` map to SamplingParams by Ollama's names; `format` ("json" or a JSON schema) is
structured output; tool calls come back with `arguments` as objects. A reasoning model's
thinking (split by protocols/reasoning.py, through common/chat.py's `reasoning_of`) comes back
as `thinking`, and `think` switches it on or off where the template allows. Models are chosen
when the server starts, so /api/pull, /api/create and /api/delete are refused.
"""

from __future__ import annotations

import json
import time
from datetime import datetime, timezone
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from ..engine.driver import Item
from ..outputs import RequestOutput
from ..sampling.params import SamplingParams, SamplingParamsError
from . import fim
from .common import chat as neutral
from .common.call import Call
from .common.context import ServingContext, new_id
from .common.errors import ApiError

MODEL_MANAGEMENT = (
    "models are chosen when pagedllm starts (`pagedllm serve MODEL`); this server "
    "cannot {what} models: restart it with the model you want"
)
# What /api/version reports: the Ollama release whose API this server follows (clients such as
# Codex's --oss mode compare it against the release they need), not pagedllm's own version.
OLLAMA_API_VERSION = "0.13.4"
THINK_LEVELS = ("low", "medium", "high")  # `think` as a string (gpt-oss's reasoning effort)


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    options: dict[str, Any] | None = None
    format: str | dict | None = None
    stream: bool = True
    keep_alive: str | int | float | None = None  # accepted: the model stays loaded while serving
    think: bool | str | None = None


class OllamaMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str = ""
    images: list[str] | None = None
    tool_calls: list[dict] | None = None
    tool_name: str | None = None
    thinking: str | None = None


class ChatRequest(_Body):
    messages: list[OllamaMessage] = Field(default_factory=list)
    tools: list[dict] | None = None


class GenerateRequest(_Body):
    prompt: str = ""
    suffix: str | None = None
    system: str | None = None
    raw: bool = False
    images: list[str] | None = None


class EmbedRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    input: str | list[str] = ""
    truncate: bool = True
    dimensions: int | None = None
    options: dict[str, Any] | None = None
    keep_alive: str | int | float | None = None


class PullRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    name: str | None = None  # older clients' spelling
    stream: bool = True
    insecure: bool = False


def pull_lines(req: PullRequest) -> list[dict]:
    """/api/pull of a model this server already serves: nothing to download, so the progress
    Ollama streams is its first and last line."""
    return [{"status": "pulling manifest"}, {"status": "success"}] if req.stream else [{"status": "success"}]


class ShowRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    name: str | None = None  # older clients' spelling


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


# -- requests to engine inputs --------------------------------------------------------------------


def sampling_params(body: _Body, ctx: ServingContext, n_prompt: int, structured: Any) -> SamplingParams:
    """Ollama's `options` (its names) as sampling parameters; unknown options (num_ctx, num_gpu,
    mirostat ...) are accepted and have no effect here. `num_predict` past the context's room
    is served up to that room (done_reason "length"), as Ollama does."""
    o = body.options or {}
    num_predict = o.get("num_predict")
    max_tokens = num_predict if isinstance(num_predict, int) and num_predict > 0 else None
    try:
        return SamplingParams(
            max_tokens=ctx.capped_max_tokens(n_prompt, max_tokens),
            temperature=float(o.get("temperature", 0.8)),
            top_k=int(o.get("top_k", 40)) or -1,
            top_p=float(o.get("top_p", 0.9)),
            min_p=float(o.get("min_p", 0.0)),
            repetition_penalty=float(o.get("repeat_penalty", 1.0)),
            presence_penalty=float(o.get("presence_penalty", 0.0)),
            frequency_penalty=float(o.get("frequency_penalty", 0.0)),
            seed=o.get("seed"),
            stop=o.get("stop"),
            structured=structured,
        )
    except (SamplingParamsError, TypeError, ValueError) as e:
        raise ApiError(f"invalid options: {getattr(e, 'message', e)}", param="options") from None


def structured_format(fmt: str | dict | None) -> Any:
    """`format`: "json" (any JSON object) or a JSON schema, as OpenAI's response_format."""
    if fmt in (None, ""):
        return None
    if fmt == "json":
        return neutral.structured_spec({"type": "json_object"}, {})
    if isinstance(fmt, dict):
        return neutral.structured_spec({"type": "json_schema", "json_schema": {"name": "format", "schema": fmt}}, {})
    raise ApiError(f'format {fmt!r} is not supported: use "json" or a JSON schema', param="format")


def _neutral_messages(req: ChatRequest) -> list[dict]:
    if not req.messages:
        raise ApiError("messages must hold at least one message", param="messages")
    out: list[dict] = []
    for i, m in enumerate(req.messages):
        if m.role not in ("system", "user", "assistant", "tool"):
            raise ApiError(f"unknown role {m.role!r}; use system, user, assistant or tool", param=f"messages.{i}.role")
        if m.images:
            raise ApiError("images are not supported on /api/chat yet", param=f"messages.{i}.images")
        msg: dict[str, Any] = {"role": m.role, "content": m.content}
        if m.thinking and m.role == "assistant":  # templates with reasoning write it back
            msg["reasoning_content"] = m.thinking
        if m.tool_calls:
            msg["tool_calls"] = [
                {
                    "id": f"call_{i}_{j}",
                    "type": "function",
                    "function": {
                        "name": c.get("function", {}).get("name"),
                        "arguments": json.dumps(c.get("function", {}).get("arguments") or {}),
                    },
                }
                for j, c in enumerate(m.tool_calls)
            ]
        if m.role == "tool":
            msg["tool_call_id"] = _answered_call(out, m.tool_name)
            if m.tool_name:
                msg["name"] = m.tool_name
        out.append(msg)
    return out


def think_kwargs(think: bool | str | None) -> dict:
    """Ollama's `think` as the chat template's switch (Qwen3's enable_thinking; a level also as
    gpt-oss's reasoning_effort); a template without one ignores it, and no `think` leaves the
    template's default."""
    if think is None:
        return {}
    if isinstance(think, bool):
        return {"enable_thinking": think}
    if think in THINK_LEVELS:
        return {"enable_thinking": True, "reasoning_effort": think}
    raise ApiError(
        f"think {think!r} is not supported: use true, false, or one of {', '.join(THINK_LEVELS)}", param="think"
    )


def _answered_call(messages: list[dict], name: str | None) -> str:
    """Ollama's tool messages name the tool, not the call: the latest call of that tool (or the
    latest call at all) is the one answered."""
    for m in reversed(messages):
        for c in reversed(m.get("tool_calls") or []):
            if name is None or c["function"]["name"] == name:
                return c["id"]
    return "call_0"


def _tool_dicts(calls: list, as_objects: bool = True) -> list[dict]:
    out = []
    for c in calls:
        try:
            args = json.loads(c.arguments) if as_objects else c.arguments
        except json.JSONDecodeError:
            args = c.arguments
        out.append({"function": {"name": c.name, "arguments": args}})
    return out


# -- answers --------------------------------------------------------------------------------------


def timings(final: RequestOutput) -> dict:
    """Ollama's final-line counts and nanosecond durations."""
    m = final.metrics
    end = m.finished_time or time.time()
    first = m.first_token_time or end
    ns = 1_000_000_000
    return {
        "total_duration": int(max(0.0, end - m.arrival_time) * ns),
        "load_duration": 0,
        "prompt_eval_count": m.num_prompt_tokens,
        "prompt_eval_duration": int(max(0.0, first - m.arrival_time) * ns),
        "eval_count": len(final.outputs[0].token_ids),
        "eval_duration": int(max(0.0, end - first) * ns),
    }


def done_reason(reason: str | None) -> str:
    return "length" if reason == "length" else "stop"


class NDJSONStreamer:
    """Ollama's stream: one JSON line per delta, then the final line with `done` and timings.
    Thinking streams as it comes; tool calls go out whole on the final line (Ollama's own
    server sends them in one chunk), so the content of an answer that may hold them is held
    back until then."""

    def __init__(self, model: str, chat: bool, plan: Any, reasoning: neutral.Reasoning | None = None) -> None:
        self.model, self.chat, self.plan = model, chat, plan
        self.splitter = reasoning.splitter() if reasoning is not None else None
        self.text = ""

    media_type = "application/x-ndjson"

    def start(self) -> list[str]:
        return []

    def end(self, finals: list[RequestOutput]) -> list[str]:
        return []  # the done line went with the last output

    def error(self, exc: Exception) -> list[str]:
        return [self._line({"error": str(exc)})]

    def keepalive(self) -> list[str]:
        return []  # every NDJSON line is a chunk to Ollama's clients: none is sent

    def _line(self, obj: dict) -> str:
        return json.dumps(obj, ensure_ascii=False) + "\n"

    def _piece(self, text: str, calls: list | None = None, thought: str | None = None) -> dict:
        if not self.chat:
            return {"response": text, **({"thinking": thought} if thought else {})}
        msg: dict[str, Any] = {"role": "assistant", "content": text}
        if thought:
            msg["thinking"] = thought
        if calls:
            msg["tool_calls"] = _tool_dicts(calls)
        return {"message": msg}

    def events(self, out: RequestOutput) -> list[str]:
        c = out.outputs[0]
        thought, text = "", c.delta_text
        if self.splitter is not None:
            thought, text = self.splitter.feed(text)
            if c.finish_reason is not None:
                more_thought, more_text = self.splitter.finish()
                thought, text = thought + more_thought, text + more_text
        if self.plan is not None and self.plan.parses:
            self.text += text  # held back: the whole answer is parsed for calls at the end
            text = ""
        lines = []
        if text or thought:
            lines.append(
                self._line(
                    {"model": self.model, "created_at": now_iso(), **self._piece(text, thought=thought), "done": False}
                )
            )
        if c.finish_reason is not None:
            text, calls = "", []
            if self.plan is not None and self.plan.parses:
                content, calls = neutral.parse_answer(self.text, self.plan)
                text = content or ""
            lines.append(
                self._line(
                    {
                        "model": self.model,
                        "created_at": now_iso(),
                        **self._piece(text, calls),
                        "done": True,
                        "done_reason": done_reason(c.finish_reason),
                        **timings(out),
                    }
                )
            )
        return lines


def _answer(
    model: str, final: RequestOutput, chat: bool, plan: Any, reasoning: neutral.Reasoning | None = None
) -> dict:
    c = final.outputs[0]
    streamer = NDJSONStreamer(model, chat, plan)
    thought, text = reasoning.split(c.text) if reasoning is not None else (None, c.text)
    content, calls = neutral.parse_answer(text, plan)
    return {
        "model": model,
        "created_at": now_iso(),
        **streamer._piece(content or "", calls, thought),
        "done": True,
        "done_reason": done_reason(c.finish_reason),
        **timings(final),
    }


def _call(
    ctx: ServingContext, body: _Body, prompt: Any, structured: Any, plan: Any, chat: bool, templated: bool
) -> Call:
    """`templated`: the prompt came through the chat template, so the answer may begin with the
    template's reasoning (the answer to a raw or fill-in-the-middle prompt is never split)."""
    params = sampling_params(body, ctx, neutral.prompt_len(prompt), structured)
    neutral.constrain_to_tools(params, plan)
    rid = new_id("ollama")
    reasoning = neutral.reasoning_of(ctx, prompt) if templated else None
    return Call(
        rid,
        [Item(rid, prompt, params)],
        body.stream,
        neutral.grammar_param(plan, "format"),
        NDJSONStreamer(ctx.model_name, chat, plan, reasoning),
        lambda finals: _answer(ctx.model_name, finals[0], chat, plan, reasoning),
    )


def chat_call(req: ChatRequest, ctx: ServingContext) -> Call:
    """/api/chat: the messages through the model's chat template, tools through the tool plan."""
    tools = [t if "type" in t else {"type": "function", "function": t} for t in req.tools or []]
    plan = neutral.tool_plan(ctx, tools or None, "auto" if tools else None, None)
    prompt = neutral.chat_prompt(ctx, _neutral_messages(req), plan, **think_kwargs(req.think))
    return _call(ctx, req, prompt, structured_format(req.format), plan, chat=True, templated=True)


def generate_call(req: GenerateRequest, ctx: ServingContext) -> Call:
    """/api/generate: with `suffix`, fill-in-the-middle (fim.py); `raw`, the prompt as given;
    otherwise the prompt (and `system`) as one user turn of the chat template."""
    if req.images:
        raise ApiError("images are not supported on /api/generate yet", param="images")
    templated = False
    if req.suffix is not None:
        prompt = fim.infill_ids(ctx, req.prompt, req.suffix)
    elif req.raw or getattr(ctx.tokenizer, "chat_template", None) is None:
        if not req.prompt:
            raise ApiError("prompt is empty", param="prompt")
        prompt = ctx.tokenizer.encode(req.prompt)
    else:
        messages = [{"role": "system", "content": req.system}] if req.system else []
        prompt = neutral.chat_prompt(
            ctx, [*messages, {"role": "user", "content": req.prompt}], None, **think_kwargs(req.think)
        )
        templated = True
    return _call(ctx, req, prompt, structured_format(req.format), None, chat=False, templated=templated)


# -- the model's description ----------------------------------------------------------------------


def capabilities(ctx: ServingContext, task: str) -> list[str]:
    """What /api/show lists: completion, tools (the chat template takes tools), vision,
    insert (the vocabulary has FIM tokens), embedding."""
    if task == "embed":
        return ["embedding"]
    caps = ["completion"]
    template = getattr(ctx.tokenizer, "chat_template", None) or ""
    if "tools" in template:
        caps.append("tools")
    if ctx.processor is not None:
        caps.append("vision")
    if fim.fim_tokens(ctx.tokenizer) is not None:
        caps.append("insert")
    return caps


def model_entry(name: str, ctx: ServingContext, family: str, size: int, modified: str) -> dict:
    """One model of /api/tags and /api/ps."""
    details = {
        "parent_model": "",
        "format": "gguf",
        "family": family,
        "families": [family],
        "parameter_size": "",
        "quantization_level": "",
    }
    return {"name": name, "model": name, "modified_at": modified, "size": size, "digest": "", "details": details}


def show(ctx: ServingContext, family: str, task: str, modified: str) -> dict:
    return {
        "modelfile": "",
        "parameters": "",
        "template": getattr(ctx.tokenizer, "chat_template", None) or "",
        "details": {
            "parent_model": "",
            "format": "gguf",
            "family": family,
            "families": [family],
            "parameter_size": "",
            "quantization_level": "",
        },
        "model_info": {"general.architecture": family, f"{family}.context_length": ctx.max_model_len},
        "capabilities": capabilities(ctx, task),
        "modified_at": modified,
    }
