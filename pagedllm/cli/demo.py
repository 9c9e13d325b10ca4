"""`pagedllm demo` (what `make run` runs): a handful of chat requests served together."""

from __future__ import annotations

import argparse
import threading
import time
from typing import Callable

QUESTIONS = [
    "What is the capital of France? Answer in one sentence.",
    "Write a haiku about the sea.",
    "Give me three short tips for sleeping better.",
    "Explain in two sentences what a hash table is.",
    "Name three planets of the solar system.",
    "Translate 'good morning' into Spanish and French.",
]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="default")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--pa-gpu-mem", type=float, default=256, help="KV cache size in MB")


class _Heartbeat:
    """A line from a side thread whenever the demo has said nothing for 5 s: one engine step (the
    prefill of every prompt) or the load may take that long on a busy machine."""

    def __init__(self, status: Callable[[], str]) -> None:
        self.status, self.last = status, time.perf_counter()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._beat, daemon=True)

    def said(self) -> None:
        self.last = time.perf_counter()

    def _beat(self) -> None:
        while not self.stop.wait(1.0):
            if time.perf_counter() - self.last >= 5:
                print(f"  ... {self.status()}", flush=True)
                self.said()

    def __enter__(self) -> "_Heartbeat":
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join()


def run(args: argparse.Namespace) -> int:
    print(f"loading torch, then {args.model} ...", flush=True)
    t_load = time.perf_counter()
    with _Heartbeat(lambda: f"loading, {time.perf_counter() - t_load:.0f} s"):
        from .. import LLM, SamplingParams
        from ..tokenizer.chat import render_chat

        llm = LLM(args.model, kv_cache_memory_mb=args.pa_gpu_mem)
    eng = llm.engine
    print(
        f"model: {eng.model_config.architecture}, {eng.model_config.num_layers} layers, "
        f"dtype {eng.dtype}, device {eng.device}"
    )
    convs = [[{"role": "user", "content": q}] for q in QUESTIONS]
    sp = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    t0 = time.perf_counter()
    # Track the cache while the requests run together.
    prompts = [render_chat(llm.tokenizer, c) for c in convs]
    from ..engine.driver import Item

    ids = llm.driver.add([Item(None, p, sp) for p in prompts])
    done, peak_blocks, peak_tokens = {}, 0, 0
    question = dict(zip(ids, QUESTIONS))
    print(f"{len(ids)} requests sent together; each answer is printed as it finishes", flush=True)
    with _Heartbeat(lambda: f"{len(done)} of {len(ids)} answers done, {time.perf_counter() - t0:.0f} s") as beat:
        for outs in llm.driver.steps(ids):
            for out in outs:
                if out.finished:
                    done[out.request_id] = o = out
                    print(
                        f"\n>>> {question[o.request_id]}\n{o.text.strip()}\n[{len(o.token_ids)} tokens, "
                        f"{o.finish_reason}, TTFT {o.metrics.time_to_first_token:.2f} s]",
                        flush=True,
                    )
                    beat.said()
            peak_blocks = max(peak_blocks, eng.block_manager.num_used_blocks)
            peak_tokens = max(peak_tokens, sum(s.num_computed_tokens for s in eng.scheduler.running))
    dt = time.perf_counter() - t0
    n_out = sum(len(o.token_ids) for o in done.values())
    bm = eng.block_manager
    print(f"\n{len(ids)} requests served together in {dt:.1f} s: {n_out} tokens, {n_out / dt:.1f} tokens/s aggregate")
    print(
        f"KV cache: {bm.num_usable_blocks} blocks of {bm.block_size} tokens; peak {peak_blocks} "
        f"blocks used holding {peak_tokens} tokens; now {bm.num_used_blocks} used, "
        f"{bm.num_free_blocks} free; preemptions {eng.scheduler.num_preemptions}"
    )
    return 0


if __name__ == "__main__":
    import logging

    logging.basicConfig(level=logging.WARNING)
    parser = argparse.ArgumentParser(prog="pagedllm demo")
    add_arguments(parser)
    raise SystemExit(run(parser.parse_args()))
