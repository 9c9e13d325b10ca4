"""Repetition, presence and frequency penalties from state kept incrementally per stream.

Each stream that asks for penalties owns a slot in two batched tensors:
- `counts[slot, token]`: how often the token appeared in the output (presence, frequency);
- `hist[slot, :len]`: the token ids seen so far, prompt then output (repetition, and the
  list of logits to touch).
A step appends only the tokens added since the previous step (one per running stream),
whatever happened in between: a preempted stream keeps its tokens and its slot, a forked
sibling starts its own slot from its prompt, a prefix-cache hit changes no tokens. The
penalised logits are gathered and scattered at `hist` only, so a step costs O(tokens seen),
not O(vocabulary) per row.
"""

from __future__ import annotations

import torch

from .metadata import SamplingMetadata


class PenaltyState:
    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.slots: dict[int, int] = {}  # seq_id -> slot
        self.lengths: list[int] = []  # tokens recorded per slot
        self.free: list[int] = []
        self.counts = torch.zeros((0, vocab_size), dtype=torch.int32, device=device)
        self.hist = torch.zeros((0, 0), dtype=torch.int64, device=device)

    @property
    def num_slots(self) -> int:
        return len(self.slots)

    @torch.inference_mode()  # the tensors were made in the step's inference mode
    def release(self, seq_id: int) -> None:
        slot = self.slots.pop(seq_id, None)
        if slot is not None:
            self.counts[slot].zero_()
            self.lengths[slot] = 0
            self.free.append(slot)

    def apply(self, logits: torch.Tensor, rows: list[int], meta: SamplingMetadata) -> None:
        """Penalise `logits` ([rows of the batch, vocab], contiguous) in place for `rows`."""
        slots = self._sync(rows, meta)
        dev, v = logits.device, self.vocab_size
        slot_t = torch.tensor(slots, dtype=torch.int64, device=dev)
        lens = [self.lengths[s] for s in slots]
        width = max(lens)
        ids = self.hist[slot_t, :width]
        if min(lens) < width:  # pad with each row's first token: rewriting it twice is harmless
            pos = torch.arange(width, device=dev)[None, :]
            ids = torch.where(pos < torch.tensor(lens, device=dev)[:, None], ids, ids[:, :1])
        flat_logits = (torch.tensor(rows, dtype=torch.int64, device=dev)[:, None] * v + ids).view(-1)
        counts = self.counts.view(-1)[(slot_t[:, None] * v + ids).view(-1)].view(ids.shape).float()
        vals = logits.view(-1)[flat_logits].view(ids.shape)
        ps = [meta.params[r] for r in rows]
        rep = torch.tensor([p.repetition_penalty for p in ps], device=dev)[:, None]
        pres = torch.tensor([p.presence_penalty for p in ps], device=dev)[:, None]
        freq = torch.tensor([p.frequency_penalty for p in ps], device=dev)[:, None]
        # vLLM semantics: repetition over prompt and output, presence/frequency over output.
        vals = torch.where(vals > 0, vals / rep, vals * rep)
        vals = vals - freq * counts - pres * (counts > 0).float()
        logits.view(-1)[flat_logits] = vals.view(-1)  # duplicates write the same value

    def _sync(self, rows: list[int], meta: SamplingMetadata) -> list[int]:
        """Slot per row, after recording every token the rows gained since last seen."""
        slots, h_slot, h_pos, h_tok, c_slot, c_tok = [], [], [], [], [], []
        for r in rows:
            sid, toks = meta.seq_ids[r], meta.token_ids[r]
            slot = self.slots.get(sid)
            if slot is None:
                slot = self._new_slot(sid)
            start = self.lengths[slot]
            if start > len(toks):  # the stream lost tokens (never expected): start over
                self.counts[slot].zero_()
                start = 0
            new = toks[start:]
            if new:
                self._ensure_width(len(toks))
                h_slot += [slot] * len(new)
                h_pos += range(start, len(toks))
                h_tok += new
                first_out = max(start, meta.num_prompt_tokens[r])
                if first_out < len(toks):
                    c_slot += [slot] * (len(toks) - first_out)
                    c_tok += toks[first_out:]
                self.lengths[slot] = len(toks)
            slots.append(slot)
        dev = self.device
        if h_tok:
            self.hist[torch.tensor(h_slot, device=dev), torch.tensor(h_pos, device=dev)] = torch.tensor(
                h_tok, dtype=torch.int64, device=dev
            )
        if c_tok:
            self.counts.index_put_(
                (torch.tensor(c_slot, device=dev), torch.tensor(c_tok, device=dev)),
                torch.ones(len(c_tok), dtype=torch.int32, device=dev),
                accumulate=True,
            )
        return slots

    def _new_slot(self, seq_id: int) -> int:
        if not self.free:
            old = self.counts.shape[0]
            cap = max(8, 2 * old)
            counts = torch.zeros((cap, self.vocab_size), dtype=torch.int32, device=self.device)
            counts[:old] = self.counts
            hist = torch.zeros((cap, self.hist.shape[1]), dtype=torch.int64, device=self.device)
            hist[:old] = self.hist
            self.counts, self.hist = counts, hist
            self.lengths += [0] * (cap - old)
            self.free = list(range(cap - 1, old - 1, -1))
        slot = self.free.pop()
        self.slots[seq_id] = slot
        return slot

    def _ensure_width(self, n: int) -> None:
        w = self.hist.shape[1]
        if n > w:
            hist = torch.zeros((self.hist.shape[0], max(n, 2 * w, 256)), dtype=torch.int64, device=self.device)
            hist[:, :w] = self.hist
            self.hist = hist
