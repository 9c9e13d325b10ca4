"""Speculative decoding around the engine's step: who speculates, what is proposed (n-gram
lookup, or a draft model: engine/draft.py), what is accepted, and the figures the trace and
/metrics report.

Verification. A sequence with proposals d_1..d_k is scheduled with k + 1 query tokens (its
last token, then the proposals), run as k + 1 decode rows over its blocks in one forward,
and the sampler draws t_j from row j: the target distribution after t_0 = d_1, ..., t_{j-1}
= d_j. Proposals are accepted while t_j == d_{j+1}; the first t_j that differs (or t_k when
all are accepted) is the token the step adds. For a deterministic draft (n-gram lookup, a
draft model's greedy choice) this is exactly rejection sampling: d is accepted with
probability p(d), and on rejection t_j is distributed as p with d removed and renormalised,
so the output has the target's distribution. Greedy rows take argmaxes, so greedy output is
the non-speculative output token for token. Seeded rows draw position p's token with the key
of position p, as a non-speculative run does.
"""
from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field
from typing import Any

from .config import SpeculativeConfig
from .ngram import NgramIndex

logger = logging.getLogger(__name__)

# A sequence that paused starts again after this many steps, doubling up to the maximum
# each time it pauses again.
PAUSE_STEPS, MAX_PAUSE_STEPS = 4, 128
EMA = 0.3  # weight of the newest verification in a sequence's acceptance mean


def accepted_length(drafts: list[int], sampled: list[int]) -> int:
    """How many proposals are accepted: while the token drawn at a row equals the proposal
    that row's successor holds. sampled has len(drafts) + 1 tokens."""
    a = 0
    while a < len(drafts) and sampled[a] == drafts[a]:
        a += 1
    return a


@dataclass
class SpecStats:
    proposed: int = 0  # draft tokens verified
    accepted: int = 0  # of which accepted
    verifications: int = 0  # (sequence, step) pairs that verified proposals
    steps_off_batch: int = 0  # steps where the batch was too wide to speculate
    paused: int = 0  # times a sequence paused for low acceptance

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Draft tokens accepted per verification (the step adds one more token of its own)."""
        return self.accepted / self.verifications if self.verifications else 0.0

    def to_dict(self) -> dict:
        d = asdict(self)
        d["acceptance_rate"] = self.acceptance_rate
        d["mean_accepted_length"] = self.mean_accepted_length
        return d


@dataclass
class SeqSpecState:
    """Per sequence: its n-gram index and how well its proposals have been doing."""
    index: NgramIndex | None = None
    acceptance: float = 1.0  # running mean of accepted / proposed
    pause: int = 0  # steps left without proposals
    pause_len: int = PAUSE_STEPS


@dataclass
class SpeculativeDecoder:
    config: SpeculativeConfig
    max_model_len: int
    stats: SpecStats = field(default_factory=SpecStats)
    draft: Any = None  # method "draft": the DraftModel (engine/draft.py) that proposes

    def eligible(self, seq) -> bool:
        """Speculation applies: penalties read every earlier token of the row, which the
        verification rows do not model. A grammar row speculates with n-gram proposals, cut to
        what its grammar accepts; each verification row is masked by the grammar advanced
        through the proposals before it (GrammarEngine.start_masks). Draft-model proposals
        would leave the draft's cache ahead of a cut, so grammar rows skip that method."""
        p = seq.params
        return not p.needs_penalties and (seq.grammar is None or self.draft is None)

    def propose(self, running: list) -> None:
        """Set `spec_tokens` on the running sequences that will speculate this step."""
        decoding = [s for s in running if s.num_uncomputed_tokens == 1 and not s.fork_children]
        for s in running:
            s.spec_tokens = []
        if len(decoding) > self.config.max_batch:
            self.stats.steps_off_batch += 1
            return
        want = []
        for s in decoding:
            if not self.eligible(s):
                continue
            st = s.spec
            if st is None:
                st = s.spec = SeqSpecState()
            if st.pause > 0:
                st.pause -= 1
                continue
            k = self._num_tokens(s, st)
            if k > 0:
                want.append((s, k))
        # Proposal rows the step may add, shared out evenly (what one leaves goes to the next).
        room = self.config.max_rows - sum(1 for s in running if s.num_uncomputed_tokens == 1)
        capped = []
        for i, (s, k) in enumerate(want):
            k = min(k, room // (len(want) - i))
            if k > 0:
                capped.append((s, k))
                room -= k
        want = capped
        if self.draft is not None:  # its blocks come from the pool the running sequences grow in
            self.draft.propose(want, running)
            return
        c = self.config
        for s, k in want:
            st = s.spec
            if st.index is None:
                st.index = NgramIndex(c.min_ngram, c.max_ngram)
            s.spec_tokens = st.index.propose(s.token_ids, k)
            if s.grammar is not None and s.spec_tokens:  # only what the grammar would accept
                s.spec_tokens = s.spec_tokens[:s.grammar.validate_tokens(s.spec_tokens)]

    def release(self, seq) -> None:
        """seq finished, was aborted or preempted: the draft model gives back its blocks (to
        the pool the target's blocks come from)."""
        if self.draft is not None:
            self.draft.release(seq)

    def _num_tokens(self, seq, st: SeqSpecState) -> int:
        k = self.config.num_tokens
        if st.acceptance < 0.5:  # turned down before it turns off
            k = max(1, k // 2)
        room = min(seq.params.max_tokens - seq.num_output_tokens, self.max_model_len - seq.num_tokens)
        # The step adds up to k + 1 tokens, and the last proposal's position must fit.
        room -= 1
        return max(0, min(k, room))

    def record(self, seq, proposed: int, accepted: int) -> None:
        """After a verification: the figures, and the sequence's acceptance mean."""
        s = self.stats
        s.proposed += proposed
        s.accepted += accepted
        s.verifications += 1
        st = seq.spec
        st.acceptance = (1 - EMA) * st.acceptance + EMA * (accepted / proposed)
        if st.acceptance < self.config.min_acceptance:
            st.pause = st.pause_len
            st.pause_len = min(MAX_PAUSE_STEPS, 2 * st.pause_len)
            st.acceptance = 0.5  # a fresh start after the pause, at the turned-down k
            s.paused += 1
        elif st.acceptance >= 0.5:
            st.pause_len = PAUSE_STEPS
