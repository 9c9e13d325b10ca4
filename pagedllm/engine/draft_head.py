"""The draft model's LM head over part of the vocabulary.

A draft's proposals are only greedy guesses that the target verifies, so they need not come
from the whole vocabulary. On a model with a large vocabulary the head is a large part of the
draft's step: Qwen2.5-0.5B's 151,936 x 896 head is 145 of the 391 MB a decode step reads. The
draft here scores:

- the first `keep` token ids. Byte-level BPE vocabularies number their tokens in merge order
  and SentencePiece ones by score, so the low ids are the frequent tokens (the idea of
  FR-Spec's frequency-ranked draft head), and they are one slice of the weight, read by the
  same kernel as the whole head;
- the added tokens (end of turn, end of text, tool-call markers), always;
- every token id at or above `keep` that a live speculating sequence holds, in its prompt or
  its output: an answer mostly reuses the words of its question and repeats its own rare
  words. Their rows are kept dequantized and refreshed when that set changes.

A token outside these is never proposed; the target's own step still produces it, so output
is unchanged, only the proposal at that position is lost. The argmax over this subset equals
the whole head's whenever the whole head's argmax lies in it (a monotonic logit transform, such
as Gemma 2's soft-capping, keeps the argmax, so the plain product suffices).
"""

from __future__ import annotations

import torch

from ..quant import kernels as qk
from ..quant.formats import PACK_ROWS, QuantTensor
from ..quant.isq import requantize
from ..sampling.sampler import greedy_ids
from .draft_weights import target_format

# With draft_vocab unset, a vocabulary over AUTO_MIN_VOCAB ids is cut to its first AUTO_KEEP.
AUTO_KEEP, AUTO_MIN_VOCAB = 32768, 65536


def resolve_keep(draft_vocab: int | None, vocab_size: int) -> int:
    """The head's rows scored in full: `draft_vocab` (0: the whole vocabulary; None: the
    default) rounded up to whole 16-row groups, at most the vocabulary."""
    if draft_vocab is None:
        draft_vocab = AUTO_KEEP if vocab_size > AUTO_MIN_VOCAB else 0
    if draft_vocab <= 0:
        return vocab_size
    return min(vocab_size, -(-draft_vocab // PACK_ROWS) * PACK_ROWS)


class DraftHead:
    """Greedy tokens from the draft's final hidden states over the first `keep` ids, the
    added tokens, and the ids the live sequences hold (see the module docstring)."""

    def __init__(self, model, vocab_size: int, keep: int, always: list[int], weights: str = "file") -> None:
        """`weights`: speculative draft_weights, for the `keep` rows scored (draft_weights.py)."""
        lm = model.lm_head
        self.vocab_size = vocab_size
        self.keep = keep
        self.dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
        self.parts: list[QuantTensor] | None = None
        self.weight: torch.Tensor | None = None
        if lm.qparts is not None:
            (w,) = lm.qparts
            self.full = w
            fmt = target_format(weights, w)
            if fmt is not None:
                self.parts = [requantize(w, fmt, keep, "lm_head")]
            else:
                n = keep // PACK_ROWS if w.packed else keep
                self.parts = [QuantTensor(w.fmt, w.data[:n], (keep, w.shape[1]), packed=w.packed)]
        else:
            self.full = lm.weight
            self.weight = lm.weight[:keep]
        self.always = frozenset(i for i in always if keep <= i < vocab_size)
        self.held: dict[int, set[int]] = {}  # seq id -> its token ids at or above keep
        self.count: dict[int, int] = {}  # token id -> live sequences holding it
        self._ids: torch.Tensor | None = None  # the extra ids in use, and their float32 rows
        self._rows: torch.Tensor | None = None

    @staticmethod
    def usable(model) -> bool:
        """The head is one plain weight (not split across ranks, not column-permuted, no bias)."""
        lm = getattr(model, "lm_head", None)
        if (
            lm is None
            or getattr(model, "tp", None) is not None
            or getattr(lm, "lora", None) is not None
            or getattr(lm, "bias", None) is not None
        ):
            return False
        if lm.qparts is not None:
            return len(lm.qparts) == 1 and lm.qparts[0].col_perm is None and lm.in_perm is None
        return lm.weight is not None

    @property
    def num_extra(self) -> int:
        return len(self.always) + len(self.count)

    def hold(self, seq_id: int, token_ids: list[int]) -> None:
        """seq_id holds these tokens (new ones since the last call): their rare ids join."""
        keep, always = self.keep, self.always
        rare = [t for t in token_ids if t >= keep and t not in always]
        if not rare:
            return
        mine = self.held.setdefault(seq_id, set())
        for t in rare:
            if t not in mine and t < self.vocab_size:
                mine.add(t)
                n = self.count.get(t, 0)
                self.count[t] = n + 1
                if n == 0:
                    self._ids = None

    def drop(self, seq_id: int) -> None:
        """seq_id left: the ids only it held leave the head."""
        for t in self.held.pop(seq_id, ()):
            n = self.count.pop(t) - 1
            if n:
                self.count[t] = n
            else:
                self._ids = None

    def _extra(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._ids is None:
            ids = torch.tensor(sorted(self.always | self.count.keys()), dtype=torch.long)
            if self.parts is not None:  # quantized weights live on the CPU
                rows = qk.embedding(self.full, ids, torch.float32) if len(ids) else torch.empty(0, self.full.shape[1])
            else:
                ids = ids.to(self.full.device)
                rows = self.full.index_select(0, ids).float()
            self._ids, self._rows = ids, rows
        return self._ids, self._rows

    def greedy(self, hidden: torch.Tensor) -> list[int]:
        """hidden: [rows, K] float32 final hidden states -> each row's greedy token id."""
        if self.parts is not None:
            main = qk.matmul(hidden.to(self.dtype), self.parts, out_dtype=torch.float32, role="lm_head")
        else:
            main = (hidden.to(self.weight.dtype) @ self.weight.t()).float()
        ids, rows = self._extra()
        if not len(ids):
            return greedy_ids(main)
        best, arg = main.max(-1)
        ebest, earg = (hidden @ rows.t()).max(-1)
        out = torch.where(ebest > best, ids[earg], arg)
        return out.tolist()
