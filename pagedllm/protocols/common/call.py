"""One request made ready for the engine, in any dialect: what the HTTP face (or the
`Runner`) submits, what frames its stream, and what turns the engine's outputs back into the
dialect's answer."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol

from ...engine.driver import Item
from ...outputs import RequestOutput


class Framing(Protocol):
    """How a dialect writes a streamed answer: its media type, the lines before the first engine
    output (`start`), those of each output (`events`), those after the last (`end`), and those
    that end a stream the engine failed (`error`), and what it sends while no output comes (a
    long prefill) so that a client's idle timeout does not fire (`keepalive`). The server
    writes every dialect's stream through this (server/sse.py's `framed`)."""

    media_type: str

    def start(self) -> list[str]: ...

    def events(self, out: RequestOutput) -> list[str]: ...

    def end(self, finals: list[RequestOutput]) -> list[str]: ...

    def error(self, exc: Exception) -> list[str]: ...

    def keepalive(self) -> list[str]: ...


SSE_KEEPALIVE = ": keep-alive\n\n"  # a server-sent-events comment: read by no client as data


@dataclass
class Call:
    """A request made ready for the engine, and what turns its engine outputs into the answer.
    The HTTP server and the `Runner` both answer through one, so tool calls, logprobs and usage
    come out the same from both; only the engine driving differs.

    `items` hold token ids (or a MultiModalInput), never text: prompts are tokenized while the
    request is prepared, off the engine thread. `framing` writes the HTTP stream; `streamer`,
    where a dialect has one, builds its chunks as objects (OpenAI's, for the `Runner`:
    `start()`, `update(output)`, `usage_chunk(finals)`)."""

    rid: str
    items: list[Item]
    stream: bool
    grammar_param: str  # the request field blamed when the request's grammar does not compile
    framing: Framing
    respond: Callable[[list[RequestOutput]], Any]  # final outputs (in `items` order) -> the answer
    streamer: Any = None
    include_usage: bool = False  # a last chunk with the usage (OpenAI's stream_options.include_usage)

    @property
    def request_ids(self) -> list[str]:
        return [it.request_id for it in self.items]

    def response(self, finals: list[RequestOutput]) -> Any:
        return self.respond(finals)

    def usage_chunk(self) -> Any:
        """The streamer's usage chunk builder when the client asked for it, else None."""
        return self.streamer.usage_chunk if self.include_usage else None
