"""The sampler against plain references: a full-vocabulary sort for top-k/top-p/min-p, dense
penalties rebuilt from whole token lists, log_softmax for logprobs, softmax for the draws."""

from __future__ import annotations

import random

import pytest
import torch

from pagedllm.sampling.metadata import SamplingMetadata
from pagedllm.sampling.params import SamplingParams
from pagedllm.sampling.sampler import Sampler, filter_tensors, mix32, mix32_t

DEV = torch.device("cpu")


def reference_filter(logits: torch.Tensor, ps: list[SamplingParams]) -> torch.Tensor:
    """Kept probabilities [B, V] (0 where dropped): softmax, full sort, vLLM's rules. The softmax
    is spelled out as the sampler computes it, so no token on a top-p boundary is decided by an ulp."""
    temps = torch.tensor([p.temperature for p in ps])[:, None]
    e = ((logits - logits.amax(-1, keepdim=True)) / temps).exp()
    probs = e / e.sum(-1, keepdim=True)
    sp, order = probs.sort(dim=-1, descending=True)
    ranks = torch.arange(sp.shape[1])[None, :]
    top_k = torch.tensor([p.top_k if p.top_k > 0 else sp.shape[1] for p in ps])[:, None]
    top_p = torch.tensor([p.top_p if p.top_p < 1 else 2.0 for p in ps])[:, None]
    drop = (ranks >= top_k) | (sp.cumsum(-1) - sp > top_p)
    sp = sp.masked_fill(drop, 0.0)
    min_p = torch.tensor([p.min_p for p in ps])[:, None]
    sp = sp.masked_fill(sp < min_p * sp[:, :1], 0.0)
    return torch.zeros_like(sp).scatter_(1, order, sp)


def candidate_filter(sampler: Sampler, logits: torch.Tensor, ps: list[SamplingParams]) -> torch.Tensor:
    """The same, from the sampler's bounded candidate sets, densified."""
    n, v = logits.shape
    temps, top_k, top_p, min_p = filter_tensors(ps, v, DEV)
    exps = ((logits - logits.amax(-1, keepdim=True)) / temps).exp()
    out = torch.zeros(n, v)
    seen = []
    for rows, cand, ids, keep in sampler.filtered(exps, exps.sum(-1), top_k, top_p, min_p, torch.arange(n)):
        out[rows] = out[rows].scatter(1, ids, cand.masked_fill(~keep, 0.0))
        seen += rows.tolist()
    assert sorted(seen) == list(range(n))  # every row exactly once
    return out


def _logits(n: int, v: int, seed: int, spread=(0.5, 3.0)) -> torch.Tensor:
    """Rows from peaked to nearly flat, so some nuclei overflow every candidate level."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.empty(n, 1).uniform_(*spread, generator=g)
    return torch.randn(n, v, generator=g) * scale


def _params(n: int, seed: int) -> list[SamplingParams]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        out.append(
            SamplingParams(
                temperature=rng.choice([0.3, 0.7, 1.0, 1.3]),
                top_k=rng.choice([-1, -1, 1, 5, 50, 700, 3000]),
                top_p=rng.choice([1.0, 0.5, 0.9, 0.95, 0.999]),
                min_p=rng.choice([0.0, 0.0, 0.01, 0.2]),
            )
        )
    return out


@pytest.mark.parametrize("levels", [(64, 512), (4, 16), (1,)])
def test_candidate_filter_is_exact(levels):
    sampler = Sampler(DEV)
    sampler.candidate_levels = levels
    logits = _logits(96, 5000, seed=len(levels))
    ps = _params(96, seed=1)
    ps = [p for p in ps if p.top_k > 0 or p.top_p < 1 or p.min_p > 0]  # filtered rows only
    logits = logits[: len(ps)]
    want = reference_filter(logits, ps)
    got = candidate_filter(sampler, logits, ps)
    assert torch.equal(got > 0, want > 0)  # the same kept sets, token for token
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


def test_fallback_rows_are_exercised():
    """A flat row's nucleus overflows the 64 and 512 candidates and needs the whole vocabulary."""
    sampler = Sampler(DEV)
    logits = torch.randn(2, 20000) * 0.1
    ps = [SamplingParams(temperature=1.0, top_p=0.9)] * 2
    v = logits.shape[1]
    temps, top_k, top_p, min_p = filter_tensors(ps, v, DEV)
    exps = (logits - logits.amax(-1, keepdim=True)).exp()
    sizes = [
        ids.shape[1] for _, _, ids, _ in sampler.filtered(exps, exps.sum(-1), top_k, top_p, min_p, torch.arange(2))
    ]
    assert sizes == [v]
    torch.testing.assert_close(
        candidate_filter(sampler, logits, ps), reference_filter(logits, ps), rtol=1e-5, atol=1e-8
    )


def _meta(ps, seeds=None, token_ids=None, output_pos=None, seq_ids=None, prompt_lens=None):
    n = len(ps)
    token_ids = token_ids or [[1] for _ in range(n)]
    return SamplingMetadata(
        params=ps,
        seq_ids=seq_ids or list(range(n)),
        token_ids=token_ids,
        num_prompt_tokens=prompt_lens or [len(t) for t in token_ids],
        seeds=seeds or [None] * n,
        output_pos=output_pos or [0] * n,
    )


@pytest.mark.parametrize(
    "kw",
    [
        dict(temperature=1.0),
        dict(temperature=0.7, top_p=0.8),
        dict(temperature=1.2, top_k=5),
        dict(temperature=1.0, min_p=0.1),
    ],
)
def test_draws_follow_the_filtered_distribution(kw):
    """Many seeded draws of one row: frequencies match the reference probabilities. With 4 first
    candidates out of 24 tokens, unfiltered rows also take the tail branch."""
    v, n = 24, 30000
    row = torch.randn(1, v, generator=torch.Generator().manual_seed(3)) * 1.5
    p = SamplingParams(**kw)
    want = reference_filter(row, [p])[0]
    want = want / want.sum()  # the kept tokens, renormalised
    sampler = Sampler(DEV)
    sampler.candidate_levels = (4,)
    tokens = sampler(row.expand(n, v).clone(), _meta([p] * n, seeds=list(range(n)))).token_ids
    freq = torch.bincount(torch.tensor(tokens), minlength=v).float() / n
    assert freq[want == 0].sum() == 0  # nothing outside the filters, ever
    assert (freq - want).abs().max() < 0.012, (freq, want)


def test_seeded_row_same_alone_and_anywhere_in_a_batch():
    v = 3000
    logits = _logits(8, v, seed=5)
    ps = [SamplingParams(temperature=1.0, top_p=0.95, seed=11)] + _params(7, seed=2)
    sampler = Sampler(DEV, seed=0)
    alone = [sampler(logits[:1].clone(), _meta(ps[:1], seeds=[11], output_pos=[t])).token_ids[0] for t in range(20)]
    for perm_seed in range(3):
        perm = list(range(8))
        random.Random(perm_seed).shuffle(perm)
        at = perm.index(0)
        seeds = [11 if i == 0 else None for i in perm]
        for t in range(20):
            got = Sampler(DEV, seed=perm_seed + 1)(
                logits[perm].clone(), _meta([ps[i] for i in perm], seeds=seeds, output_pos=[t] * 8)
            ).token_ids[at]
            assert got == alone[t]
    assert len(set(alone)) > 3  # the position moves the noise: not one token over and over


def reference_penalties(logits: torch.Tensor, ps, prompts, outputs) -> torch.Tensor:
    """vLLM's rules from whole token lists: repetition over prompt and output, the rest over output."""
    logits = logits.clone()
    for i, p in enumerate(ps):
        if not p.needs_penalties:
            continue
        counts = torch.bincount(torch.tensor(outputs[i], dtype=torch.long), minlength=logits.shape[1]).float()
        seen = counts > 0
        seen[torch.tensor(prompts[i])] = True
        row = logits[i]
        pen = torch.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty)
        row = torch.where(seen, pen, row)
        logits[i] = row - p.frequency_penalty * counts - p.presence_penalty * (counts > 0).float()
    return logits


def test_penalties_kept_incrementally_match_rebuilt_ones():
    v = 200
    rng = random.Random(0)
    ps = [
        SamplingParams(temperature=0.0, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.3),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.0, presence_penalty=-0.7),
        SamplingParams(temperature=0.0, repetition_penalty=0.8, frequency_penalty=1.0),
    ]
    prompts = [[rng.randrange(v) for _ in range(rng.randint(1, 30))] for _ in ps]
    seqs = [list(p) for p in prompts]
    ids = [10, 11, 12, 13]
    sampler = Sampler(DEV)
    for step in range(40):
        if step == 15:  # a fork: a new stream starts from its prompt; an old one ends, its slot is reused
            sampler.release(ids[0])
            ids[0] = 99
            seqs[0] = list(prompts[0])
        if step == 25:  # tokens gained without a sample in between (two at once)
            for s in seqs:
                s += [rng.randrange(v), rng.randrange(v)]
        logits = torch.randn(len(ps), v) * 3
        meta = _meta(ps, token_ids=seqs, seq_ids=ids, prompt_lens=[len(p) for p in prompts])
        want = reference_penalties(logits, ps, prompts, [s[len(p) :] for s, p in zip(seqs, prompts)])
        got = logits.clone()
        sampler.penalties.apply(got, [0, 2, 3], meta) if sampler.penalties else None
        tokens = sampler(logits.clone(), meta).token_ids
        assert tokens == want.argmax(-1).tolist()
        if sampler.penalties is not None and step:
            torch.testing.assert_close(got, want)
        for s, t in zip(seqs, tokens):
            s.append(t)
    assert sampler.penalties.num_slots == 3


def test_logprobs_one_transfer_and_correct():
    v = 500
    logits = torch.randn(4, v) * 2
    ps = [
        SamplingParams(temperature=0.0, logprobs=3, repetition_penalty=2.0),
        SamplingParams(temperature=0.8),
        SamplingParams(temperature=0.9, top_p=0.9, logprobs=0),
        SamplingParams(temperature=0.0, logprobs=5),
    ]
    out = Sampler(DEV)(logits.clone(), _meta(ps, token_ids=[[1, 2]] * 4))
    lsm = torch.log_softmax(logits, -1)  # logprobs report the model's distribution, before penalties
    assert out.logprobs[1] is None
    for i in (0, 2, 3):
        chosen, top = out.logprobs[i]
        assert chosen == pytest.approx(lsm[i, out.token_ids[i]].item(), abs=1e-5)
        k = ps[i].logprobs
        assert [t for t, _ in top] == lsm[i].topk(k).indices.tolist() if k else top == []
        assert [lp for _, lp in top] == pytest.approx(lsm[i].topk(k).values.tolist(), abs=1e-5)
    assert out.token_ids[3] == logits[3].argmax().item()


def test_greedy_rows_in_a_mixed_batch_take_the_argmax():
    logits = torch.randn(6, 1000) * 2
    ps = [SamplingParams(temperature=0.0 if i % 2 else 0.9, top_p=0.9) for i in range(6)]
    toks = Sampler(DEV)(logits.clone(), _meta(ps)).token_ids
    assert [toks[i] for i in (1, 3, 5)] == logits[[1, 3, 5]].argmax(-1).tolist()


def test_greedy_rows_take_torchs_argmax_and_mark_non_finite_rows(monkeypatch):
    """An all-greedy step takes one native pass per row (greedy_tokens): the first maximal
    logit, as torch.argmax picks it (ties, signed zeros, narrow and wide rows, strided rows),
    and with check_finite, -1 for rows holding a NaN or an infinity, judged on the model's
    logits before a mask's -inf. The torch fallback gives the same."""
    from pagedllm.native import cpu_kernels
    from pagedllm.sampling import sampler as sm

    g = torch.Generator().manual_seed(3)
    rows = [torch.randn(b, v, generator=g) for b, v in ((1, 49152), (6, 151936), (3, 37), (2, 9), (1, 1))]
    ties = torch.zeros(3, 100)
    ties[0, [5, 50]] = 3.0
    ties[1, [98, 99]] = 1.0
    ties[2] = -0.0
    ties[2, 3] = 0.0
    bad = torch.randn(5, 1000, generator=g)
    bad[0, 999], bad[1, 3], bad[2, 500] = float("nan"), float("inf"), float("-inf")
    strided = torch.randn(6, 300, generator=g)[::2]
    greedy = _meta([SamplingParams(temperature=0.0)] * 5)
    ops = cpu_kernels()
    paths = [True] + ([False] if ops is not None and hasattr(ops, "greedy_tokens") else [])
    for torch_path in paths:
        if torch_path:
            monkeypatch.setattr(sm, "cpu_kernels", lambda: None)
        else:
            monkeypatch.undo()
        for x in [*rows, ties, strided]:
            assert sm.greedy_ids(x, check_finite=True) == x.argmax(-1).tolist()
        assert sm.greedy_ids(ties) == [5, 98, 0]
        assert Sampler(DEV)(bad.clone(), greedy, check_finite=True).token_ids[:3] == [-1, -1, -1]
        assert Sampler(DEV)(bad.clone(), greedy, check_finite=True).token_ids[3:] == bad[3:].argmax(-1).tolist()
        picked = Sampler(DEV)(bad.clone(), greedy).token_ids  # unchecked: every row gets a token
        assert all(0 <= t < 1000 for t in picked) and picked[1:] == bad[1:].argmax(-1).tolist()
        # A mask's -inf is not a failure; the masked argmax is taken.
        meta = _meta([SamplingParams(temperature=0.0)] * 2)
        meta.allowed_mask, meta.mask_rows = torch.zeros(1, 1000, dtype=torch.bool), [0]
        meta.allowed_mask[0, 7] = True
        assert Sampler(DEV)(bad[3:].clone(), meta, check_finite=True).token_ids == [7, bad[4].argmax().item()]


def test_allowed_mask_is_honoured():
    logits = torch.randn(3, 100)
    allowed = torch.zeros(2, 100, dtype=torch.bool)
    allowed[0, [5, 7]] = True
    allowed[1, 42] = True
    ps = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.0), SamplingParams(temperature=0.0)]
    meta = _meta(ps)
    meta.allowed_mask, meta.mask_rows = allowed, [0, 2]
    toks = Sampler(DEV)(logits.clone(), meta).token_ids
    assert toks[0] in (5, 7) and toks[2] == 42 and toks[1] == logits[1].argmax().item()


def test_tensor_hash_matches_integer_hash():
    xs = [0, 1, 2, 12345, 2**31 - 1, 2**31, 2**32 - 1] + [random.Random(4).getrandbits(32) for _ in range(200)]
    assert mix32_t(torch.tensor(xs, dtype=torch.int64)).tolist() == [mix32(x) for x in xs]


@pytest.mark.parametrize("levels", [(64, 512, 4096), (4, 16)])
def test_native_draws_equal_the_torch_path(levels, monkeypatch):
    """On the CPU each candidate level is one native call (filter, draw, bound for the rows
    left); it must draw what the torch path draws from the same noise. Flat and peaked rows,
    every filter, several levels. Only a near-tie of two scores (an ulp of exp or log) could
    tell the paths apart; none is expected in these 480 draws, 2 are tolerated."""
    import pagedllm.sampling.sampler as sampler_mod

    if sampler_mod.cpu_kernels() is None:
        pytest.skip("native CPU kernels not built here")
    logits = _logits(96, 5000, seed=9, spread=(0.05, 3.0))
    ps = [p for p in _params(96, seed=4) if p.top_k > 0 or p.top_p < 1 or p.min_p > 0]
    logits = logits[: len(ps)]
    seeds = list(range(len(ps)))

    def draws() -> list[int]:
        sampler = Sampler(DEV)
        sampler.candidate_levels = levels
        return [
            t
            for pos in range(6)
            for t in sampler(logits.clone(), _meta(ps, seeds=seeds, output_pos=[pos] * len(ps))).token_ids
        ]

    native = draws()
    monkeypatch.setattr(sampler_mod, "cpu_kernels", lambda: None)
    torch_path = draws()
    want = reference_filter(logits, ps) > 0
    assert all(want[i % len(ps), t] for i, t in enumerate(native))  # never outside the filters
    assert sum(a != b for a, b in zip(native, torch_path)) <= 2
