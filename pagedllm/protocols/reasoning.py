"""Reasoning output: the text a reasoning model writes between its template's thinking markers
(Qwen3's and DeepSeek-R1's `<think>`...`</think>`), split from the answer.

The markers are read from the model's own chat template, never assumed for one family: a
template that has reasoning puts the reasoning back between a tag pair when it renders a past
turn (`'<think>\\n' + reasoning_content + ...`) or cuts it off with `.split('</think>')`. A
template without such a pair has no reasoning, and its answers pass through untouched.

Every dialect shares the split: OpenAI chat's `reasoning_content`, Anthropic's thinking
blocks, Ollama's `thinking`."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

# A closing tag the template cuts a past answer at, or writes reasoning_content before.
_SPLIT_AT = re.compile(r"""split\(\s*['"]</([A-Za-z_][\w-]*)>['"]""")
_CLOSE = re.compile(r"</([A-Za-z_][\w-]*)>")


@dataclass(frozen=True)
class ReasoningMarkers:
    start: str  # e.g. "<think>"
    end: str  # e.g. "</think>"


def markers_of(tokenizer: Any) -> ReasoningMarkers | None:
    """The thinking markers in the tokenizer's chat template; None when it has none."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # several named templates: the default one
        template = template.get("default")
    if not isinstance(template, str):
        return None
    names = _SPLIT_AT.findall(template)
    if not names and "reasoning_content" in template:
        # the tag the template writes reasoning_content inside
        names = [n for n in _CLOSE.findall(template) if f"<{n}>" in template]
    for name in names:
        if f"<{name}>" in template or f"'<{name}>" in template:
            return ReasoningMarkers(f"<{name}>", f"</{name}>")
    return None


def starts_inside(markers: ReasoningMarkers | None, prompt_text: str) -> bool:
    """Whether the answer begins inside the reasoning: the prompt's generation prompt opened the
    start marker and did not close it (DeepSeek-R1's template ends with `<think>\\n`)."""
    if markers is None:
        return False
    return prompt_text.rfind(markers.start) > prompt_text.rfind(markers.end)


def split(text: str, markers: ReasoningMarkers | None, inside: bool = False) -> tuple[str | None, str]:
    """(reasoning, content) of a whole answer; reasoning None when the answer has none. An
    answer cut off before its end marker is all reasoning."""
    if markers is None:
        return None, text
    s = ReasoningSplitter(markers, inside)
    r1, c1 = s.feed(text)
    r2, c2 = s.finish()
    return (r1 + r2 if s.seen else None), c1 + c2


class ReasoningSplitter:
    """Splits a streamed answer into reasoning and content deltas. A delta that may be the
    beginning of a marker is held back until the next one tells."""

    def __init__(self, markers: ReasoningMarkers, inside: bool = False) -> None:
        self.markers = markers
        self.state = "reasoning" if inside else "start"  # start -> reasoning -> content
        self.seen = inside  # any reasoning at all (an opened marker)
        self.held = ""

    def feed(self, delta: str) -> tuple[str, str]:
        """(reasoning, content) of this delta."""
        text, self.held = self.held + delta, ""
        reasoning = content = ""
        while text:
            if self.state == "content":
                return reasoning, content + text
            if self.state == "start":
                stripped = text.lstrip()
                if stripped.startswith(self.markers.start):
                    self.state, self.seen = "reasoning", True
                    text = stripped[len(self.markers.start) :]
                    continue
                if not stripped or self.markers.start.startswith(stripped):
                    self.held = text  # may still become the marker
                    return reasoning, content
                self.state = "content"
                continue
            # inside the reasoning: up to the end marker
            at = text.find(self.markers.end)
            if at >= 0:
                reasoning += text[:at]
                text = text[at + len(self.markers.end) :]
                self.state = "content"
                continue
            keep = _partial_suffix(text, self.markers.end)
            reasoning += text[: len(text) - keep]
            self.held = text[len(text) - keep :]
            return reasoning, content
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """What was held back, once the answer has ended."""
        held, self.held = self.held, ""
        if self.state == "reasoning":
            return held, ""
        return "", held


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of `text` that begins `marker`."""
    for k in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0
