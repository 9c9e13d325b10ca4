"""Batched sampling on the model's device: one set of tensor ops for the whole batch.

Sampling is an exponential race: token = argmax(p_i / E_i) with E_i ~ Exp(1),
which draws exactly from p. Unlike inverse-CDF sampling over a long cumulative
sum, it only flips when the two best candidates nearly tie, so round-off in the
logits (a different batch shape, a cached prefix) leaves the sample alone. A
request with a seed draws its noise from its own generator and gets the same
tokens whatever else shares the batch; other rows share the engine's generator.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..engine.sequence import Sequence


@dataclass
class SamplerOutput:
    token_ids: list[int]
    # Per row, when asked for: (logprob of the chosen token, [(token, logprob), ...] top-k)
    logprobs: list[tuple[float, list[tuple[int, float]]] | None] | None = None
    seqs: list[Sequence] = field(default_factory=list)  # the rows, in order


class Sampler:
    def __init__(self, device: torch.device, seed: int = 0) -> None:
        self.device = device
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    @torch.no_grad()
    def __call__(self, logits: torch.Tensor, seqs: list[Sequence],
                 finite: torch.Tensor | None = None) -> SamplerOutput:
        """`finite` [rows] bool: False rows get token -1 (their logits were not finite)."""
        params = [s.params for s in seqs]
        raw = logits
        if any(p.needs_penalties for p in params):
            logits = apply_penalties(logits.clone(), seqs)
        greedy = [p.greedy for p in params]
        if all(greedy):
            tokens = logits.argmax(dim=-1)
        else:
            tokens = self._sample(logits, seqs, greedy)
        token_list = (tokens if finite is None else tokens.masked_fill(~finite, -1)).tolist()
        lp = None
        if any(p.logprobs is not None for p in params):
            lp = _logprobs(raw, tokens, params)
        return SamplerOutput(token_list, lp)

    def _noise(self, probs: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        q = torch.empty_like(probs)
        q.exponential_(generator=self.generator)
        for i, s in enumerate(seqs):
            if s.generator is not None:
                q[i].exponential_(generator=s.generator)
        return q

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence], greedy: list[bool]) -> torch.Tensor:
        params = [s.params for s in seqs]
        dev = logits.device
        temps = torch.tensor([1.0 if g else p.temperature for g, p in zip(greedy, params)],
                             device=dev, dtype=torch.float32)
        probs = torch.softmax(logits / temps[:, None], dim=-1)

        order = None
        if any(p.top_k > 0 or p.top_p < 1.0 for p in params):
            probs, order = probs.sort(dim=-1, descending=True)
            ranks = torch.arange(probs.shape[-1], device=dev)[None, :]
            top_k = torch.tensor([p.top_k if p.top_k > 0 else probs.shape[-1] for p in params], device=dev)
            drop = ranks >= top_k[:, None]
            top_p = torch.tensor([p.top_p for p in params], device=dev, dtype=torch.float32)
            before = probs.cumsum(dim=-1) - probs  # mass strictly above each token
            drop |= before > top_p[:, None]
            probs = probs.masked_fill(drop, 0.0)
        if any(p.min_p > 0 for p in params):
            min_p = torch.tensor([p.min_p for p in params], device=dev, dtype=torch.float32)
            peak = probs.amax(dim=-1, keepdim=True)
            probs = probs.masked_fill(probs < min_p[:, None] * peak, 0.0)

        if order is not None:  # back to vocabulary order, so each token meets the same noise
            probs = torch.zeros_like(probs).scatter_(1, order, probs)
        tokens = (probs / self._noise(probs, seqs)).argmax(dim=-1)
        if any(greedy):
            g = torch.tensor(greedy, device=dev)
            tokens = torch.where(g, logits.argmax(dim=-1), tokens)
        return tokens


def apply_penalties(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """Repetition (prompt and output), presence and frequency (output) penalties, vLLM semantics."""
    b, v = logits.shape
    dev = logits.device
    out_counts = torch.zeros((b, v), dtype=torch.float32, device=dev)
    seen = torch.zeros((b, v), dtype=torch.bool, device=dev)
    for i, s in enumerate(seqs):
        if not s.params.needs_penalties:
            continue
        if s.output_token_ids:
            ids = torch.tensor(s.output_token_ids, device=dev)
            out_counts[i].index_add_(0, ids, torch.ones_like(ids, dtype=torch.float32))
        if s.params.repetition_penalty != 1.0:
            seen[i, torch.tensor(s.prompt_token_ids, device=dev)] = True
    seen |= out_counts > 0
    rep = torch.tensor([s.params.repetition_penalty for s in seqs], device=dev)[:, None]
    pres = torch.tensor([s.params.presence_penalty for s in seqs], device=dev)[:, None]
    freq = torch.tensor([s.params.frequency_penalty for s in seqs], device=dev)[:, None]
    penalised = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalised, logits)
    logits = logits - freq * out_counts - pres * (out_counts > 0).float()
    return logits


def _logprobs(logits: torch.Tensor, tokens: torch.Tensor, params) -> list:
    lsm = torch.log_softmax(logits.float(), dim=-1)
    chosen = lsm.gather(1, tokens[:, None]).squeeze(1).tolist()
    k = max((p.logprobs or 0) for p in params)
    top_v, top_i = (lsm.topk(k, dim=-1) if k > 0 else (None, None))
    out = []
    for i, p in enumerate(params):
        if p.logprobs is None:
            out.append(None)
            continue
        tops = []
        if p.logprobs > 0:
            tops = list(zip(top_i[i, : p.logprobs].tolist(), top_v[i, : p.logprobs].tolist()))
        out.append((chosen[i], tops))
    return out
