"""Messages to prompt: the one function every face calls to apply a chat template.

`LLM.chat`, the CLI, the `Runner` and every protocol dialect (through
pagedllm/protocols/common/chat.py, which adds the dialect-neutral checks and the tool
plan) come here, so a template is applied one way: with the model's processor when the
messages hold images, else with the tokenizer's template. It sits beside the tokenizer
because `LLM` (below the protocols) needs it too."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def render_chat(
    tokenizer: Any,
    messages: list[dict],
    *,
    processor: Any = None,
    media_policy: Any = None,
    add_generation_prompt: bool = True,
    tokenize: bool = True,
    **template_kwargs: Any,
) -> Any:
    """The prompt for `messages`: token ids (or the text, with tokenize=False); with a
    `processor` (a vision-language model's, pagedllm/multimodal), its MultiModalInput.
    Raises what the template raises (ValueError, jinja2.TemplateError)."""
    if processor is not None:
        return processor.chat(messages, add_generation_prompt, media_policy, **template_kwargs)
    return tokenizer.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tokenize=tokenize, **template_kwargs
    )


def read_chat_template(path: str) -> str:
    """A chat template from a .jinja file or a JSON file with a "chat_template" key."""
    text = Path(path).expanduser().read_text()
    if path.endswith(".json"):
        data = json.loads(text)
        if not isinstance(data, dict) or not isinstance(data.get("chat_template"), str):
            raise ValueError(f'{path} has no "chat_template" string')
        return data["chat_template"]
    return text
