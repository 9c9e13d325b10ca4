"""`pagedllm bench speculative`: n-gram speculation (and, with --draft, a draft model) against
plain decoding in one run, on a code-editing workload (rewrite a given 60-line function with
one small change: the answer mostly copies the prompt), on free-form chat (little to copy) at
batch 1, and with 32 concurrent chat requests; decode tokens/s, ratios and acceptance rates
for each. `--plot PATH` draws each mode's speedup, acceptance rate and mean accepted length
per workload (matplotlib, the `plot` extra)."""

from __future__ import annotations

import argparse
import statistics
import time

from .common import machine_info, pyplot, save_figure, write_json

CHAT_QUESTIONS = [
    "What makes a good cup of tea?",
    "Tell me a short story about a lighthouse keeper.",
    "Why is the sky blue?",
    "Give me three tips for learning a new language.",
    "What would you pack for a week of hiking?",
    "Describe a rainy afternoon in a city.",
    "How do bees make honey?",
    "What is your favourite season and why?",
]


def code_edit_function(i: int) -> str:
    """A 60-line Python function, slightly different for each i."""
    name = ["summarize_orders", "merge_inventory", "score_students", "plan_routes"][i % 4]
    lines = [
        f"def {name}(records, threshold={10 + i}, verbose=False):",
        '    """Group the records by key, total their amounts and flag the large groups."""',
        "    totals = {}",
        "    counts = {}",
        "    flagged = []",
    ]
    for j in range(12):
        lines += [
            f"    # step {j + 1}: fold field_{j} into the running totals",
            "    for rec in records:",
            f"        key = rec.get('key_{j}', 'none')",
            f"        totals[key] = totals.get(key, 0) + rec.get('amount_{j}', 0) * {j + 2}",
        ]
    lines += [
        "    for key, total in totals.items():",
        "        counts[key] = counts.get(key, 0) + 1",
        "        if total > threshold:",
        "            flagged.append((key, total))",
        "    flagged.sort(key=lambda kv: kv[1], reverse=True)",
        "    if verbose:",
        "        for key, total in flagged:",
        "            print(key, total)",
        "    return flagged",
    ]
    return "\n".join(lines)


def code_edit_prompt(i: int) -> str:
    return (
        "Here is a Python function:\n\n```python\n" + code_edit_function(i) + "\n```\n\n"
        "Rewrite the whole function with one change: rename the variable `totals` to `sums`. "
        "Output only the complete rewritten code."
    )


def _one_request(llm, prompts, sp) -> dict:
    """Sums over one request: decode tokens and seconds (from its first token to its end), and
    for the whole request its output tokens and seconds from arrival to end (the prompt's
    prefill, the target's and a draft's, included)."""
    (o,) = llm.generate(prompts, sp, use_tqdm=False)
    n = len(o.outputs[0].token_ids)
    m = o.metrics
    return {
        "decode_tokens": max(0, n - 1),
        "decode_s": m.finished_time - m.first_token_time,
        "tokens": n,
        "request_s": m.finished_time - m.arrival_time,
    }


def _one_by_one_rates(sums: dict) -> dict:
    return {
        "decode_tok_s": sums["decode_tokens"] / sums["decode_s"],
        "decode_tokens": sums["decode_tokens"],
        "request_tok_s": sums["tokens"] / sums["request_s"],
    }


def _run_concurrent(llm, prompts, sp) -> dict:
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    return {"output_tokens": sum(len(o.outputs[0].token_ids) for o in outs), "s": time.perf_counter() - t0}


def _concurrent_rates(sums: dict) -> dict:
    return {"output_tok_s": sums["output_tokens"] / sums["s"], "output_tokens": sums["output_tokens"]}


def _chat(llm, text: str) -> list[int]:
    from ..tokenizer.chat import render_chat

    return render_chat(llm.tokenizer, [{"role": "user", "content": text}])


def _counts(llm) -> tuple[int, int, int]:
    st = llm.engine.spec.stats
    return st.proposed, st.accepted, st.verifications


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="default")
    p.add_argument("--dtype", default="auto")
    p.add_argument(
        "--num-tokens",
        type=int,
        default=5,
        help="proposals per step (k): 5 measured best on the default model's code-editing workload",
    )
    p.add_argument("--max-ngram", type=int, default=4)
    p.add_argument("--min-ngram", type=int, default=2)
    p.add_argument("--code-requests", type=int, default=2)
    p.add_argument("--code-tokens", type=int, default=400)
    p.add_argument("--chat-requests", type=int, default=3)
    p.add_argument("--chat-tokens", type=int, default=128)
    p.add_argument("--concurrent", type=int, default=32)
    p.add_argument("--concurrent-tokens", type=int, default=64)
    p.add_argument("--runs", type=int, default=3, help="alternating runs per mode; medians are reported")
    p.add_argument("--workloads", default="code,chat,concurrent")
    p.add_argument(
        "--draft",
        metavar="MODEL",
        default=None,
        help="also run draft-model speculation with this draft ('default' is the default "
        "model drafting for itself: with --draft-weights file about every proposal "
        "accepted, so it shows the draft's overhead and the ceiling)",
    )
    p.add_argument("--draft-tokens", type=int, default=None, help="the draft's proposals a step (default --num-tokens)")
    p.add_argument(
        "--draft-vocab",
        type=int,
        default=None,
        help="token ids the draft's head scores in full (speculative draft_vocab; 0: all; "
        "default: the first 32,768 of a vocabulary over 65,536)",
    )
    p.add_argument(
        "--draft-weights",
        default=None,
        help="the format the draft's quantized weights run in (speculative draft_weights: "
        "'auto', the default, requantizes those over 4.5 bits a weight to Q4_0; 'file' keeps "
        "the file's; or a type such as Q8_0)",
    )
    p.add_argument("--no-ngram", action="store_true", help="leave the n-gram mode out")
    p.add_argument(
        "--fixed",
        action="store_true",
        help="every mode proposes its full k each step (adaptive lengths off): the figures "
        "before adaptive lengths, for comparison",
    )
    p.add_argument("--pa-gpu-mem", type=float, default=512, help="KV cache MB")
    p.add_argument("--output", default="bench-results/speculative.json")
    p.add_argument(
        "--plot",
        default=None,
        metavar="PATH",
        help="draw speedup, acceptance rate and mean accepted length per workload and mode as a "
        "PNG (matplotlib: pip install 'pagedllm[plot]')",
    )


def run(args: argparse.Namespace) -> dict:
    from .. import LLM

    specs = _specs(args)
    if args.fixed:
        specs = {m: {**spec, "adaptive": False} for m, spec in specs.items()}
    if not specs:
        raise SystemExit("nothing to compare: --no-ngram needs --draft MODEL")
    if args.plot and pyplot() is None:
        raise SystemExit(2)
    # Prefix caching off: the repeated runs must not get their prompts for free in one mode only.
    common = dict(dtype=args.dtype, kv_cache_memory_mb=args.pa_gpu_mem, enable_prefix_caching=False)
    llms = {"plain": LLM(args.model, **common)}
    llms.update({m: LLM(args.model, speculative=spec, **common) for m, spec in specs.items()})
    workloads = _workloads(args, llms["plain"])
    result = {"machine": machine_info(), "args": vars(args), "speculative": specs}
    for name in args.workloads.split(","):
        result[name], line = _workload_figures(name, workloads[name], llms, specs, args.runs)
        print(line)
    path = write_json(args.output, result)
    print(f"results written to {path}")
    if args.plot:
        plot(result, list(specs), args.workloads.split(","), args.plot)
    return result


def _specs(args: argparse.Namespace) -> dict[str, dict]:
    """The speculative configs compared with plain decoding, by mode."""
    specs: dict[str, dict] = (
        {}
        if args.no_ngram
        else {
            "ngram": {
                "method": "ngram",
                "num_tokens": args.num_tokens,
                "max_ngram": args.max_ngram,
                "min_ngram": args.min_ngram,
            }
        }
    )
    if args.draft:
        specs["draft"] = {
            "method": "draft",
            "model": args.draft,
            "num_tokens": args.draft_tokens or args.num_tokens,
            **({} if args.draft_vocab is None else {"draft_vocab": args.draft_vocab}),
            **({} if args.draft_weights is None else {"draft_weights": args.draft_weights}),
        }
        # Both proposers: the lookup where the sequence's suffix recurs, the draft elsewhere.
        specs["draft+ngram"] = {
            **specs["draft"],
            "ngram": True,
            "max_ngram": args.max_ngram,
            "min_ngram": args.min_ngram,
        }
    return specs


def _workloads(args: argparse.Namespace, tok_llm) -> dict:
    from ..sampling.params import SamplingParams

    workloads = {
        # (the batches each mode runs in turn, what one returns, its sums -> rates, the metric)
        "code": (
            [[_chat(tok_llm, code_edit_prompt(i))] for i in range(args.code_requests)],
            SamplingParams(max_tokens=args.code_tokens, temperature=0.0),
            _one_request,
            _one_by_one_rates,
            "decode_tok_s",
        ),
        "chat": (
            [[_chat(tok_llm, CHAT_QUESTIONS[i % len(CHAT_QUESTIONS)])] for i in range(args.chat_requests)],
            SamplingParams(max_tokens=args.chat_tokens, temperature=0.0),
            _one_request,
            _one_by_one_rates,
            "decode_tok_s",
        ),
        "concurrent": (
            [[_chat(tok_llm, CHAT_QUESTIONS[i % len(CHAT_QUESTIONS)] + f" ({i})") for i in range(args.concurrent)]],
            SamplingParams(max_tokens=args.concurrent_tokens, temperature=0.0),
            _run_concurrent,
            _concurrent_rates,
            "output_tok_s",
        ),
    }
    return workloads


def _workload_figures(name: str, workload: tuple, llms: dict, specs: dict, runs: int) -> tuple[dict, str]:
    """One workload through every mode, `runs` times: the median rates, the speedups and the
    proposers' counts, and the line that says them."""
    batches, sp, fn, to_rates, key = workload
    rates = {m: [] for m in llms}
    whole = {m: [] for m in llms}
    before = {m: _counts(llms[m]) for m in specs}
    for _ in range(runs):
        sums: dict = {m: {} for m in llms}
        # Every batch (one request at a time, or all at once) in every mode before the next:
        # the machine's speed drifts over seconds, and this way the drift hits the modes alike.
        for batch in batches:
            for mode, llm in llms.items():
                for k, v in fn(llm, batch, sp).items():
                    sums[mode][k] = sums[mode].get(k, 0) + v
        for mode in llms:
            res = to_rates(sums[mode])
            rates[mode].append(res[key])
            if "request_tok_s" in res:
                whole[mode].append(res["request_tok_s"])
    med = {m: statistics.median(v) for m, v in rates.items()}
    r = {"metric": key, "plain": med["plain"], "runs": rates}
    line = f"{name}: {key} plain {med['plain']:.1f}"
    if whole["plain"]:
        wmed = {m: statistics.median(v) for m, v in whole.items()}
        r["request_tok_s"] = {
            m: {"median": wmed[m], "speedup": wmed[m] / wmed["plain"], "runs": whole[m]} for m in llms
        }
        line += (
            " (whole requests, prefill included: plain "
            + f"{wmed['plain']:.1f}"
            + "".join(f", {m} {wmed[m] / wmed['plain']:.2f}x" for m in specs)
            + ")"
        )
    for m in specs:
        prop, acc, ver = (x - y for x, y in zip(_counts(llms[m]), before[m]))
        row = {
            m: med[m],
            "speedup": med[m] / med["plain"],
            "proposed": prop,
            "accepted": acc,
            "acceptance_rate": acc / prop if prop else 0.0,
            "mean_accepted_length": acc / ver if ver else 0.0,
        }
        # n-gram's figures keep their flat keys; the draft's go under "draft_*".
        r.update(row if m == "ngram" else {m: med[m], **{f"{m}_{k}": v for k, v in row.items() if k != m}})
        line += (
            f"; {m} {med[m]:.1f} -> {row['speedup']:.2f}x, proposed {prop}, accepted {acc} "
            f"(acceptance {row['acceptance_rate']:.1%}, mean accepted length "
            f"{row['mean_accepted_length']:.2f})"
        )
    return r, line


def _mode_figures(r: dict, mode: str) -> tuple[float, float, float]:
    """(speedup, acceptance rate, mean accepted length) of one mode in one workload's result
    (n-gram's keys are flat, the others' prefixed by the mode)."""
    pre = "" if mode == "ngram" else f"{mode}_"
    return r[f"{pre}speedup"], r[f"{pre}acceptance_rate"], r[f"{pre}mean_accepted_length"]


def plot(result: dict, modes: list[str], workloads: list[str], path: str) -> None:
    """Three panels, a group of bars per workload and a bar per mode: decode tok/s against plain
    decoding, the share of proposals accepted, and the proposals accepted per verification."""
    plt = pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    width = 0.8 / len(modes)
    titles = ("speedup against plain decoding", "proposals accepted", "accepted per verification")
    for i, mode in enumerate(modes):
        figs = [_mode_figures(result[w], mode) for w in workloads]
        for ax, values in zip(axes, zip(*figs)):
            xs = [j + (i - (len(modes) - 1) / 2) * width for j in range(len(workloads))]
            bars = ax.bar(xs, values, width, label=mode)
            ax.bar_label(bars, fmt="%.2f", fontsize=7)
    for ax, title in zip(axes, titles):
        ax.set_xticks(range(len(workloads)), workloads)
        ax.set_title(title)
    axes[0].axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
    axes[0].set_ylabel("x plain (decode tok/s)")
    axes[1].set_ylim(0, 1.05)
    axes[0].legend(fontsize=8)
    fig.suptitle(
        f"pagedllm bench speculative, {result['args']['model']}, k = {result['args']['num_tokens']}", fontsize=10
    )
    save_figure(fig, path)


if __name__ == "__main__":
    import logging

    logging.basicConfig(level=logging.WARNING)
    parser = argparse.ArgumentParser(prog="pagedllm bench speculative")
    add_arguments(parser)
    raise SystemExit(0 if run(parser.parse_args()) else 1)
