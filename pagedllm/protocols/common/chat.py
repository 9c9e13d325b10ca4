"""The dialect-neutral chat seam: neutral messages + tools -> a prompt, a tool plan and the
grammar a forced call runs under.

Every dialect's chat translation (OpenAI chat and Responses today; Anthropic Messages and
Ollama's /api/chat next) turns its request into neutral messages, i.e. dicts with
`role` ("system" | "user" | "assistant" | "tool"), `content` (a string, or OpenAI-style
content parts when it holds images) and, where they apply, `name`, `tool_calls`
(OpenAI's [{"id", "type": "function", "function": {"name", "arguments"}}]) and
`tool_call_id`; and its tools into OpenAI's function-tool dicts with a tool choice
("none" | "auto" | "required" | {"type": "function", "function": {"name"}}). From there
the steps below are the same for all of them: `tool_plan`, then `chat_prompt`, then
sampling parameters (the dialect's own names), then `constrain_to_tools`. Answers are
parsed back with the plan (`structured.tools.parse` / `StreamParser`, fmt `plan.fmt`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jinja2

from ...native import release_omp_threads
from ...sampling.params import SamplingParams
from ...structured import openai as structured_api, tool_parser, tools as tool_api
from ...tokenizer.chat import render_chat
from .. import reasoning
from .context import ServingContext
from .errors import ApiError

_RESERVED_TEMPLATE_KWARGS = {"messages", "tools", "add_generation_prompt", "tokenize", "processor", "media_policy"}


def tool_plan(
    ctx: ServingContext, tools: list[dict] | None, tool_choice: Any, parallel_tool_calls: bool | None
) -> tool_api.ToolPlan | None:
    """The tools' plan (how they are offered to the template, parsed and forced); None without tools."""
    try:
        tags = tool_api.tag_token_ids(ctx.tokenizer) if tools and hasattr(ctx.tokenizer, "backend") else {}
        return tool_api.plan(
            tools, tool_choice, parallel_tool_calls, getattr(ctx.tokenizer, "chat_template", None), tags
        )
    except structured_api.StructuredRequestError as e:
        raise ApiError(str(e), param=e.param) from None


def chat_prompt(
    ctx: ServingContext, messages: list[dict], plan: tool_api.ToolPlan | None = None, **template_kwargs: Any
) -> list[int] | Any:
    """The prompt's token ids for neutral `messages`; a MultiModalInput (pagedllm/multimodal)
    when images are in them, made by the model's processor (its chat template and image
    processing)."""
    if ctx.processor is not None and any(isinstance(m["content"], list) for m in messages):
        if plan is not None:
            raise ApiError("tools with images are not supported yet", param="tools")
        try:
            return render_chat(
                ctx.tokenizer, messages, processor=ctx.processor, media_policy=ctx.media_policy, **template_kwargs
            )
        except (ValueError, jinja2.TemplateError) as e:
            raise ApiError(f"cannot use the messages' images: {e}", param="messages") from None
        finally:  # the image work ran on this request-preparation thread, not the engine's
            release_omp_threads()
    template = getattr(ctx.tokenizer, "chat_template", None)
    messages = tool_api.template_messages(messages, plan, template)
    if plan is not None:
        template_kwargs["tools"] = plan.tools
    try:
        return render_chat(ctx.tokenizer, messages, **template_kwargs)
    except (ValueError, jinja2.TemplateError) as e:
        raise ApiError(f"cannot format the messages with the model's chat template: {e}", param="messages") from None


def template_kwargs(kwargs: dict | None, param: str) -> dict:
    """A request's extra chat-template variables (e.g. {"enable_thinking": False}), checked."""
    kwargs = dict(kwargs or {})
    bad = sorted(_RESERVED_TEMPLATE_KWARGS & kwargs.keys())
    if bad:
        raise ApiError(f"{param} may not set {', '.join(bad)}: the server sets them", param=param)
    return kwargs


@dataclasses.dataclass(frozen=True)
class Reasoning:
    """How a call's answers split into reasoning and content (protocols/reasoning.py)."""

    markers: reasoning.ReasoningMarkers
    inside: bool  # the prompt left the answer inside the reasoning

    def split(self, text: str) -> tuple[str | None, str]:
        return reasoning.split(text, self.markers, self.inside)

    def splitter(self) -> reasoning.ReasoningSplitter:
        return reasoning.ReasoningSplitter(self.markers, self.inside)


def reasoning_of(ctx: ServingContext, prompt: list[int] | Any) -> Reasoning | None:
    """The reasoning split for answers to `prompt`; None when the model's template has none."""
    markers = reasoning.markers_of(ctx.tokenizer)
    if markers is None:
        return None
    ids = prompt if isinstance(prompt, list) else prompt.prompt_token_ids
    tail = ctx.tokenizer.decode(list(ids[-32:]), skip_special_tokens=False)
    return Reasoning(markers, reasoning.starts_inside(markers, tail))


def prompt_len(prompt: list[int] | Any) -> int:
    """Tokens in a prompt from `chat_prompt` (ids, or a MultiModalInput)."""
    return len(prompt) if isinstance(prompt, list) else len(prompt.prompt_token_ids)


def structured_spec(response_format: dict | None, extra: dict) -> Any:
    """The structured-output spec a request asks for (OpenAI's response_format, or vLLM's
    `structured_outputs` and guided_* fields in `extra`); None for free text."""
    try:
        return structured_api.from_request(response_format, extra)
    except structured_api.StructuredRequestError as e:
        raise ApiError(str(e), param=e.param) from None


def constrain_to_tools(params: SamplingParams, plan: tool_api.ToolPlan | None) -> None:
    """A forced call (tool_choice required or named) is constrained by the tools' grammar.
    The request's response format governs text answers, which a forced call does not give
    (vLLM's reading too)."""
    forced = plan.grammar() if plan is not None else None
    if forced is not None:
        params.structured = forced


def grammar_param(plan: tool_api.ToolPlan | None, text_format_param: str) -> str:
    """The request field to blame when the request's grammar does not compile."""
    return "tools" if plan is not None and plan.grammar() else text_format_param


# -- answers: the tool parser (structured/tool_parser.py), called from here only -------------------


def parse_answer(text: str, plan: tool_api.ToolPlan | None) -> tuple[str | None, list[tool_api.ToolCall]]:
    """A whole answer's text and tool calls under `plan`; a forced answer holds nothing but its
    calls (its text is None then)."""
    if plan is None or not plan.parses:
        return text, []
    content, calls = tool_parser.parse(text, plan.fmt)
    if calls and plan.forced:
        return None, calls
    if not calls and plan.mode == "auto":  # a call as bare or fenced JSON naming a request's tool
        calls = tool_parser.bare_json_calls(text, _tool_names(plan))
        if calls:
            return None, calls
    return content, calls


def answer_stream_parser(
    plan: tool_api.ToolPlan | None,
) -> tool_parser.StreamParser | tool_parser.AutoStreamParser | None:
    """A parser that splits a streamed answer into text and tool-call deltas, as `parse_answer`
    splits it whole (under tool_choice=auto, bare or fenced JSON calls too); None when the
    answer holds no calls to parse."""
    if plan is None or not plan.parses:
        return None
    if plan.mode == "auto":
        return tool_parser.AutoStreamParser(plan.fmt, _tool_names(plan))
    return tool_parser.StreamParser(plan.fmt)


def _tool_names(plan: tool_api.ToolPlan) -> list[str]:
    return [t["function"]["name"] for t in plan.tools if "function" in t]
