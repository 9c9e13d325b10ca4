"""`pagedllm chat` (and `pagedllm -i ...`): an interactive chat in the terminal.

Tokens are printed as they come; the conversation is kept and re-sent each turn
(the chat template formats it). Ctrl-C stops the current answer, Ctrl-D or /exit
leaves. Works on a terminal and with stdin piped in.
"""

from __future__ import annotations

import sys
from dataclasses import asdict, dataclass, fields
from typing import Any, TextIO

from ..sampling.params import SamplingParams
from ..tokenizer.chat import render_chat

PROMPT = ">>> "

HELP = """commands:
  /help                 this help
  /system MESSAGE       set the system message (and start over)
  /clear                forget the conversation (keeps the system message)
  /image PATH           attach an image (a file, or an http(s) URL) to your next message
                        (vision-language models)
  /trace                KV cache figures: blocks used and free, preemptions
  /settings             show the sampling settings
  /stats                toggle token counts and speed after each answer
  /exit, /quit          leave (Ctrl-D too); Ctrl-C stops an answer
sampling settings, e.g. /temperature 0.7:
  /temperature /top_p /top_k /min_p /max_tokens /seed
  /presence_penalty /frequency_penalty /repetition_penalty"""


class UsageError(ValueError):
    """A /command given the wrong kind of value; the message is its usage line."""


EXAMPLES = {
    "max_tokens": "256",
    "temperature": "0.7",
    "top_p": "0.9",
    "top_k": "40",
    "min_p": "0.05",
    "presence_penalty": "0.5",
    "frequency_penalty": "0.5",
    "repetition_penalty": "1.1",
    "seed": "42",
}


@dataclass
class ChatSettings:
    max_tokens: int = 512
    temperature: float = 0.7
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None

    def sampling_params(self) -> SamplingParams:
        return SamplingParams(**asdict(self))

    def set(self, name: str, value: str) -> None:
        """Set one setting from text; raises ValueError (settings unchanged) if it is invalid."""
        kinds = {f.name: f.type for f in fields(self)}
        if name not in kinds:
            raise ValueError(f"unknown setting {name!r}")
        kind = str(kinds[name])
        try:
            if value.lower() in ("none", "off") and name == "seed":
                parsed: Any = None
            elif "int" in kind:
                parsed = int(value)
            else:
                parsed = float(value)
        except ValueError:
            what = "an integer" if "int" in kind else "a number"
            if name == "seed":
                what += " or 'none'"
            raise UsageError(
                f"usage: /{name} VALUE ({what}, e.g. /{name} {EXAMPLES.get(name, '1')}); now {getattr(self, name)}"
            ) from None
        old = getattr(self, name)
        setattr(self, name, parsed)
        try:
            self.sampling_params()  # validates
        except ValueError:
            setattr(self, name, old)
            raise


def kv_report(llm: Any) -> str:
    """A one-line block summary, then `llm.kv_cache_trace()` in full when the engine has it."""
    eng = llm.engine
    bm, sched = eng.block_manager, eng.scheduler
    lines = [
        f"KV cache: {bm.num_used_blocks} blocks used, {bm.num_free_blocks} free, "
        f"{bm.num_usable_blocks} total ({eng.cache_config.block_size} tokens each); "
        f"running {sched.num_running}, waiting {sched.num_waiting}, "
        f"preemptions {sched.num_preemptions}"
    ]
    lines.append(llm.kv_cache_trace().table())
    return "\n".join(lines)


class ChatSession:
    def __init__(
        self,
        llm: Any,
        settings: ChatSettings | None = None,
        system: str | None = None,
        out: TextIO = sys.stdout,
        inp: TextIO = sys.stdin,
    ) -> None:
        self.llm = llm
        self.settings = settings or ChatSettings()
        self.system = system
        self.messages: list[dict] = []
        self.show_stats = False
        self.images: list = []  # attached with /image, sent with the next message
        self.out, self.inp = out, inp
        self._interactive = inp.isatty()

    def say(self, text: str = "") -> None:
        self.out.write(text + "\n")
        self.out.flush()

    def run(self) -> int:
        if self._interactive:
            try:
                import readline  # noqa: F401  (line editing and history for input())
            except ImportError:
                pass
        self.say(f"chatting with {self.llm.model_name}; /help for commands, /exit to leave")
        while True:
            try:
                line = self._read()
            except EOFError:
                self.say()
                return 0
            except KeyboardInterrupt:
                self.say()
                continue
            line = line.strip()
            if not line:
                continue
            if line.startswith("/"):
                if not self.command(line):
                    return 0
                continue
            self.turn(line)

    def _read(self) -> str:
        if self._interactive and self.inp is sys.stdin:
            return input(PROMPT)
        self.out.write(PROMPT)
        self.out.flush()
        line = self.inp.readline()
        if not line:
            raise EOFError
        return line

    # -- commands -----------------------------------------------------------------------
    def command(self, line: str) -> bool:
        """Run a /command; False means leave."""
        name, _, arg = line[1:].partition(" ")
        name, arg = name.lower(), arg.strip()
        if name in ("exit", "quit", "q"):
            return False
        if name in ("help", "h", "?"):
            self.say(HELP)
        elif name == "system":
            if not arg:
                self.say(f"system message: {self.system!r}" if self.system else "no system message")
            else:
                self.system = arg
                self.messages.clear()
                self.say("system message set; conversation cleared")
        elif name == "clear":
            self.messages.clear()
            self.images.clear()
            self.say("conversation cleared")
        elif name == "image":
            self.attach(arg)
        elif name == "trace":
            self.say(kv_report(self.llm))
        elif name == "settings":
            self.say(", ".join(f"{k}={v}" for k, v in asdict(self.settings).items()))
        elif name == "stats":
            self.show_stats = not self.show_stats
            self.say(f"stats {'on' if self.show_stats else 'off'}")
        elif name in {f.name for f in fields(ChatSettings)}:
            if not arg:
                self.say(f"{name} = {getattr(self.settings, name)}")
            else:
                try:
                    self.settings.set(name, arg)
                    self.say(f"{name} = {getattr(self.settings, name)}")
                except UsageError as e:
                    self.say(str(e))
                except ValueError as e:
                    self.say(f"error: {e}")
        else:
            self.say(f"unknown command /{name}; /help lists them")
        return True

    def attach(self, path: str) -> None:
        """/image PATH: read the image now (so a bad file is said at once), send it with the next message."""
        if not path:
            self.say("usage: /image PATH (a picture file, or an http(s) URL)")
            return
        if self.llm.processor is None:
            self.say(f"error: {self.llm.model_name} is text-only; it takes no images")
            return
        from pathlib import Path

        from ..multimodal.media import MediaPolicy, load_image

        # The terminal's user reads their own files: any local path (the server keeps its limit).
        policy = MediaPolicy(allowed_local_dir=Path("/"), timeout_s=self.llm.media_policy.timeout_s)
        try:
            self.images.append(load_image(path, policy))
        except ValueError as e:
            self.say(f"error: {e}")
            return
        self.say(
            f"image attached ({self.images[-1].size[0]}x{self.images[-1].size[1]}); it goes with your next message"
        )

    # -- one exchange -------------------------------------------------------------------------
    def conversation(self) -> list[dict]:
        head = [{"role": "system", "content": self.system}] if self.system else []
        return head + self.messages

    def turn(self, text: str) -> None:
        if self.images:
            content = [*({"type": "image", "image": im} for im in self.images), {"type": "text", "text": text}]
            self.messages.append({"role": "user", "content": content})
        else:
            self.messages.append({"role": "user", "content": text})
        eng, driver = self.llm.engine, self.llm.driver
        try:
            # A model's processor, where it has one, writes image turns.
            ids = render_chat(self.llm.tokenizer, self.conversation(), processor=self.llm.processor)
            from ..engine.driver import Item

            [rid] = driver.add([Item(None, ids, self.settings.sampling_params())])
        except ValueError as e:
            self.messages.pop()
            self.say(f"error: {e}\n(/clear starts a new conversation)")
            return
        self.images = []
        final, parts = None, []
        try:
            for out in driver.outputs([rid]):
                delta = out.outputs[0].delta_text
                if delta:
                    parts.append(delta)
                    self.out.write(delta)
                    self.out.flush()
                if out.finished:
                    final = out
        except KeyboardInterrupt:
            driver.abort([rid])
            self.say("\n[stopped]")
        else:
            self.say()
        # Keep what was said, even a stopped answer, so the conversation stays coherent.
        self.messages.append({"role": "assistant", "content": "".join(parts)})
        if final is None:
            return
        note = cut_off_note(
            final, eng.sched_config.max_model_len, ("/max_tokens N allows more", "/clear starts a new conversation")
        )
        if note:
            self.say(note)
        if self.show_stats:
            m = final.metrics
            self.say(
                f"[{m.num_prompt_tokens} prompt tokens, {m.num_output_tokens} generated, "
                f"TTFT {m.time_to_first_token or 0:.2f} s, {m.decode_tokens_per_s or 0:.1f} tok/s, "
                f"{final.finish_reason}]"
            )


def cut_off_note(final: Any, max_model_len: int, hints: tuple[str, str]) -> str | None:
    """A line saying that the answer stopped at a length limit, and which, or None.
    `hints`: what raises max_tokens, and what to do about max_model_len."""
    c = final.outputs[0]
    if c.finish_reason != "length":
        return None
    if len(final.prompt_token_ids) + len(c.token_ids) >= max_model_len:
        return f"[cut off: the conversation reached max_model_len ({max_model_len} tokens); {hints[1]}]"
    return f"[cut off at max_tokens ({len(c.token_ids)} tokens); {hints[0]}]"
