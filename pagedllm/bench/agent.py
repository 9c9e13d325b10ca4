"""`pagedllm bench agent`: a coding agent's recorded session replayed against `pagedllm serve`
and llama.cpp's server (llama-cpp-python's OpenAI server: same GGUF file, same threads, its
prompt cache on: a prompt that extends what its context holds computes only the rest), one
engine at a time, each started fresh for every repeat.

Both get the same prompts through the same route: each recorded request is rendered to its
prompt by pagedllm's dialect code (agent_session.py), checked to tokenize alike in both, and sent
as text to `/v1/completions`, streamed, greedy, with the end-of-text tokens forbidden so that
every turn generates `--max-tokens` tokens in both. Turns go one after another, as the agent sent
them. Per turn: time to first token, the turn's time, and the prompt tokens the engine computed
(not read from its cache): pagedllm's usage (`cached_tokens`), llama.cpp's own timing line.
The session's wall time is the sum of its turns. Medians over `--repeats`.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .agent_session import Turn, load_turns
from .common import machine_info, stop_server, wait_ready, write_json

ENGINES = ("pagedllm", "llama.cpp")
LLAMA_HINT = (
    "llama-cpp-python's server is not installed: run `make bench-deps` (the wheel, and the "
    "server's sse-starlette, starlette-context and pydantic-settings)"
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="a GGUF file (the agents' sessions were recorded on Qwen2.5-Coder-1.5B-Instruct)")
    p.add_argument(
        "--session",
        default="claude-code",
        help="a shipped session (claude-code, codex) or a folder of `serve --record-requests` files",
    )
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="threads of each engine")
    p.add_argument("--repeats", type=int, default=3, help="fresh starts of each engine (the median is reported)")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens each turn generates, in both engines")
    p.add_argument("--ctx", type=int, default=32768, help="context length of both engines")
    p.add_argument("--engines", default=",".join(ENGINES), help="comma-separated: pagedllm, llama.cpp")
    p.add_argument(
        "--peer-ram-cache",
        action="store_true",
        help="turn on llama-cpp-python's RAM cache of whole prompt states (--cache true) as well as its "
        "prefix reuse within the context; off by default: on an 11k-token session it copies a 330 MB "
        "state at each turn and its server was killed for memory on a 24 GiB machine",
    )
    p.add_argument("--output", default="bench-results/agent.json")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _command(engine: str, args: argparse.Namespace, port: int) -> list[str]:
    if engine == "pagedllm":
        return [
            sys.executable,
            "-m",
            "pagedllm.cli.main",
            "serve",
            args.model,
            "--port",
            str(port),
            "--threads",
            str(args.threads),
            "--max-model-len",
            str(args.ctx),
            "--served-model-name",
            "replay",
        ]
    return [
        sys.executable,
        "-m",
        "llama_cpp.server",
        "--model",
        args.model,
        "--port",
        str(port),
        "--host",
        "127.0.0.1",
        "--n_threads",
        str(args.threads),
        "--n_threads_batch",
        str(args.threads),
        "--n_ctx",
        str(args.ctx),
        "--cache",
        str(args.peer_ram_cache).lower(),
        "--model_alias",
        "replay",
        "--verbose",
        "true",
    ]


def _turn(url: str, turn: Turn, args: argparse.Namespace, forbid: dict) -> dict:
    """One streamed completion: time to the first token, the whole turn's time, usage."""
    import httpx

    body = {
        "model": "replay",
        "prompt": turn.text,
        "max_tokens": args.max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "logit_bias": forbid,
    }
    t0 = time.perf_counter()
    first, usage, pieces = None, None, 0
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=3600) as r:
        if r.status_code != 200:
            raise RuntimeError(f"the server answered {r.status_code}: {r.read().decode()[:500]}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices") and chunk["choices"][0].get("text"):
                pieces += 1
                first = first or time.perf_counter()
            usage = chunk.get("usage") or usage
    end = time.perf_counter()
    return {
        "ttft_s": (first or end) - t0,
        "turn_s": end - t0,
        "prompt_tokens": len(turn.ids),
        "pieces": pieces,
        "usage": usage,
    }


# llama.cpp's own line after each completion: "prompt eval time = X ms / N tokens".
PROMPT_EVAL = re.compile(r"prompt eval time =\s*[\d.]+ ms /\s*(\d+) tokens")


def _session(engine: str, args: argparse.Namespace, turns: list[Turn], forbid: dict, logs: Path, k: int) -> dict:
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    log = logs / f"{engine}-{k}.log"
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    with open(log, "w") as out:
        proc = subprocess.Popen(_command(engine, args, port), stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        try:
            wait_ready(url, proc, 600, "/v1/models")  # (llama-cpp-python's server has no /health)
        except RuntimeError as e:
            raise RuntimeError(f"{engine}: {e}; its log: {log}") from None
        # One short request first, sharing nothing with the session: a server a user points an
        # agent at has been up, its lazy start-up work done.
        _turn(url, Turn("/v1/completions", 0.0, [], "Hello"), args, forbid)
        rows = []
        for turn in turns:
            seen = len(PROMPT_EVAL.findall(log.read_text(errors="replace")))
            row = _turn(url, turn, args, forbid)
            row["computed_tokens"] = _computed(engine, row, log, seen)
            rows.append(row)
            print(
                f"  {engine} run {k + 1} turn {len(rows)}: {row['prompt_tokens']} prompt tokens, "
                f"{row['computed_tokens']} computed, TTFT {row['ttft_s']:.1f} s, turn {row['turn_s']:.1f} s",
                flush=True,
            )
        return {"turns": rows, "wall_s": sum(r["turn_s"] for r in rows)}
    finally:
        stop_server(proc)


def _computed(engine: str, row: dict, log: Path, seen: int) -> int | None:
    """Prompt tokens the engine computed for the turn (the rest came from its cache)."""
    if engine == "pagedllm":
        u = row["usage"] or {}
        cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        return u.get("prompt_tokens", row["prompt_tokens"]) - cached
    for _ in range(20):  # (its timing line is written just after the stream ends)
        found = PROMPT_EVAL.findall(log.read_text(errors="replace"))
        if len(found) > seen:
            return int(found[seen])
        time.sleep(0.1)
    return None


# Tokens either engine may end a turn on (llama.cpp stops at every end-of-generation token of
# the vocabulary, pagedllm at the model's EOS ids): all forbidden, so both generate alike.
END_NAMES = (
    "<|endoftext|>",
    "<|im_end|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
    "<|eot_id|>",
    "<end_of_turn>",
)


def _end_tokens(tok) -> list[int]:
    ids = set(tok.eos_token_ids) | {tok.token_to_id(n) for n in END_NAMES}
    return sorted(i for i in ids if i is not None)


def _median_session(runs: list[dict]) -> dict:
    n = len(runs[0]["turns"])
    return {
        "wall_s": statistics.median(r["wall_s"] for r in runs),
        "walls_s": [round(r["wall_s"], 2) for r in runs],
        "ttft_s": [statistics.median(r["turns"][i]["ttft_s"] for r in runs) for i in range(n)],
        "turn_s": [statistics.median(r["turns"][i]["turn_s"] for r in runs) for i in range(n)],
        "computed_tokens": [runs[0]["turns"][i]["computed_tokens"] for i in range(n)],
        "prompt_tokens": [runs[0]["turns"][i]["prompt_tokens"] for i in range(n)],
    }


def _report(result: dict) -> None:
    eng = result["engines"]
    print(
        f"\nsession {result['session']}: {len(result['prompt_tokens'])} turns, prompts {result['prompt_tokens']} tokens; "
        f"{result['max_tokens']} generated a turn; {result['threads']} threads; medians of {result['repeats']}"
    )
    for name, r in eng.items():
        ttft = ", ".join(f"{t:.1f}" for t in r["ttft_s"])
        print(
            f"  {name:10s} wall {r['wall_s']:7.1f} s (runs {r['walls_s']}); TTFT per turn [{ttft}] s; "
            f"computed prompt tokens {r['computed_tokens']}"
        )
    if len(eng) == 2:
        p, ll = eng["pagedllm"], eng["llama.cpp"]
        result["wall_ratio"] = p["wall_s"] / ll["wall_s"]
        result["ttft_ratio"] = [a / b for a, b in zip(p["ttft_s"], ll["ttft_s"])]
        print(
            f"  pagedllm / llama.cpp: session wall {result['wall_ratio']:.2f}x; TTFT per turn "
            f"[{', '.join(f'{x:.2f}' for x in result['ttft_ratio'])}]x"
        )


def run(args: argparse.Namespace) -> int:
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    bad = [e for e in engines if e not in ENGINES]
    if bad or not engines:
        print(f"error: --engines {args.engines!r}: choose from {', '.join(ENGINES)}", file=sys.stderr)
        return 2
    if "llama.cpp" in engines:
        try:
            import llama_cpp.server.app  # noqa: F401
        except ImportError:
            print(f"error: {LLAMA_HINT}", file=sys.stderr)
            return 2
    try:
        turns, tok = load_turns(args.session, args.model, args.ctx)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    forbid = {str(t): -100 for t in _end_tokens(tok)}
    result = {
        "session": args.session,
        "model": str(args.model),
        "threads": args.threads,
        "repeats": args.repeats,
        "max_tokens": args.max_tokens,
        "prompt_tokens": [len(t.ids) for t in turns],
        "engines": {},
        "machine": machine_info(),
    }
    logs = Path(tempfile.mkdtemp(prefix="pagedllm-bench-agent-"))
    print(f"replaying {len(turns)} turns of {args.session} (server logs in {logs})", flush=True)
    runs: dict[str, list] = {e: [] for e in engines}
    for k in range(args.repeats):  # engines alternate, so a drift of the machine's speed hits both
        for engine in engines:
            runs[engine].append(_session(engine, args, turns, forbid, logs, k))
    result["engines"] = {e: _median_session(r) | {"runs": r} for e, r in runs.items()}
    _report(result)
    write_json(args.output, result)
    print(f"wrote {args.output}")
    return 0
