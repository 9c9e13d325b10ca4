"""Where an engine step's time goes, for `pagedllm bench throughput --profile` and its planning
figures: one decode step under torch's profiler, and the step's planning (scheduling, the
runner's plan and tensors) timed alone by a runner that skips the forward."""

from __future__ import annotations

import argparse
import time


def profile_decode_step(llm, batch: int = 32, context: int = 256) -> str:
    """Top operators of one batched decode step, to show where the time goes."""
    from torch.profiler import ProfilerActivity, profile

    from ..sampling.params import SamplingParams

    eng = llm.engine
    from .workload import make_workload

    wl = make_workload(batch, eng.model_config.vocab_size, 7, (context, context), (8, 8), set(eng.eos_token_ids))
    from ..engine.driver import Item

    ids = llm.driver.add(
        [Item(None, p, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)) for p in wl.prompts]
    )
    steps = llm.driver.steps(ids)  # next(steps) runs one step
    while any(s.num_computed_tokens < s.num_prompt_tokens for s in eng.scheduler.running) or eng.scheduler.waiting:
        next(steps)
    next(steps)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        next(steps)
    for _ in steps:
        pass
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15)


def planning_report(args: argparse.Namespace, sizes=(32, 256), context: int = 512) -> dict:
    """Per-step input planning at each of `sizes` running sequences, printed, on an engine of
    its own with room for the largest (its KV cache is never written: the model does not run)."""
    from .. import LLM

    # Every prompt admitted in one step, so no sequence decodes (and grows) while others wait.
    llm = LLM(
        args.model,
        dtype=args.dtype,
        max_num_seqs=max(sizes),
        block_size=args.pa_blk_size,
        kv_cache_context_len=max(sizes) * (context + 64),
        max_model_len=context + 64 + 16,
        max_num_batched_tokens=max(sizes) * (context + 1),
        runner_cls=planning_runner(),
    )
    out = {}
    try:
        for n in sizes:
            r = out[n] = profile_planning(llm, n, context)
            print(
                f"planning at {n} running sequences (context {context}): median {r['median_ms']:.3f} ms "
                f"per decode step over {r['steps']} steps (plan {r['plan_ms']:.3f}, tensors "
                f"{r['tensors_ms']:.3f}, the rest of the step {r['rest_ms']:.3f})"
            )
    finally:
        llm.shutdown()
    return out


def planning_runner():
    """A ModelRunner whose step plans its inputs (ModelRunner.plan and .tensors, timed) and skips
    the forward: each sampling row takes the next token of its own prompt, so the engine's real
    step (schedule, update, record, outputs) runs around the planning alone."""
    from ..engine.model_runner import ModelRunner, RunnerOutput
    from ..sampling.sampler import SamplerOutput

    class PlanningRunner(ModelRunner):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self.timed = {"plan": 0.0, "tensors": 0.0}
            self.decodes = 0  # the last step's sequences if every one decoded, else 0

        def execute(self, batch, images: bool = False):
            batch = sorted(batch, key=lambda it: not it.is_decode)
            self.decodes = len(batch) if all(it.is_decode for it in batch) else 0
            t0 = time.perf_counter()
            plan = self.plan(batch, images)
            t1 = time.perf_counter()
            self.tensors(plan)
            self.timed["plan"] += t1 - t0
            self.timed["tensors"] += time.perf_counter() - t1
            seqs = [it.seq for it in batch if it.samples]
            toks = [s.prompt_token_ids[s.num_output_tokens % len(s.prompt_token_ids)] for s in seqs]
            return RunnerOutput(seqs, SamplerOutput(toks)) if seqs else None

    return PlanningRunner


def profile_planning(llm, num_seqs: int, context: int = 512, steps: int = 16) -> dict:
    """Per-step input planning with `num_seqs` sequences decoding at about `context` tokens, on
    an LLM made with `runner_cls=planning_runner()`: the engine's real step without the forward,
    timed whole (median_ms) and in its parts: ModelRunner.plan and .tensors (the step's inputs as
    tensors), and the rest of the step (scheduling, the update, KV waste tracking, outputs)."""
    import statistics

    from ..sampling.params import SamplingParams

    eng = llm.engine
    runner = eng.runner
    if not hasattr(runner, "timed"):
        raise ValueError("profile_planning needs an LLM made with runner_cls=planning_runner()")
    if eng.sched_config.max_num_seqs < num_seqs:
        raise ValueError(
            f"profile_planning needs max_num_seqs >= {num_seqs} (the engine has "
            f"{eng.sched_config.max_num_seqs}); pass --max-seqs"
        )
    from .workload import make_workload

    wl = make_workload(num_seqs, eng.model_config.vocab_size, 11, (context, context), (1, 1), set(eng.eos_token_ids))
    from ..engine.driver import Item

    rids = llm.driver.add(
        Item(None, p, SamplingParams(max_tokens=steps + 4, temperature=0.0, ignore_eos=True)) for p in wl.prompts
    )
    per_step, parts = [], {"plan": [], "tensors": [], "rest": []}
    try:
        while len(per_step) < steps and eng.has_unfinished():
            runner.timed["plan"] = runner.timed["tensors"] = 0.0
            t0 = time.perf_counter()
            llm.driver.advance()
            took = time.perf_counter() - t0
            if runner.decodes == num_seqs:
                per_step.append(took)
                parts["plan"].append(runner.timed["plan"])
                parts["tensors"].append(runner.timed["tensors"])
                parts["rest"].append(took - runner.timed["plan"] - runner.timed["tensors"])
    finally:
        llm.driver.abort(rids)

    def med(xs: list[float]) -> float:
        return 1000 * statistics.median(xs) if xs else float("nan")

    return {
        "num_seqs": num_seqs,
        "context": context,
        "steps": len(per_step),
        "median_ms": med(per_step),
        "min_ms": 1000 * min(per_step, default=float("nan")),
        "max_ms": 1000 * max(per_step, default=float("nan")),
        **{f"{k}_ms": med(v) for k, v in parts.items()},
    }
