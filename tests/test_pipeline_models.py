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
        whole.weight_bytes + (whole.model.embed_tokens.weight.nbytes if cfg.tie_word_embeddings else 0), rel=1e-6)
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
