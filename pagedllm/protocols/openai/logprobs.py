"""OpenAI's logprobs (chat and text-completion shapes) and usage figures from engine outputs."""

from __future__ import annotations

from typing import Any

from ...outputs import RequestOutput
from ..common.tokens import TokenText
from .models import ChatLogprobs, CompletionLogprobs, PromptTokensDetails, TokenLogprob, TopLogprob, Usage


def chat_logprobs(entries: list[dict], tt: TokenText) -> ChatLogprobs:
    content = []
    for e in entries:
        tid = e["token_id"]
        tops = [TopLogprob(token=tt.text(t), logprob=lp, bytes=list(tt.bytes(t))) for t, lp in e["top"]]
        content.append(
            TokenLogprob(token=tt.text(tid), logprob=e["logprob"], bytes=list(tt.bytes(tid)), top_logprobs=tops)
        )
    return ChatLogprobs(content=content)


def echo_texts(prompts: list[str | list[int]], tokenizer: Any) -> list[str]:
    """The prompts as `echo` repeats them: a token-id prompt decoded with its special tokens,
    the same text its logprobs' `tokens` spell."""
    return [p if isinstance(p, str) else tokenizer.decode(p, skip_special_tokens=False) for p in prompts]


def prompt_logprobs(out: RequestOutput, tt: TokenText, text_len: int | None = None) -> CompletionLogprobs:
    """The echoed prompt's tokens and logprobs (None for the first, as OpenAI sends them).
    Offsets never pass `text_len`, the echoed text's length, where the completion's start."""
    lp = CompletionLogprobs()
    offset = 0
    for tid, entry in zip(out.prompt_token_ids, out.prompt_logprobs or []):
        tok = tt.text(tid)
        lp.tokens.append(tok)
        lp.token_logprobs.append(None if entry is None else entry[tid])
        lp.top_logprobs.append(None if entry is None else {tt.text(t): v for t, v in entry.items()})
        lp.text_offset.append(offset if text_len is None else min(offset, text_len))
        offset += len(tok)
    return lp


def join_logprobs(a: CompletionLogprobs, b: CompletionLogprobs) -> CompletionLogprobs:
    return CompletionLogprobs(
        tokens=a.tokens + b.tokens,
        token_logprobs=a.token_logprobs + b.token_logprobs,
        top_logprobs=a.top_logprobs + b.top_logprobs,
        text_offset=a.text_offset + b.text_offset,
    )


def completion_logprobs(entries: list[dict], tt: TokenText, offset: int) -> CompletionLogprobs:
    out = CompletionLogprobs()
    for e in entries:
        tok = tt.text(e["token_id"])
        out.tokens.append(tok)
        out.token_logprobs.append(e["logprob"])
        # The sampled token is always among them, as OpenAI sends it (logprobs 0 included).
        out.top_logprobs.append({tok: e["logprob"], **{tt.text(t): lp for t, lp in e["top"]}})
        out.text_offset.append(offset)
        offset += len(tok)
    return out


# -- usage ---------------------------------------------------------------------------


def usage_from(finals: list[RequestOutput]) -> Usage:
    """Token counts and mistral.rs's timing figures over one or more finished requests."""
    prompt = sum(o.metrics.num_prompt_tokens for o in finals)
    completion = sum(len(c.token_ids) for o in finals for c in o.outputs)
    cached = sum(o.num_cached_tokens for o in finals)
    arrival = min(o.metrics.arrival_time for o in finals)
    firsts = [o.metrics.first_token_time for o in finals if o.metrics.first_token_time is not None]
    ends = [o.metrics.finished_time for o in finals if o.metrics.finished_time is not None]
    end = max(ends) if ends else arrival
    first = max(firsts) if firsts else end
    total = max(0.0, end - arrival)
    prompt_time = max(0.0, first - arrival)
    compl_time = max(0.0, end - first)

    def rate(n: int, t: float) -> float:
        return n / t if t > 0 else 0.0

    return Usage(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
        avg_tok_per_sec=rate(prompt + completion, total),
        avg_prompt_tok_per_sec=rate(prompt, prompt_time),
        avg_compl_tok_per_sec=rate(completion, compl_time),
        total_time_sec=total,
        total_prompt_time_sec=prompt_time,
        total_completion_time_sec=compl_time,
    )
