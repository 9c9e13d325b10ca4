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

Lengths. Each step a sequence proposes what is expected to pay (speculative/costs.py): its
proposer's per-token acceptance so far against the step times measured in this run, so a
draft that costs more than it brings, or a chat that rarely repeats itself, decodes plainly
and probes again after a pause. A draft model's probe first catches up on every token added
during the pause, so it waits for a sign that the sequence is copying (its suffix recurs
earlier in it), which is where drafts are accepted.
With a draft model and n-gram lookup both on, a sequence whose suffix has an earlier match
takes the lookup's proposals (free), the others the draft's.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field
from typing import Any

from .config import SpeculativeConfig
from .costs import Candidate, StepCosts, best_rate, plan_lengths
from .ngram import NgramIndex

logger = logging.getLogger(__name__)

# A sequence that paused starts again after this many steps, doubling up to the maximum
# each time it pauses again, and then proposes once whatever the planner says (a probe that
# refreshes its acceptance).
PAUSE_STEPS, MAX_PAUSE_STEPS = 4, 128
# Weight of the earlier verifications in an acceptance estimate. Lower, two rejections in a row
# declined a free chat whose proposals are mostly accepted and pay overall; 0.9 keeps proposing
# there (docs/benchmarks/from-code.md, "The speculative planner's constants").
DECAY = 0.9
# A new sequence's acceptance: this many accepted of this many trials, soon outweighed.
PRIOR_ACCEPTED, PRIOR_TRIALS = 1.2, 2.0
# Proposals must be expected to raise tokens per unit of step time by this factor. The cost
# model leaves out the sampling and bookkeeping of verification rows and the noise of a few
# verifications' acceptance; at a bare 1.0 a chat whose expected gain was just above 1 ran
# slower than plain decoding (docs/benchmarks/from-code.md, "The speculative planner's constants").
MIN_GAIN = 1.05
# A draft model's probe after a pause first catches up on the tokens added during the pause.
# Where they are few enough to run as decode rows (the first pauses), that is the forward that
# makes its first proposal anyway, and it probes; past them the catch-up is a prefill chunk,
# and it waits until the sequence's last PROBE_NGRAM tokens occur earlier in it: in free chat
# such probes cost more than their proposals saved. (Gated always, free chat declined after
# its first rejections and ran plain, where one proposal a step paid. Figures:
# docs/benchmarks/from-code.md, "The speculative planner's constants".)
PROBE_NGRAM = 8


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
    declined: int = 0  # times a sequence paused because no proposal was worth its cost
    ngram_proposed: int = 0  # method "draft" with n-gram on: proposals that came from the lookup

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
class Acceptance:
    """A proposer's per-token acceptance probability for one sequence: accepted proposals over
    trials (each accepted one, and the first rejection), older verifications decaying."""

    accepted: float = PRIOR_ACCEPTED
    trials: float = PRIOR_TRIALS

    @property
    def rate(self) -> float:
        return self.accepted / self.trials

    def update(self, proposed: int, accepted: int) -> None:
        self.accepted = DECAY * self.accepted + accepted
        self.trials = DECAY * self.trials + accepted + (accepted < proposed)


@dataclass
class SeqSpecState:
    """Per sequence: its n-gram index and how well each proposer has been doing."""

    index: NgramIndex | None = None
    ngram: Acceptance = field(default_factory=Acceptance)
    draft: Acceptance = field(default_factory=Acceptance)
    source: str = ""  # who made the proposals under verification: "ngram" or "draft"
    pause: int = 0  # steps left without proposals
    pause_len: int = PAUSE_STEPS
    probe: bool = False  # just back from a pause: propose once whatever the planner says
    repeats: NgramIndex | None = None  # a draft's probe: does the suffix recur (PROBE_NGRAM)?


@dataclass
class SpeculativeDecoder:
    config: SpeculativeConfig
    max_model_len: int
    stats: SpecStats = field(default_factory=SpecStats)
    draft: Any = None  # method "draft": the DraftModel (engine/draft.py) that proposes
    costs: StepCosts = field(default_factory=StepCosts)

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
        plain = sum(1 for s in running if s.num_uncomputed_tokens == 1)
        costs = self.costs.relative(plain)
        seqs, cands, found = [], [], []
        for s in decoding:
            got = self._candidate(s, costs) if self.eligible(s) else None
            if got is not None:
                seqs.append(s)
                found.append(got[0])
                cands.append(got[1])
        # Proposal rows the step may add (the step holds max_rows decode rows at most).
        room = self.config.max_rows - plain
        want = self._assign(seqs, found, cands, self._lengths(cands, plain, room, costs), room)
        if want:  # its blocks come from the pool the running sequences grow in
            d = self.draft
            n0, s0 = d.decode_forwards, d.decode_s
            d.propose(want, running)
            self.costs.observe_draft(d.decode_forwards - n0, d.decode_s - s0)

    def _candidate(self, s, costs) -> tuple[list[int], Candidate] | None:
        """What `s` could propose this step (n-gram tokens, or a draft's run) and its expected
        acceptance; None where it pauses, has no room or nothing is expected to pay."""
        c = self.config
        st = s.spec
        if st is None:
            st = s.spec = SeqSpecState(probe=True)  # its first step: propose once
        if st.pause > 0:
            st.pause -= 1
            if st.pause == 0:
                st.probe = self._worth_probing(s, st)
                st.pause = 0 if st.probe else 1  # (no evidence: look again next step)
            return None
        cap = self._room(s)
        if cap <= 0:
            return None
        toks: list[int] = []
        if self.draft is None or c.ngram:  # the sequence's own earlier text first
            if st.index is None:
                st.index = NgramIndex(c.min_ngram, c.max_ngram)
            toks = st.index.propose(s.token_ids, cap)
            if s.grammar is not None and toks:  # only what the grammar would accept
                toks = toks[: s.grammar.validate_tokens(toks)]
        if toks and not self._draft_pays_more(st, len(toks), cap, costs):
            st.source, acc = "ngram", st.ngram
        elif self.draft is not None:
            toks = []
            st.source, acc = "draft", st.draft
        else:
            return None
        if acc.rate < c.min_acceptance and not st.probe:
            self._pause(st)
            self.stats.paused += 1
            return None
        cand = Candidate(acc.rate, len(toks) if toks else cap, not toks)
        if c.adaptive and not st.probe and best_rate(cand, *costs) < MIN_GAIN:
            self._pause(st)  # no length is expected to pay (not for want of room)
            self.stats.declined += 1
            return None
        return toks, cand

    def _assign(self, seqs: list, found: list, cands: list, ks: list[int], room: int) -> list:
        """Give each candidate its proposal length: n-gram tokens are set at once; the sequences
        the draft model proposes for are returned with their lengths."""
        want = []
        for s, toks, cand, k in zip(seqs, found, cands, ks):
            st = s.spec
            if k == 0 and st.probe and room > 0:
                k = 1  # back from a pause: one proposal refreshes the acceptance
            elif k > 0:
                st.pause_len = PAUSE_STEPS
            st.probe = False
            if k == 0:  # the step's rows went to others: it may propose next step
                continue
            if cand.draft:
                want.append((s, k))
            else:
                s.spec_tokens = toks[:k]
                if self.draft is not None:
                    self.stats.ngram_proposed += k
            room -= k
        return want

    def _worth_probing(self, seq, st: SeqSpecState) -> bool:
        """A pause is over: probe now? An n-gram probe costs no forward, and a draft's whose
        catch-up runs in its first proposal's forward no extra one; a longer catch-up is worth
        it where the sequence copies (its suffix recurs), which is where drafts are accepted."""
        if self.draft is None or self.draft.cheap_probe(seq):
            return True
        if st.repeats is None:
            st.repeats = NgramIndex(PROBE_NGRAM, PROBE_NGRAM)
        return bool(st.repeats.propose(seq.token_ids, 1))

    def _draft_pays_more(self, st: SeqSpecState, found: int, cap: int, costs: tuple[float, float]) -> bool:
        """n-gram lookup and a draft both on, and the lookup found `found` tokens: whether the
        draft's proposals are expected to pay more than the lookup's, which cost no forward
        (with fixed lengths the lookup is always taken)."""
        if self.draft is None or not self.config.adaptive:
            return False
        return best_rate(Candidate(st.draft.rate, cap, True), *costs) > best_rate(
            Candidate(st.ngram.rate, found, False), *costs
        )

    def _lengths(self, cands: list[Candidate], plain: int, room: int, costs: tuple[float, float]) -> list[int]:
        """Each candidate's proposals: what is worth its measured cost (adaptive), or as many as
        fit, the room shared out evenly (what one leaves goes to the next)."""
        if self.config.adaptive:
            return plan_lengths(cands, plain, room, *costs)
        ks = []
        for i, cand in enumerate(cands):
            k = max(0, min(cand.cap, room // (len(cands) - i)))
            ks.append(k)
            room -= k
        return ks

    def observe_step(self, rows: int, secs: float) -> None:
        """A decode-only target step (rows: its decode rows, proposals included) took secs."""
        self.costs.observe_step(rows, secs)

    def release(self, seq) -> None:
        """seq finished, was aborted or preempted: the draft model gives back its blocks (to
        the pool the target's blocks come from)."""
        if self.draft is not None:
            self.draft.release(seq)

    def _room(self, seq) -> int:
        """Proposals that fit: num_tokens, within max_tokens and the model's length (the step adds
        up to k + 1 tokens, and the last proposal's position must fit)."""
        room = min(seq.params.max_tokens - seq.num_output_tokens, self.max_model_len - seq.num_tokens)
        return max(0, min(self.config.num_tokens, room - 1))

    @staticmethod
    def _pause(st: SeqSpecState) -> None:
        st.pause = st.pause_len
        st.pause_len = min(MAX_PAUSE_STEPS, 2 * st.pause_len)

    def record(self, seq, proposed: int, accepted: int) -> None:
        """After a verification: the figures, and the proposer's acceptance for the sequence."""
        s = self.stats
        s.proposed += proposed
        s.accepted += accepted
        s.verifications += 1
        st = seq.spec
        (st.ngram if st.source == "ngram" else st.draft).update(proposed, accepted)
