"""`pagedllm bench lora`: decode speed with LoRA adapters against the base model, in one run.

Random rank-R PEFT adapters (all seven projections, B not zero) are written for the model's
shape; one engine (enable_lora, max_loras = the adapter count) then runs, interleaved per run:
32 concurrent requests on the base and 32 spread over the adapters (twice each, in the order
base, adapters, adapters, base), and one request alone on the base and on one adapter (in
eight short alternating requests each). Medians of --runs."""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from .common import machine_info, median_of_runs, write_json

TARGETS = {
    "q_proj": "self_attn",
    "k_proj": "self_attn",
    "v_proj": "self_attn",
    "o_proj": "self_attn",
    "gate_proj": "mlp",
    "up_proj": "mlp",
    "down_proj": "mlp",
}


def write_adapter(folder: Path, cfg, rank: int, seed: int) -> Path:
    """A random PEFT LoRA folder for a dense model of config `cfg` (a pagedllm ModelConfig)."""
    import torch

    from safetensors.torch import save_file

    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    dims = {
        "q_proj": (cfg.hidden_size, q),
        "k_proj": (cfg.hidden_size, kv),
        "v_proj": (cfg.hidden_size, kv),
        "o_proj": (q, cfg.hidden_size),
        "gate_proj": (cfg.hidden_size, cfg.intermediate_size),
        "up_proj": (cfg.hidden_size, cfg.intermediate_size),
        "down_proj": (cfg.intermediate_size, cfg.hidden_size),
    }
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg.num_layers):
        for name, (fin, fout) in dims.items():
            key = f"base_model.model.model.layers.{layer}.{TARGETS[name]}.{name}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fin, generator=g) / fin**0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(fout, rank, generator=g) * 0.01
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(
        json.dumps(
            {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(dims), "bias": "none"}
        )
    )
    return folder


def _prompts(llm, n: int, seed: int) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    vocab = llm.engine.model_config.vocab_size
    return [torch.randint(100, vocab - 1, (32,), generator=g).tolist() for _ in range(n)]


def _batch(llm, prompts, loras, tokens: int) -> float:
    """Output tokens per second of the whole batch."""
    from ..sampling.params import SamplingParams

    sp = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False, lora_request=loras)
    return sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t0)


def _alone(llm, prompt, lora, tokens: int) -> float:
    """Decode tokens per second of one request (after its first token)."""
    from ..sampling.params import SamplingParams

    sp = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    [out] = llm.generate([prompt], sp, use_tqdm=False, lora_request=lora)
    return out.metrics.decode_tokens_per_s


def _alone_pair(llm, prompt, lora, tokens: int, segments: int = 8) -> tuple[float, float]:
    """Batch-1 decode rates of the base and of `lora`, each over `tokens` tokens taken as
    `segments` requests alternating base/adapter/adapter/base...: a shared machine's speed
    drifts within seconds, and one long request each put all of a drift on one side."""
    per = max(2, tokens // segments)
    times = {False: 0.0, True: 0.0}
    for i in range(segments):
        for with_lora in (False, True) if i % 2 == 0 else (True, False):
            times[with_lora] += (per - 1) / _alone(llm, prompt, lora if with_lora else None, per)
    return segments * (per - 1) / times[False], segments * (per - 1) / times[True]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="default")
    p.add_argument("--adapters", type=int, default=4)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--concurrent", type=int, default=32)
    p.add_argument("--tokens", type=int, default=64, help="output tokens per request")
    p.add_argument("--runs", type=int, default=3, help="repeat and report medians")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--pa-gpu-mem", type=float, default=256, help="KV cache MB")
    p.add_argument("--output", default="bench-results/lora.json")


def run(args: argparse.Namespace) -> dict:
    import torch

    from .. import LLM, LoRARequest

    llm = LLM(
        args.model,
        dtype=args.dtype,
        kv_cache_memory_mb=args.pa_gpu_mem,
        enable_lora=True,
        max_loras=args.adapters,
        max_lora_rank=args.rank,
        enable_prefix_caching=False,
    )
    with tempfile.TemporaryDirectory() as tmp:
        reqs = [
            LoRARequest(
                f"bench{i}", i + 1, str(write_adapter(Path(tmp) / f"a{i}", llm.engine.model_config, args.rank, i))
            )
            for i in range(args.adapters)
        ]
        prompts = _prompts(llm, args.concurrent, 0)
        spread = [reqs[i % len(reqs)] for i in range(len(prompts))]
        _batch(llm, prompts[:4], spread[:4], 4)  # warm-up: adapters into their slots, kernels touched
        runs = []
        for i in range(args.runs):  # interleaved, so the machine's load weighs on both alike
            batch = {False: 0.0, True: 0.0}  # seconds per token, base/adapter/adapter/base
            for with_lora in (False, True, True, False):
                batch[with_lora] += 0.5 / _batch(llm, prompts, spread if with_lora else None, args.tokens)
            batch = {k: 1.0 / v for k, v in batch.items()}
            base_alone, lora_alone = _alone_pair(llm, prompts[0], reqs[0], args.tokens * 2)
            runs.append(
                {
                    "base_batch_tok_s": batch[False],
                    "lora_batch_tok_s": batch[True],
                    "base_alone_decode_tok_s": base_alone,
                    "lora_alone_decode_tok_s": lora_alone,
                }
            )
    r = median_of_runs(runs)
    r["batch_ratio"] = r["lora_batch_tok_s"] / r["base_batch_tok_s"]
    r["alone_ratio"] = r["lora_alone_decode_tok_s"] / r["base_alone_decode_tok_s"]
    from .startup import cpu_flags

    print(
        f"CPU flags: {cpu_flags()}; {torch.get_num_threads()} threads; dtype {str(llm.engine.dtype).removeprefix('torch.')}"
    )
    print(
        f"{args.concurrent} concurrent over {args.adapters} rank-{args.rank} adapters: "
        f"{r['lora_batch_tok_s']:.1f} tok/s vs base {r['base_batch_tok_s']:.1f} ({r['batch_ratio']:.2f}x); "
        f"batch 1 decode with one adapter: {r['lora_alone_decode_tok_s']:.1f} tok/s vs base "
        f"{r['base_alone_decode_tok_s']:.1f} ({r['alone_ratio']:.2f}x); medians of {args.runs}"
    )
    result = {"machine": machine_info(), "args": vars(args), "runs": runs, **r}
    path = write_json(args.output, result)
    print(f"results written to {path}")
    return result


if __name__ == "__main__":
    import logging

    logging.basicConfig(level=logging.WARNING)
    parser = argparse.ArgumentParser(prog="pagedllm bench lora")
    add_arguments(parser)
    raise SystemExit(0 if run(parser.parse_args()) else 1)
