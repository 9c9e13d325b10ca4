"""What each `pagedllm` command does once its command line is parsed (cli/parser.py reads it):
engine options from the flags, then serve, chat and bench (generate and trace: cli/generate.py)."""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import logging
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .flags import engine_config
from .generate import load_llm
from .parser import BENCHES, _bench_module, build_parser

if TYPE_CHECKING:
    from ..config import EngineConfig

logger = logging.getLogger("pagedllm.cli")

# A server's requests are streams: a token every few steps beside a long prefill matters more
# there than the prefill's last percent (engine/pacing.py).
SERVE_DECODE_LATENCY_FACTOR = 2.5


def command_config(args: argparse.Namespace) -> EngineConfig:
    """The engine's config for the command given: its flags, where the model comes from (MODEL,
    -m, or mistral.rs's `plain` / `gguf` forms), and serve's own default pacing."""
    given: dict[str, Any] = {}
    if args.command == "plain":
        given = dict(model=args.model_id, tokenizer=_tokenizer_dir(args.tokenizer_json), arch=args.arch)
    elif args.command == "gguf":
        from ..options import gguf_source

        model, gguf_file, tok = gguf_source(args.quantized_model_id, args.quantized_filename, args.tok_model_id)
        given = dict(model=model, gguf_file=gguf_file, tokenizer=tok)
    else:
        given = dict(model=_model_of(args))
    serving = args.command == "serve" or (args.command in ("plain", "gguf") and not args.interactive_mode)
    if serving and vars(args).get("decode_latency_factor") is None:
        given["decode_latency_factor"] = SERVE_DECODE_LATENCY_FACTOR
    return engine_config(args, **given)


def _model_of(args: argparse.Namespace) -> str:
    return vars(args).get("model") or vars(args).get("model_pos") or "default"


# -- commands ---------------------------------------------------------------------------------


class _BadFlag(ValueError):
    """A server flag that cannot be served as given (exit code 2, before or right after the load)."""


def cmd_serve(args: argparse.Namespace, config: EngineConfig) -> int:
    from ..server.app import run_server

    try:
        origins, modules = _check_server_flags(args, config)  # before the slow load
        llm = load_llm(config)
        _check_adapters(llm, modules)
    except _BadFlag as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    cfg = _server_config(args, config, llm, origins, modules)
    eng = llm.engine
    print(
        f"serving {' = '.join((cfg.model_name, *cfg.aliases))} on http://{args.host}:{args.port}/v1 "
        f"({eng.block_manager.num_usable_blocks} KV blocks of {eng.cache_config.block_size} tokens"
        f"{', API key required' if cfg.api_key else ''})",
        file=sys.stderr,
        flush=True,
    )
    if args.host not in ("127.0.0.1", "localhost", "::1") and not cfg.api_key:
        logger.warning("serving on %s without --api-key: anyone who can reach it may use it", args.host)
    sock = vars(args).get("listen_socket")  # bound by main() before the load, so a busy port fails at once
    result = run_server(llm, args.host, args.port, cfg, log_level=args.log_level, access_log=args.access_log, sock=sock)
    llm.shutdown()  # tensor-parallel workers or pipeline stages first: _exit_now skips every exit handler
    if result.stopped_by:
        print(
            f"stopped by {result.stopped_by}: {result.requests_ended} request(s) in flight ended "
            f"with an error; {eng.block_manager.num_used_blocks} KV blocks in use",
            file=sys.stderr,
        )
        # Everything is stopped and said; tearing down torch's modules would add 1-2 s more.
        _exit_now(0)
    return 0


def _check_server_flags(args: argparse.Namespace, config: EngineConfig) -> tuple[Any, list]:
    """The CORS origins and the LoRA modules the flags name, checked as far as they can be
    without the model."""
    from ..server.lora import parse_modules
    from ..server.routes import parse_origins

    try:
        modules = parse_modules(args.lora_modules or ())
        origins = parse_origins(args.allowed_origins)
    except ValueError as e:
        raise _BadFlag(str(e)) from None
    if (modules or args.allow_runtime_lora) and not config.lora.enable_lora:
        raise _BadFlag("--lora-modules and --allow-runtime-lora need --enable-lora")
    if args.shutdown_timeout < 0:
        raise _BadFlag("--shutdown-timeout must be 0 or more seconds")
    return origins, modules


def _check_adapters(llm: Any, modules: list) -> None:
    """Each --lora-modules adapter against the base model: a bad one is a clear error, not a traceback."""
    if not modules:
        return
    from ..lora.peft import load_adapter

    for name, path in modules:
        try:
            load_adapter(path, llm.engine.lora.model, llm.engine.lora.max_rank)
        except ValueError as e:
            raise _BadFlag(f"--lora-modules {name}: {e}") from None


def _server_config(args: argparse.Namespace, config: EngineConfig, llm: Any, origins: Any, modules: list) -> Any:
    from .. import settings
    from ..server.app import ServerConfig

    names = args.served_model_name or [llm.model_name]
    return ServerConfig(
        model_name=names[0],
        aliases=tuple(names[1:]),
        api_key=args.api_key or settings.get("api_key") or None,
        max_body_bytes=args.max_body_bytes,
        allowed_origins=origins,
        shutdown_timeout=args.shutdown_timeout,
        responses_store_size=max(0, args.responses_store_size),
        header_timeout=args.header_timeout,
        keep_alive_timeout=args.keep_alive_timeout,
        max_connections=args.max_connections,
        lora_modules=tuple(modules),
        allow_runtime_lora=bool(args.allow_runtime_lora),
        keep_anthropic_attribution=bool(args.keep_anthropic_attribution),
        root_path=(args.root_path or "").rstrip("/"),
        record_requests=args.record_requests,
        tokenizer_path=_tokenizer_path(config),
    )


def _tokenizer_path(config: EngineConfig) -> str | None:
    """A tokenizer a router could load itself: the folder given, or the model's when it holds one."""
    for cand in (config.load.tokenizer, config.load.model):
        if cand and (Path(cand).expanduser() / "tokenizer.json").is_file():
            return str(Path(cand).expanduser().resolve())
    return None


def _exit_now(code: int) -> None:
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def cmd_chat(args: argparse.Namespace, config: EngineConfig) -> int:
    from .chat import ChatSession, ChatSettings

    llm = load_llm(config)
    # `chat` has the sampling flags; `-i` and the mistral.rs forms take ChatSettings' defaults.
    given = {f.name: vars(args)[f.name] for f in dataclasses.fields(ChatSettings) if vars(args).get(f.name) is not None}
    return ChatSession(llm, ChatSettings(**given), system=vars(args).get("system")).run()


def _load_serve_args(server_args: list[str]) -> Any:
    """The `LLM` that `pagedllm serve SERVER_ARGS` would serve."""
    argv = ["serve", *server_args]
    ns = build_parser(argv).parse_args(argv)
    return load_llm(command_config(ns))


def cmd_bench(args: argparse.Namespace) -> int:
    if args.bench == "serve":
        from ..bench import loadtest

        # --against-throughput builds its offline engine from the server's flags, read by this
        # module's parser (the bench layer sits below the CLI and does not import it).
        args.offline_llm = lambda server_args: _load_serve_args(server_args)
        return loadtest.run(args)
    if args.bench in BENCHES:
        if args.tune:
            from .. import tuning

            try:
                tuning.configure(**tuning.from_args(args.tune))
            except ValueError as e:
                print(f"error: {e}", file=sys.stderr)
                return 2
        return _run_module(_bench_module(args.bench), args)
    print(f"usage: pagedllm bench {{{','.join([*BENCHES, 'serve'])}}} ...", file=sys.stderr)
    return 2


def _run_module(module: str, args: argparse.Namespace) -> int:
    try:
        mod = importlib.import_module(module)
    except ImportError as e:
        print(f"error: {module} is not available in this build ({e})", file=sys.stderr)
        return 2
    if not hasattr(mod, "run"):
        print(f"error: {module} has no run(args)", file=sys.stderr)
        return 2
    result = mod.run(args)
    return result if isinstance(result, int) else 0


def _tokenizer_dir(tok: str | None) -> str | None:
    from ..options import _local_tokenizer_dir

    return _local_tokenizer_dir(tok)
