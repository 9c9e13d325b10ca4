"""`pagedllm generate` (one prompt, streamed to the terminal) and `pagedllm trace` (the KV
cache's figures, step by step, while a request runs); and loading the model for any command."""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..config import EngineConfig


def load_llm(config: EngineConfig) -> Any:
    from ..llm import LLM

    print(f"loading {config.load.gguf_file or config.load.model} ...", file=sys.stderr, flush=True)
    return LLM(config=config)


def cmd_generate(args: argparse.Namespace, config: EngineConfig) -> int:
    prompt = args.prompt
    if prompt is None or prompt == "-":
        prompt = sys.stdin.read()
    if not prompt.strip() and args.suffix is None:
        print("error: the prompt is empty (give it as an argument or on stdin)", file=sys.stderr)
        return 2
    try:
        params = _sampling_params(args)  # before the slow load
        llm = load_llm(config)
        inputs = _inputs(llm, args, prompt)
    except _BadInput as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from ..engine.driver import Item

    driver = llm.driver
    [rid] = driver.add([Item(None, inputs, params)])
    final = None
    try:
        for out in driver.outputs([rid]):
            if args.n == 1:
                sys.stdout.write(out.outputs[0].delta_text)
                sys.stdout.flush()
            if out.finished:
                final = out
    except KeyboardInterrupt:
        driver.abort([rid])
        print(file=sys.stderr)
        return 130
    _print_final(args, final, llm.engine.sched_config.max_model_len)
    return 0


class _BadInput(ValueError):
    """A sampling flag or prompt the engine cannot take (exit code 2)."""


def _sampling_params(args: argparse.Namespace) -> Any:
    from ..sampling.params import SamplingParams

    names = ("n", "max_tokens", "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty")
    try:
        return SamplingParams(**{n: vars(args)[n] for n in names}, repetition_penalty=args.repetition_penalty)
    except ValueError as e:
        raise _BadInput(str(e)) from None


def _inputs(llm: Any, args: argparse.Namespace, prompt: str) -> str | list[int]:
    """The engine's prompt: a fill-in-the-middle prompt with --suffix, the text as it is with
    --raw or without a chat template, else the chat template's rendering."""
    from ..tokenizer.chat import render_chat

    tok = llm.tokenizer
    if args.suffix is not None:
        from ..protocols import fim
        from ..protocols.common.context import ServingContext
        from ..protocols.common.errors import ApiError

        try:
            return fim.infill_ids(ServingContext.from_llm(llm), prompt, args.suffix)
        except ApiError as e:
            raise _BadInput(str(e)) from None
    if args.raw or not tok.chat_template:
        return prompt
    msgs = [{"role": "system", "content": args.system}] if args.system else []
    return render_chat(tok, msgs + [{"role": "user", "content": prompt.strip()}])


def _print_final(args: argparse.Namespace, final: Any, max_model_len: int) -> None:
    from .chat import cut_off_note

    if args.n == 1:
        print()
        note = cut_off_note(final, max_model_len, ("--max-tokens N allows more", "--max-model-len N allows more"))
        if note:
            print(note, file=sys.stderr)
    else:
        for c in final.outputs:
            print(f"--- completion {c.index} ({c.finish_reason}) ---\n{c.text}")
    if args.stats:
        m = final.metrics
        print(
            f"[{m.num_prompt_tokens} prompt tokens, {m.num_output_tokens} generated, "
            f"TTFT {m.time_to_first_token or 0:.2f} s, {m.decode_tokens_per_s or 0:.1f} tok/s]",
            file=sys.stderr,
        )


def cmd_trace(args: argparse.Namespace, config: EngineConfig) -> int:
    from .chat import kv_report
    from ..sampling.params import SamplingParams
    from ..tokenizer.chat import render_chat

    llm = load_llm(config)
    eng = llm.engine
    tok = llm.tokenizer
    prompt: str | list[int] = args.prompt
    if tok.chat_template:
        prompt = render_chat(tok, [{"role": "user", "content": args.prompt}])
    params = SamplingParams(n=args.n, max_tokens=args.max_tokens, temperature=0.0)
    rows = [_snapshot(eng, 0)]
    from ..engine.driver import Item

    llm.driver.add([Item(None, prompt, params)])
    for step, _ in enumerate(llm.driver.steps(), 1):  # until the engine is idle
        rows.append(_snapshot(eng, step))
    if args.json:
        out: dict[str, Any] = {"steps": rows, "kv_cache_trace": llm.kv_cache_trace().to_dict()}
        print(json.dumps(out, indent=2, default=str))
        return 0
    draft = "draft_used_blocks" in rows[0]  # speculative draft model: of the used blocks, its own
    print(
        f"{'step':>5} {'running':>8} {'waiting':>8} {'used':>6} {'free':>6} {'preempt':>8}"
        + (f" {'draft used':>10}" if draft else "")
    )
    for r in rows:
        print(
            f"{r['step']:>5} {r['running']:>8} {r['waiting']:>8} {r['used_blocks']:>6} "
            f"{r['free_blocks']:>6} {r['preemptions']:>8}" + (f" {r['draft_used_blocks']:>10}" if draft else "")
        )
    print(kv_report(llm))
    return 0


def _snapshot(eng: Any, step: int) -> dict:
    bm, sched = eng.block_manager, eng.scheduler
    row = {
        "step": step,
        "running": sched.num_running,
        "waiting": sched.num_waiting,
        "used_blocks": bm.num_used_blocks,
        "free_blocks": bm.num_free_blocks,
        "preemptions": sched.num_preemptions,
    }
    draft = eng.spec.draft if eng.spec is not None else None
    if draft is not None:  # one pool: the draft's share of the used blocks (free ones are shared)
        row.update(draft_used_blocks=draft.block_manager.num_held_blocks)
    return row
