"""`pagedllm serve --data-parallel-size N` and `pagedllm router --backend URL ...`: replicas behind
SGLang's model gateway (server/replicas.py starts and supervises them)."""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from .. import settings
from ..server import replicas as rp

# Flags of `serve` that belong to the whole (the gateway) rather than to each replica.
_GATEWAY_FLAGS = {
    "--data-parallel-size": 1,
    "--routing": 1,
    "--host": 1,
    "--serve-ip": 1,
    "--port": 1,
    "-p": 1,
    "--api-key": 1,
}


def add_serve_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("replicas (SGLang's gateway in front: pip install 'pagedllm[router]')")
    g.add_argument(
        "--data-parallel-size",
        "-dp",
        type=int,
        default=1,
        metavar="N",
        help="N replicas of the model, each its own process on its share of the cores, "
        "behind SGLang's gateway on --port (default 1: no gateway)",
    )
    g.add_argument(
        "--routing",
        default="cache_aware",
        choices=rp.POLICIES,
        help="the gateway's policy with --data-parallel-size (default: cache_aware, the replica "
        "that holds the longest prefix of the request)",
    )


def _fault_flags(p: argparse.ArgumentParser) -> None:
    d = rp.FaultOptions()
    g = p.add_argument_group("faults (the gateway's)")
    g.add_argument(
        "--retries",
        type=int,
        default=d.retries,
        metavar="N",
        help="a request that failed before its first byte is tried N more times, on the "
        "replica the policy picks again (default %(default)s)",
    )
    g.add_argument(
        "--health-interval",
        type=int,
        default=d.health_interval,
        metavar="S",
        help="seconds between health checks of each backend (default %(default)s)",
    )
    g.add_argument(
        "--health-timeout",
        type=int,
        default=d.health_timeout,
        metavar="S",
        help="a health check slower than S seconds fails (default %(default)s)",
    )
    g.add_argument(
        "--health-failures",
        type=int,
        default=d.health_failures,
        metavar="N",
        help="failed checks in a row that take a backend out of routing (default %(default)s)",
    )
    g.add_argument(
        "--breaker-failures",
        type=int,
        default=d.breaker_failures,
        metavar="N",
        help="failed requests in a row that open a backend's circuit breaker (default %(default)s)",
    )
    g.add_argument(
        "--breaker-open",
        type=int,
        default=d.breaker_open_s,
        metavar="S",
        help="seconds an open circuit breaker keeps the backend out (default %(default)s)",
    )


def add_router_parser(sub: argparse._SubParsersAction) -> None:
    r = sub.add_parser(
        "router",
        help="SGLang's gateway in front of running `pagedllm serve` instances",
        usage="pagedllm router --backend URL [--backend URL ...] [--port N] [--routing POLICY]",
    )
    r.add_argument(
        "--backend",
        action="append",
        required=True,
        metavar="URL|FILE",
        help="a `pagedllm serve` URL (repeatable), or a file of URLs, one a line",
    )
    r.add_argument("--host", default="127.0.0.1", help="address the gateway binds (default 127.0.0.1)")
    r.add_argument("--port", "-p", type=int, default=8000)
    r.add_argument("--api-key", default=None, help="the key clients must send to the gateway (also PAGEDLLM_API_KEY)")
    r.add_argument("--routing", default="cache_aware", choices=rp.POLICIES)
    r.add_argument("--log-dir", default=None, help="where gateway.log goes (default: a temporary folder)")
    _fault_flags(r)


def _faults(args: argparse.Namespace) -> rp.FaultOptions:
    if not hasattr(args, "retries"):
        return rp.FaultOptions()
    return rp.FaultOptions(
        retries=args.retries,
        health_interval=args.health_interval,
        health_timeout=args.health_timeout,
        health_failures=args.health_failures,
        breaker_failures=args.breaker_failures,
        breaker_open_s=args.breaker_open,
    )


def replica_args(argv: list[str]) -> list[str]:
    """`serve`'s arguments as each replica gets them: without the flags that belong to the gateway."""
    out, i = [], 0
    argv = argv[argv.index("serve") + 1 :] if "serve" in argv else list(argv)
    while i < len(argv):
        a = argv[i]
        name = a.split("=", 1)[0]
        if name in _GATEWAY_FLAGS:
            i += 1 if "=" in a else 1 + _GATEWAY_FLAGS[name]
            continue
        out.append(a)
        i += 1
    return out


def _log_dir(given: str | None) -> Path:
    path = Path(given) if given else Path(tempfile.mkdtemp(prefix="pagedllm-fleet-"))
    path.mkdir(parents=True, exist_ok=True)
    return path


def cmd_serve_replicas(argv: list[str], args: argparse.Namespace) -> int:
    n = args.data_parallel_size
    if n < 1:
        print("error: --data-parallel-size must be 1 or more", file=sys.stderr)
        return 2
    try:
        rp.require_gateway()
    except RuntimeError as e:
        print(f"error: --data-parallel-size {n}: {e}", file=sys.stderr)
        return 2
    log_dir = _log_dir(settings.get("fleet_log_dir"))
    shares = rp.split_cores(n)
    per = replica_args(argv)
    reps = [rp.Replica(i, per, rp.free_port(), shares[i], log_dir) for i in range(n)]
    api_key = args.api_key or settings.get("api_key") or None
    fleet = rp.Fleet(reps, [], args.host, args.port, args.routing, _faults(args), log_dir, api_key)
    print(f"starting {n} replicas and the gateway (logs in {log_dir})", file=sys.stderr, flush=True)
    return rp.run_until_signal(fleet)


def cmd_router(args: argparse.Namespace) -> int:
    try:
        rp.require_gateway()
        backends = rp.read_backends(args.backend)
    except (RuntimeError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    api_key = args.api_key or settings.get("api_key") or None
    fleet = rp.Fleet([], backends, args.host, args.port, args.routing, _faults(args), _log_dir(args.log_dir), api_key)
    return rp.run_until_signal(fleet)
