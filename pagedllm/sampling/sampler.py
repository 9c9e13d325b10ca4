"""Batched sampling on the model's device: one set of tensor ops per step, not per row.

Sampling is an exponential race, written as Gumbel-max: token = argmax(logit/T + G_token)
with G = -log(-log U), which draws exactly from softmax(logit/T) over the tokens that
survive top-k/top-p/min-p. U comes from a hash of (row key, token id): the noise a token
meets depends only on its id, not on where it sits in a candidate list, so round-off in
the logits (another batch shape, a cached prefix) flips a sample only on a near-tie. A
seeded row's key depends only on (seed, completion index, output position), so a seeded
request gives the same tokens alone and in any batch; other rows take keys from the
engine's seeded stream.

Only a few candidates are looked at per row. `topk` picks the best `candidate_levels[0]`
tokens; top-k, top-p and min-p are decided on them when they provably hold every token
the filters keep (the candidates' mass already exceeds top_p, the last one falls under
min_p, or top_k fits). Rows where they do not are retried with more candidates, and
finally with the whole vocabulary, so the filters are exact. Rows with no filter at all
draw from the candidates with probability equal to their mass, else from the rest of the
vocabulary (an exact two-stage draw). Greedy rows take an argmax and nothing else.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from ..native import cpu_kernels
from .metadata import SamplingMetadata
from .penalties import PenaltyState

MASK32 = 0xFFFFFFFF
_BRANCH_SALT = 0x5BD1E995


def mix32(x: int) -> int:
    """A 32-bit integer hash (lowbias32); `mix32_t` is the same on tensors."""
    x ^= x >> 16
    x = (x * 0x7FEB352D) & MASK32
    x ^= x >> 15
    x = (x * 0x846CA68B) & MASK32
    return x ^ (x >> 16)


def mix32_t(x: torch.Tensor) -> torch.Tensor:
    """mix32 on an int64 tensor of values in [0, 2**32); products wrap mod 2**64, and only
    their low 32 bits are kept."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & MASK32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & MASK32
    return x ^ (x >> 16)


def uniform_from_hash(h: torch.Tensor) -> torch.Tensor:
    """24 bits of a 32-bit hash -> float32 uniform strictly inside (0, 1)."""
    return ((h >> 8).float() + 0.5) * (1.0 / (1 << 24))


def row_key(seed: int, output_pos: int) -> int:
    return mix32((mix32(seed & MASK32) + output_pos * 0x9E3779B1) & MASK32)


def greedy_ids(logits: torch.Tensor, check_finite: bool = False) -> list[int]:
    """Each row's argmax (the first of equal values), and -1 where `check_finite` and the row
    holds a NaN or an infinity. On the CPU one native call (`greedy_tokens`): torch's argmax
    and finite check are two passes over each row, the native call one, fused."""
    ops = cpu_kernels() if logits.device.type == "cpu" and logits.dtype == torch.float32 else None
    if ops is not None and logits.dim() == 2 and logits.shape[1] > 0:
        return ops.greedy_tokens(logits, check_finite).tolist()
    ids = logits.argmax(dim=-1)
    if check_finite:
        ids = ids.masked_fill(~logits.sum(-1, dtype=torch.float32).isfinite(), -1)
    return ids.tolist()


@dataclass
class SamplerOutput:
    token_ids: list[int]
    # Per row, when asked for: (logprob of the chosen token, [(token, logprob), ...] top-k)
    logprobs: list[tuple[float, list[tuple[int, float]]] | None] | None = None


class _RowCandidates:
    """The rows' first candidates, straight from the logits (the order does not depend on T), and
    softmax's denominator: on the CPU one native pass per row; elsewhere topk, then the
    numerators in place into a reused buffer (torch.softmax is far slower on very wide rows).
    The whole rows' numerators (and logits / T, in place) are made only when a row needs more
    than the first candidates."""

    def __init__(self, batch_logits: torch.Tensor, sel, temps: torch.Tensor, k0: int, native, buffer) -> None:
        self.logits, self.sel, self.temps, self.native, self.buffer = batch_logits, sel, temps, native, buffer
        self.made: list[torch.Tensor] = []  # [logits / T of the rows, softmax numerators], once made
        if native is not None:
            self.top_vals, self.top_ids, self.total = native.sample_topk(batch_logits, temps.view(-1), k0, sel)
        else:
            x = batch_logits if sel is None else batch_logits.index_select(0, sel)
            self.top_vals, self.top_ids = x.topk(k0, dim=-1)
            self.total = self.numerators().sum(dim=-1)
        tv = self.top_vals
        self.first = (((tv - tv[:, :1]) / temps).exp() / self.total[:, None], self.top_ids)

    def numerators(self) -> torch.Tensor:
        if not self.made:
            x = self.logits if self.sel is None else self.logits.index_select(0, self.sel)
            x.sub_(self.top_vals[:, :1]).div_(self.temps)  # scaled, max at 0
            n, v = x.shape
            self.made.extend([x, torch.exp(x, out=self.buffer(n, v, x.device))])
        return self.made[1]

    def scaled(self) -> torch.Tensor:
        self.numerators()
        return self.made[0]

    def candidates(self, rows_t: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The k most likely tokens of rows `rows_t`: probabilities (descending) and ids."""
        total, temps = self.total, self.temps
        if self.native is not None and not self.made:  # logits still raw: one native pass per row
            where = rows_t if self.sel is None else self.sel[rows_t]
            vals, ids, _ = self.native.sample_topk(self.logits, temps[rows_t].view(-1), k, where, False)
            return ((vals - self.top_vals[rows_t, :1]) / temps[rows_t]).exp() / total[rows_t][:, None], ids
        x = self.numerators()
        cand, ids = (x if rows_t.numel() == x.shape[0] else x[rows_t]).topk(k, dim=-1)
        return cand / total[rows_t][:, None], ids


class Sampler:
    # Candidates tried per row before the whole vocabulary, each level only for the rows the
    # level before could not decide: chat at usual settings settles almost every row at the
    # first, and the wider levels spare the rows that need thousands of candidates (random text
    # at top_p 0.95) a sort of the whole vocabulary (commit cfa10ac has the measurements).
    candidate_levels: tuple[int, ...] = (64, 512, 4096, 16384)

    def __init__(self, device: torch.device, seed: int = 0) -> None:
        self.device = device
        self.rng = random.Random(seed)
        self.penalties: PenaltyState | None = None
        self._token_hash: torch.Tensor | None = None
        self._exp_buf: torch.Tensor | None = None

    def release(self, seq_id: int) -> None:
        """A stream ended: drop its penalty state."""
        if self.penalties is not None:
            self.penalties.release(seq_id)

    @torch.no_grad()
    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata, check_finite: bool = False) -> SamplerOutput:
        """logits: [rows, vocab] float32, owned by the sampler (modified in place).
        `check_finite`: rows whose logits are not all finite get token -1, in the same transfer.
        The model's own logits decide that, before any mask, bias or penalty: a -inf a mask
        puts there is not a failure."""
        b, v = logits.shape
        dev = logits.device
        lp_rows = meta.rows_where("logprobs")
        pen_rows = meta.rows_where("needs_penalties")
        bias_rows = meta.rows_where("has_logit_bias")
        sampled = meta.rows_where("sampled")
        if not (lp_rows or pen_rows or bias_rows or sampled) and meta.allowed_mask is None:
            return SamplerOutput(greedy_ids(logits, check_finite))  # nothing to change or report
        finite = logits.sum(-1, dtype=torch.float32).isfinite() if check_finite else None
        raw = None
        if lp_rows:  # logprobs report the model's distribution, before penalties, masks, sampling
            changed = bool(pen_rows) or meta.allowed_mask is not None or bool(sampled) or bool(bias_rows)
            raw = logits if not changed and len(lp_rows) == b else logits[lp_rows]
        if meta.allowed_mask is not None:
            self._apply_mask(logits, meta)
        if bias_rows:
            _apply_logit_bias(logits, meta, bias_rows)
        if pen_rows:
            if self.penalties is None:
                self.penalties = PenaltyState(v, dev)
            self.penalties.apply(logits, pen_rows, meta)

        if not sampled:
            tokens = logits.argmax(dim=-1)
        elif len(sampled) == b:
            tokens = self._sample(logits, meta, sampled)
        else:
            tokens = torch.empty(b, dtype=torch.int64, device=dev)
            is_sampled = set(sampled)
            greedy = [i for i in range(b) if i not in is_sampled]
            g = torch.tensor(greedy, device=dev)
            tokens[g] = logits.index_select(0, g).argmax(dim=-1)
            s = torch.tensor(sampled, device=dev)
            tokens[s] = self._sample(logits, meta, sampled, s)
        ids = tokens if finite is None else tokens.masked_fill(~finite, -1)
        if raw is None:
            return SamplerOutput(ids.tolist())
        return _with_logprobs(tokens, raw, lp_rows, meta, ids)

    def _apply_mask(self, logits: torch.Tensor, meta: SamplingMetadata) -> None:
        if meta.mask_rows is None:
            logits.masked_fill_(~meta.allowed_mask, float("-inf"))
        else:
            r = torch.tensor(meta.mask_rows, device=logits.device)
            logits[r] = logits[r].masked_fill(~meta.allowed_mask, float("-inf"))

    # -- sampling -----------------------------------------------------------
    def _keys(self, meta: SamplingMetadata, rows: list[int]) -> list[int]:
        keys = []
        for r in rows:
            seed = meta.seeds[r]
            keys.append(self.rng.getrandbits(32) if seed is None else row_key(seed, meta.output_pos[r]))
        return keys

    def _gumbel(self, keys: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Gumbel noise for tokens `ids` [n, k] of rows with hash keys `keys` [n]."""
        v = self._token_hash
        h = mix32_t(v[ids] ^ keys[:, None])
        return -torch.log(-torch.log(uniform_from_hash(h)))

    def _sample(
        self, batch_logits: torch.Tensor, meta: SamplingMetadata, rows: list[int], sel: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Tokens for `rows` (non-greedy), whose logits are the rows `sel` of `batch_logits`
        (all of them when None; a row may be overwritten)."""
        n, v = len(rows), batch_logits.shape[1]
        dev = batch_logits.device
        if self._token_hash is None or self._token_hash.shape[0] != v or self._token_hash.device != dev:
            self._token_hash = mix32_t(torch.arange(v, dtype=torch.int64, device=dev))
        ps = [meta.params[r] for r in rows]
        keys_l = self._keys(meta, rows)
        keys = torch.tensor(keys_l, dtype=torch.int64, device=dev)
        temps, top_k, top_p, min_p = filter_tensors(ps, v, dev)
        native = cpu_kernels() if dev.type == "cpu" else None
        rows = _RowCandidates(batch_logits, sel, temps, min(self.candidate_levels[0], v), native, self._buffer)
        top_vals, top_ids, total, first = rows.top_vals, rows.top_ids, rows.total, rows.first

        free_rows = [i for i, p in enumerate(ps) if p.top_k <= 0 and p.top_p >= 1.0 and p.min_p <= 0]

        tokens = torch.empty(n, dtype=torch.int64, device=dev)
        todo = torch.arange(n, device=dev)
        if free_rows:
            free = torch.tensor(free_rows, device=dev)
            keep_todo = torch.ones(n, dtype=torch.bool, device=dev)
            keep_todo[free] = False
            todo = todo[keep_todo]
        # Filtered rows first: the free rows' tail draw scales the logits in place.
        if native is not None:
            self._filtered_native(
                native,
                batch_logits,
                sel,
                temps.view(-1),
                total,
                top_k,
                top_p,
                min_p,
                keys,
                top_vals,
                top_ids,
                todo,
                tokens,
            )
        else:
            for rows_t, cand, ids, keep in self.filtered(rows.candidates, total, top_k, top_p, min_p, todo, first, v):
                score = (cand.log() + self._gumbel(keys[rows_t], ids)).masked_fill(~keep, float("-inf"))
                tokens[rows_t] = ids.gather(1, score.argmax(dim=-1, keepdim=True))[:, 0]
        if free_rows:  # no filter: the two-stage draw, on the first candidates
            tokens[free] = self._sample_free(
                rows.scaled, free, first[0][free], first[1][free], keys[free], [keys_l[i] for i in free_rows]
            )
        return tokens

    def _filtered_native(
        self,
        native,
        batch_logits: torch.Tensor,
        sel: torch.Tensor | None,
        temps: torch.Tensor,
        total: torch.Tensor,
        top_k: torch.Tensor,
        top_p: torch.Tensor,
        min_p: torch.Tensor,
        keys: torch.Tensor,
        top_vals: torch.Tensor,
        top_ids: torch.Tensor,
        todo: torch.Tensor,
        tokens: torch.Tensor,
    ) -> None:
        """`filtered` and the draw for the rows `todo` on the CPU: per candidate level one native
        call filters every row, draws the decided ones (the same rules and noise as the torch
        path) and bounds what the others need, so flat rows skip the levels that cannot hold
        their nucleus. Writes tokens[todo]."""
        v = batch_logits.shape[1]
        need = torch.zeros(tokens.shape[0], dtype=torch.float32)
        for level, k in enumerate((*self.candidate_levels, v)):
            if todo.numel() == 0:
                return
            k = min(k, v)
            if level == 0:
                now, vals, ids = todo, top_vals[todo], top_ids[todo]
            else:
                ready = need[todo] <= k
                if k < v and not bool(ready.any()):
                    continue
                now = todo if k == v or bool(ready.all()) else todo[ready]
                vals, ids, _ = native.sample_topk(batch_logits, temps[now], k, now if sel is None else sel[now], False)
            got, short = native.sample_candidates(
                vals,
                ids,
                temps[now],
                total[now],
                top_k[now],
                top_p[now],
                min_p[now],
                keys[now],
                self._token_hash,
                k == v,
            )
            decided = got >= 0
            tokens[now[decided]] = got[decided]
            need[now] = short
            left = torch.ones(tokens.shape[0], dtype=torch.bool)
            left[now[decided]] = False
            todo = todo[left[todo]]

    def _buffer(self, n: int, v: int, dev: torch.device) -> torch.Tensor:
        buf = self._exp_buf
        if buf is None or buf.numel() < n * v or buf.device != dev:
            buf = self._exp_buf = torch.empty(n * v, device=dev)
        return buf[: n * v].view(n, v)

    def filtered(
        self,
        exps,
        total: torch.Tensor,
        top_k: torch.Tensor,
        top_p: torch.Tensor,
        min_p: torch.Tensor,
        todo: torch.Tensor,
        first=None,
        vocab: int | None = None,
    ):
        """Yields (rows, candidate probabilities, token ids, kept) for the rows `todo` of `exps`
        (softmax numerators with row sums `total`, or a callable (rows, k) -> the k best
        candidates' probabilities and ids, for a vocabulary of `vocab`), each row once, at the
        first candidate count that provably holds every token its filters keep. `first`: the first level's
        (probabilities, ids) for every row, when already known."""
        if callable(exps):
            pick, n, v = exps, len(total), vocab
        else:
            n, v = exps.shape

            def pick(rows: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
                cand, ids = (exps if rows.numel() == n else exps[rows]).topk(k, dim=-1)
                return cand / total[rows][:, None], ids

        # Per row, a lower bound on the candidates its filters need (0: unknown): after a level
        # falls short, every later token is at most as likely as its last candidate, so at least
        # (top_p - mass so far) / p_last more are needed (or top_k), and levels below that are
        # skipped (flat rows go from 64 straight to thousands). min_p can end a row anywhere.
        need = torch.zeros(n, dtype=torch.float32, device=total.device)
        for level, k in enumerate((*self.candidate_levels, v)):
            if todo.numel() == 0:
                return
            k = min(k, v)
            if level == 0 and first is not None:
                now, cand, ids = todo, first[0][todo], first[1][todo]
            else:
                ready = need[todo] <= k
                if k < v and not bool(ready.any()):
                    continue
                now = todo if k == v or bool(ready.all()) else todo[ready]
                cand, ids = pick(now, k)
            keep, done = _filter(cand, top_k[now], top_p[now], min_p[now], complete=k == v)
            if bool(done.all()):
                yield now, cand, ids, keep
            else:
                if bool(done.any()):
                    yield now[done], cand[done], ids[done], keep[done]
                short = ~done
                rest, last = now[short], cand[short, -1]
                more = (top_p[rest] - cand[short].sum(dim=-1)) / last
                bound = torch.minimum(top_k[rest].float(), k + more)
                need[rest] = torch.where(min_p[rest] > 0, 0.0, bound.nan_to_num(nan=0.0))
            if now.numel() == todo.numel():
                todo = now[~done]
            else:
                left = torch.ones(n, dtype=torch.bool, device=total.device)
                left[now[done]] = False
                todo = todo[left[todo]]

    def _sample_free(
        self, scaled, rows: torch.Tensor, cand: torch.Tensor, ids: torch.Tensor, keys: torch.Tensor, keys_l: list[int]
    ) -> torch.Tensor:
        """Unfiltered rows: a candidate with probability equal to the candidates' mass (a race
        among them), otherwise a race among all other tokens (`scaled()`: logits / T, all rows)."""
        mass = cand.sum(dim=-1)
        u = uniform_from_hash(
            torch.tensor([mix32(key ^ _BRANCH_SALT) for key in keys_l], dtype=torch.int64, device=cand.device)
        )
        tokens = ids.gather(1, (cand.log() + self._gumbel(keys, ids)).argmax(dim=-1, keepdim=True))[:, 0]
        tail = (u >= mass).nonzero()[:, 0]
        if tail.numel():  # rare when the distribution is peaked; costs one pass over the row
            x = scaled()[rows[tail]]
            all_ids = torch.arange(x.shape[1], device=x.device).expand_as(x)
            score = (x + self._gumbel(keys[tail], all_ids)).scatter_(1, ids[tail], float("-inf"))
            tokens[tail] = score.argmax(dim=-1)
        return tokens


def _apply_logit_bias(logits: torch.Tensor, meta: SamplingMetadata, rows: list[int]) -> None:
    """Add each row's logit_bias to its logits, in one scatter over the rows that have one."""
    r, t, v = [], [], []
    for i in rows:
        bias = meta.params[i].logit_bias
        r += [i] * len(bias)
        t += bias.keys()
        v += bias.values()
    dev = logits.device
    logits.index_put_(
        (torch.tensor(r, device=dev), torch.tensor(t, device=dev)),
        torch.tensor(v, dtype=logits.dtype, device=dev),
        accumulate=True,
    )


def filter_tensors(ps: list, vocab: int, device) -> tuple[torch.Tensor, ...]:
    """Per-row temperature [n, 1], top_k (vocab when off), top_p, min_p, as tensors."""
    temps = torch.tensor([p.temperature for p in ps], device=device)[:, None]
    top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in ps], device=device)
    # top_p = 1 is off: a cumulative sum that rounds above 1 must not drop the tail.
    top_p = torch.tensor([p.top_p if p.top_p < 1 else float("inf") for p in ps], device=device)
    min_p = torch.tensor([p.min_p for p in ps], device=device)
    return temps, top_k, top_p, min_p


def _filter(
    probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor, complete: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Which of the k most likely tokens (probabilities, descending) survive top-k, top-p and
    min-p, and whether that is final for the row: every token beyond the k would be dropped too
    (the kept tokens always form a prefix of the ranking)."""
    n, k = probs.shape
    ranks = torch.arange(k, device=probs.device)[None, :]
    cum = probs.cumsum(dim=-1)
    keep = (ranks < top_k[:, None]) & (cum - probs <= top_p[:, None])  # mass strictly above
    keep &= probs >= min_p[:, None] * probs[:, :1]
    if complete:
        return keep, torch.ones(n, dtype=torch.bool, device=probs.device)
    done = (top_k <= k) | (cum[:, -1] > top_p) | ~keep[:, -1]
    return keep, done


def _with_logprobs(
    tokens: torch.Tensor, raw: torch.Tensor, lp_rows: list[int], meta: SamplingMetadata, ids: torch.Tensor
) -> SamplerOutput:
    """Token ids (`ids`: tokens, failed rows -1) and logprobs for `lp_rows` (raw holds their
    logits), in one host transfer."""
    dev = raw.device
    sel = torch.tensor(lp_rows, device=dev)
    lsm_norm = raw.logsumexp(dim=-1, keepdim=True)
    chosen = raw.gather(1, tokens[sel][:, None]) - lsm_norm
    k = max(meta.params[r].logprobs for r in lp_rows)
    parts = [ids.double(), chosen[:, 0].double()]
    if k:
        top_v, top_i = raw.topk(k, dim=-1)
        parts += [(top_v - lsm_norm).double().flatten(), top_i.double().flatten()]
    flat = torch.cat(parts).tolist()  # one copy to the host (ids are exact in float64)
    b, m = tokens.shape[0], len(lp_rows)
    token_ids = [int(t) for t in flat[:b]]
    chosen_l = flat[b : b + m]
    out: list = [None] * b
    for j, r in enumerate(lp_rows):
        n = meta.params[r].logprobs
        base = b + m
        tv = flat[base + j * k : base + j * k + n]
        ti = flat[base + m * k + j * k : base + m * k + j * k + n]
        out[r] = (chosen_l[j], [(int(t), lp) for t, lp in zip(ti, tv)])
    return SamplerOutput(token_ids, out)
