"""What the sampler needs to know about one step's rows, built once per step by the model runner.

Plain per-row data, no engine objects: the sampler never sees a `Sequence`. Row i of the
logits belongs to entry i of every list here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .params import SamplingParams


@dataclass
class SamplingMetadata:
    params: list[SamplingParams]
    # Identifies a stream across steps (the penalty state is kept per stream).
    seq_ids: list[int]
    # Each row's whole token list (prompt then output), by reference: penalties read only
    # the tokens appended since the previous step.
    token_ids: list[list[int]]
    num_prompt_tokens: list[int]
    # Effective seed per row (request seed + completion index), None for the engine's stream.
    seeds: list[int | None]
    # Tokens generated so far per row: the position of the token drawn now.
    output_pos: list[int]
    # Optional per-row allowed-token mask, applied before anything else (structured output):
    # bool [len(mask_rows), vocab], True where a token may be sampled; mask_rows None = every row.
    allowed_mask: torch.Tensor | None = None
    mask_rows: list[int] | None = None
    _flags: dict = field(default_factory=dict, repr=False)

    @property
    def num_rows(self) -> int:
        return len(self.params)

    def rows_where(self, name: str) -> list[int]:
        """Row indices with a property of SamplingParams set (greedy, needs_penalties, logprobs), cached."""
        rows = self._flags.get(name)
        if rows is None:
            if name == "logprobs":
                rows = [i for i, p in enumerate(self.params) if p.logprobs is not None]
            elif name == "sampled":
                rows = [i for i, p in enumerate(self.params) if not p.greedy]
            else:
                rows = [i for i, p in enumerate(self.params) if getattr(p, name)]
            self._flags[name] = rows
        return rows
