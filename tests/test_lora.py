"""LoRA adapters against peft's PeftModel (unmerged), float32, on random-weight base models with
random adapters (B not zero: init_lora_weights=False)."""

from __future__ import annotations

import json

import pytest
import torch

from models import build_checkpoint
from pagedllm import LLM, LoRARequest, SamplingParams

pytest.importorskip("peft")
from lora_adapters import base_model as _base, greedy_references, import_peft, make_adapter  # noqa: E402

peft = import_peft()

NEW_TOKENS = 16
PROMPT_LENS = (5, 40, 97)
# (rank, alpha, use_rslora, target modules): full and partial targets, rsLoRA, unequal ranks
ADAPTERS = [
    (8, 16, False, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
    (4, 8, True, ["q_proj", "v_proj", "down_proj"]),
    (16, 32, False, ["k_proj", "o_proj", "up_proj", "gate_proj"]),
    (2, 4, False, ["v_proj", "gate_proj", "down_proj"]),
]


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def family(request, tmp_path_factory, hf_smollm2_tokenizer):
    """(family, base path, adapter folders, prompts, {adapter index or None: greedy tokens per prompt},
    reference model per adapter)."""
    tok = hf_smollm2_tokenizer
    root = tmp_path_factory.mktemp(f"lora-{request.param}")
    base = build_checkpoint(request.param, root / "base", tok, len(tok))
    adapters = [make_adapter(base, root / f"a{i}", 100 + i, *spec) for i, spec in enumerate(ADAPTERS)]
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, len(tok), (n,), generator=g).tolist() for n in PROMPT_LENS]
    refs = {None: _base(base)}
    for i, a in enumerate(adapters):
        refs[i] = peft.PeftModel.from_pretrained(_base(base), a).eval()
    expected = greedy_references(refs, prompts, NEW_TOKENS)
    return request.param, base, adapters, prompts, expected, refs


def _req(adapters, i):
    return None if i is None else LoRARequest(f"a{i}", i + 1, str(adapters[i]))


def _greedy(llm, prompts, loras):
    sp = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    return [o.token_ids for o in llm.generate(prompts, sp, use_tqdm=False, lora_request=loras)]


@pytest.mark.slow
def test_adapters_change_the_output(family):
    """The test's own premise: every adapter gives tokens the base and the others do not."""
    _, _, _, prompts, expected, _ = family
    outs = [tuple(map(tuple, expected[k])) for k in (None, 0, 1, 2, 3)]
    assert len(set(outs)) == len(outs)


def test_prefill_logits_match_peft(family):
    name, base, adapters, prompts, _, refs = family
    llm = LLM(str(base), dtype="float32", kv_cache_memory_mb=16, enable_lora=True, max_loras=4, max_lora_rank=16)
    for i in range(len(adapters)):
        for p in prompts:
            with torch.no_grad():
                want = refs[i](input_ids=torch.tensor([p])).logits[0]
            got = llm.prompt_logits(p, lora_request=_req(adapters, i))
            err = (got - want).abs().max().item()
            assert err < 1e-4, f"{name} adapter {i}: prefill logits differ from peft by {err}"


def test_greedy_alone_and_mixed(family):
    """Each request alone, then all adapters and the base in one batch: the tokens peft gives."""
    name, base, adapters, prompts, expected, _ = family
    llm = LLM(str(base), dtype="float32", kv_cache_memory_mb=16, enable_lora=True, max_loras=4, max_lora_rank=16)
    keys = [None, 0, 1, 2, 3]
    for k in keys:
        assert _greedy(llm, prompts, [_req(adapters, k)] * len(prompts)) == expected[k], f"{name} adapter {k}"
    # Mixed: every (prompt, adapter) pair in one batch, interleaved.
    pairs = [(j, k) for j in range(len(prompts)) for k in keys]
    got = _greedy(llm, [prompts[j] for j, _ in pairs], [_req(adapters, k) for _, k in pairs])
    assert got == [expected[k][j] for j, k in pairs]
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_usable_blocks


def test_preemption_prefix_cache_and_lru(family):
    """A cache far smaller than the batch (it must preempt), prefix caching on, and two slots
    for four adapters (the others are evicted and read back from disk): the same tokens."""
    name, base, adapters, prompts, expected, _ = family
    llm = LLM(
        str(base),
        dtype="float32",
        block_size=8,
        max_num_batched_tokens=64,
        kv_cache_context_len=400,
        enable_prefix_caching=True,
        enable_lora=True,
        max_loras=2,
        max_lora_rank=16,
    )
    keys = [None, 0, 1, 2, 3]
    pairs = [(j, k) for k in keys for j in range(len(prompts))] * 2  # repeats hit the prefix cache
    got = _greedy(llm, [prompts[j] for j, _ in pairs], [_req(adapters, k) for _, k in pairs])
    assert got == [expected[k][j] for j, k in pairs]
    eng = llm.engine
    assert eng.scheduler.num_preemptions > 0
    assert eng.lora.num_loads > 4  # LRU: adapters left their slots and came back
    trace = llm.kv_cache_trace()
    assert trace.lora_slots == 2 and len(trace.lora_adapters) <= 2 and trace.lora_loads == eng.lora.num_loads
    assert trace.lora_memory_mb > 0
    assert eng.block_manager.stats.hits > 0
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_usable_blocks


def test_prefix_cache_keys_include_the_adapter(family):
    """One adapter's second request reuses its first one's blocks; another adapter's (or the
    base's) request with the same prompt does not, and still gets its own tokens."""
    name, base, adapters, prompts, expected, _ = family
    llm = LLM(
        str(base),
        dtype="float32",
        block_size=8,
        kv_cache_memory_mb=16,
        enable_prefix_caching=True,
        enable_lora=True,
        max_loras=4,
        max_lora_rank=16,
    )
    p = prompts[2]
    stats = llm.engine.block_manager.stats
    assert _greedy(llm, [p], [_req(adapters, 0)]) == [expected[0][2]]
    h0 = stats.hits
    assert _greedy(llm, [p], [_req(adapters, 1)]) == [expected[1][2]]
    assert _greedy(llm, [p], [None]) == [expected[None][2]]
    assert stats.hits == h0, "another adapter (or the base) reused the first adapter's KV blocks"
    assert _greedy(llm, [p], [_req(adapters, 0)]) == [expected[0][2]]
    assert stats.hits > h0, "the same adapter's request did not reuse its blocks"


def test_wrong_adapter_on_one_row_fails(family):
    """The check has teeth: one row given another adapter's request gives other tokens."""
    name, base, adapters, prompts, expected, _ = family
    llm = LLM(str(base), dtype="float32", kv_cache_memory_mb=16, enable_lora=True, max_loras=4, max_lora_rank=16)
    loras = [_req(adapters, 0), _req(adapters, 1), _req(adapters, 2)]
    right = [expected[0][0], expected[1][1], expected[2][2]]
    assert _greedy(llm, prompts, loras) == right
    loras[1] = _req(adapters, 3)
    assert _greedy(llm, prompts, loras) != right


def test_refusals(tmp_path, family):
    name, base, adapters, prompts, _, _ = family
    llm = LLM(str(base), dtype="float32", kv_cache_memory_mb=16, enable_lora=True, max_loras=2, max_lora_rank=8)
    sp = SamplingParams(max_tokens=2)
    with pytest.raises(ValueError, match="rank 16, above max_lora_rank=8"):
        llm.generate(prompts[0], sp, lora_request=_req(adapters, 2))
    # An adapter of another base shape (hidden size 96 instead of 64).
    import transformers as tf

    tok = tf.AutoTokenizer.from_pretrained(base)
    other = build_checkpoint(name, tmp_path / "other", tok, len(tok), hidden_size=96)
    wrong = make_adapter(other, tmp_path / "wrong", 1, 4, 8, False, ["q_proj"])
    with pytest.raises(ValueError, match="takes 64 inputs: the adapter is for another base model"):
        llm.generate(prompts[0], sp, lora_request=LoRARequest("wrong", 9, str(wrong)))
    # Features not reproduced are refused, not ignored.
    cfg = json.loads((adapters[0] / "adapter_config.json").read_text())
    for key, value, what in (("use_dora", True, "DoRA"), ("modules_to_save", ["lm_head"], "modules_to_save")):
        bad = tmp_path / f"bad-{key}"
        bad.mkdir()
        (bad / "adapter_config.json").write_text(json.dumps({**cfg, key: value}))
        (bad / "adapter_model.safetensors").write_bytes((adapters[0] / "adapter_model.safetensors").read_bytes())
        with pytest.raises(ValueError, match=what):
            llm.generate(prompts[0], sp, lora_request=LoRARequest(key, 20, str(bad)))
    with pytest.raises(ValueError, match="not a folder"):
        llm.generate(prompts[0], sp, lora_request=LoRARequest("nope", 21, str(tmp_path / "missing")))
    plain = LLM(str(base), dtype="float32", kv_cache_memory_mb=16)
    with pytest.raises(ValueError, match="LoRA is not enabled"):
        plain.generate(prompts[0], sp, lora_request=_req(adapters, 0))
    assert not llm.engine.requests and not plain.engine.requests


def test_native_decode_stack_adds_the_deltas(family, monkeypatch):
    """On a quantized base (ISQ Q8_0), decode steps with adapter rows stay in the native
    all-layer call, which adds the deltas: the logprobs of the per-layer path (the one checked
    against peft above), with four adapters and the base mixed in one batch. The two paths round
    activations to int8 at other points, so a greedy choice may flip where its top two are tied
    within that noise; each sequence is compared up to such a flip."""
    from pagedllm.quant import kernels as qk

    if not qk.decode_layers_available():
        pytest.skip("native CPU kernels not built here")
    name, base, adapters, prompts, _, _ = family
    llm = LLM(
        str(base), dtype="float32", isq="Q8_0", kv_cache_memory_mb=16, enable_lora=True, max_loras=4, max_lora_rank=16
    )
    keys = [None, 0, 1, 2, 3]
    pairs = [(j, k) for j in range(len(prompts)) for k in keys]
    ps, loras = [prompts[j] for j, _ in pairs], [_req(adapters, k) for _, k in pairs]
    sp = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, logprobs=5)

    # The mixed batch (groups of several rows), then one adapter row alone (the one-row kernels).
    batches = [(ps, loras, pairs), ([prompts[0]], [_req(adapters, 1)], [(0, 1)])]

    def run():
        return [
            [(o.token_ids, o.outputs[0].logprobs) for o in llm.generate(p, sp, use_tqdm=False, lora_request=lr)]
            for p, lr, _ in batches
        ]

    real, stacked_steps = qk.decode_layers, []

    def spy(*args, **kwargs):
        stacked_steps.append(args[7] if len(args) > 7 else kwargs.get("lora"))
        return real(*args, **kwargs)

    monkeypatch.setattr(qk, "decode_layers", spy)
    stacked_runs = run()
    assert any(lora is not None for lora in stacked_steps), f"{name}: adapter decode steps left the native stack"
    monkeypatch.setattr(qk, "decode_layers_take_lora", lambda: False)  # adapter steps: the layers one by one
    per_layer_runs = run()
    tol, compared = 0.15, 0  # the int8-rounding noise between the paths, on base rows too (Q8_0, hidden 64)
    rows = [
        (a, b, pair)
        for sr, pr, (_, _, prs) in zip(stacked_runs, per_layer_runs, batches)
        for a, b, pair in zip(sr, pr, prs)
    ]
    for (t1, lp1), (t2, lp2), (j, k) in rows:
        for step, (a, b) in enumerate(zip(lp1, lp2)):
            if t1[step] != t2[step]:  # a flip: only between two choices tied within the noise
                top = dict(a["top"])
                assert t2[step] in top and top[t1[step]] - top[t2[step]] < 2 * tol, (
                    f"{name} prompt {j} adapter {k} step {step}: the paths chose apart without a near-tie"
                )
                break
            err = abs(a["logprob"] - b["logprob"])
            assert err < tol, f"{name} prompt {j} adapter {k} step {step}: logprobs differ by {err}"
            compared += 1
    assert compared > len(rows) * NEW_TOKENS // 2
    assert len({tuple(t) for t, _ in stacked_runs[0][: len(keys)]}) == len(keys)  # every adapter changes the tokens


def test_chat_runs_the_adapter(family):
    """`llm.chat(..., lora_request=)` runs the adapter, one for all conversations or one each (a
    run on a real GGUF found the keyword went to the chat template as a variable, unused)."""
    _, base, adapters, _, _, _ = family
    llm = LLM(str(base), dtype="float32", kv_cache_memory_mb=16, enable_lora=True, max_loras=2, max_lora_rank=16)
    msgs = [{"role": "user", "content": "Name three colours."}]
    sp = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    ids = llm.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    want = llm.generate([ids], sp, use_tqdm=False, lora_request=_req(adapters, 0))[0].token_ids
    plain = llm.generate([ids], sp, use_tqdm=False)[0].token_ids
    assert want != plain
    assert llm.chat(msgs, sp, use_tqdm=False, lora_request=_req(adapters, 0)).token_ids == want
    both = llm.chat([msgs, msgs], sp, use_tqdm=False, lora_request=[None, _req(adapters, 0)])
    assert [o.token_ids for o in both] == [plain, want]
