"""Anthropic's Messages dialect (POST /v1/messages, /v1/messages/count_tokens): `messages.py`
turns its requests into the neutral chat seam's messages and tools
(pagedllm/protocols/common/chat.py) and frames the answers as Anthropic's content blocks and
stream events. Templating, the tool plan and parser, structured output and the engine call are
the OpenAI path's own, reached through the seam."""
