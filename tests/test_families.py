"""Config reading for the newer families, as their checkpoints on the hub write it (the
exactness tests build configs with today's transformers, which writes the newer form)."""

from __future__ import annotations

import pytest

from pagedllm.config import ModelConfig
from pagedllm.models import model_class
from pagedllm.models.rope import inv_frequencies

# slow: whole models, servers or builds; `make test-fast` leaves it out
pytestmark = pytest.mark.slow

BASE = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=1,
    head_dim=16,
    max_position_embeddings=32768,
)


def test_gemma3_hub_config_pattern_and_local_rope():
    """gemma-3 config.json (transformers 4.5x): sliding_window_pattern, rope_local_base_freq,
    and rope_scaling for the global layers only."""
    d = {
        **BASE,
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "num_hidden_layers": 12,
        "sliding_window": 512,
        "sliding_window_pattern": 6,
        "rope_theta": 1000000.0,
        "rope_local_base_freq": 10000.0,
        "rope_scaling": {"rope_type": "linear", "factor": 8.0},
        "query_pre_attn_scalar": 256,
    }
    c = ModelConfig.from_hf_dict(d)
    assert c.layer_windows == [512] * 5 + [None] + [512] * 5 + [None]
    assert (c.rope_theta, c.rope_scaling["factor"]) == (1e6, 8.0)
    assert (c.local_rope_theta, c.local_rope_scaling) == (1e4, None)
    assert model_class(c.architecture).__name__ == "Gemma3ForCausalLM"


def test_gemma2_hub_config_alternates_from_a_sliding_layer():
    d = {
        **BASE,
        "architectures": ["Gemma2ForCausalLM"],
        "model_type": "gemma2",
        "num_hidden_layers": 4,
        "sliding_window": 4096,
        "attn_logit_softcapping": 50.0,
        "final_logit_softcapping": 30.0,
    }
    c = ModelConfig.from_hf_dict(d)
    assert c.layer_windows == [4096, None, 4096, None]
    assert (c.attn_logit_softcapping, c.final_logit_softcapping) == (50.0, 30.0)


def test_phi3_su_scaling_reads_factors_against_the_original_length():
    """Phi-3-mini-128k writes {"type": "su"} and original_max_position_embeddings beside it."""
    short, long = [1.0] * 8, [4.0] * 8
    d = {
        **BASE,
        "architectures": ["Phi3ForCausalLM"],
        "model_type": "phi3",
        "num_hidden_layers": 2,
        "max_position_embeddings": 131072,
        "original_max_position_embeddings": 4096,
        "rope_scaling": {"type": "su", "short_factor": short, "long_factor": long},
    }
    c = ModelConfig.from_hf_dict(d)
    inv_short, a_short = inv_frequencies(16, c.rope_theta, c.rope_scaling, 4096)
    inv_long, a_long = inv_frequencies(16, c.rope_theta, c.rope_scaling, 8192)
    assert inv_short.allclose(4 * inv_long) and a_short == a_long > 1.0


def test_unsupported_architecture_keeps_its_error():
    with pytest.raises(ValueError, match="unknown model architecture 'FalconForCausalLM'; supported: "):
        model_class("FalconForCausalLM")
