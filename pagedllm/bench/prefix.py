"""`pagedllm bench prefix`: a seeded multi-turn chat + shared-system-prompt workload with
prefix caching on (token-exact), on (block-granular only) and off, in one run. `--plot PATH`
draws each mode's TTFT against the conversation's length, turn by turn (matplotlib, the `plot`
extra)."""

from __future__ import annotations

import argparse
import random
import time

from .common import machine_info, median_of_runs, percentile, pyplot, save_figure, write_json

WORDS = (
    "river mountain engine paper garden window history science music planet market "
    "language winter signal forest harbor bridge ocean theory memory circuit village "
    "library orbit canvas thunder desert lantern compass meadow glacier"
).split()


def _sentence(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n)).capitalize() + "."


def _user_turn(rng: random.Random, words: int) -> str:
    return "Please think about this: " + " ".join(_sentence(rng, 10) for _ in range(words // 10))


def run_conversations(llm, n_convs: int, turns: int, answer_tokens: int, user_words: int, seed: int) -> list[list]:
    """Conversations advance together, one turn per generate call. Returns outputs per turn."""
    from ..sampling.params import SamplingParams
    from ..tokenizer.chat import render_chat

    rng = random.Random(seed)
    convs = [[{"role": "system", "content": "You are a helpful assistant."}] for _ in range(n_convs)]
    per_turn = []
    for _ in range(turns):
        for c in convs:
            c.append({"role": "user", "content": _user_turn(rng, user_words)})
        prompts = [render_chat(llm.tokenizer, c) for c in convs]
        sp = SamplingParams(max_tokens=answer_tokens, temperature=0.0, ignore_eos=True)
        outs = llm.generate(prompts, sp, use_tqdm=False)
        for c, o in zip(convs, outs):
            c.append({"role": "assistant", "content": o.text})
        per_turn.append(outs)
    return per_turn


def run_shared_system(llm, n: int, system_words: int, answer_tokens: int, seed: int) -> list:
    from ..sampling.params import SamplingParams
    from ..tokenizer.chat import render_chat

    rng = random.Random(seed + 1)
    system = "You are an expert assistant. " + " ".join(_sentence(rng, 12) for _ in range(system_words // 12))
    msgs = [
        [{"role": "system", "content": system}, {"role": "user", "content": f"Question {i}: " + _sentence(rng, 12)}]
        for i in range(n)
    ]
    prompts = [render_chat(llm.tokenizer, m) for m in msgs]
    sp = SamplingParams(max_tokens=answer_tokens, temperature=0.0, ignore_eos=True)
    return llm.generate(prompts, sp, use_tqdm=False)


def measure(llm, args) -> dict:
    bm = llm.engine.block_manager
    t0 = time.perf_counter()
    turns = run_conversations(llm, args.conversations, args.turns, args.answer_tokens, args.user_words, args.seed)
    shared = run_shared_system(llm, args.shared_requests, args.system_words, 32, args.seed)
    dt = time.perf_counter() - t0
    outs = [o for t in turns for o in t] + list(shared)
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outs)
    out_tokens = sum(len(o.token_ids) for o in outs)
    ttft = [o.metrics.time_to_first_token for o in outs]
    last = turns[-1]
    return {
        "elapsed_s": dt,
        "requests": len(outs),
        "output_tokens_per_s": out_tokens / dt,
        "prompt_tokens": prompt_tokens,
        "prefill_tokens_saved": sum(o.num_cached_tokens for o in outs),
        "partial_block_tokens_saved": bm.stats.partial_hits,
        "hit_rate": sum(o.num_cached_tokens for o in outs) / prompt_tokens,
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p99_s": percentile(ttft, 99),
        "last_turn_prompt_tokens": sum(len(o.prompt_token_ids) for o in last) / len(last),
        "last_turn_cached_share": sum(o.num_cached_tokens for o in last) / sum(len(o.prompt_token_ids) for o in last),
        "last_turn_ttft_s": percentile([o.metrics.time_to_first_token for o in last], 50),
        "shared_system_ttft_p50_s": percentile([o.metrics.time_to_first_token for o in shared], 50),
        # per turn of the conversations: mean prompt tokens (the history so far) and TTFT p50;
        # a list, so median_of_runs keeps the first run's
        "by_turn": [
            [
                sum(len(o.prompt_token_ids) for o in t) / len(t),
                percentile([o.metrics.time_to_first_token for o in t], 50),
            ]
            for t in turns
        ],
    }


def turn_n_alone(llm, args) -> dict:
    """One conversation alone: the last turn's TTFT and cached share (TTFT is not diluted by
    other requests sharing the step)."""
    turns = run_conversations(llm, 1, args.turns, args.alone_answer_tokens, args.alone_user_words, args.seed + 7)
    o = turns[-1][0]
    return {
        "prompt_tokens": len(o.prompt_token_ids),
        "cached_tokens": o.num_cached_tokens,
        "ttft_s": o.metrics.time_to_first_token,
    }


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="default")
    p.add_argument("--conversations", type=int, default=4)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--answer-tokens", type=int, default=160)
    p.add_argument("--user-words", type=int, default=90)
    p.add_argument(
        "--alone-user-words",
        type=int,
        default=30,
        help="user turn length of the single conversation timed alone (chat-like)",
    )
    p.add_argument("--alone-answer-tokens", type=int, default=220)
    p.add_argument("--shared-requests", type=int, default=32)
    p.add_argument("--system-words", type=int, default=400)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--runs", type=int, default=1, help="repeat and report medians")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--pa-gpu-mem", type=float, default=512, help="KV cache MB")
    p.add_argument("--output", default="bench-results/prefix.json")
    p.add_argument(
        "--plot",
        default=None,
        metavar="PATH",
        help="draw TTFT against the conversation's length per mode as a PNG (matplotlib: pip install 'pagedllm[plot]')",
    )


def run(args: argparse.Namespace) -> dict:
    from .. import LLM

    modes = {
        "cache on (token-exact)": dict(enable_prefix_caching=True),
        "cache on (block-granular)": dict(enable_prefix_caching=True),
        "cache off": dict(enable_prefix_caching=False),
    }
    if args.plot and pyplot() is None:
        raise SystemExit(2)
    result = {"machine": machine_info(), "args": vars(args)}
    for name, kw in modes.items():
        runs, alone = [], []
        for _ in range(args.runs):
            llm = LLM(args.model, dtype=args.dtype, kv_cache_memory_mb=args.pa_gpu_mem, **kw)
            llm.engine.block_manager.token_exact = "block-granular" not in name
            runs.append(measure(llm, args))
            alone.append(turn_n_alone(llm, args))
            del llm
        r = median_of_runs(runs)
        r["turn_alone"] = median_of_runs(alone)
        result[name] = r
        a = r["turn_alone"]
        print(
            f"{name}: hit rate {r['hit_rate']:.1%}, prefill tokens saved {r['prefill_tokens_saved']:.0f} "
            f"of {r['prompt_tokens']:.0f} (partial-block copies {r['partial_block_tokens_saved']:.0f}), "
            f"TTFT p50 {r['ttft_p50_s']:.3f} s p99 {r['ttft_p99_s']:.3f} s, "
            f"{r['output_tokens_per_s']:.1f} output tok/s, {r['elapsed_s']:.1f} s; "
            f"turn {args.turns} alone: {a['cached_tokens']:.0f}/{a['prompt_tokens']:.0f} tokens cached, "
            f"TTFT {a['ttft_s'] * 1000:.0f} ms"
        )
    on, off = result["cache on (token-exact)"], result["cache off"]
    blk = result["cache on (block-granular)"]
    speedup = off["turn_alone"]["ttft_s"] / on["turn_alone"]["ttft_s"]
    print(
        f"turn {args.turns} TTFT, cache off / on: {speedup:.1f}x; whole workload time off / on: "
        f"{off['elapsed_s'] / on['elapsed_s']:.2f}x; token-exact over block-granular: "
        f"{on['prefill_tokens_saved'] - blk['prefill_tokens_saved']:.0f} more prefill tokens saved, "
        f"TTFT p50 {blk['ttft_p50_s'] / on['ttft_p50_s']:.2f}x lower"
    )
    result["turn_ttft_speedup"] = speedup
    path = write_json(args.output, result)
    print(f"results written to {path}")
    if args.plot:
        plot(result, list(modes), args.plot)
    return result


def plot(result: dict, modes: list[str], path: str) -> None:
    """TTFT p50 of each turn of the concurrent conversations against that turn's prompt length."""
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for name in modes:
        turns = result[name]["by_turn"]
        ax.plot([t[0] for t in turns], [t[1] * 1e3 for t in turns], marker="o", label=name)
    ax.set_xlabel("prompt tokens of the turn (the conversation so far)")
    ax.set_ylabel("TTFT p50 (ms)")
    a = result["args"]
    ax.set_title(
        f"pagedllm bench prefix, {a['model']}: {a['conversations']} conversations x {a['turns']} turns", fontsize=10
    )
    ax.legend(fontsize=8)
    save_figure(fig, path)


if __name__ == "__main__":
    import logging

    logging.basicConfig(level=logging.WARNING)
    parser = argparse.ArgumentParser(prog="pagedllm bench prefix")
    add_arguments(parser)
    raise SystemExit(0 if run(parser.parse_args()) else 1)
