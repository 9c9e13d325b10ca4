"""Tokenizer wrapper around a `tokenizers.Tokenizer`, plus chat templates and streaming detokenization.

The goal is byte-for-byte agreement with transformers' fast tokenizers for the same model: the same
ids from `encode`, the same text from `decode` and the same prompt from `apply_chat_template`.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable, Mapping
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import tokenizers
from tokenizers import processors

from . import template_guard

logger = logging.getLogger(__name__)

_REPLACEMENT_CHAR = "\ufffd"
# How many prompt tokens the detokenizer decodes as context before the first output token, so that
# merges across the prompt/output boundary (a leading space, a split character) come out right.
_PROMPT_CONTEXT_TOKENS = 5
# Older names some chat formats use for a message's reasoning; transformers aliases them the same way.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
# Longer texts are encoded through encode_batch, which releases the GIL (encode holds it: a
# 600,000-character prompt would stop every other thread, the server's event loop included, ~2 s).
_GIL_FREE_CHARS = 8192


class TokenizerLoadError(ValueError):
    """A tokenizer folder is missing a file or holds one that cannot be read."""


class Tokenizer:
    """A `tokenizers.Tokenizer` with the special tokens, BOS policy and chat template of one model.

    The Tokenizer owns `tk`: its post-processor is replaced so that `encode(add_special_tokens=True)` adds
    BOS exactly when `add_bos_token` (and EOS when `add_eos_token`), as transformers does when a model
    states these flags.
    """

    def __init__(
        self,
        tk: tokenizers.Tokenizer,
        *,
        bos_token: str | None,
        eos_token: str | None,
        add_bos_token: bool,
        chat_template: str | None,
        eos_token_ids: Iterable[int] = (),
        pad_token: str | None = None,
        unk_token: str | None = None,
        add_eos_token: bool = False,
        keep_post_processor: bool = False,
        fim_token_ids: dict[str, int | None] | None = None,
    ) -> None:
        self._tk = tk
        # GGUF's tokenizer.ggml.fim_{pre,suf,mid,rep,sep}_token_id, where the file states them
        # (protocols/fim.py falls back to the vocabulary's spellings).
        self.fim_token_ids = dict(fim_token_ids or {})
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.pad_token = pad_token
        self.unk_token = unk_token
        self._compiled_template: Any = None
        self.chat_template = chat_template
        self.bos_token_id = self._id_of(bos_token)
        self.eos_token_id = self._id_of(eos_token)
        self.pad_token_id = self._id_of(pad_token)
        # A flag without its token cannot be honoured; transformers drops it the same way.
        self.add_bos_token = bool(add_bos_token) and self.bos_token_id is not None
        self.add_eos_token = bool(add_eos_token) and self.eos_token_id is not None
        self.eos_token_ids: set[int] = {int(i) for i in eos_token_ids}
        if self.eos_token_id is not None:
            self.eos_token_ids.add(self.eos_token_id)
        if not keep_post_processor:
            self._set_post_processor()

    @property
    def chat_template(self) -> str | None:
        return self._chat_template

    @chat_template.setter
    def chat_template(self, template: str | None) -> None:
        self._chat_template = template
        self._compiled_template = None
        self.chat_template_source: str | None = None  # where it came from, for error messages

    # ----------------------------------------------------------------------------------------------
    # construction

    @classmethod
    def from_pretrained_dir(cls, path: str | os.PathLike) -> Tokenizer:
        """Load a Hugging Face tokenizer folder (tokenizer.json + tokenizer_config.json)."""
        folder = Path(path)
        if not folder.is_dir():
            raise TokenizerLoadError(f"tokenizer folder {str(folder)!r} does not exist or is not a directory")
        tokenizer_file = folder / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise TokenizerLoadError(
                f"tokenizer folder {str(folder)!r} has no tokenizer.json (only fast tokenizers are supported)"
            )
        try:
            tk = tokenizers.Tokenizer.from_file(str(tokenizer_file))
        except Exception as exc:  # tokenizers raises plain Exception subclasses with terse messages
            raise TokenizerLoadError(f"cannot read {tokenizer_file}: {exc}") from exc

        config = _read_json(folder / "tokenizer_config.json", required=True)
        special_map = _read_json(folder / "special_tokens_map.json", required=False)
        generation = _read_json(folder / "generation_config.json", required=False)

        def special(name: str) -> str | None:
            value = config.get(name, special_map.get(name))
            return _token_content(value)

        bos, eos = special("bos_token"), special("eos_token")
        # tokenizer.json's post-processor decides whether BOS/EOS are added; like transformers >= 5,
        # add_bos_token / add_eos_token in tokenizer_config.json are ignored when tokenizer.json exists.
        add_bos, add_eos = _probe_post_processor(tk, bos, eos)
        # A post-processor that adds other tokens (Qwen3-Embedding appends <|endoftext|>, which
        # is not its EOS; BERT adds [CLS] and [SEP]) is kept as it is, as transformers keeps it.
        keep = _adds_other_tokens(tk, bos, eos)
        if "add_bos_token" in config and bool(config["add_bos_token"]) != add_bos:
            logger.info(
                "%s: tokenizer_config add_bos_token=%s ignored; tokenizer.json decides (%s)",
                folder,
                config["add_bos_token"],
                add_bos,
            )

        eos_ids = _as_id_list(generation.get("eos_token_id"))
        return cls(
            tk,
            bos_token=bos,
            eos_token=eos,
            add_bos_token=add_bos,
            add_eos_token=add_eos,
            chat_template=_find_chat_template(folder, config),
            eos_token_ids=eos_ids,
            pad_token=special("pad_token"),
            unk_token=special("unk_token"),
            keep_post_processor=keep,
        )

    # ----------------------------------------------------------------------------------------------
    # vocabulary

    @property
    def backend(self) -> tokenizers.Tokenizer:
        return self._tk

    @property
    def vocab_size(self) -> int:
        return self._tk.get_vocab_size(with_added_tokens=True)

    def __len__(self) -> int:
        return self.vocab_size

    def token_to_id(self, token: str) -> int | None:
        return self._tk.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tk.id_to_token(token_id)

    @property
    def special_token_ids(self) -> set[int]:
        return {tid for tid, tok in self._tk.get_added_tokens_decoder().items() if tok.special}

    # ----------------------------------------------------------------------------------------------
    # encode / decode

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if len(text) > _GIL_FREE_CHARS:
            return self._tk.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        return self._tk.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self._tk.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    # ----------------------------------------------------------------------------------------------
    # chat template

    def apply_chat_template(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        tokenize: bool = False,
        **kwargs: Any,
    ) -> str | list[int]:
        """Render `messages` with the model's chat template, as transformers would."""
        if not self.chat_template:
            raise ValueError(
                "this model has no chat template, so chat messages cannot be formatted; "
                "pass a plain prompt (completion) instead"
            )
        if self._compiled_template is None:  # reset by the chat_template setter
            self._compiled_template = _compile_template(self.chat_template)
        variables: dict[str, Any] = {
            name: value
            for name, value in (
                ("bos_token", self.bos_token),
                ("eos_token", self.eos_token),
                ("unk_token", self.unk_token),
                ("pad_token", self.pad_token),
            )
            if value is not None
        }
        variables.update({"tools": None, "documents": None})
        variables.update(kwargs)
        rendered = template_guard.render(
            self._compiled_template,
            self.chat_template_source,
            messages=_alias_reasoning_fields(messages),
            add_generation_prompt=add_generation_prompt,
            **variables,
        )
        if tokenize:
            return self.encode(rendered, add_special_tokens=False)
        return rendered

    # ----------------------------------------------------------------------------------------------
    # internals

    def _id_of(self, token: str | None) -> int | None:
        return None if token is None else self._tk.token_to_id(token)

    def _set_post_processor(self) -> None:
        """Make the backend add BOS/EOS exactly as the flags say (TemplateProcessing, like transformers)."""
        bos, eos = self.bos_token, self.eos_token
        single = "$A:0"
        pair = "$A:0 $B:1"
        specials: list[tuple[str, int]] = []
        if self.add_bos_token:
            single = f"{bos}:0 {single}"
            pair = f"{bos}:0 $A:0 {bos}:1 $B:1"
            specials.append((bos, self.bos_token_id))
        if self.add_eos_token:
            single = f"{single} {eos}:0"
            pair = pair.replace("$A:0", f"$A:0 {eos}:0").replace("$B:1", f"$B:1 {eos}:1")
            specials.append((eos, self.eos_token_id))
        self._tk.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)


class IncrementalDetokenizer:
    """Streams text for a growing list of output token ids.

    Decodes only a short window, `ids[prefix_offset:]`, and emits what it adds beyond the already
    emitted `ids[prefix_offset:read_offset]`, so each step costs O(window), not O(sequence). A delta
    is held back while the window's text ends in U+FFFD (a multi-byte character still incomplete).
    Without prompt context the deltas concatenate to `tokenizer.decode(output_ids)`.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_ids: list[int] | None = None,
        skip_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        context = list(prompt_ids[-_PROMPT_CONTEXT_TOKENS:]) if prompt_ids else []
        self._ids: list[int] = context
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._pieces: list[str] = []

    @property
    def text(self) -> str:
        return "".join(self._pieces)

    def add(self, new_ids: Iterable[int]) -> str:
        self._ids.extend(int(i) for i in new_ids)
        return self._advance(final=False)

    def flush(self) -> str:
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        if self._read_offset >= len(self._ids):
            return ""
        decode = self._tokenizer.decode
        prefix_text = decode(self._ids[self._prefix_offset : self._read_offset], self._skip)
        full_text = decode(self._ids[self._prefix_offset :], self._skip)
        if not final and (len(full_text) <= len(prefix_text) or full_text.endswith(_REPLACEMENT_CHAR)):
            # Nothing new yet, or the last character is still incomplete: wait for more tokens.
            return ""
        delta = full_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        # Drop ids that can no longer be part of the window, so memory stays bounded too.
        if self._prefix_offset > 0:
            del self._ids[: self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0
        if delta:
            self._pieces.append(delta)
        return delta


# --------------------------------------------------------------------------------------------------
# helpers


def _read_json(path: Path, *, required: bool) -> dict:
    if not path.is_file():
        if required:
            raise TokenizerLoadError(f"tokenizer folder {str(path.parent)!r} has no {path.name}")
        return {}
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except (OSError, json.JSONDecodeError) as exc:
        raise TokenizerLoadError(f"cannot read {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise TokenizerLoadError(f"{path} does not hold a JSON object")
    return data


def _token_content(value: Any) -> str | None:
    """Special tokens are saved as a string or as a serialized AddedToken dict."""
    if value is None:
        return None
    if isinstance(value, Mapping):
        content = value.get("content")
        return str(content) if content is not None else None
    return str(value)


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value]
    return [int(value)]


def _probe_post_processor(tk: tokenizers.Tokenizer, bos: str | None, eos: str | None) -> tuple[bool, bool]:
    """Whether the tokenizer.json post-processor adds BOS / EOS to a single sequence."""
    plain = tk.encode("a", add_special_tokens=False).ids
    full = tk.encode("a", add_special_tokens=True).ids
    bos_id = tk.token_to_id(bos) if bos else None
    eos_id = tk.token_to_id(eos) if eos else None
    added_front = len(full) > len(plain) and bos_id is not None and full[0] == bos_id
    added_back = len(full) > len(plain) and eos_id is not None and full[-1] == eos_id
    return added_front, added_back


def _adds_other_tokens(tk: tokenizers.Tokenizer, bos: str | None, eos: str | None) -> bool:
    """Whether the tokenizer.json post-processor adds tokens other than BOS and EOS."""
    plain = tk.encode("a", add_special_tokens=False).ids
    full = tk.encode("a", add_special_tokens=True).ids
    known = {tk.token_to_id(t) for t in (bos, eos) if t}
    extra = list(full)
    for t in plain:
        if t in extra:
            extra.remove(t)
    return any(t not in known for t in extra)


def _find_chat_template(folder: Path, config: dict) -> str | None:
    """chat_template.jinja wins, then chat_template.json, then tokenizer_config.json (as transformers)."""
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    json_file = folder / "chat_template.json"
    if json_file.is_file():
        template = _read_json(json_file, required=True).get("chat_template")
        if template:
            return _pick_template(template)
    return _pick_template(config.get("chat_template"))


def _pick_template(template: Any) -> str | None:
    """A template may be a string or a list of named templates; use the "default" one."""
    if template is None or isinstance(template, str):
        return template
    if isinstance(template, list):
        named = {entry.get("name"): entry.get("template") for entry in template if isinstance(entry, Mapping)}
        if "default" in named:
            return named["default"]
        if named:
            return next(iter(named.values()))
    return None


def _alias_reasoning_fields(messages: list[dict]) -> list[dict]:
    """Copy a message's reasoning to every name templates read it under (as transformers does)."""
    out = []
    for message in messages:
        if isinstance(message, Mapping):
            reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
            if reasoning is not None:
                message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


class _GenerationTag(jinja2.ext.Extension):
    """Accepts `{% generation %}...{% endgeneration %}` (used by templates for assistant masks) and
    renders its body unchanged; we never need the mask itself."""

    tags = {"generation"}

    def parse(self, parser: Any) -> Any:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


def _compile_template(source: str) -> Any:
    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(
        value: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False
    ) -> str:
        # Jinja's own tojson escapes HTML characters, which chat templates must not do.
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    env = template_guard.GuardedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as exc:
        raise ValueError(f"the model's chat template is not valid Jinja: {exc}") from exc
    except RecursionError:
        raise ValueError("the model's chat template is nested too deeply to compile") from None
