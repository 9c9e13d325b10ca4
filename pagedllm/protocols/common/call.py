"""One request made ready for the engine, in any dialect: what the HTTP face (or the
`Runner`) submits, and what turns the engine's outputs back into the dialect's answer."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ...outputs import RequestOutput
from ...sampling.params import SamplingParams


@dataclass
class Call:
    """A request made ready for the engine, and what turns its engine outputs into the answer.
    The HTTP server and the `Runner` both answer through one, so tool calls, logprobs and usage
    come out the same from both; only the engine driving differs.

    `streamer` builds the stream: `start()` (opening chunks), `update(output)` (chunks for one
    engine output), `events(output, include_usage)` (the same as framed lines) and
    `usage_chunk(finals)`. `items` hold token ids (or a MultiModalInput), never text: prompts
    are tokenized while the request is prepared, off the engine thread."""

    rid: str
    items: list[tuple[str, list[int] | Any, SamplingParams]]  # (engine request id, prompt, params)
    stream: bool
    include_usage: bool  # a last chunk with the usage (OpenAI's stream_options.include_usage)
    grammar_param: str  # the request field blamed when the request's grammar does not compile
    streamer: Any
    respond: Any  # final outputs (in `items` order) -> the whole response
    # vLLM's stream_options.continuous_usage_stats: each chunk carries the usage so far
    continuous_usage: bool = False

    @property
    def request_ids(self) -> list[str]:
        return [it[0] for it in self.items]  # (an item may carry a LoRARequest after its params)

    def response(self, finals: list[RequestOutput]) -> Any:
        return self.respond(finals)

    def usage_chunk(self) -> Any:
        """The streamer's usage chunk builder when the client asked for it, else None."""
        return self.streamer.usage_chunk if self.include_usage else None
