"""Chat templates under limits: a template is code, and it may come from a downloaded GGUF.

Jinja's sandbox stops attribute escapes (`__globals__`, `__mro__`), but not a template that
spends the machine: `{{ 'a' * 10**10 }}` allocates 10 GB, nested `range(10**5)` loops never
end, a string doubled in a loop reaches gigabytes in 30 steps. As llama.cpp's and vLLM's
template guards do, this environment bounds what one operation may build (string and list
repetition and concatenation, `~`, `**` and `*` on integers, %-formatting widths, padding
methods and filters, `range`), and `render` bounds the whole rendering in time and in output
size. A template that breaks a limit raises `TemplateLimitError` (a `jinja2.TemplateError`,
so the server answers 400) naming where the template came from.
"""

from __future__ import annotations

import logging
import math
import re
import sys
import threading
import time
from typing import Any, Callable

import jinja2
from jinja2.compiler import CodeGenerator
from jinja2.sandbox import ImmutableSandboxedEnvironment

logger = logging.getLogger(__name__)

RENDER_TIMEOUT_S = 2.0  # real templates render in milliseconds
MAX_OUTPUT_CHARS = 16 * 2**20  # a rendered prompt
MAX_SIZE = 16 * 2**20  # one string or list built by an operator, a method or a filter
MAX_RANGE = 100_000  # items of one range() (Jinja's own sandbox bound)
MAX_INT_BITS = 1 << 16  # an integer built by ** or *

# ChatML: what a GGUF gets when its own template breaks the limits at load.
DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] "
    "+ '<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% endif %}"
)
DEFAULT_SOURCE = "the default ChatML template"

_WIDE_PERCENT = re.compile(r"%[-#0 +]*(?:\d{8,}|\d*\.\d{8,})")  # %-format width/precision >= 10**7
_WIDE_BRACE = re.compile(r"\{[^{}]*?\d{8,}[^{}]*\}")  # str.format width/precision >= 10**7
_PADDING_METHODS = {"center", "ljust", "rjust", "zfill", "expandtabs"}
_SIZED_FILTERS = {"center", "indent", "wordwrap", "truncate"}  # their int arguments are sizes
_state = threading.local()  # the deadline and source of the rendering on this thread


class TemplateLimitError(jinja2.TemplateError):
    """A chat template that broke one of this module's limits."""


def _fail(what: str) -> None:
    source = getattr(_state, "source", None) or "the chat template"
    raise TemplateLimitError(f"the chat template from {source} {what}")


def _check_deadline() -> None:
    deadline = getattr(_state, "deadline", None)
    if deadline is not None and time.monotonic() > deadline:
        _fail(f"ran past its rendering time limit of {RENDER_TIMEOUT_S:g} s")


def _size(x: Any) -> int | None:
    return len(x) if isinstance(x, (str, bytes, list, tuple)) else None


def _check_size(n: int, what: str) -> None:
    if n > MAX_SIZE:
        _fail(f"tried to build {what} of {n} items; the limit is {MAX_SIZE}")


def _check_ints(args: tuple, kwargs: dict, what: str) -> None:
    for v in (*args, *kwargs.values()):
        if isinstance(v, int) and not isinstance(v, bool) and v > MAX_SIZE:
            _fail(f"passed {v} to {what}; sizes are limited to {MAX_SIZE}")


class _GuardedCodeGenerator(CodeGenerator):
    """`a ~ b` compiles to a plain join; route it through the environment so it is bounded."""

    def visit_Concat(self, node: jinja2.nodes.Concat, frame: Any) -> None:
        self.write("environment.guarded_concat((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


class GuardedEnvironment(ImmutableSandboxedEnvironment):
    code_generator_class = _GuardedCodeGenerator
    intercepted_binops = frozenset({"+", "*", "**", "%"})

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.globals["range"] = bounded_range
        self.globals.pop("lipsum", None)  # lipsum(n=10**9) would write 10**9 paragraphs
        for name in ("center", "indent", "replace", "join", "format", "wordwrap", "truncate"):
            self.filters[name] = _guard_filter(name, self.filters[name])

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        _check_deadline()
        if operator == "*":
            for seq, count in ((left, right), (right, left)):
                n = _size(seq)
                if n is not None and isinstance(count, int):
                    _check_size(n * max(count, 0), f"a {type(seq).__name__} by repetition")
            if (
                isinstance(left, int)
                and isinstance(right, int)
                and abs(left).bit_length() + abs(right).bit_length() > MAX_INT_BITS
            ):
                _fail(f"multiplied integers past {MAX_INT_BITS} bits")
        elif operator == "+":
            a, b = _size(left), _size(right)
            if a is not None and b is not None:
                _check_size(a + b, f"a {type(left).__name__} by concatenation")
        elif operator == "**":
            if (
                isinstance(left, int)
                and isinstance(right, int)
                and right > 0
                and abs(left) > 1
                and right * math.log2(abs(left)) > MAX_INT_BITS
            ):
                _fail(f"raised an integer past {MAX_INT_BITS} bits ({left} ** {right})")
        elif operator == "%" and isinstance(left, str):
            _check_percent(left, right)
        return super().call_binop(context, operator, left, right)

    def guarded_concat(self, parts: tuple) -> str:
        _check_deadline()
        texts = [str(p) for p in parts]
        _check_size(sum(map(len, texts)), "a string by ~")
        return "".join(texts)

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        _check_deadline()
        owner = getattr(__obj, "__self__", getattr(getattr(__obj, "__wrapped__", None), "__self__", None))
        if isinstance(owner, str):
            name = getattr(__obj, "__name__", "")
            if name in _PADDING_METHODS:
                _check_ints(args, kwargs, f"str.{name}()")
            _check_str_method(owner, name, args)
        return super().call(__context, __obj, *args, **kwargs)


def _check_percent(fmt: str, values: Any) -> None:
    if _WIDE_PERCENT.search(fmt):
        _fail("used a %-format width past 10**7")
    if "*" in fmt:
        _check_ints(values if isinstance(values, tuple) else (values,), {}, "a %* width")


def _check_str_method(s: str, name: str, args: tuple) -> None:
    if name in ("format", "format_map") and _WIDE_BRACE.search(s):
        _fail("used a format width past 10**7")
    elif name == "replace" and len(args) >= 2 and isinstance(args[0], str) and isinstance(args[1], str):
        grow = len(args[1]) - len(args[0])
        if grow > 0:
            hits = s.count(args[0]) if args[0] else len(s) + 1
            _check_size(len(s) + hits * grow, "a string by replace()")
    elif name == "join" and args and isinstance(args[0], (list, tuple)):
        _check_size(_joined_size(args[0], s), "a string by join()")


def _joined_size(items: Any, sep: str) -> int:
    return sum(len(x) if isinstance(x, str) else 8 for x in items) + len(items) * len(sep)


def _guard_filter(name: str, fn: Callable) -> Callable:
    passes_arg = hasattr(fn, "jinja_pass_arg")  # the first argument is the context or environment

    def guarded(*args: Any, **kwargs: Any) -> Any:
        _check_deadline()
        if name in _SIZED_FILTERS:
            _check_ints(args, kwargs, f"the {name} filter")
        first = 1 if passes_arg else 0
        if len(args) <= first:
            return fn(*args, **kwargs)
        value, rest = args[first], args[first + 1 :]
        if name == "replace" and isinstance(value, str):
            _check_str_method(value, "replace", tuple(str(a) for a in rest[:2]))
        elif name == "indent" and isinstance(value, str):
            width = rest[0] if rest else kwargs.get("width", 4)
            prefix = len(width) if isinstance(width, str) else int(width)
            _check_size(len(value) + (value.count("\n") + 1) * prefix, "a string by indent")
        elif name == "format" and isinstance(value, str):
            _check_percent(value, rest)
        elif name == "join":
            if not isinstance(value, (str, list, tuple)):
                value = list(value)  # materialized once, and handed on
                args = (*args[:first], value, *rest)
            sep = rest[0] if rest else kwargs.get("d", "")
            _check_size(_joined_size(value, str(sep)), "a string by join")
        out = fn(*args, **kwargs)
        n = _size(out)
        if n is not None:
            _check_size(n, f"a value by the {name} filter")
        return out

    for attr in ("jinja_pass_arg",):  # keep pass_context / pass_eval_context / pass_environment
        if hasattr(fn, attr):
            setattr(guarded, attr, getattr(fn, attr))
    guarded.__name__ = getattr(fn, "__name__", name)
    return guarded


def bounded_range(*args: int) -> range:
    _check_deadline()
    rng = range(*args)
    if len(rng) > MAX_RANGE:
        _fail(f"asked for a range of {len(rng)} items; the limit is {MAX_RANGE}")
    return rng


def render(template: jinja2.Template, source: str | None, **variables: Any) -> str:
    """Render under the time and output-size limits (on the calling thread)."""
    _state.source = source
    _state.deadline = time.monotonic() + RENDER_TIMEOUT_S
    previous = sys.gettrace()
    # The time limit needs a check inside template loops that call nothing of ours (an empty
    # nested loop): a line tracer, only on the template's own frames. A debugger or coverage
    # tool keeps its tracer; the checks in the operators and calls still hold then.
    tracer = _tracer() if previous is None else None
    if tracer is not None:
        sys.settrace(tracer)
    try:
        parts, total = [], 0
        for chunk in template.generate(**variables):
            total += len(chunk)
            if total > MAX_OUTPUT_CHARS:
                _fail(f"rendered more than its output limit of {MAX_OUTPUT_CHARS} characters")
            parts.append(chunk)
        _check_deadline()
        return "".join(parts)
    except RecursionError:
        _fail("recursed too deeply")
    except MemoryError:
        _fail("ran out of memory")
    except (ArithmeticError, TypeError, LookupError) as e:  # a template bug, not a server error
        raise jinja2.TemplateError(
            f"the chat template from {source or 'the model'} failed: {type(e).__name__}: {e}"
        ) from None
    finally:
        if tracer is not None:
            sys.settrace(None)
        _state.deadline = _state.source = None
    raise AssertionError("unreachable")


def _tracer() -> Callable:
    deadline = _state.deadline

    def local(frame: Any, event: str, arg: Any) -> Any:
        if event == "line" and time.monotonic() > deadline:
            _check_deadline()
        return local

    def on_call(frame: Any, event: str, arg: Any) -> Any:
        return local if frame.f_code.co_filename == "<template>" else None

    return on_call


def check_gguf_template(tokenizer: Any) -> None:
    """At load: a GGUF's own template is dry-rendered under the limits; one that breaks them is
    reported and replaced by the default template, so a malicious file cannot take down every
    chat request."""
    if not tokenizer.chat_template:
        return
    try:
        tokenizer.apply_chat_template([{"role": "user", "content": "Hello"}], add_generation_prompt=True)
    except TemplateLimitError as e:
        logger.warning("%s; using %s instead", e, DEFAULT_SOURCE)
        tokenizer.chat_template = DEFAULT_CHAT_TEMPLATE
        tokenizer.chat_template_source = DEFAULT_SOURCE
    except (jinja2.TemplateError, ValueError):
        pass  # a template that needs other messages: its errors reach the requests that hit them
