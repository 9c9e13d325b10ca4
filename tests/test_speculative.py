"""Speculative decoding: greedy output token-identical to plain decoding, sampled output with
the target's distribution (a chi-square test that also rejects a broken acceptance rule), and
no KV block leaked, across batching, preemption, prefix caching and a quantized KV cache."""

from __future__ import annotations

import random

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.speculative import decoder as spec_decoder
from models import build_checkpoint

# slow: whole models, servers or builds; `make test-fast` leaves it out
pytestmark = pytest.mark.slow

NEW_TOKENS = 40
# Never paused and fixed lengths (not adaptive), so every lookup that matches is verified.
# max_rows: these random models run float32 weights (no two-level rounding regime to stay
# in), and wide verification steps are what the identity checks should see.
NGRAM = {
    "method": "ngram",
    "num_tokens": 4,
    "min_ngram": 1,
    "max_ngram": 3,
    "min_acceptance": 0.0,
    "adaptive": False,
    "max_rows": 64,
}
# A small vocabulary makes a random model's output repeat, so proposals are both accepted
# and rejected.
RANDOM_VOCAB = 256


def _prompts(vocab: int, seed: int = 7) -> list[list[int]]:
    """Random chunks repeated, so the sequences' suffixes recur and n-gram lookup proposes."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in (3, 9, 20, 41, 70):
        chunk = torch.randint(0, vocab, (n,), generator=g).tolist()
        out.append(chunk * 3 + chunk[: n // 2])
    return out


def _greedy(llm: LLM, prompts) -> list[list[int]]:
    sp = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    return [o.token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]


def _assert_no_leak(llm: LLM) -> None:
    """Every block of the pool is free again: the target's and, with a draft model, the
    draft's (its groups draw from the same pool)."""
    eng = llm.engine
    bm = eng.block_manager
    assert not eng.scheduler.has_unfinished()
    bm.check_invariants([])
    assert bm.num_free_blocks == bm.num_usable_blocks
    draft = eng.spec.draft if eng.spec is not None else None
    if draft is not None:
        assert not draft.shadows, "a finished sequence kept its draft state"
        assert draft.block_manager.pool is bm.pool
        draft.block_manager.check_invariants([])
        assert draft.block_manager.num_held_blocks == 0


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def family_ckpt(request, tmp_path_factory, hf_smollm2_tokenizer):
    tok = hf_smollm2_tokenizer
    path = build_checkpoint(request.param, tmp_path_factory.mktemp(request.param), tok, RANDOM_VOCAB)
    prompts = _prompts(RANDOM_VOCAB)
    ref = LLM(str(path), dtype="float32", kv_cache_memory_mb=16, enable_prefix_caching=False)
    return request.param, path, prompts, _greedy(ref, prompts)


@pytest.mark.parametrize("variant", ["batched", "preempt", "prefix", "int8", "contiguous"])
@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_greedy_matches_plain_decoding(family_ckpt, method, variant, request):
    family, path, prompts, expected = family_ckpt
    kwargs = {
        "batched": dict(kv_cache_memory_mb=16, enable_prefix_caching=False),
        # Few blocks (a draft's cache too) and small prefill chunks: running sequences are
        # preempted, and a draft catches up on long prompts over several steps.
        "preempt": dict(block_size=8, max_num_batched_tokens=64, kv_cache_context_len=400),
        "prefix": dict(kv_cache_memory_mb=16, block_size=8),
        "int8": dict(kv_cache_memory_mb=16, kv_cache_dtype="int8"),
        # The target without paged attention (a draft's own cache is paged regardless).
        "contiguous": dict(kv_cache_memory_mb=16, paged_attention=False),
    }[variant]
    # The draft: a noisy copy of the target, so proposals are both accepted and rejected.
    spec = NGRAM if method == "ngram" else _draft(request.getfixturevalue("drafts")["noisy"])
    llm = LLM(str(path), dtype="float32", speculative=spec, **kwargs)
    if variant == "int8":  # the reference for a quantized cache is plain decoding on the same cache
        expected = _greedy(LLM(str(path), dtype="float32", **kwargs), prompts)
    got = _greedy(llm, prompts)
    if variant == "prefix":  # again, now with the prompts (and outputs) in the prefix cache
        assert _greedy(llm, prompts) == expected
        assert llm.engine.block_manager.stats.hits > 0
        if method == "draft":  # the draft's cache reuses its own K/V of the prompts too
            assert llm.engine.spec.draft.block_manager.stats.hits > 0
    assert got == expected
    st = llm.engine.spec.stats
    assert st.proposed > 50 and 0 < st.accepted < st.proposed, st  # both outcomes exercised
    if variant == "preempt":
        assert llm.engine.scheduler.num_preemptions > 0
    _assert_no_leak(llm)


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_invariants_hold_every_step(family_ckpt, method, request):
    """Ref counts and table sizes after every step, with rejections, prefix sharing, n > 1
    forks and sampling; with a draft model, in its cache too, where each table covers exactly
    the tokens the draft holds and no draft state outlives its sequence."""
    _, path, prompts, _ = family_ckpt
    spec = (
        {**NGRAM, "max_batch": 64}
        if method == "ngram"
        else _draft(request.getfixturevalue("drafts")["noisy"], max_batch=64)
    )
    llm = LLM(str(path), dtype="float32", block_size=8, kv_cache_memory_mb=4, speculative=spec)
    eng = llm.engine
    draft = eng.spec.draft
    sp = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.8, seed=3, n=2, ignore_eos=True)
    for p in prompts + prompts[:2]:
        eng.add_request(p, sp)
    while eng.has_unfinished():
        eng.step()
        live = eng.scheduler.running
        eng.block_manager.check_invariants(live)
        for s in live:
            assert len(s.block_table) == -(-s.num_computed_tokens // 8), "table not trimmed to its tokens"
        if draft is not None:
            shadows = [sh.seq for sh in draft.shadows.values()]
            draft.block_manager.check_invariants(shadows)
            assert set(draft.shadows) <= {s.seq_id for s in live}, "a draft state outlived its sequence"
            for d in shadows:
                assert len(d.block_table) == -(-d.num_computed_tokens // 8), "draft table not trimmed"
    assert eng.spec.stats.accepted > 0
    _assert_no_leak(llm)


@pytest.fixture(scope="module")
def default_models(smollm2_gguf_path):
    """The default model (GGUF, quantized kernels) plain, with n-gram speculation, and drafting
    for itself (its weights as the file's: the same model). The cache is sized in tokens, not
    MB: "auto" KV is bf16 on a machine with AVX-512 BF16 and float32 elsewhere, and 64 MB of
    float32 holds 45 blocks, fewer than the seeded n=2 test's two 1,038-token siblings need. A context length is given whole to the
    draft's cache as well. The n-gram model chooses its lengths (adaptive, the default); the
    draft, as costly as the target, would rarely pay, so its lengths are fixed."""
    return {
        "plain": LLM("default", kv_cache_context_len=4096),
        "ngram": LLM("default", kv_cache_context_len=4096, speculative={"method": "ngram", "num_tokens": 3}),
        "draft": LLM(
            "default",
            kv_cache_context_len=4096,
            speculative={
                "method": "draft",
                "model": "default",
                "num_tokens": 4,
                "adaptive": False,
                "draft_weights": "file",
            },
        ),
        "plain_results": {},
    }


def _plain_once(models: dict, key: str, run):
    """The plain model's result of `run`, computed on its first request only: run again, the
    plain engine would hit its prefix cache, and bf16 logits computed over other query shapes
    can flip a near-tie argmax, speculation or not."""
    done = models["plain_results"]
    if key not in done:
        done[key] = run(models["plain"])
    return done[key]


@pytest.fixture(scope="module")
def default_pair(default_models):
    return default_models["plain"], default_models["ngram"]


@pytest.mark.parametrize("method, min_acceptance", [("ngram", 0.3), ("draft", 0.9)])
def test_default_model_greedy_identical_on_code_edit(default_models, method, min_acceptance):
    from pagedllm.bench.speculative import code_edit_prompt

    spec = default_models[method]
    msgs = [[{"role": "user", "content": code_edit_prompt(i)}] for i in range(2)]
    sp = SamplingParams(max_tokens=64, temperature=0.0)
    want = _plain_once(
        default_models, "code", lambda m: [o.outputs[0].token_ids for o in m.chat(msgs, sp, use_tqdm=False)]
    )
    got = [o.outputs[0].token_ids for o in spec.chat(msgs, sp, use_tqdm=False)]
    assert got == want
    st = spec.engine.spec.stats
    assert st.acceptance_rate > min_acceptance, st  # the draft is the model itself: all but ties
    _assert_no_leak(spec)


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_default_model_seeded_sampling_stop_strings_streaming_n(default_models, method):
    """Seeded rows key each position's noise as plain decoding does: the same text, stop
    strings cut at the same place, streamed deltas add up to it, n > 1 siblings too (n-gram
    lookups and greedy draft tokens are deterministic drafts)."""
    from pagedllm.bench.speculative import code_edit_prompt

    spec = default_models[method]
    prompt = spec.tokenizer.apply_chat_template(
        [{"role": "user", "content": code_edit_prompt(0)}], add_generation_prompt=True, tokenize=True
    )
    sp = SamplingParams(max_tokens=48, temperature=0.7, top_p=0.9, seed=11, n=2, stop=["for rec", "counts ="])
    want = _plain_once(default_models, "seeded", lambda m: m.generate([prompt], sp, use_tqdm=False)[0])
    got = spec.generate([prompt], sp, use_tqdm=False)[0]
    assert [c.text for c in got.outputs] == [c.text for c in want.outputs]
    assert [c.finish_reason for c in got.outputs] == [c.finish_reason for c in want.outputs]
    # Tokens a speculative step accepted past the stop string are not handed out.
    assert [(list(c.token_ids), c.stop_reason) for c in got.outputs] == [
        (list(c.token_ids), c.stop_reason) for c in want.outputs
    ]
    assert {c.stop_reason for c in got.outputs} == {"counts ="}  # the stop strings do cut here
    greedy = SamplingParams(max_tokens=64, temperature=0.0, stop=["def "], logprobs=1)
    g_want = _plain_once(default_models, "greedy stop", lambda m: m.generate([prompt], greedy, use_tqdm=False)[0])
    g_got = spec.generate([prompt], greedy, use_tqdm=False)[0]
    assert [(c.text, list(c.token_ids), c.finish_reason, c.stop_reason) for c in g_got.outputs] == [
        (c.text, list(c.token_ids), c.finish_reason, c.stop_reason) for c in g_want.outputs
    ]
    assert g_want.outputs[0].stop_reason == "def "
    assert len(g_got.outputs[0].logprobs) == len(g_got.outputs[0].token_ids)  # none past the stop
    one = SamplingParams(max_tokens=40, temperature=0.7, top_p=0.9, seed=11)
    streamed = "".join(spec.stream(prompt, one))
    assert streamed == _plain_once(
        default_models, "streamed", lambda m: m.generate([prompt], one, use_tqdm=False)[0].outputs[0].text
    )
    assert spec.engine.spec.stats.accepted > 0
    _assert_no_leak(spec)


# -- the distribution ------------------------------------------------------------------------
VOCAB = 12
SAMPLES = 20_000
POSITIONS = 5


def _chi2_pvalue(a: torch.Tensor, b: torch.Tensor) -> float:
    """Two-sample chi-square test of homogeneity over token counts a, b [VOCAB]."""
    keep = (a + b) > 0
    a, b = a[keep].double(), b[keep].double()
    tot = a + b
    ea, eb = tot * a.sum() / tot.sum(), tot * b.sum() / tot.sum()
    stat = (((a - ea) ** 2 / ea) + ((b - eb) ** 2 / eb)).sum()
    dof = keep.sum().item() - 1
    # chi2 survival function: the regularized upper incomplete gamma Q(dof/2, stat/2)
    return torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), stat / 2).item()


@pytest.fixture(scope="module")
def tiny_vocab_ckpt(tmp_path_factory, hf_smollm2_tokenizer):
    return build_checkpoint("llama", tmp_path_factory.mktemp("tiny"), hf_smollm2_tokenizer, VOCAB, seed=5)


def _position_counts(path, speculative, seed0: int, samples: int = SAMPLES) -> tuple[torch.Tensor, object]:
    # At most 8 requests admitted: with their forks, under max_batch decoding at once.
    llm = LLM(
        str(path),
        dtype="float32",
        kv_cache_memory_mb=64,
        max_num_seqs=8,
        speculative=speculative,
        enable_prefix_caching=False,
    )
    prompt = [3, 5, 7, 3, 5, 7, 3, 5]
    # n = 100 completions a request: the prompt is computed once per request, and completion
    # j of request i draws with seed seed0 + 100 i + j, each seed once.
    n, reqs = 100, samples // 100
    params = [
        SamplingParams(n=n, max_tokens=POSITIONS, temperature=1.0, top_p=0.9, seed=seed0 + n * i, ignore_eos=True)
        for i in range(reqs)
    ]
    outs = llm.generate([prompt] * reqs, params, use_tqdm=False)
    toks = torch.tensor([c.token_ids for o in outs for c in o.outputs])
    assert toks.shape == (samples, POSITIONS)
    counts = torch.stack([torch.bincount(toks[:, j], minlength=VOCAB) for j in range(POSITIONS)])
    _assert_no_leak(llm)
    return counts, llm.engine.spec


@pytest.fixture(scope="module")
def plain_counts(tiny_vocab_ckpt) -> torch.Tensor:
    return _position_counts(tiny_vocab_ckpt, None, 0)[0]


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_rejection_sampling_keeps_the_target_distribution(tiny_vocab_ckpt, plain_counts, monkeypatch, method):
    """n-gram lookups and a draft model's greedy tokens are both deterministic drafts (here the
    tiny model drafts for itself: a proposal is accepted when the sample is its argmax)."""
    spec_cfg = (
        {
            "method": "ngram",
            "num_tokens": 3,
            "min_ngram": 1,
            "max_ngram": 3,
            "max_batch": 1024,
            "max_rows": 4096,
            "min_acceptance": 0.0,
            "adaptive": False,
        }
        if method == "ngram"
        else _draft(tiny_vocab_ckpt, 3, max_batch=1024, max_rows=4096)
    )
    # Different seed ranges: independent samples, reproducible test.
    seed0 = {"ngram": 10, "draft": 30}[method] * SAMPLES
    ours, dec = _position_counts(tiny_vocab_ckpt, spec_cfg, seed0)
    st = dec.stats
    assert st.proposed > SAMPLES and 0.1 < st.acceptance_rate < 0.9, st  # a real test of both branches
    pvals = [_chi2_pvalue(plain_counts[j], ours[j]) for j in range(POSITIONS)]
    assert min(pvals) > 0.01, pvals

    # Power: accepting the first proposal whatever was drawn must be caught. A quarter of the
    # samples is plenty for that (measured at 5,000: smallest p-values 1e-31 with the draft, 0
    # with n-gram); the 20,000 above are for the test that keeps the right rule.
    real = spec_decoder.accepted_length
    monkeypatch.setattr(spec_decoder, "accepted_length", lambda d, s: max(1, real(d, s)))
    broken, _ = _position_counts(tiny_vocab_ckpt, spec_cfg, seed0 + 10 * SAMPLES, SAMPLES // 4)
    bad = [_chi2_pvalue(plain_counts[j], broken[j]) for j in range(1, POSITIONS)]
    assert min(bad) < 1e-6, bad


# -- what speculates, and what is reported ---------------------------------------------------
def test_penalised_rows_do_not_speculate_and_match_plain(family_ckpt):
    """Penalised sequences are left out of speculation (their rows would need the counts
    advanced through each proposal); they decode as without it, in the same batch as
    sequences that speculate."""
    _, path, prompts, expected = family_ckpt
    llm = LLM(str(path), dtype="float32", kv_cache_memory_mb=16, speculative=NGRAM)
    plain = LLM(str(path), dtype="float32", kv_cache_memory_mb=16)
    greedy = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    penalised = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, repetition_penalty=1.3)
    params = [greedy] * len(prompts) + [penalised] * 2
    batch = prompts + prompts[:2]
    got = [o.outputs[0].token_ids for o in llm.generate(batch, params, use_tqdm=False)]
    want = [o.outputs[0].token_ids for o in plain.generate(batch, params, use_tqdm=False)]
    assert got[: len(prompts)] == expected
    assert got == want
    assert llm.engine.spec.stats.accepted > 0
    _assert_no_leak(llm)


def test_default_model_grammar_rows_speculate_within_their_grammar(default_pair):
    """A grammar-constrained sequence speculates with n-gram proposals cut to what its grammar
    accepts, and each verification row is masked by the grammar advanced through the proposals
    before it: the tokens are those of plain decoding under the same grammar. One grammar lets
    the copied code through (proposals verified), one cuts it (lower-case letters only)."""
    from pagedllm.bench.speculative import code_edit_prompt

    plain, spec = default_pair
    msgs = [[{"role": "user", "content": code_edit_prompt(1)}], [{"role": "user", "content": code_edit_prompt(2)}]]
    params = [
        SamplingParams(max_tokens=40, temperature=0.0, structured={"regex": "(?s:.){0,400}"}),
        SamplingParams(max_tokens=16, temperature=0.0, structured={"regex": "[a-z ]{1,60}"}),
    ]
    prompts = [plain.tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=True) for m in msgs]
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    before = (spec.engine.spec.stats.verifications, spec.engine.spec.stats.accepted)
    got = [o.outputs[0].token_ids for o in spec.generate(prompts, params, use_tqdm=False)]
    assert got == want
    st = spec.engine.spec.stats
    assert st.verifications > before[0] and st.accepted > before[1], st
    assert all(c.islower() or c == " " for c in plain.tokenizer.decode(got[1]))
    _assert_no_leak(spec)


def test_off_when_the_batch_is_wide_and_reported(family_ckpt):
    _, path, prompts, expected = family_ckpt
    llm = LLM(str(path), dtype="float32", kv_cache_memory_mb=16, speculative={**NGRAM, "max_batch": 2})
    lens = [8, 8, 8, NEW_TOKENS, NEW_TOKENS]
    sps = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in lens]
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, sps, use_tqdm=False)]
    assert got == [e[:m] for e, m in zip(expected, lens)]
    st = llm.engine.spec.stats
    assert st.steps_off_batch > 0 and st.proposed > 0  # off while 5 decode, on once 2 are left
    tr = llm.kv_cache_trace()
    assert tr.spec_proposed_tokens == st.proposed and tr.spec_accepted_tokens == st.accepted
    assert tr.spec_acceptance_rate == pytest.approx(st.accepted / st.proposed)
    assert tr.spec_mean_accepted_length == pytest.approx(st.accepted / st.verifications)
    assert tr.speculative.startswith("ngram")
    assert LLM(str(path), dtype="float32", kv_cache_memory_mb=16).kv_cache_trace().speculative == "off"

    from pagedllm.server.metrics import ServerMetrics

    m = ServerMetrics()
    m.on_engine_state(llm.engine, 0)
    text = m.render().decode()
    assert f"pagedllm_spec_decode_num_draft_tokens_total {float(st.proposed)}" in text
    assert f"pagedllm_spec_decode_num_accepted_tokens_total {float(st.accepted)}" in text
    assert "pagedllm_spec_decode_acceptance_rate" in text


def test_low_acceptance_pauses_a_sequence(family_ckpt):
    _, path, prompts, expected = family_ckpt
    llm = LLM(
        str(path),
        dtype="float32",
        kv_cache_memory_mb=16,
        speculative={"method": "ngram", "num_tokens": 4, "min_ngram": 1, "min_acceptance": 0.6},
    )
    assert _greedy(llm, prompts) == expected
    assert llm.engine.spec.stats.paused > 0


@pytest.mark.parametrize(
    "bad, msg",
    [
        ({"method": "medusa"}, "unknown"),
        ({"num_tokens": 4}, "needs a 'method'"),
        ({"method": "ngram", "num_tokens": 0}, "num_tokens"),
        ({"method": "ngram", "k": 3}, "unknown key"),
        ({"method": "ngram", "min_ngram": 5, "max_ngram": 2}, "exceeds"),
        ({"method": "draft"}, "needs 'model'"),
        ({"method": "draft", "model": ""}, "needs 'model'"),
        ({"method": "ngram", "model": "x"}, "takes no 'model'"),
        ({"method": "draft", "model": "x", "draft_vocab": -1}, "draft_vocab"),
        ({"method": "draft", "model": "x", "draft_vocab": "32k"}, "draft_vocab"),
        ({"method": "ngram", "draft_vocab": 1024}, "method 'ngram' has none"),
        ({"method": "draft", "model": "x", "draft_weights": "Q3_X"}, "draft_weights must be"),
        ({"method": "ngram", "draft_weights": "Q4_0"}, "method 'ngram' has none"),
    ],
)
def test_bad_speculative_settings_are_refused(bad, msg):
    from pagedllm.speculative.config import SpeculativeConfig

    with pytest.raises(ValueError, match=msg):
        SpeculativeConfig.coerce(bad)


def test_cli_flag_reaches_the_engine():
    from pagedllm.cli.main import build_parser, command_config

    argv = ["serve", "--speculative-ngram", "3"]
    args = build_parser(argv).parse_args(argv)
    assert command_config(args).speculative.to_dict() == {"method": "ngram", "num_tokens": 3}


# -- a draft model ---------------------------------------------------------------------------
def _draft(model, k: int = 4, **kw) -> dict:
    """Draft-model speculation, never paused and of fixed length, so every proposal is verified."""
    return {
        "method": "draft",
        "model": str(model),
        "num_tokens": k,
        "min_acceptance": 0.0,
        "adaptive": False,
        **{"max_rows": 64, **kw},
    }


def _noisy_copy(src, out, scale: float, seed: int = 1):
    """The checkpoint with Gaussian noise (`scale` x each matrix's std) on its matrices: a draft
    that agrees with the target often but not always."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, out, dirs_exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    w = load_file(src / "model.safetensors")
    w = {k: v + scale * v.std() * torch.randn(v.shape, generator=g) if v.dim() == 2 else v for k, v in w.items()}
    save_file(w, out / "model.safetensors", metadata={"format": "pt"})
    return out


@pytest.fixture(scope="module")
def drafts(family_ckpt, tmp_path_factory, hf_smollm2_tokenizer):
    """Three drafts of the family's target: a noisy copy (accepted about a third of the
    time), the target itself (all accepted) and a smaller, unrelated random model (the
    same vocabulary, almost nothing accepted)."""
    family, path, _, _ = family_ckpt
    noisy = _noisy_copy(path, tmp_path_factory.mktemp(f"{family}-noisy"), 0.05)
    small = build_checkpoint(
        family,
        tmp_path_factory.mktemp(f"{family}-small"),
        hf_smollm2_tokenizer,
        RANDOM_VOCAB,
        seed=3,
        intermediate_size=64,
    )
    return {"noisy": noisy, "self": path, "small": small}


@pytest.mark.parametrize("family", ["mistral", "gemma2"])
def test_draft_sliding_window_families(family, tmp_path, hf_smollm2_tokenizer):
    """Prompts longer than the window (48): the draft's sliding layers give blocks back as it
    advances (Gemma 2: in their own block tables beside the global layers'), and trimming
    rejected proposals never reaches behind the window."""
    path = build_checkpoint(family, tmp_path / "target", hf_smollm2_tokenizer, RANDOM_VOCAB)
    draft = _noisy_copy(path, tmp_path / "draft", 0.05)
    prompts = _prompts(RANDOM_VOCAB)
    kwargs = dict(block_size=8, max_num_batched_tokens=64, kv_cache_context_len=400)
    expected = _greedy(LLM(str(path), dtype="float32", **kwargs), prompts)
    llm = LLM(str(path), dtype="float32", speculative=_draft(draft), **kwargs)
    assert _greedy(llm, prompts) == expected
    st = llm.engine.spec.stats
    assert st.proposed > 50 and 0 < st.accepted < st.proposed, st
    _assert_no_leak(llm)


def test_draft_cache_short_of_blocks(family_ckpt, drafts):
    """Forks share the target's prompt blocks but each has its own draft blocks, from the same
    pool: it runs short, those sequences propose less (or nothing) that step, and the seeded
    output is plain decoding's. Nothing leaks."""
    _, path, prompts, _ = family_ckpt
    kwargs = dict(dtype="float32", block_size=8, kv_cache_context_len=600, max_num_batched_tokens=64)
    sp = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.8, seed=3, n=2, ignore_eos=True)
    batch = prompts + prompts[:2]
    want = [[c.token_ids for c in o.outputs] for o in LLM(str(path), **kwargs).generate(batch, sp, use_tqdm=False)]
    llm = LLM(str(path), speculative=_draft(drafts["noisy"], max_batch=64), **kwargs)
    got = [[c.token_ids for c in o.outputs] for o in llm.generate(batch, sp, use_tqdm=False)]
    assert got == want
    draft = llm.engine.spec.draft
    assert draft.no_room > 0 and llm.engine.spec.stats.accepted > 0
    assert f"{draft.no_room} times short of draft blocks" in llm.kv_cache_trace().spec_draft_cache
    _assert_no_leak(llm)


def test_draft_blocks_come_from_the_target_pool_and_all_return(family_ckpt, drafts):
    """One pool: the draft's tables take their blocks from the target's free list (the pool's
    used count is both models' holdings at every step), and once every request is done the
    pool's free count is back where it was before them, so the draft returned its blocks."""
    _, path, prompts, expected = family_ckpt
    llm = LLM(
        str(path),
        dtype="float32",
        block_size=8,
        kv_cache_context_len=600,
        max_num_batched_tokens=64,
        speculative=_draft(drafts["noisy"]),
    )
    eng = llm.engine
    pool, draft = eng.block_manager.pool, eng.spec.draft
    assert draft.block_manager.pool is pool
    free0 = pool.num_free_blocks
    sp = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    for p in prompts:
        eng.add_request(p, sp)
    got, held = {}, 0
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                got[o.request_id] = o.outputs[0].token_ids
        d = draft.block_manager.num_held_blocks
        assert pool.num_used_blocks == eng.block_manager.num_held_blocks + d
        held = max(held, d)
    assert [got[str(i)] for i in range(len(prompts))] == expected
    assert held > 0 and eng.spec.stats.proposed > 0
    assert pool.num_free_blocks == free0 == pool.num_usable_blocks


def test_draft_acceptance_follows_the_draft(family_ckpt, drafts):
    """The target drafting for itself has every proposal accepted; an unrelated random draft
    almost none. The output is the target's either way."""
    _, path, prompts, expected = family_ckpt
    rates = {}
    for name in ("self", "small"):
        llm = LLM(str(path), dtype="float32", kv_cache_memory_mb=16, speculative=_draft(drafts[name]))
        assert _greedy(llm, prompts) == expected, name
        st = llm.engine.spec.stats
        assert st.proposed > 50, st
        rates[name] = st.acceptance_rate
        _assert_no_leak(llm)
    assert rates["self"] > 0.97 and rates["small"] < 0.2, rates


def test_draft_head_over_part_of_the_vocabulary(family_ckpt, drafts):
    """draft_vocab=64 of 256 ids: the target drafting for itself now misses the tokens it would
    pick from ids >= 64 that its sequences do not hold yet, so fewer proposals are accepted than
    with the whole head, the output is still the target's, and the rare ids leave the head
    with the sequences that held them."""
    _, path, prompts, expected = family_ckpt
    rates = {}
    for dv in (0, 64):
        llm = LLM(str(path), dtype="float32", kv_cache_memory_mb=16, speculative=_draft(drafts["self"], draft_vocab=dv))
        assert _greedy(llm, prompts) == expected, dv
        draft = llm.engine.spec.draft
        rates[dv] = llm.engine.spec.stats.acceptance_rate
        _assert_no_leak(llm)
        if dv:
            assert draft.head.keep == 64 and not draft.head.count and not draft.head.held
            assert "head over token ids below 64 of 256" in draft.describe()
        else:
            assert draft.head is None and "head over all 256 token ids" in draft.describe()
    assert rates[0] > 0.97 and 0.3 < rates[64] < rates[0] - 0.02, rates


def test_first_token_time_is_when_the_step_hands_it_out(family_ckpt, drafts, monkeypatch):
    """The draft's catch-up of a new prompt runs after sampling, in the step that samples the
    first token: the caller has that token only when the step returns, so its time (and so
    time to first token, and the decode rate from it) counts the catch-up."""
    import time

    from pagedllm.engine.draft import DraftModel

    _, path, prompts, _ = family_ckpt
    llm = LLM(str(path), dtype="float32", kv_cache_memory_mb=16, speculative=_draft(drafts["noisy"]))
    ends = []
    propose = DraftModel.propose

    def timed(self, *a, **kw):
        propose(self, *a, **kw)
        ends.append(time.perf_counter())

    monkeypatch.setattr(DraftModel, "propose", timed)
    eng = llm.engine
    eng.add_request(prompts[-1], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    out = []
    while not out:
        out = [o for o in eng.step() if o.outputs[0].token_ids]
    assert ends and out[0].metrics.first_token_time >= ends[0]
    while eng.has_unfinished():
        eng.step()


def test_draft_lag_is_the_catch_up_it_then_computes(family_ckpt, drafts, monkeypatch):
    """DraftModel.lag, which decides whether a probe is cheap, against what the draft then
    computes for each sequence asking for proposals: the prompt at first, then one token (the
    target's) after a rejection or two (the last proposal and the target's) after a full
    acceptance."""
    import pagedllm.engine.draft as dm

    _, path, prompts, expected = family_ckpt
    llm = LLM(
        str(path),
        dtype="float32",
        kv_cache_memory_mb=16,
        enable_prefix_caching=False,
        speculative=_draft(drafts["noisy"]),
    )
    before, caught = [], []
    propose, catch_up = dm.DraftModel.propose, dm._catch_up

    def spy_propose(self, want, running=()):
        before.append({s.request_id: self.lag(s) for s, _ in want})
        caught.append({})
        return propose(self, want, running)

    def spy_catch_up(d, n):
        caught[-1][d.request_id] = n
        return catch_up(d, n)

    monkeypatch.setattr(dm.DraftModel, "propose", spy_propose)
    monkeypatch.setattr(dm, "_catch_up", spy_catch_up)
    assert _greedy(llm, prompts) == expected
    assert len(before) > 3 and before == caught
    lags = [n for b in before for n in b.values()]
    assert any(n > dm.CATCH_UP_ROWS for n in lags) and 1 in lags, sorted(set(lags))
    _assert_no_leak(llm)


def test_draft_forwards_take_the_fastest_route_and_the_target_keeps_its_own(smollm2_gguf_path, monkeypatch, tune):
    """A quantized draft's forwards run inside proposals_only (its catch-up of a 40-token prompt
    through the integer kernel where the CPU's is AVX-512 VNNI), the target's never: the
    target's route and so its output are those of plain decoding, token for token."""
    from pagedllm.quant import kernels as qk

    tune(quant_wide="auto")
    seen = []
    route = qk.integer_route

    def spy(rows, parts, role=None):
        seen.append((rows, getattr(qk._route, "proposals_only", False)))
        return route(rows, parts, role)

    monkeypatch.setattr(qk, "integer_route", spy)
    path = str(smollm2_gguf_path)
    prompt = [[1] + list(range(200, 239))]  # 40 tokens: past INT_ROWS (32)
    plain = _greedy(LLM(path, kv_cache_memory_mb=16), prompt)
    seen.clear()
    llm = LLM(path, kv_cache_memory_mb=16, speculative=_draft(path, max_rows=8))  # plain's rounding
    assert _greedy(llm, prompt) == plain
    wide = {d for r, d in seen if r > qk.int_rows()}  # the target's prefill, the draft's catch-up (41 tokens)
    assert wide == {False, True}, sorted(set(seen))
    assert llm.engine.spec.stats.verifications > 0
    assert not getattr(qk._route, "proposals_only", False)
    _assert_no_leak(llm)


def _decoder_formats(model) -> set[str]:
    from pagedllm.quant import kernels as qk

    return {
        w.fmt
        for m in model.modules()
        if getattr(m, "act_role", None) in qk.DECODE_ROLES and getattr(m, "qparts", None)
        for w in m.qparts
    }


def test_a_quantized_draft_runs_in_fewer_bits_and_output_is_unchanged(smollm2_gguf_path):
    """speculative draft_weights: "auto" (the default) runs the default GGUF's Q4_1 decoder
    projections (5 bits a weight) and its head's scored rows as Q4_0 in the draft, the target
    keeping the file's; "file" keeps the file's; a type sets it. Greedy output is plain
    decoding's in each, and nothing leaks."""
    path = str(smollm2_gguf_path)
    prompt = [[1] + list(range(300, 339))]
    plain_llm = LLM(path, kv_cache_memory_mb=16)
    plain = _greedy(plain_llm, prompt)
    file_fmts = _decoder_formats(plain_llm.engine.model)
    assert file_fmts == {"Q4_1"}, file_fmts  # (the file this test is about)
    head_fmt = plain_llm.engine.model.lm_head.qparts[0].fmt
    for setting, want in (("auto", "Q4_0"), ("file", "Q4_1"), ("Q8_0", "Q8_0")):
        kw = {} if setting == "auto" else {"draft_weights": setting}
        llm = LLM(path, kv_cache_memory_mb=16, speculative=_draft(path, max_rows=8, draft_vocab=16384, **kw))
        draft = llm.engine.spec.draft
        assert _decoder_formats(draft.loaded.model) == {want}, setting
        assert _decoder_formats(llm.engine.model) == file_fmts  # the target's are its own
        assert draft.head.parts[0].fmt == (head_fmt if setting == "file" else want)
        assert draft.head.parts[0].shape[0] == draft.head.keep == 16384
        assert (setting == "file") == ("weights as loaded" in draft.describe())
        assert _greedy(llm, prompt) == plain, setting
        assert llm.engine.spec.stats.verifications > 0 and llm.engine.spec.stats.accepted > 0
        _assert_no_leak(llm)


@pytest.mark.parametrize("source", ["float", "gguf"])
def test_draft_head_argmax_is_the_best_of_its_ids(source, family_ckpt, smollm2_gguf_path):
    """DraftHead.greedy against the whole head's logits: each row's pick is the best-scoring id
    among the first `keep`, the added tokens and the ids held by live sequences, never another.
    Float weights (a random model) and the default GGUF's quantized head (whose held rows are
    dequantized, so equal up to rounding)."""
    from pagedllm.engine.draft_head import DraftHead

    if source == "float":
        eng = LLM(str(family_ckpt[1]), dtype="float32", kv_cache_memory_mb=4).engine
        keep, held = 64, [200, 255, 130]
    else:
        eng = LLM(str(smollm2_gguf_path), dtype="float32", kv_cache_memory_mb=4).engine
        keep, held = 1024, [40000, 2048, 49151]
    model, cfg = eng.model, eng.model_config
    vocab = cfg.vocab_size
    assert DraftHead.usable(model)
    always = [vocab - 3]
    head = DraftHead(model, vocab, keep, always)
    head.hold(1, [5, *held[:2]])
    head.hold(2, held[1:])
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(64, cfg.hidden_size, generator=g) * 3
    # Rows pointed at the extra ids' own head rows, so some best ids lie among them.
    extra = torch.tensor(always + held)
    lm = model.lm_head
    with torch.inference_mode():
        rows = lm.weight[extra] if lm.weight is not None else model.embed_tokens(extra)
    hidden[: len(extra)] = 8 * rows.float() / rows.float().norm(dim=-1, keepdim=True) * cfg.hidden_size**0.5
    with torch.inference_mode():
        full = model.compute_logits(hidden)
    allowed = torch.tensor(list(range(keep)) + always + held)
    assert full.argmax(-1).ge(keep).any(), "some rows' best id lies outside the first keep"
    got = torch.tensor(head.greedy(hidden))
    assert torch.isin(got, allowed).all()
    assert torch.isin(got, extra).any() and got.lt(keep).any()
    best = full[:, allowed].max(-1).values
    picked = full.gather(1, got[:, None]).squeeze(1)
    tol = 0 if source == "float" else 0.02 * full.abs().max()
    assert (picked >= best - tol - 1e-5).all()
    # Ids in the head only through a sequence leave with it (2048 stays: sequence 2 holds it).
    head.drop(1)
    assert set(head.count) == ({2048, 49151} if source == "gguf" else {255, 130})
    head.drop(2)
    assert not head.count and head.num_extra == 1


def test_draft_blocks_share_the_budget_and_are_traced(family_ckpt, drafts):
    _, path, prompts, expected = family_ckpt
    plain = LLM(str(path), dtype="float32", kv_cache_memory_mb=16)
    llm = LLM(str(path), dtype="float32", kv_cache_memory_mb=16, speculative=_draft(drafts["small"], 3))
    tr0 = llm.kv_cache_trace()
    # One pool, each block a page in both caches: the draft has the target's layers and KV
    # heads, so a block costs twice a plain one and 16 MB buy half the blocks.
    assert tr0.spec_draft_blocks_total == tr0.capacity_blocks
    assert tr0.memory_mb + tr0.spec_draft_memory_mb == pytest.approx(16, abs=0.1)
    assert tr0.capacity_blocks == plain.kv_cache_trace().capacity_blocks // 2
    assert "one pool of" in tr0.sized_by and "the draft's pages" in tr0.sized_by
    eng = llm.engine
    sp = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    for p in prompts:
        eng.add_request(p, sp)
    used = 0
    while eng.has_unfinished():
        eng.step()
        tr = llm.kv_cache_trace()
        assert tr.spec_draft_blocks_used == eng.spec.draft.block_manager.num_held_blocks
        # The pool's used blocks are the target's tables' and the draft's together.
        assert tr.blocks_used == eng.block_manager.num_held_blocks + tr.spec_draft_blocks_used
        used = max(used, tr.spec_draft_blocks_used)
    assert used > 0
    tr = llm.kv_cache_trace()
    assert tr.speculative.startswith("draft model") and "draft model" in tr.spec_draft_cache
    assert tr.spec_draft_blocks_used == 0 and tr.spec_proposed_tokens == eng.spec.stats.proposed > 0
    _assert_no_leak(llm)


def test_bad_draft_models_are_refused(family_ckpt, tmp_path, hf_smollm2_tokenizer):
    import json

    _, path, _, _ = family_ckpt
    with pytest.raises(ValueError, match="does not run under tensor parallelism"):  # before any load
        LLM(str(path), dtype="float32", tensor_parallel_size=2, speculative=_draft(path))
    with pytest.raises(ValueError, match="draft model .*nope.* cannot be loaded"):
        LLM(str(path), dtype="float32", kv_cache_memory_mb=4, speculative=_draft(tmp_path / "nope"))
    other = build_checkpoint("llama", tmp_path / "v300", hf_smollm2_tokenizer, RANDOM_VOCAB + 44)
    with pytest.raises(ValueError, match=r"vocabulary of 300 token ids but the target .* has 256.*same family"):
        LLM(str(path), dtype="float32", kv_cache_memory_mb=4, speculative=_draft(other))
    # Same sizes, two tokens swapped in the tokenizer: ids would mean other text.
    swapped = _noisy_copy(path, tmp_path / "swapped", 0.0)
    tj = json.loads((swapped / "tokenizer.json").read_text())
    vocab = tj["model"]["vocab"]
    a, b = "hello", "world"
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (swapped / "tokenizer.json").write_text(json.dumps(tj))
    with pytest.raises(ValueError, match=r"tokenize differently: 2 token id\(s\) differ"):
        LLM(str(path), dtype="float32", kv_cache_memory_mb=4, speculative=_draft(swapped))


def test_cli_draft_flags_reach_the_engine():
    from pagedllm.cli.main import build_parser, command_config

    argv = ["serve", "--speculative-draft", "path/to/draft", "--speculative-tokens", "3"]
    args = build_parser(argv).parse_args(argv)
    assert command_config(args).speculative.to_dict() == {"method": "draft", "model": "path/to/draft", "num_tokens": 3}
    # Both: n-gram lookup where the sequence's suffix matches, the draft elsewhere.
    argv = ["serve", "--speculative-ngram", "4", "--speculative-draft", "x"]
    assert command_config(build_parser(argv).parse_args(argv)).speculative.to_dict() == {
        "method": "draft",
        "model": "x",
        "num_tokens": 4,
        "ngram": True,
    }
    # The draft's weight format (engine/draft_weights.py; default "auto", so left out when not given).
    argv = ["serve", "--speculative-draft", "x", "--speculative-draft-weights", "file"]
    assert command_config(build_parser(argv).parse_args(argv)).speculative.to_dict() == {
        "method": "draft",
        "model": "x",
        "draft_weights": "file",
    }
    for argv, msg in (
        (["serve", "--speculative-tokens", "3"], "needs --speculative-draft"),
        (["serve", "--speculative-ngram", "3", "--speculative-tokens", "2"], "goes with"),
        (["serve", "--speculative-ngram", "3", "--speculative-draft-weights", "Q4_0"], "needs --speculative-draft"),
        (
            ["serve", "--speculative-draft", "x", "--speculative-draft-weights", "Q9_9"],
            "draft_weights must be 'auto', 'file' or a quantized type",
        ),
    ):
        args = build_parser(argv).parse_args(argv)
        with pytest.raises(ValueError, match=msg):  # before anything loads ("x" is no model)
            LLM(config=command_config(args))


# -- adaptive lengths and n-gram + draft -------------------------------------------------------
def _expected_rate(cands, ks, plain: int, row: float, draft: float) -> float:
    """Expected tokens per unit of step time (a plain step costs 1) of proposal lengths ks."""
    tokens = plain + sum(sum(c.acceptance**j for j in range(1, k + 1)) for c, k in zip(cands, ks))
    forwards = max((k for c, k in zip(cands, ks) if c.draft), default=0)
    return tokens / (1 + row * sum(ks) + draft * forwards)


@pytest.mark.parametrize("row, draft", [(0.02, 0.0), (0.1, 0.0), (0.05, 0.2), (0.05, 0.35), (0.1, 0.9)])
def test_planned_lengths_are_the_best_by_enumeration(row, draft):
    """The planner's lengths against every combination of lengths, scored by the same model of
    expected tokens per step time: one sequence gets the best length exactly (0 where no
    length pays), three together at least 99% of the best combination."""
    import itertools

    from pagedllm.speculative.costs import Candidate, best_rate, plan_lengths

    for a in (0.05, 0.3, 0.5, 0.7, 0.9, 0.99):
        c = [Candidate(a, 6, draft > 0)]
        best = max(range(7), key=lambda k: _expected_rate(c, [k], 1, row, draft))
        assert plan_lengths(c, 1, 8, row, draft) == [best], (a, row, draft)
        assert best_rate(c[0], row, draft) == pytest.approx(_expected_rate(c, [best], 1, row, draft))
    for accs in ((0.9, 0.4, 0.1), (0.8, 0.8, 0.6), (0.2, 0.3, 0.95)):
        cands = [Candidate(a, 4, i != 1 or draft == 0) for i, a in enumerate(accs)]
        got = plan_lengths(cands, 3, 9, row, draft)
        assert sum(got) <= 9
        best = max(
            _expected_rate(cands, ks, 3, row, draft) for ks in itertools.product(range(5), repeat=3) if sum(ks) <= 9
        )
        assert _expected_rate(cands, got, 3, row, draft) >= 0.99 * best, (accs, got)
    # A draft as costly as a target step never pays for one proposal, however good it is.
    assert plan_lengths([Candidate(0.99, 6, True)], 1, 8, row, 1.0) == [0]


def test_step_costs_fit_the_rows_line():
    from pagedllm.speculative.costs import DRAFT_PRIOR, ROW_PRIOR, StepCosts

    c = StepCosts()
    assert c.relative(1) == (ROW_PRIOR, DRAFT_PRIOR)  # nothing timed yet
    for rows, secs in ((1, 0.010), (3, 0.012), (5, 0.014), (1, 0.010)):
        c.observe_step(rows, secs)
    c.observe_draft(2, 0.006)
    row, draft = c.relative(1)  # (3 and 5 seen once: the line prices every row)
    assert row == pytest.approx([0.001 / 0.010] * len(row)) and draft == pytest.approx(0.003 / 0.010)


def test_step_costs_follow_the_curve_of_trusted_row_counts():
    """Row counts timed often enough are joined piece by piece, the line past them: a second
    row that costs nothing is priced at nothing, so one proposal of a chat's draft (60%
    accepted, a forward 0.24 of a step) pays, which the line through every count declined."""
    from pagedllm.speculative.costs import TRUSTED, Candidate, StepCosts, best_rate, plan_lengths
    from pagedllm.speculative.decoder import MIN_GAIN

    c = StepCosts()
    for _ in range(TRUSTED):
        for rows, secs in ((1, 0.030), (2, 0.030), (6, 0.075)):
            c.observe_step(rows, secs)
    c.observe_draft(1, 0.0072)
    row, draft = c.relative(1)
    slope = c._line()[1]
    # Pieces 2 -> 6 at 0.375 a row, the line past 6 at its slope (lower: it starts flat), so
    # the prices past the free second row are those pooled into one non-decreasing run.
    pooled = (4 * 0.045 / 4 / 0.030 + (len(row) - 5) * slope / 0.030) / (len(row) - 1)
    assert row[0] == 0.0 and row[1:] == pytest.approx([pooled] * (len(row) - 1)) and draft == pytest.approx(0.24)
    chat = Candidate(0.6, 5, True)
    assert plan_lengths([chat], 1, 8, row, draft) == [1]
    assert best_rate(chat, row, draft) == pytest.approx(1.6 / 1.24) and best_rate(chat, row, draft) >= MIN_GAIN
    assert best_rate(chat, slope / 0.030, draft) < MIN_GAIN


def test_row_prices_are_scipys_isotonic_regression():
    """`rising` is the least-squares non-decreasing fit (scipy's isotonic regression is the
    reference), and a code edit's lookups are no longer stopped short by one noisy row count."""
    from scipy.optimize import isotonic_regression

    from pagedllm.speculative.costs import TRUSTED, Candidate, StepCosts, plan_lengths, rising

    rnd = random.Random(7)
    for n in (1, 2, 5, 33):
        for _ in range(20):
            prices = [rnd.choice([0.0, 0.03, 0.1, 0.3]) * rnd.uniform(0.5, 1.5) for _ in range(n)]
            assert rising(prices) == pytest.approx(isotonic_regression(prices).x, abs=1e-12)
    # Medians of 1-5 rows timed in different phases of the machine: the 3rd row looks free and
    # the 4th costs a third of a step. Raw, the planner proposed 2 of an 80% lookup's tokens.
    c = StepCosts()
    for _ in range(TRUSTED):
        for rows, secs in ((1, 0.030), (2, 0.0353), (3, 0.0353), (4, 0.0453), (5, 0.050), (8, 0.056)):
            c.observe_step(rows, secs)
    row, draft = c.relative(1)
    assert all(a <= b for a, b in zip(row, row[1:]))
    assert plan_lengths([Candidate(0.8, 5, False)], 1, 8, row, draft) == [5]


@pytest.mark.parametrize("prices", [[0.0, 0.3, 0.3, 0.3, 0.3, 0.3], [0.05, 0.1, 0.2, 0.3, 0.4, 0.5]])
def test_planned_lengths_with_rising_row_prices_are_the_best_by_enumeration(prices):
    from pagedllm.speculative.costs import Candidate, best_rate, plan_lengths

    def rate(a, k, draft):
        return sum(a**j for j in range(k + 1)) / (1 + sum(prices[:k]) + draft * k)

    for draft in (0.0, 0.2):
        for a in (0.05, 0.3, 0.5, 0.7, 0.9, 0.99):
            c = Candidate(a, 6, draft > 0)
            best = max(range(7), key=lambda k: rate(a, k, draft))
            assert plan_lengths([c], 1, 8, prices, draft) == [best], (a, draft)
            assert best_rate(c, prices, draft) == pytest.approx(rate(a, best, draft))


def test_step_costs_shrug_off_a_slow_step():
    """One step (or draft forward) the machine slowed does not move the costs: they are medians
    of the recent timings. (A running mean moved by one such step declined a code edit whose
    drafts were 99% accepted.)"""
    from pagedllm.speculative.costs import StepCosts

    c = StepCosts()
    for _ in range(4):
        c.observe_step(1, 0.010)
        c.observe_step(6, 0.020)
        c.observe_draft(2, 0.008)
    c.observe_step(6, 0.080)
    c.observe_draft(1, 0.040)
    row, draft = c.relative(1)
    assert row == pytest.approx([0.002 / 0.010] * len(row)) and draft == pytest.approx(0.004 / 0.010)


def test_a_paused_draft_probes_again_where_the_sequence_copies():
    """A draft's probe first catches up on the whole pause: past a few decode rows' worth it
    waits until the sequence's suffix recurs earlier in it; a short catch-up (a proposal's own
    forward) and an n-gram probe, which costs no forward, never wait."""
    from types import SimpleNamespace

    from pagedllm.speculative.config import SpeculativeConfig
    from pagedllm.speculative.decoder import PROBE_NGRAM, SeqSpecState, SpeculativeDecoder

    dec = SpeculativeDecoder(SpeculativeConfig(method="draft", model="draft"), 4096)
    dec.draft = SimpleNamespace(cheap_probe=lambda seq: True)
    assert dec._worth_probing(SimpleNamespace(token_ids=list(range(100))), SeqSpecState())
    dec.draft = SimpleNamespace(cheap_probe=lambda seq: False)
    st = SeqSpecState()
    seq = SimpleNamespace(token_ids=list(range(100)))
    assert not dec._worth_probing(seq, st)
    seq.token_ids += list(range(50, 50 + PROBE_NGRAM - 1))  # one token short of a repeat
    assert not dec._worth_probing(seq, st)
    seq.token_ids.append(50 + PROBE_NGRAM - 1)
    assert dec._worth_probing(seq, st)
    dec.draft = None
    assert dec._worth_probing(SimpleNamespace(token_ids=list(range(100))), SeqSpecState())


@pytest.mark.parametrize("draft_cost, declines", [(1.0, True), (0.05, False)])
def test_adaptive_draft_proposes_what_pays(family_ckpt, drafts, monkeypatch, draft_cost, declines):
    """Given a draft forward that costs a whole target step, the noisy copy's proposals (about a
    third accepted) never pay: the decoder declines and only probes now and then, where fixed
    lengths propose every step. Given a cheap one, they pay and it keeps proposing. The costs
    are set here (tiny random models' step times are mostly overhead, and the machine may be
    loaded); that they are measured is asserted, and the fit is tested above. Greedy output is
    plain decoding's either way."""
    from pagedllm.speculative.costs import StepCosts

    _, path, prompts, expected = family_ckpt
    spec = {"method": "draft", "model": str(drafts["noisy"]), "num_tokens": 4, "max_rows": 64, "min_acceptance": 0.0}
    fixed = LLM(str(path), dtype="float32", kv_cache_memory_mb=16, speculative={**spec, "adaptive": False})
    assert _greedy(fixed, prompts) == expected
    monkeypatch.setattr(StepCosts, "relative", lambda self, rows: (0.02, draft_cost))
    adaptive = LLM(str(path), dtype="float32", kv_cache_memory_mb=16, speculative=spec)
    assert _greedy(adaptive, prompts) == expected
    a, f = adaptive.engine.spec, fixed.engine.spec
    assert len(a.costs.step_s) >= 2  # it timed target steps of more than one row count
    if declines:
        assert a.stats.declined > 0 and a.stats.proposed < f.stats.proposed / 3, (a.stats, f.stats)
    else:
        assert a.stats.proposed > f.stats.proposed / 3, (a.stats, f.stats)
        # It timed the draft's decode forwards, not the catch-up prefills (the prompt on first use).
        d = adaptive.engine.spec.draft
        assert a.costs.draft_s is not None and 0 < d.decode_forwards < d.forwards
    _assert_no_leak(adaptive)


def test_ngram_and_draft_together(family_ckpt, drafts):
    """Both on: a sequence whose suffix recurs takes the lookup's proposals, the others the
    draft's; greedy output is plain decoding's and nothing leaks."""
    _, path, prompts, expected = family_ckpt
    spec = {**_draft(drafts["small"]), "ngram": True, "min_ngram": 1, "max_ngram": 3}
    llm = LLM(str(path), dtype="float32", kv_cache_memory_mb=16, speculative=spec)
    assert _greedy(llm, prompts) == expected
    st, draft = llm.engine.spec.stats, llm.engine.spec.draft
    assert 0 < st.ngram_proposed < st.proposed and draft.forwards > 0, st
    _assert_no_leak(llm)
    with pytest.raises(ValueError, match="combines n-gram lookup with a draft"):
        LLM(str(path), speculative={"method": "ngram", "ngram": True})
