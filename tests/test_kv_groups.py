"""KV groups: sliding layers keep only their window's blocks (kv/groups.py)."""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.kv.groups import plan_groups


def test_gemma3_1b_layout_groups():
    windows = [None if (i + 1) % 6 == 0 else 512 for i in range(26)]  # globals: 5, 11, 17, 23
    g = plan_groups(windows, 26)
    assert g.slots == 4 and g.windows == [None] + [512] * 6
    assert g.layers[0] == [5, 11, 17, 23] and g.layers[-1] == [24, 25]
    assert sorted(i for ls in g.layers for i in ls) == list(range(26))
    assert plan_groups([None] * 4, 4).num_groups == 1 and plan_groups([48] * 4, 4).windows == [48]
    assert plan_groups(windows, 26, hybrid=False).num_groups == 1  # the contiguous backend


def _gemma3_shaped(tmp_path, tok):
    """Gemma 3 1B's layer pattern and window (26 layers, a global one every 6, window 512) at
    toy width, so an 8,192-token sequence runs in seconds on a CPU."""
    import transformers as tf

    cfg = tf.Gemma3TextConfig(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=26,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        query_pre_attn_scalar=16,
        sliding_window=512,
        max_position_embeddings=8448,
        sliding_window_pattern=6,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    return tmp_path


def _blocks_held_at_8192(path, monkeypatch=None, hybrid=True):
    if not hybrid:  # one table for every layer, as before KV groups
        import pagedllm.engine.factory as le

        real = le.plan_groups
        monkeypatch.setattr(le, "plan_groups", lambda w, n, hybrid=True: real(w, n, hybrid=False))
    llm = LLM(str(path), dtype="float32", kv_cache_memory_mb=64, block_size=32, enable_prefix_caching=False)
    eng = llm.engine
    prompt = torch.randint(0, 1000, (8192,), generator=torch.Generator().manual_seed(0)).tolist()
    eng.add_request(prompt, SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    seq = next(iter(eng.requests.values())).seqs[0]
    while seq.num_computed_tokens < 8192:
        eng.step()
    eng.scheduler.release_window(seq)
    eng.block_manager.grow(seq, seq.num_computed_tokens + 1)  # the decode step's table
    trace = eng.kv_cache_trace()
    while eng.has_unfinished():
        eng.step()
    return trace, eng


@pytest.mark.slow
def test_sliding_groups_hold_one_window_at_8192_tokens(tmp_path, hf_smollm2_tokenizer, monkeypatch):
    path = _gemma3_shaped(tmp_path, hf_smollm2_tokenizer)
    t, eng = _blocks_held_at_8192(path)
    # Global group: blocks 0..256 (position 8192 starts block 256); each sliding group: the
    # window before the next query, blocks 240..256.
    assert t.kv_group_layers == 4 and t.blocks_used_by_group == [257] + [17] * 6
    hybrid_pages = t.blocks_used * t.kv_group_layers
    u, _ = _blocks_held_at_8192(path, monkeypatch, hybrid=False)
    uniform_pages = u.blocks_used * u.kv_group_layers
    ideal = 4 * 257 + 22 * 17  # the global layers' blocks plus one window per sliding layer
    print(
        f"8192 tokens, blocks of 32: KV groups hold {t.blocks_used} blocks of {t.kv_group_layers} layers "
        f"= {hybrid_pages} layer-pages ({t.kv_groups}); one uniform table holds {u.blocks_used} blocks of "
        f"{u.kv_group_layers} layers = {uniform_pages}; global + one window per sliding layer = {ideal}"
    )
    assert u.blocks_used == 257 and u.kv_group_layers == 26
    assert ideal <= hybrid_pages <= ideal + 2 * 17  # the last sliding group's two idle slots
    assert hybrid_pages < uniform_pages / 4
    assert eng.block_manager.num_used_blocks == 0


def test_hybrid_n2_forks_every_group(tmp_path, hf_smollm2_tokenizer):
    """n=2 shares the prompt's blocks in every KV group, copy-on-write; greedy siblings equal
    the single run, and nothing leaks."""
    from models import build_checkpoint

    tok = hf_smollm2_tokenizer
    path = build_checkpoint("gemma3", tmp_path / "g3", tok, len(tok))
    llm = LLM(str(path), dtype="float32", kv_cache_memory_mb=16, block_size=16)
    prompt = torch.randint(0, 1000, (130,), generator=torch.Generator().manual_seed(1)).tolist()
    one = llm.generate([prompt], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True), use_tqdm=False)[
        0
    ].token_ids
    two = llm.generate([prompt], SamplingParams(n=2, max_tokens=40, temperature=0.0, ignore_eos=True), use_tqdm=False)[
        0
    ].outputs
    assert [o.token_ids for o in two] == [one, one]
    assert llm.engine.block_manager.num_groups == 4
    assert llm.engine.block_manager.num_used_blocks == 0
    llm.engine.block_manager.check_invariants([])
