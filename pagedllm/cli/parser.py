"""The `pagedllm` command.

    pagedllm serve [MODEL] [--host 127.0.0.1] [--port 8000] [--api-key KEY] [engine flags]
    pagedllm chat [MODEL] [engine flags]             interactive chat in the terminal
    pagedllm generate [PROMPT] [-m MODEL]            one-shot; the prompt may come on stdin
    pagedllm bench throughput|prefix|quality|compare|gptq-pair|make-gguf|upcycle|soak|serve ...
    pagedllm trace [MODEL]                           KV cache figures while a request runs
    pagedllm demo
    pagedllm env                                     what a bug report needs (alias: collect-env)

and mistral.rs's form, global flags first, then where the model comes from:

    pagedllm [-i] [--port N] [engine flags] plain -m MODEL_DIR [-a ARCH] [-t TOKENIZER]
    pagedllm [-i] [--port N] [engine flags] gguf [-t TOKENIZER_DIR] -m MODEL_DIR -f FILE.gguf

(`-i` chats in the terminal; without it the model is served.)
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import sys
from typing import Any, Callable

from . import scaleout
from .flags import add_engine_flags

_UNSET = argparse.SUPPRESS


class Parser(argparse.ArgumentParser):
    """argparse, forgiving where it should be and strict where it matters: abbreviations of
    flags are refused (`--max-token` silently becoming `--max-tokens` hides typos), and an
    unknown flag or command is reported by the subcommand it was given to, with its usage
    and the closest real name."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def parse_args(self, args: Any = None, namespace: Any = None) -> argparse.Namespace:
        ns, extras = self.parse_known_args(args, namespace)
        if extras:
            parser = self._chosen(ns)
            parser.error(f"unrecognized arguments: {' '.join(extras)}{parser.suggest(extras)}")
        return ns

    def _chosen(self, ns: argparse.Namespace) -> "Parser":
        """The innermost subcommand parser the command line selected."""
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                sub = action.choices.get(getattr(ns, action.dest, None) or "")
                if isinstance(sub, Parser):
                    return sub._chosen(ns)
        return self

    def suggest(self, words: list[str]) -> str:
        flags = [o for a in self._actions for o in a.option_strings]
        for w in words:
            if w.startswith("-"):
                close = difflib.get_close_matches(w.split("=", 1)[0], flags, n=1, cutoff=0.6)
                if close:
                    return f" (did you mean {close[0]}?)"
        return ""

    def error(self, message: str) -> Any:
        # An unknown subcommand: name the closest one.
        if "invalid choice:" in message and "did you mean" not in message:
            given = message.split("invalid choice:", 1)[1].split("'")[1:2]
            choices = [c for a in self._actions if isinstance(a, argparse._SubParsersAction) for c in a.choices]
            close = difflib.get_close_matches(given[0], choices, n=1) if given else []
            if close:
                message += f" (did you mean {close[0]}?)"
        return super().error(message)


def _log_flag(p: argparse.ArgumentParser, top: bool) -> None:
    p.add_argument("--log-level", default="warning" if top else _UNSET, choices=["debug", "info", "warning", "error"])


def _server_flags(p: argparse.ArgumentParser, top: bool) -> None:
    """On a subcommand a flag defaults to 'not given', so a value set before it stays."""
    d = (lambda v: v) if top else (lambda v: _UNSET)
    _listen_flags(p.add_argument_group("server: where and for whom"), d)
    _limit_flags(p.add_argument_group("server: limits"), d)
    _request_flags(p.add_argument_group("server: requests"), d)


def _listen_flags(g: argparse._ArgumentGroup, d: Callable[[Any], Any]) -> None:
    """Where the server listens, under which names, for which callers."""
    g.add_argument(
        "--host", "--serve-ip", default=d("127.0.0.1"), help="address to bind (default 127.0.0.1: this machine only)"
    )
    g.add_argument("--port", "-p", type=int, default=d(8000))
    g.add_argument(
        "--api-key",
        default=d(None),
        help="require 'Authorization: Bearer KEY' or 'x-api-key: KEY' (better: set "
        "PAGEDLLM_API_KEY, which ps does not show)",
    )
    g.add_argument(
        "--served-model-name",
        nargs="+",
        metavar="NAME",
        default=d(None),
        help="names requests may use for the model; responses carry the first "
        "(default: 'default', the GGUF file's stem or the folder's name)",
    )
    g.add_argument(
        "--root-path",
        default=d(""),
        metavar="PREFIX",
        help="the path prefix a reverse proxy serves this server under (e.g. /llm)",
    )
    g.add_argument(
        "--allowed-origins",
        nargs="+",
        metavar="ORIGIN",
        default=d(None),
        help="CORS: origins browser pages may call the API from ('*': any; vLLM's "
        "JSON list is accepted too); default: none",
    )


def _limit_flags(g: argparse._ArgumentGroup, d: Callable[[Any], Any]) -> None:
    """How much the server takes and keeps, and for how long."""
    g.add_argument("--max-body-bytes", type=int, default=d(4 * 2**20), help="request body size limit")
    g.add_argument(
        "--header-timeout",
        type=float,
        default=d(10.0),
        metavar="S",
        help="close a connection whose request headers take longer than S seconds (default 10)",
    )
    g.add_argument(
        "--keep-alive-timeout",
        type=float,
        default=d(5.0),
        metavar="S",
        help="close an idle kept-alive connection after S seconds (default 5)",
    )
    g.add_argument(
        "--max-connections",
        type=int,
        default=d(None),
        metavar="N",
        help="connections and requests at once; past N new requests get a 503 (default: no limit)",
    )
    g.add_argument(
        "--responses-store-size",
        type=int,
        metavar="N",
        default=d(1000),
        help="/v1/responses: how many responses are kept in memory for "
        "previous_response_id (default 1000; 0 keeps none)",
    )
    g.add_argument(
        "--shutdown-timeout",
        type=float,
        metavar="S",
        default=d(0.0),
        help="on SIGTERM/SIGINT, let requests in flight finish for up to S seconds "
        "(new ones get 503), then end the rest (default 0: end them at once)",
    )


def _request_flags(g: argparse._ArgumentGroup, d: Callable[[Any], Any]) -> None:
    """What the server does with requests: logs, records, LoRA adapters."""
    g.add_argument("--access-log", action="store_true", default=d(False))
    g.add_argument(
        "--keep-anthropic-attribution",
        action="store_true",
        default=d(False),
        help="/v1/messages: keep Claude Code's per-request attribution line "
        "(x-anthropic-billing-header) in the system prompt; by default it is dropped "
        "so it does not defeat prefix caching",
    )
    g.add_argument(
        "--record-requests",
        default=d(None),
        metavar="DIR",
        help="write each request (path, body, dialect headers; never credentials) to "
        "DIR/NNNNN.json, e.g. an agent's session for `pagedllm bench agent`",
    )
    g.add_argument(
        "--lora-modules",
        nargs="+",
        metavar="NAME=PATH",
        default=d(None),
        help="with --enable-lora: LoRA adapters served under NAME (a request's model picks one)",
    )
    g.add_argument(
        "--allow-runtime-lora",
        action="store_true",
        default=d(False),
        help="allow POST /v1/load_lora_adapter and /v1/unload_lora_adapter",
    )


def _sampling_flags(p: argparse.ArgumentParser, max_tokens: int, temperature: float) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument(
        "--max-tokens", type=int, default=max_tokens, metavar="N", help="most tokens to generate (default: %(default)s)"
    )
    g.add_argument(
        "--temperature",
        type=float,
        default=temperature,
        metavar="T",
        help="0 picks the likeliest token, higher is more random (default: %(default)s)",
    )
    g.add_argument(
        "--top-p",
        type=float,
        default=1.0,
        metavar="P",
        help="sample from the likeliest tokens whose probabilities add up to P, in (0, 1] (default: %(default)s, off)",
    )
    g.add_argument(
        "--top-k",
        type=int,
        default=-1,
        metavar="K",
        help="sample from the K likeliest tokens; -1 is off (default: %(default)s)",
    )
    g.add_argument(
        "--min-p",
        type=float,
        default=0.0,
        metavar="P",
        help="drop tokens less likely than P times the likeliest, in [0, 1] (default: %(default)s, off)",
    )
    g.add_argument(
        "--presence-penalty",
        type=float,
        default=0.0,
        metavar="X",
        help="lower the logits of tokens already generated by X, in [-2, 2] (default: %(default)s)",
    )
    g.add_argument(
        "--frequency-penalty",
        type=float,
        default=0.0,
        metavar="X",
        help="lower the logits of generated tokens by X per occurrence, in [-2, 2] (default: %(default)s)",
    )
    g.add_argument(
        "--repetition-penalty",
        type=float,
        default=1.0,
        metavar="X",
        help="make tokens of the prompt or output X times less likely to return "
        "(positive logits divided, negative multiplied; > 1 repeats less; "
        "default: %(default)s, off)",
    )


MODEL_HELP = "'default' (the embedded SmolLM2-135M), a .gguf file, a model folder or a hub id"


def _model_arg(p: argparse.ArgumentParser, positional: bool = True) -> None:
    if positional:
        p.add_argument("model_pos", nargs="?", metavar="MODEL", help=MODEL_HELP)
        p.add_argument("-m", "--model", default=None, help="the model (instead of MODEL)")
    else:
        p.add_argument("-m", "--model", default=None, help=MODEL_HELP + " (default: default)")


BENCHES = {
    "throughput": "offline throughput against transformers generate, in one run",
    "prefix": "multi-turn and shared-system-prompt workload, prefix caching on and off",
    "quality": "perplexity and greedy agreement of the KV cache types",
    "compare": "pagedllm beside llama.cpp on the same GGUF file, one process per figure",
    "gptq-pair": "a GGUF's weights as a GPTQ checkpoint and as a Q4_0 GGUF: decode speed of both, in one run",
    "make-gguf": "write a GGUF with a real model's shape and random weights (llama.cpp quantizes it)",
    "fim": "fill-in-the-middle on a code model: held-out stdlib lines, prompt ids against transformers",
    "upcycle": "a mixture-of-experts GGUF whose experts are copies of a real dense GGUF's MLP (its text is the dense model's)",
    "startup": "time from starting `pagedllm generate` to its first token (median of 5)",
    "allreduce": "torch.distributed all-reduce latency and bandwidth at a TP step's message sizes",
    "p2p": "pipeline stage-to-stage point-to-point latency and bandwidth (loopback, or two nodes under torchrun)",
    "speculative": "n-gram (and --draft MODEL) speculative decoding against plain decoding: code editing, chat, 32 concurrent",
    "soak": "a served model under streaming load, then idle: resident memory at start, peak and at idle",
    "router": "2 replicas behind SGLang's gateway: cache-aware against round-robin routing on multi-turn chats",
    "lora": "LoRA adapters against the base model: 32 concurrent over 4 adapters, and batch 1 decode",
    "interleave": "a short stream beside a long prefill: its inter-token latency and the prefill's throughput, "
    "each against alone, with the scheduler's pacing on and off",
    "agent": "a coding agent's recorded session replayed against pagedllm's server and llama.cpp's: "
    "each turn's time to first token and the session's wall time",
    "vision": "a vision-language model's time to first token for a one-image question, and its encoder share, "
    "against transformers; then a second turn on the same image",
}


def _bench_module(kind: str) -> str:
    return "pagedllm.bench." + kind.replace("-", "_")


def _wants(argv: list[str], *words: str) -> bool:
    return all(w in argv for w in words)


SERVE_ROUTES = """HTTP routes (the full schema: GET /openapi.json):
  OpenAI     POST /v1/chat/completions, /v1/completions, /v1/responses, /v1/embeddings;
             GET /v1/models, /v1/models/{id}
  Anthropic  POST /v1/messages (streamed and not), /v1/messages/count_tokens
             (key as 'x-api-key' or 'Authorization: Bearer')
  vLLM       POST /tokenize, /detokenize, /v1/load_lora_adapter, /v1/unload_lora_adapter;
             GET /tokenizer_info
  server     GET / (chat page), /health, /metrics, /version"""


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    argv = sys.argv[1:] if argv is None else argv
    p = Parser(
        prog="pagedllm",
        description="LLM inference with a paged KV cache",
        usage="pagedllm [-h] [--version] [-i] [engine and server flags] COMMAND ...",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__,
    )
    p.add_argument(
        "-i", "--interactive-mode", action="store_true", help="with plain/gguf: chat in the terminal instead of serving"
    )
    _log_flag(p, top=True)
    p.add_argument("--version", action="version", version=_version())
    add_engine_flags(p, top=True)
    _server_flags(p, top=True)
    sub = p.add_subparsers(dest="command", metavar="COMMAND", prog="pagedllm")
    _serve_command(sub)
    _chat_command(sub)
    _generate_command(sub)
    _trace_command(sub)
    _bench_command(sub, argv)
    dm = sub.add_parser("demo", help="a few chat requests served together")
    if _wants(argv, "demo"):
        _add_module_args(dm, "pagedllm.cli.demo")
    else:
        dm.add_argument("rest", nargs=argparse.REMAINDER)
    ev = sub.add_parser(
        "env", aliases=["collect-env"], help="versions, machine, native kernels' level: what a bug report needs"
    )
    from .env import add_arguments as env_arguments  # (the standard library only)

    env_arguments(ev)
    _mistralrs_forms(sub)
    return p


def _serve_command(sub: argparse._SubParsersAction) -> None:
    s = sub.add_parser(
        "serve",
        help="OpenAI- and Anthropic-compatible HTTP server",
        usage="pagedllm serve [MODEL] [--host H] [--port N] [--api-key KEY] [engine flags]",
        description=SERVE_ROUTES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _log_flag(s, top=False)
    _model_arg(s)
    add_engine_flags(s, top=False)
    _server_flags(s, top=False)
    scaleout.add_serve_flags(s)
    scaleout.add_router_parser(sub)


def _chat_command(sub: argparse._SubParsersAction) -> None:
    c = sub.add_parser(
        "chat",
        help="interactive chat in the terminal",
        usage="pagedllm chat [MODEL] [--system MSG] [engine and sampling flags]",
    )
    _log_flag(c, top=False)
    _model_arg(c)
    add_engine_flags(c, top=False)
    c.add_argument("--system", default=None, help="system message to start with")
    _sampling_flags(c, max_tokens=512, temperature=0.7)


def _generate_command(sub: argparse._SubParsersAction) -> None:
    g = sub.add_parser(
        "generate",
        help="one-shot generation (prompt argument or stdin)",
        usage="pagedllm generate [PROMPT] [-m MODEL] [--raw] [--suffix TEXT] [--stats] [engine and sampling flags]",
    )
    g.add_argument("prompt", nargs="?", metavar="PROMPT", help="the prompt; '-' or nothing reads stdin")
    _log_flag(g, top=False)
    _model_arg(g, positional=False)
    add_engine_flags(g, top=False)
    _sampling_flags(g, max_tokens=256, temperature=0.0)
    g.add_argument("-n", type=int, default=1, help="completions to generate (default: %(default)s)")
    g.add_argument("--raw", action="store_true", help="no chat template: continue the text as is")
    g.add_argument("--system", default=None, metavar="MSG", help="system message")
    g.add_argument(
        "--suffix",
        default=None,
        metavar="TEXT",
        help="fill in the middle: PROMPT is the code before the cursor, TEXT the code after it "
        "(a code model with FIM tokens, e.g. Qwen2.5-Coder)",
    )
    g.add_argument("--stats", action="store_true", help="print token counts and speed to stderr")


def _trace_command(sub: argparse._SubParsersAction) -> None:
    t = sub.add_parser(
        "trace",
        help="run a request and show the KV cache as it fills and empties",
        usage="pagedllm trace [MODEL] [--prompt TEXT] [-n N] [--max-tokens N] [--json] [engine flags]",
    )
    _log_flag(t, top=False)
    _model_arg(t)
    add_engine_flags(t, top=False)
    t.add_argument(
        "--prompt", default="Write a short poem about memory pages.", help="the request's prompt (default: %(default)r)"
    )
    t.add_argument("-n", type=int, default=1, help="completions of the prompt (default: %(default)s)")
    t.add_argument(
        "--max-tokens", type=int, default=32, metavar="N", help="tokens to generate, greedily (default: %(default)s)"
    )
    t.add_argument("--json", action="store_true", help="print the trace as JSON")


def _bench_command(sub: argparse._SubParsersAction, argv: list[str]) -> None:
    """Each benchmark's flags come from its module, imported only when that benchmark is asked for."""
    b = sub.add_parser("bench", help="benchmarks")
    bsub = b.add_subparsers(dest="bench", metavar="KIND", prog="pagedllm bench")
    for kind, text in BENCHES.items():
        bt = bsub.add_parser(kind, help=text)
        if _wants(argv, "bench", kind):
            _add_module_args(bt, _bench_module(kind))
            bt.add_argument(
                "--tune",
                action="append",
                metavar="KNOB=VALUE",
                help="set a kernel route or tuning knob for this run (repeatable; the knobs: "
                "docs/benchmarks/tuning.md), e.g. --tune quant_wide=gemm",
            )
        else:
            bt.add_argument("rest", nargs=argparse.REMAINDER)
    bs = bsub.add_parser("serve", help="load test of a running server (streaming clients)")
    if _wants(argv, "bench", "serve"):  # asyncio and friends: only when asked for
        from ..bench import loadtest

        loadtest.add_arguments(bs)
    else:
        bs.add_argument("rest", nargs=argparse.REMAINDER)


def _mistralrs_forms(sub: argparse._SubParsersAction) -> None:
    """mistral.rs's `plain` and `gguf` forms; the global flags are accepted after them too."""
    pl = sub.add_parser(
        "plain",
        help="mistral.rs form: a safetensors model folder or hub id",
        usage="pagedllm [-i] [flags] plain -m MODEL_ID [-a ARCH] [-t TOKENIZER] [flags]",
    )
    pl.add_argument("-m", "--model-id", required=True, help=MODEL_HELP)
    pl.add_argument("-a", "--arch", default=None, help="architecture hint (read from the model anyway)")
    pl.add_argument("-t", "--tokenizer-json", "--tokenizer", default=None)
    gg = sub.add_parser(
        "gguf",
        help="mistral.rs form: a GGUF file in a folder or hub repo",
        usage="pagedllm [-i] [flags] gguf -m MODEL_DIR -f FILE.gguf [-t TOKENIZER_DIR] [flags]",
    )
    gg.add_argument("-m", "--quantized-model-id", required=True, help="folder or hub repo of the file")
    gg.add_argument("-f", "--quantized-filename", required=True, help="the .gguf file's name")
    gg.add_argument(
        "-t",
        "--tok-model-id",
        default=None,
        help="tokenizer folder (a hub id is ignored: the GGUF's tokenizer is used)",
    )
    for form in (pl, gg):
        form.add_argument(
            "-i",
            "--interactive-mode",
            action="store_true",
            default=_UNSET,
            help="chat in the terminal instead of serving",
        )
        _log_flag(form, top=False)
        add_engine_flags(form, top=False)
        _server_flags(form, top=False)


def _add_module_args(p: argparse.ArgumentParser, module: str) -> None:
    try:
        mod = importlib.import_module(module)
    except ImportError:
        p.add_argument("rest", nargs=argparse.REMAINDER)
        return
    if hasattr(mod, "add_arguments"):
        mod.add_arguments(p)


def _version() -> str:
    from .. import __version__

    return f"pagedllm {__version__}"
