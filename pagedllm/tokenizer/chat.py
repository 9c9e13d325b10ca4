"""Messages to prompt: the one function every face calls to apply a chat template.

`LLM.chat`, the CLI, the `Runner` and every protocol dialect (through
pagedllm/protocols/common/chat.py, which adds the dialect-neutral checks and the tool
plan) come here, so a template is applied one way: with the model's processor when the
messages hold images, else with the tokenizer's template. It sits beside the tokenizer
because `LLM` (below the protocols) needs it too."""
from __future__ import annotations

from typing import Any


def render_chat(tokenizer: Any, messages: list[dict], *, processor: Any = None, media_policy: Any = None,
                add_generation_prompt: bool = True, tokenize: bool = True, **template_kwargs: Any) -> Any:
    """The prompt for `messages`: token ids (or the text, with tokenize=False); with a
    `processor` (a vision-language model's, pagedllm/multimodal), its MultiModalInput.
    Raises what the template raises (ValueError, jinja2.TemplateError)."""
    if processor is not None:
        return processor.chat(messages, add_generation_prompt, media_policy, **template_kwargs)
    return tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                         tokenize=tokenize, **template_kwargs)
