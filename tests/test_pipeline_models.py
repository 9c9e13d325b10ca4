"""Pipeline stages at the model level: a model loaded as two stages (models/stages.py) holds
only its layers' weights, and stage 0's hidden states run through stage 1 give the whole
model's logits, and transformers' in float32, for Llama, Qwen2 (tied head), Gemma 3 (sliding
and global layers) and a Mixtral-shaped mixture of experts.

The attention here is plain causal attention over one prompt (no cache), the same for the
whole model and the stages, so the comparison is of the split alone; transformers checks it."""

from __future__ import annotations

import pytest
import torch

from models import build_checkpoint
from pagedllm.loading.loader import load_model
from pagedllm.loading.source import resolve
from pagedllm.models.llama import MissingLayer
from pagedllm.models.stages import estimated_bytes, plan_stages


class _Ctx:
    def decode_stack(self, layers, dtype, pools=None):
        return None


class _Causal:
    """One prompt's causal attention, with the layer's window, scale and score soft-capping."""

    def __init__(self, attn) -> None:
        self.a = attn

    def decode_qkv(self, *args):
        return None

    def __call__(self, q, k, v, ctx):
        t, hq, _ = q.shape
        rep = hq // k.shape[1]
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        s = torch.einsum("qhd,khd->hqk", q, k) * self.a.scale
        if self.a.softcap:
            s = torch.tanh(s / self.a.softcap) * self.a.softcap
        i = torch.arange(t)
        mask = i[None, :] <= i[:, None]
        if self.a.window is not None:
            mask &= i[:, None] - i[None, :] < self.a.window
        s = s.masked_fill(~mask, float("-inf"))
        return torch.einsum("hqk,khd->qhd", s.softmax(-1), v)


def _load(path, stage=None):
    loaded = load_model(resolve(str(path)), torch.float32, torch.device("cpu"), stage=stage)
    for a in loaded.model.attention_modules():
        a.attn = _Causal(a)
    return loaded


def _run(model, ids, hidden=None):
    pos = torch.arange(len(ids))
    return model(torch.tensor(ids), pos, _Ctx(), inputs_embeds=hidden)


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma3", "mixtral"])
def test_two_stages_give_the_whole_models_logits(family, tmp_path, hf_smollm2_tokenizer):
    import transformers as tf

    tok = hf_smollm2_tokenizer
    path = build_checkpoint(family, tmp_path / family, tok, len(tok))
    whole = _load(path)
    cfg = whole.config
    layer_bytes, embed, head = estimated_bytes(cfg)
    stages = plan_stages(layer_bytes, 2, embed, head)
    parts = [_load(path, s) for s in stages]
    first, last = (p.model for p in parts)

    # Each stage holds its own layers only, the embedding first and the head last.
    for p, s in zip(parts, stages):
        held = [i for i, layer in enumerate(p.model.layers) if not isinstance(layer, MissingLayer)]
        assert held == list(s.layers)
        assert len(p.model.attention_modules()) == len(s.layers)
    assert first.lm_head is None and first.norm is None and last.lm_head is not None
    assert (last.embed_tokens is not None) == cfg.tie_word_embeddings
    assert sum(p.weight_bytes for p in parts) == pytest.approx(
        whole.weight_bytes + (whole.model.embed_tokens.weight.nbytes if cfg.tie_word_embeddings else 0), rel=1e-6
    )
    assert all(p.weight_bytes < whole.weight_bytes for p in parts)

    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, len(tok), (40,), generator=g).tolist()
    with torch.no_grad():
        want = whole.model.compute_logits(_run(whole.model, ids))
        h = _run(first, ids)
        assert h.shape == (len(ids), cfg.hidden_size)
        got = last.compute_logits(_run(last, ids, h))
        ref = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()(torch.tensor([ids])).logits[0]
    assert torch.equal(got, want)
    assert (got - ref).abs().max().item() < 1e-4
    with pytest.raises(ValueError, match="previous stage's hidden states"):
        _run(last, ids)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_each_stage_holds_about_half_the_weights_and_kv(family, tmp_path, hf_smollm2_tokenizer):
    """Eight layers at pp=2: each stage's weight bytes within 10% of half the whole model's
    (an untied head weighs what the embedding does, so the plan splits 4 + 4), and its KV cache
    for the same blocks half of pp=1's where the layers attend alike. Gemma 3's KV groups keep,
    per block, as many slots as the stage's fullest group holds layers."""
    from pagedllm.config import CacheConfig
    from pagedllm.distributed.stage_kv import stage_kv
    from pagedllm.models.stages import whole as whole_stage

    tok = hf_smollm2_tokenizer
    over = {"num_hidden_layers": 8, "tie_word_embeddings": False}
    if family == "gemma3":
        over["layer_types"] = (
            ["sliding_attention"] * 3 + ["full_attention"] + ["sliding_attention"] * 3 + ["full_attention"]
        )
    path = build_checkpoint(family, tmp_path / family, tok, len(tok), **over)
    whole = load_model(resolve(str(path)), torch.float32, torch.device("cpu"))
    cfg = whole.config
    layer_bytes, embed, head = estimated_bytes(cfg)
    stages = plan_stages(layer_bytes, 2, embed, head)
    assert [len(s.layers) for s in stages] == [4, 4]
    cache_cfg = CacheConfig(block_size=16)
    kv_heads = whole.model.shard.kv_heads
    full, _, _ = stage_kv(cfg, whole_stage(cfg), kv_heads, cache_cfg, 64, torch.device("cpu"), torch.float32)
    for s in stages:
        part = load_model(resolve(str(path)), torch.float32, torch.device("cpu"), stage=s)
        assert abs(part.weight_bytes / (whole.weight_bytes / 2) - 1) < 0.10, (part.weight_bytes, whole.weight_bytes)
        kv, _, _ = stage_kv(part.config, s, kv_heads, cache_cfg, 64, torch.device("cpu"), torch.float32)
        if family == "llama":
            assert kv.nbytes * 2 == full.nbytes
        else:
            # Groups of 2 layers (2 global layers): global [3, 7], sliding [0, 1], [2, 4], [5, 6].
            # Each stage holds both layers of one sliding group, so its blocks keep 2 slots, as
            # the whole model's do: no saving per block (the limit docs/scale-out.md states).
            assert full.spec.num_layers == 2 and kv.spec.num_layers == 2
            assert kv.nbytes == full.nbytes
