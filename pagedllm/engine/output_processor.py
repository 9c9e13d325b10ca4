"""Output processing, apart from the engine core (as vLLM v1 keeps it out of EngineCore):
incremental detokenization, stop strings, logprob entries, request metrics, and the
`RequestOutput`s callers get.

The core (llm_engine.py) appends sampled tokens and applies the stops that need no text: EOS,
stop token ids, a finished grammar, the length limits. Stop strings need text, so they are found
here: after the core has appended a step's tokens, `find_stops` turns the new tokens of requests
with stop strings into text one token at a time and hands back, as vLLM v1's output processor
hands back requests to abort, each sequence that completed a stop string with the number of its
output tokens to keep. The core ends those sequences in the same step (their blocks free at
once) and drops what a speculative step accepted past the stop.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..outputs import CompletionOutput, RequestMetrics, RequestOutput
from ..sampling.params import SamplingParams
from ..tokenizer import IncrementalDetokenizer

if TYPE_CHECKING:
    from .request import Request
    from .sequence import Sequence

logger = logging.getLogger(__name__)


class _Text:
    """A stream's text as appended pieces: adding a token, looking at the tail for a stop string
    and taking a delta cost O(piece), not O(text)."""

    def __init__(self) -> None:
        self.parts: list[str] = []
        self.length = 0

    def add(self, piece: str) -> None:
        if piece:
            self.parts.append(piece)
            self.length += len(piece)

    def since(self, start: int) -> str:
        """Characters from `start` to the end, joining only the pieces that hold them."""
        i, base = len(self.parts), self.length
        while i > 0 and base > start:
            i -= 1
            base -= len(self.parts[i])
        return "".join(self.parts[i:])[start - base :]

    def full(self) -> str:
        if len(self.parts) > 1:
            self.parts[:] = ["".join(self.parts)]
        return self.parts[0] if self.parts else ""

    def cut(self, end: int) -> None:
        text = self.full()[:end]
        self.parts[:] = [text] if text else []
        self.length = len(text)


@dataclass
class SeqOutputState:
    """One sequence's output as callers see it (the scheduler never sees text)."""

    detok: IncrementalDetokenizer
    text: _Text = field(default_factory=_Text)
    logprobs: list[dict] | None = None  # {"token_id", "logprob", "top"} per output token, when asked
    detokenized: int = 0  # output tokens already turned into text
    flushed: bool = False
    emitted: int = 0  # characters of the text already handed out as deltas
    emitted_tokens: int = 0


class OutputProcessor:
    def __init__(self, tokenizer, eos_token_ids: set[int]) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids

    def start(self, prompt_token_ids: list[int], params: SamplingParams) -> tuple[RequestMetrics, list[SeqOutputState]]:
        """A new request's metrics (arrival now) and one output state per completion."""
        metrics = RequestMetrics(arrival_time=time.perf_counter(), num_prompt_tokens=len(prompt_token_ids))
        states = [
            SeqOutputState(IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params.skip_special_tokens))
            for _ in range(params.n)
        ]
        return metrics, states

    def on_token(self, req: Request, seq: Sequence, tok: int, lp) -> None:
        """A token was appended to `seq`; `lp`: its (logprob, top) or None."""
        if lp is not None:
            st = req.states[seq.index]
            if st.logprobs is None:
                st.logprobs = []
            st.logprobs.append({"token_id": tok, "logprob": lp[0], "top": lp[1]})

    def find_stops(self, reqs) -> list[tuple[Sequence, int, str]]:
        """The sequences of `reqs` whose tokens appended this step complete one of their stop
        strings: (sequence, output tokens to keep, the stop string). Each one's text is cut
        before the stop string and its logprob entries past the kept tokens go; the core ends
        the sequence. Tokens are turned into text one at a time, so the first token that
        completes a stop string is the last one kept, however many a step appended."""
        hits = []
        for req in reqs:
            if not req.params.stop:
                continue
            for seq, st in zip(req.seqs, req.states):
                ids = seq.output_token_ids
                while st.detokenized < len(ids):
                    tok = ids[st.detokenized]
                    st.detokenized += 1
                    if seq.params.ignore_eos or tok not in self.eos_token_ids:
                        st.text.add(st.detok.add([tok]))
                    stop = self._cut_at_stop(seq, st.text)
                    if stop is not None:
                        if st.logprobs is not None:
                            del st.logprobs[st.detokenized :]
                        hits.append((seq, st.detokenized, stop))
                        break
        return hits

    @staticmethod
    def _cut_at_stop(seq: Sequence, text: _Text) -> str | None:
        """The stop string the text now holds (the earliest), with the text cut before it."""
        # Only the tail can hold a new match: the last token's text plus the longest stop string.
        longest = max(len(s) for s in seq.params.stop)
        tail_start = max(0, text.length - longest - 16)
        tail = text.since(tail_start)
        best = None
        for s in seq.params.stop:
            pos = tail.find(s)
            if pos != -1 and (best is None or pos < best[0]):
                best = (pos, s)
        if best is None:
            return None
        text.cut(tail_start + best[0])
        return best[1]

    def _detokenize(self, seq: Sequence, st: SeqOutputState) -> None:
        """Bring the text up to the sequence's tokens, one token at a time (as they came); the
        EOS that ended it has no text, and a sequence ended by a stop or a length limit flushes
        what the detokenizer held back (one cut at a stop string keeps its cut)."""
        ids = seq.output_token_ids
        if st.detokenized < len(ids):
            ignore_eos = seq.params.ignore_eos
            for tok in ids[st.detokenized :]:
                if ignore_eos or tok not in self.eos_token_ids:
                    st.text.add(st.detok.add([tok]))
            st.detokenized = len(ids)
        if seq.finish_reason in ("stop", "length") and not isinstance(seq.stop_reason, str) and not st.flushed:
            st.flushed = True
            st.text.add(st.detok.flush())

    def make_output(self, req: Request) -> RequestOutput:
        """The request's output as of this step: each completion's text so far and what is new."""
        outs = []
        hold = max((len(s) for s in req.params.stop), default=1) - 1
        for seq, st in zip(req.seqs, req.states):
            self._detokenize(seq, st)
            text = st.text
            # While running, hold back what could be the start of a stop string.
            upto = text.length if seq.is_finished else max(st.emitted, text.length - hold)
            delta = text.since(st.emitted)[: upto - st.emitted] if upto > st.emitted else ""
            st.emitted = upto
            new_tokens = seq.output_token_ids[st.emitted_tokens :]
            st.emitted_tokens = n = seq.num_output_tokens
            ids, lps = seq.output_token_ids, st.logprobs
            if seq.is_finished:  # nothing will be appended any more: hand out the state itself
                out = CompletionOutput(
                    seq.index, text.full(), ids, seq.finish_reason, seq.stop_reason, lps, delta, new_tokens
                )
            else:  # a snapshot of this step, built only if read
                out = CompletionOutput(
                    seq.index,
                    lambda t=text, u=upto: t.full()[:u],
                    lambda i=ids, m=n: i[:m],
                    seq.finish_reason,
                    seq.stop_reason,
                    None if lps is None else (lambda lp=lps, m=len(lps): lp[:m]),
                    delta,
                    new_tokens,
                )
            outs.append(out)
        m = req.metrics
        m.num_output_tokens = sum(s.num_output_tokens for s in req.seqs)
        finished = req.finished
        # Times are taken as the step hands its tokens out, which is when a caller can have
        # them: after the whole step, a draft model's catch-up of a new prompt included.
        if m.first_scheduled_time is None:
            m.first_scheduled_time = req.seqs[0].first_scheduled_time
        if m.first_token_time is None and m.num_output_tokens:
            m.first_token_time = time.perf_counter()
        if finished and m.finished_time is None:
            m.finished_time = time.perf_counter()
            if logger.isEnabledFor(logging.DEBUG):
                _log_finished(req)
        return RequestOutput(
            req.request_id,
            req.prompt,
            req.prompt_token_ids,
            outs,
            finished,
            m,
            num_cached_tokens=min(s.num_cached_tokens for s in req.seqs),
            error=req.error,
            prompt_logprobs=req.prompt_logprobs,
            embedding=req.embedding,
        )


def _log_finished(req: Request) -> None:
    """One line per finished request (--log-level debug): where its time to first token went."""
    m, seq = req.metrics, req.seqs[0]
    ttft, queued = m.time_to_first_token, m.queue_time
    logger.debug(
        "request %s finished: prompt %d tokens, cached %d, preemptions %d, queued %s s, ttft %s s, output %d tokens",
        req.request_id,
        m.num_prompt_tokens,
        seq.num_cached_tokens,
        sum(s.num_preemptions for s in req.seqs),
        "-" if queued is None else f"{queued:.3f}",
        "-" if ttft is None else f"{ttft:.3f}",
        m.num_output_tokens,
    )
