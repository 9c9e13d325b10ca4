"""What the user asks of speculative decoding, checked once."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

METHODS = ("ngram", "draft")


@dataclass
class SpeculativeConfig:
    method: str
    num_tokens: int = 5  # proposals per step at most (k)
    max_ngram: int = 4  # ngram: the longest suffix looked up in the sequence's own tokens
    min_ngram: int = 2  # ngram: the shortest; 1 proposes on any repeated token (noisy in chat)
    model: str | None = None  # draft: the draft model (a folder, GGUF file, hub id or "default"; same vocabulary)
    # Off for the whole step when more sequences decode at once than this: a wide batch is
    # compute bound on a CPU, so verifying k extra rows each costs about k times as much.
    max_batch: int = 8
    # Decode rows a speculating step holds at most (its sequences and their proposals): a
    # sequence's proposals are cut to fit. It keeps verification within the quantized
    # kernels' activation rounding of narrow steps (quant/kernels.py X2_ROWS), where plain decoding
    # of the same sequences runs, so both round alike and greedy output stays identical; wider
    # verification is compute bound on a CPU anyway.
    max_rows: int = 8
    # A sequence pauses speculation when its per-token acceptance falls under this.
    min_acceptance: float = 0.25
    # Choose each step's proposal lengths from each sequence's acceptance and the step costs
    # measured in this run (speculative/costs.py): a length that is not expected to pay is
    # not proposed. Off: always num_tokens (where they fit).
    adaptive: bool = True
    # method "draft": also look up n-gram proposals; a sequence whose suffix has an earlier
    # match proposes those (they cost no draft forward), the others ask the draft model.
    ngram: bool = False
    # method "draft": the token ids the draft's head scores in full (engine/draft_head.py), the
    # added tokens and the rarer ids of the live sequences always beside them. None: the first
    # 32,768 of a vocabulary over 65,536 (else all); 0: all.
    draft_vocab: int | None = None
    # method "draft": the format the draft's quantized weights run in (engine/draft_weights.py):
    # "auto" requantizes those stored in more bits a weight than Q4_0 to Q4_0 at load (a draft
    # only proposes, and fewer bytes make its forwards faster); a type (Q4_0, Q8_0, ...) all of
    # them to it; "file" keeps the file's.
    draft_weights: str = "auto"

    @classmethod
    def coerce(cls, value: "SpeculativeConfig | dict[str, Any] | None") -> "SpeculativeConfig | None":
        if value is None or isinstance(value, cls):
            if value is not None:
                value.validate()
            return value
        if not isinstance(value, dict):
            raise TypeError(
                f"speculative must be a dict such as {{'method': 'ngram', 'num_tokens': 5}}, got {type(value).__name__}"
            )
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative: unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        if "method" not in value:
            raise ValueError("speculative needs a 'method': 'ngram' or 'draft'")
        cfg = cls(**value)
        cfg.validate()
        return cfg

    def validate(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative method {self.method!r} is unknown; use one of {', '.join(METHODS)}")
        for name in ("num_tokens", "max_ngram", "min_ngram", "max_batch", "max_rows"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"speculative {name} must be an integer >= 1, got {v!r}")
        if self.num_tokens > 32:
            raise ValueError(f"speculative num_tokens={self.num_tokens} is too many; use at most 32")
        if self.min_ngram > self.max_ngram:
            raise ValueError(f"speculative min_ngram={self.min_ngram} exceeds max_ngram={self.max_ngram}")
        if not 0 <= self.min_acceptance < 1:
            raise ValueError(f"speculative min_acceptance must be in [0, 1), got {self.min_acceptance}")
        if self.method == "draft" and not (isinstance(self.model, str) and self.model):
            raise ValueError(
                "speculative method 'draft' needs 'model': the path (or hub id) of a small "
                "draft model with the target's tokenizer, e.g. "
                "{'method': 'draft', 'model': 'path/to/draft', 'num_tokens': 4}"
            )
        for name in ("adaptive", "ngram"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"speculative {name} must be true or false, got {getattr(self, name)!r}")
        dv = self.draft_vocab
        if dv is not None and (not isinstance(dv, int) or isinstance(dv, bool) or dv < 0):
            raise ValueError(f"speculative draft_vocab must be an integer >= 0 (0: the whole vocabulary), got {dv!r}")
        if dv is not None and self.method != "draft":
            raise ValueError("speculative 'draft_vocab' cuts a draft model's head; method 'ngram' has none")
        if self.draft_weights not in ("auto", "file"):
            from ..quant.isq import check_isq_type

            try:
                self.draft_weights = check_isq_type(self.draft_weights)
            except ValueError as e:
                raise ValueError(f"speculative draft_weights must be 'auto', 'file' or a quantized type: {e}") from None
        if self.draft_weights != "auto" and self.method != "draft":
            raise ValueError("speculative 'draft_weights' sets a draft model's weights; method 'ngram' has none")
        if self.ngram and self.method != "draft":
            raise ValueError(
                "speculative 'ngram': true combines n-gram lookup with a draft model (method "
                "'draft'); method 'ngram' looks up n-grams already"
            )
        if self.method == "ngram" and self.model:
            raise ValueError("speculative method 'ngram' takes no 'model' (did you mean method 'draft'?)")
