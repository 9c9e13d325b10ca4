"""Grammar-constrained decoding through llguidance.

Chosen over xgrammar by measurement (pagedllm/bench/grammar_engines.py): it refuses the JSON
Schema keywords it cannot enforce (a 400) where xgrammar silently emitted invalid output for
allOf, if/then/else, not and uniqueItems; it compiles a new schema far faster than xgrammar,
and the more so the larger the vocabulary (docs/benchmarks/from-code.md), which matters when
every request brings its own schema;
and it does not depend on torch, so installing it can never replace the user's torch.

One `GrammarEngine` per LLM engine: it owns the token trie (built once, lazily, off the
engine thread when the server validates a first request) and computes the allowed-token
bitmasks of a step's constrained rows on a worker thread while the model's forward runs
(llguidance drops the GIL), so constrained requests never hold up the others.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Sequence

import torch

from . import limits
from .params import StructuredOutputs

logger = logging.getLogger(__name__)


def grammar_text(spec: StructuredOutputs) -> str:
    """The llguidance grammar for a spec (not yet checked: `GrammarEngine.compile` does)."""
    import llguidance as llg

    kind = spec.kind
    if kind in ("json", "json_object"):
        schema = {"type": "object"} if kind == "json_object" else spec.json
        options = {"whitespace_flexible": spec.whitespace_flexible}
        return llg.LLMatcher.grammar_from_json_schema(schema, defaults=options)
    if kind == "regex":
        return llg.LLMatcher.grammar_from_regex(spec.regex)
    if kind == "choice":
        # JSON string quoting is also valid Lark string-literal quoting.
        return llg.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in spec.choice))
    return llg.LLMatcher.grammar_from_lark(spec.grammar)


class GrammarEngine:
    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self._hf_tokenizer = tokenizer  # pagedllm's Tokenizer (wraps a `tokenizers.Tokenizer`)
        self.vocab_size = vocab_size  # the logits' width
        self.eos_token_ids = sorted(eos_token_ids)
        self._lltok = None
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._executor = None
        # Matchers the server compiled off the engine thread, waiting for their request.
        self._ready: OrderedDict[int, tuple[StructuredOutputs, Any]] = OrderedDict()

    @property
    def lltokenizer(self) -> Any:
        with self._lock:
            if self._lltok is None:
                import llguidance as llg

                backend = self._hf_tokenizer.backend
                n_vocab = max(self.vocab_size, backend.get_vocab_size(with_added_tokens=True))
                self._lltok = llg.LLTokenizer(backend.to_str(), n_vocab=n_vocab, eos_token=self.eos_token_ids or None)
                self._executor = llg.LLExecutor()
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="pagedllm-grammar")
            return self._lltok

    def compile(self, spec: StructuredOutputs) -> Any:
        """A fresh matcher for `spec`; ValueError saying what is wrong when it cannot be built
        (limits.GrammarLimitError, naming the limit, when it is too big to compile safely)."""
        import llguidance as llg

        limits.check(spec)
        try:
            text = grammar_text(spec)
        except ValueError as e:
            raise ValueError(f"invalid {spec.kind} constraint: {limits.clean_error(str(e))}") from None
        m = llg.LLMatcher(self.lltokenizer, text, log_level=0)
        if m.is_error():
            raise ValueError(f"invalid {spec.kind} constraint: {limits.clean_error(m.get_error())}")
        return m

    def prepare(self, spec: StructuredOutputs) -> None:
        """Compile `spec` now (the server does, on its own threads) and keep the matcher for
        `matchers`, so the engine thread does not compile it again."""
        m = self.compile(spec)
        with self._lock:
            self._ready[id(spec)] = (spec, m)
            while len(self._ready) > 64:  # requests that never reached the engine
                self._ready.popitem(last=False)

    def matchers(self, spec: StructuredOutputs, n: int) -> list[Any]:
        with self._lock:
            ready = self._ready.pop(id(spec), None)
        first = ready[1] if ready is not None and ready[0] is spec else self.compile(spec)
        return [first] + [first.deep_copy() for _ in range(n - 1)]

    # -- per step ------------------------------------------------------------------
    def start_masks(
        self,
        seqs: Sequence[Any],
        offsets: Sequence[int] | None = None,
        drafts: Sequence[Sequence[int] | None] | None = None,
    ) -> "MaskJob | None":
        """Begin computing the masks of the constrained rows of `seqs` (the sampler's rows).
        A speculating sequence has consecutive rows at offsets 0..k; `drafts` gives, on its
        offset-0 row, the k proposals its grammar already accepted: row j is masked by the
        grammar advanced through the first j of them (and rolled back after)."""
        offsets = offsets or [0] * len(seqs)
        rows = [i for i, s in enumerate(seqs) if s.grammar is not None]
        if not rows:
            return None
        jobs = [
            (seqs[i].grammar, pos, list(drafts[i]) if drafts and drafts[i] else [])
            for pos, i in enumerate(rows)
            if offsets[i] == 0
        ]
        self.lltokenizer  # noqa: B018 (makes sure the executor exists)
        fut = self._pool.submit(self._fill, jobs, len(rows))
        return MaskJob(rows, fut)

    def _fill(self, jobs: list[tuple[Any, int, list[int]]], n: int) -> torch.Tensor:
        """The constrained rows' allowed tokens, (n, vocab) bool; the unpacking also runs here,
        off the engine thread (torch releases the GIL)."""
        words = (self.vocab_size + 31) // 32
        bitmask = torch.full((n, words), -1, dtype=torch.int32)
        plain = [(m, k) for m, k, d in jobs if not d]
        spec = [(m, k, d) for m, k, d in jobs if d]
        if plain:
            self._executor.unsafe_compute_mask_ptr(plain, bitmask.data_ptr(), words * 4, n)
        if spec:
            self._executor.unsafe_compute_mask_ptr_with_draft_token(spec, bitmask.data_ptr(), words * 4, n)
        return allowed_tokens(bitmask, self.vocab_size)


class MaskJob:
    """One step's masks, computed on the grammar thread; `result` waits for them."""

    def __init__(self, rows: list[int], fut: Future) -> None:
        self.rows, self.fut = rows, fut

    def result(self, device: torch.device, num_rows: int) -> tuple[torch.Tensor, list[int] | None]:
        """(allowed [len(rows), vocab] bool, rows) for SamplingMetadata.allowed_mask/mask_rows;
        rows is None when every one of the step's `num_rows` rows is constrained (the sampler
        then masks in place, without a gather)."""
        allowed = self.fut.result().to(device, non_blocking=True)
        return allowed, None if len(self.rows) == num_rows else self.rows


_BITS = 1 << torch.arange(32, dtype=torch.int32)  # bit 31 is the sign bit: -2**31, which ANDs right


def allowed_tokens(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """(rows, ceil(V/32)) int32 words, bit j of word w set = token 32*w + j allowed, to a
    (rows, V) bool tensor that is True where a token is allowed."""
    return (bitmask[:, :, None] & _BITS).ne(0).flatten(1)[:, :vocab]


def advance(matcher: Any, token: int) -> bool:
    """Feed a sampled token to its matcher; True when the grammar is complete (stop now)."""
    if not matcher.consume_token(token):
        logger.warning("grammar refused sampled token %d: %s", token, _first_lines(matcher.get_error()))
        return True
    return matcher.is_stopped()


def _first_lines(msg: str, n: int = 6) -> str:
    return " ".join(line.strip() for line in msg.strip().splitlines()[:n] if line.strip())
