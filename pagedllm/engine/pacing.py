"""How many prompt tokens a step may take while other sequences are decoding.

A step's time grows with the prompt tokens it computes. Beside a long prefill (a coding
agent's 10-20k-token first turn), a stream that decodes one token a step would wait a whole
prompt chunk for each token: on a CPU, seconds. So while any sequence decodes, the scheduler
limits the step's prompt tokens to what keeps the step within `factor` times a step of decodes
alone. Costs are measured, never assumed (they differ by model, machine and context length),
and a prompt token's cost is not linear in their number (a few rows ride on the weights' read
for free, many are compute-bound), so the limit is steered from the last step's time: scaled by
how far that step was from the target, and at most doubled a step. Without a decoding sequence
prompts take the whole token budget, so a prefill alone runs as fast as it did.
"""

from __future__ import annotations

# The weight of the newest step in the moving average of a decode step's time.
_EMA = 0.25
# The steered limit aims this far under the target, for the steps' own spread.
_MARGIN = 0.85


class PrefillPacer:
    """The prompt tokens a step beside decodes may take, steered by the steps' measured times."""

    def __init__(self, factor: float, floor: int = 4) -> None:
        self.factor = factor
        self.floor = floor  # prompt tokens a step always may take, so a prefill never stalls
        self.decode_s: float | None = None  # a step of decodes (and at most `floor` prompt tokens)
        self.limit = floor

    def observe(self, decodes: int, prompt_tokens: int, seconds: float) -> None:
        """A step ran: `decodes` sequences decoded beside `prompt_tokens` prompt tokens."""
        if not decodes:
            return
        if prompt_tokens <= self.floor or self.decode_s is None:
            self.decode_s = seconds if self.decode_s is None else (1 - _EMA) * self.decode_s + _EMA * seconds
            return
        room = (self.factor * _MARGIN - 1.0) * self.decode_s  # what the prompt tokens may add
        spent = max(seconds - self.decode_s, 1e-6)
        self.limit = max(self.floor, min(2 * prompt_tokens, int(prompt_tokens * room / spent)))

    def prompt_budget(self) -> int:
        """The prompt tokens the next step may take beside its decodes."""
        return self.floor if self.decode_s is None else self.limit
