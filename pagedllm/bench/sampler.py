"""Sampler microbenchmark: one sampling step at a given batch and vocabulary, per kind of request.

    python -m pagedllm.bench.sampler --batch 32 --vocab 49152 262144 --threads 2

Logits are synthetic but shaped like a language model's: a Zipf-like law over a random
permutation of the vocabulary, exponent per row in [1.0, 2.2], so top-p nuclei range from
one token to hundreds (the nucleus sizes are printed). Each row carries a 256-token prompt
and grows by one token per step, as in decoding, so penalties pay their incremental upkeep.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

CASES: dict[str, dict] = {
    "greedy": dict(temperature=0.0),
    "temperature": dict(temperature=0.7),
    "top_k": dict(temperature=0.7, top_k=50),
    "top_p": dict(temperature=0.7, top_p=0.95),
    "min_p": dict(temperature=0.7, min_p=0.05),
    "penalties": dict(temperature=0.7, top_p=0.95, repetition_penalty=1.1, presence_penalty=0.5),
    "penalties_greedy": dict(temperature=0.0, repetition_penalty=1.1, presence_penalty=0.5, frequency_penalty=0.2),
}


def lm_like_logits(batch: int, vocab: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    exponent = torch.empty(batch, 1).uniform_(1.0, 2.2, generator=g)
    ranks = torch.arange(1, vocab + 1, dtype=torch.float32)[None, :]
    base = -exponent * ranks.log() + 0.3 * torch.randn(batch, vocab, generator=g)
    perm = torch.argsort(torch.rand(batch, vocab, generator=g), dim=-1)
    return torch.empty(batch, vocab).scatter_(1, perm, base) + 8.0


def nucleus_sizes(logits: torch.Tensor, temperature: float, top_p: float) -> list[int]:
    p = torch.softmax(logits / temperature, -1).sort(-1, descending=True).values
    return ((p.cumsum(-1) - p) <= top_p).sum(-1).tolist()


def time_case(params, logits: list[torch.Tensor], steps: int, prompt_len: int = 256) -> tuple[list[float], list[float]]:
    """Wall and process CPU seconds per sampling step over `steps` decode steps of one batch
    (CPU time stays meaningful when the machine is shared); each step takes the
    logits of the list in turn (a model's next distribution differs from the last one, so the
    tokens just penalised are not always its top ones)."""
    from ..sampling.metadata import SamplingMetadata
    from ..sampling.sampler import Sampler

    b, v = logits[0].shape
    g = torch.Generator().manual_seed(1)
    tokens = [torch.randint(0, v, (prompt_len,), generator=g).tolist() for _ in range(b)]
    sampler = Sampler(logits[0].device, seed=0)
    times, cpu = [], []
    for step in range(steps + 2):  # two warm-up steps
        meta = SamplingMetadata(
            params=[params] * b,
            seq_ids=list(range(b)),
            token_ids=tokens,
            num_prompt_tokens=[prompt_len] * b,
            seeds=[None] * b,
            output_pos=[step] * b,
        )
        x = logits[step % len(logits)].clone()  # the model hands the sampler fresh logits every step
        t0, c0 = time.perf_counter(), time.process_time()
        out = sampler(x, meta)
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
        for row, t in zip(tokens, out.token_ids):
            row.append(t)
    return times[2:], cpu[2:]


def main(argv: list[str] | None = None) -> None:
    from ..sampling.params import SamplingParams

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--vocab", type=int, nargs="+", default=[49152, 262144])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--steps", type=int, default=15)
    p.add_argument("--cases", default=",".join(CASES))
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(
        f"batch {args.batch}, {args.threads} threads, ms per sampling step over {args.steps} steps: "
        "median wall (min wall, median process CPU time)"
    )
    for v in args.vocab:
        logits = [lm_like_logits(args.batch, v, seed) for seed in range(4)]
        n = sorted(nucleus_sizes(logits[0], 0.7, 0.95))
        print(f"vocab {v}: top-p 0.95 nucleus at T=0.7 median {n[len(n) // 2]}, max {n[-1]} tokens")
        for name in args.cases.split(","):
            ts, cpu = time_case(SamplingParams(**CASES[name]), logits, args.steps)
            print(
                f"  {name:<17} {1000 * statistics.median(ts):8.2f} ms  (min {1000 * min(ts):.2f}, "
                f"cpu {1000 * statistics.median(cpu):.2f})"
            )


if __name__ == "__main__":
    main()
