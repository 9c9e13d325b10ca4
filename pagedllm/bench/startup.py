"""`pagedllm bench startup`: time from starting `pagedllm generate` to its first token.

Each run is a fresh process (the cost a user pays for every one-shot command): the clock
starts just before the process is spawned and stops when the first byte of the answer
arrives on its stdout (the "loading ..." line goes to stderr). Reports the median, and the
CPU seconds the whole process used, which a busy machine disturbs less than the wall time;
and beside it a bare `python -c "import torch"` timed the same way, and the gap between the two:
what pagedllm adds to the torch every such program pays.

In the same run, llama.cpp (llama-cpp-python, where installed: `make bench-deps`) does the same
on the same GGUF file: a fresh Python process that loads it, applies the GGUF's chat template
to the prompt (as `generate` does) and streams the answer, timed to its first byte.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable


# The llama.cpp child: what `pagedllm generate PROMPT --max-tokens 8` does, with llama-cpp-python.
LLAMA_CPP_CHILD = """
import os, sys
from llama_cpp import Llama
llm = Llama(model_path=sys.argv[1], n_ctx=2048, n_threads=os.cpu_count(), verbose=False)
stream = llm.create_chat_completion(messages=[{"role": "user", "content": sys.argv[2]}], max_tokens=8,
                                    temperature=0.0, stream=True)
for chunk in stream:
    text = chunk["choices"][0]["delta"].get("content")
    if text:
        sys.stdout.write(text)
        sys.stdout.flush()
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="default")
    p.add_argument("--runs", type=int, default=5, help="processes to start (default 5)")
    p.add_argument("--prompt", default="Why is the sky blue?")
    p.add_argument("--extra", default="", help="more flags for `generate`, as one string")


def time_to_first_token(model: str, prompt: str, extra: list[str]) -> tuple[float, float, float]:
    """(seconds to the first stdout byte, seconds to exit, CPU seconds) of one `pagedllm generate`."""
    return _time_first_byte(
        [sys.executable, "-m", "pagedllm.cli.main", "generate", prompt, "-m", model, "--max-tokens", "8", *extra]
    )


def llama_cpp_time_to_first_token(gguf: str, prompt: str) -> tuple[float, float, float]:
    """The same for llama.cpp on the GGUF file `gguf`."""
    return _time_first_byte([sys.executable, "-c", LLAMA_CPP_CHILD, gguf, prompt])


def _time_first_byte(cmd: list[str]) -> tuple[float, float, float]:
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=os.environ.copy())
    assert proc.stdout is not None
    first = proc.stdout.read(1)
    t_first = time.perf_counter() - t0
    proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = rc = os.waitstatus_to_exitcode(status)
    if rc != 0 or not first:
        raise RuntimeError(f"{' '.join(cmd[:3])} ... failed with exit code {rc}")
    return t_first, time.perf_counter() - t0, usage.ru_utime + usage.ru_stime


def import_torch_time() -> tuple[float, float, float]:
    """The same for a bare `python -c "import torch"`: the floor every torch program pays."""
    return _time_first_byte([sys.executable, "-c", "import torch, sys; sys.stdout.write('x')"])


def _series(label: str, runs: int, once: Callable[[], tuple[float, float, float]]) -> tuple[float, float]:
    firsts, totals, cpus = [], [], []
    for i in range(runs):
        t_first, t_total, cpu = once()
        firsts.append(t_first)
        totals.append(t_total)
        cpus.append(cpu)
        print(
            f"{label} run {i + 1}: first token after {t_first:.2f} s, exit after {t_total:.2f} s, {cpu:.2f} CPU s",
            flush=True,
        )
    print(
        f"{label} median of {runs}: first token {statistics.median(firsts):.2f} s "
        f"(min {min(firsts):.2f}, max {max(firsts):.2f}), exit {statistics.median(totals):.2f} s, "
        f"{statistics.median(cpus):.2f} CPU s",
        flush=True,
    )
    return statistics.median(firsts), statistics.median(cpus)


def llama_cpp_skip_reason(model: str) -> tuple[str | None, str]:
    """(None, the GGUF path) where llama.cpp can run the model, else (why not, "")."""
    import importlib.util

    from .llamacpp_peer import MISSING_HINT

    if importlib.util.find_spec("llama_cpp") is None:
        return MISSING_HINT, ""
    from ..loading.source import default_model_path

    path = default_model_path() if model == "default" else Path(model).expanduser()
    if path.suffix != ".gguf" or not path.is_file():
        return f"{model} is not a .gguf file (llama.cpp reads only GGUF)", ""
    return None, str(path)


def run(args: argparse.Namespace) -> int:
    extra = args.extra.split() if args.extra else []
    print(f"CPU flags: {cpu_flags()}", flush=True)
    floor = _series("import torch", args.runs, import_torch_time)
    first = _series("pagedllm", args.runs, lambda: time_to_first_token(args.model, args.prompt, extra))
    print(
        f"pagedllm's first token {first[0]:.2f} s - bare import torch {floor[0]:.2f} s = "
        f"{first[0] - floor[0]:.2f} s; in CPU seconds {first[1]:.2f} - {floor[1]:.2f} = {first[1] - floor[1]:.2f} "
        f"(medians of {args.runs}; CPU seconds are what a busy machine disturbs least)",
        flush=True,
    )
    why, gguf = llama_cpp_skip_reason(args.model)
    if why:
        print(f"llama.cpp: skipped ({why})", flush=True)
        return 0
    _series("llama.cpp", args.runs, lambda: llama_cpp_time_to_first_token(gguf, args.prompt))
    return 0


def cpu_flags() -> str:
    """The CPU's SIMD flags, which decide the kernels' level (pagedllm/native), beside the figures."""
    from .compare import cpu_info

    info = cpu_info()
    return f"{' '.join(info['cpu_flags']) or 'unknown'} ({info['cpu'] or 'unknown CPU'})"


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="pagedllm bench startup")
    add_arguments(parser)
    raise SystemExit(run(parser.parse_args()))
