"""The `pagedllm` command's entry point: parse (cli/parser.py), then run the command chosen
(cli/commands.py). The usage is in cli/parser.py's docstring and `pagedllm --help`."""

from __future__ import annotations

import logging
import sys
from typing import Callable

from .commands import _run_module, cmd_bench, cmd_chat, cmd_serve, command_config
from .generate import cmd_generate, cmd_trace
from .parser import build_parser
from . import scaleout

__all__ = ["build_parser", "command_config", "main"]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=getattr(logging, args.log_level.upper()), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if args.command is None and not args.interactive_mode:
        parser.print_help()
        return 2
    handlers: dict[str, Callable[..., int]] = {
        "serve": cmd_serve,
        "chat": cmd_chat,
        "generate": cmd_generate,
        "trace": cmd_trace,
    }
    try:
        if args.command == "router":
            return scaleout.cmd_router(args)
        if args.command == "serve" and args.data_parallel_size != 1:
            return scaleout.cmd_serve_replicas(argv, args)
        if args.command == "serve" or (args.command in ("plain", "gguf") and not args.interactive_mode):
            from ..server.listen import listen_socket

            # Before the model loads: a busy port fails now, in well under a second.
            args.listen_socket = listen_socket(args.host, args.port)
        if args.command == "bench":
            return cmd_bench(args)
        if args.command == "demo":
            return _run_module("pagedllm.cli.demo", args)
        if args.command in ("env", "collect-env"):
            return _run_module("pagedllm.cli.env", args)
        config = command_config(args)
        if args.command in ("plain", "gguf"):
            return cmd_chat(args, config) if args.interactive_mode else cmd_serve(args, config)
        if args.command is None:  # `pagedllm -i`: chat with the default model
            return cmd_chat(args, config)
        return handlers[args.command](args, config)
    except (ValueError, FileNotFoundError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        options = sys.modules.get("pagedllm.options")  # not imported: e cannot be an UnsupportedOption
        return 2 if options is not None and isinstance(e, options.UnsupportedOption) else 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
