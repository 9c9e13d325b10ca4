"""A fixed, seeded offline workload: random prompts (no EOS among them) and output lengths, the
same for every engine a benchmark compares."""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)


def make_workload(
    n: int, vocab: int, seed: int, prompt_range=(16, 512), output_range=(16, 256), avoid: set[int] | None = None
) -> Workload:
    rng = random.Random(seed)
    avoid = avoid or set()
    prompts, outs = [], []
    for _ in range(n):
        plen = rng.randint(*prompt_range)
        ids = []
        while len(ids) < plen:
            t = rng.randrange(vocab)
            if t not in avoid:
                ids.append(t)
        prompts.append(ids)
        outs.append(rng.randint(*output_range))
    return Workload(prompts, outs)
