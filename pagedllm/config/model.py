"""What a loaded model is: `ModelConfig`, read from a transformers-style config.json (a Hugging
Face folder's, or one made from GGUF metadata)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class ModelConfig:
    """What the engine needs to know about a decoder-only transformer.

    Built from a transformers-style config.json dict, whether it came from a
    Hugging Face folder or was synthesised from GGUF metadata.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    # Bias on o_proj: Llama ties it to attention_bias, Qwen2 has none.
    o_proj_bias: bool | None = None
    sliding_window: int | None = None
    # Per layer: window size, or None for full attention.
    layer_windows: list[int | None] = field(default_factory=list)
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    # Sliding layers' own rope (Gemma 3: rope_local_base_freq); None: the same as global layers.
    local_rope_theta: float | None = None
    local_rope_scaling: dict | None = None
    # Gemma: attention scale query_pre_attn_scalar ** -0.5 instead of head_dim ** -0.5.
    query_pre_attn_scalar: float | None = None
    attn_logit_softcapping: float | None = None  # Gemma 2: tanh cap on attention scores
    final_logit_softcapping: float | None = None  # Gemma 2: tanh cap on the logits
    hidden_activation: str = "silu"
    # Mixture of experts (models/moe.py); num_experts == 0: a dense model.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0  # each routed expert's intermediate size
    norm_topk_prob: bool = False  # renormalize the top-k routing weights to sum to one
    # Per layer: True where the MLP is the sparse block (Qwen-MoE's decoder_sparse_step and
    # mlp_only_layers leave some layers dense).
    moe_layers: list[bool] = field(default_factory=list)
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE's always-on expert (0: none)
    clip_qkv: float | None = None  # OLMoE: q, k and v clamped to [-clip, clip]
    # A vision-language model (pagedllm/multimodal): the whole config.json, whose text_config
    # the fields above were read from; None for a text-only model.
    vision: dict | None = None
    # M-RoPE (Qwen2.5-VL): how many of the head's rope frequencies follow each of the
    # (temporal, height, width) position streams; None: one position per token.
    mrope_section: list[int] | None = None

    @property
    def all_layers_sliding(self) -> bool:
        return bool(self.layer_windows) and all(w is not None for w in self.layer_windows)

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        archs = d.get("architectures") or []
        if not archs:
            raise ValueError("config.json has no 'architectures' entry; cannot tell which model family to build")
        if isinstance(d.get("vision_config"), dict) and not isinstance(d.get("text_config"), dict):
            # Qwen2.5-VL's configs as published keep the language model's keys at the top level.
            d = {**d, "text_config": {k: v for k, v in d.items() if k != "vision_config"}}
        if isinstance(d.get("text_config"), dict) and isinstance(d.get("vision_config"), dict):
            cfg = cls.from_hf_dict(_language_model(d, archs))
            cfg.vision = d
            return cfg
        n_heads = int(d["num_attention_heads"])
        hidden = int(d["hidden_size"])
        n_layers = int(d["num_hidden_layers"])
        head_dim = d.get("head_dim") or hidden // n_heads
        window = d.get("sliding_window")
        layer_windows = _layer_windows(d, n_layers, window)
        eos = d.get("eos_token_id")
        eos_ids = [] if eos is None else ([int(eos)] if isinstance(eos, int) else [int(e) for e in eos])
        rope = _rope_fields(d)
        moe = _moe(d, archs[0], n_layers)
        attention_bias = d.get("attention_bias", False)
        if archs[0] == "Qwen2MoeForCausalLM":  # q/k/v biases unless the config turns them off
            attention_bias = d.get("qkv_bias", True)
        return cls(
            architecture=archs[0],
            vocab_size=int(d["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(d["intermediate_size"]),
            num_layers=n_layers,
            num_heads=n_heads,
            num_kv_heads=int(d.get("num_key_value_heads") or n_heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(d.get("max_position_embeddings") or 4096),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=bool(attention_bias),
            mlp_bias=bool(d.get("mlp_bias", False)),
            sliding_window=int(window) if window and any(layer_windows) else None,
            layer_windows=layer_windows,
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_ids,
            query_pre_attn_scalar=d.get("query_pre_attn_scalar"),
            attn_logit_softcapping=d.get("attn_logit_softcapping"),
            final_logit_softcapping=d.get("final_logit_softcapping"),
            hidden_activation=d.get("hidden_activation") or d.get("hidden_act") or "silu",
            clip_qkv=d.get("clip_qkv"),
            **rope,
            **moe,
        )


def _language_model(d: dict, archs: list) -> dict:
    """A vision-language model's language model config, under the VLM's architecture. Top-level
    values the text config lacks (or that override it: tie_word_embeddings) come along."""
    text = {**{k: d[k] for k in ("eos_token_id", "bos_token_id") if k in d}, **d["text_config"], "architectures": archs}
    if "tie_word_embeddings" in d:
        text["tie_word_embeddings"] = d["tie_word_embeddings"]
    return text


def _rope_fields(d: dict) -> dict[str, Any]:
    """The rotary embedding's fields: global and sliding layers' theta and scaling, M-RoPE's sections."""
    rope_theta, rope_scaling = _rope(d, d.get("rope_theta"), d.get("rope_scaling"), "full_attention")
    mrope_section = None
    for rp in (d.get("rope_parameters"), d.get("rope_scaling")):
        if isinstance(rp, dict) and rp.get("mrope_section"):
            mrope_section = [int(x) for x in rp["mrope_section"]]
            break
    if (rope_scaling or {}).get("rope_type", (rope_scaling or {}).get("type")) == "mrope":
        rope_scaling = None  # M-RoPE's frequencies are the default ones (mrope_section above)
    local_theta, local_scaling = None, None
    if "rope_local_base_freq" in d or _per_layer_type_rope(d):  # Gemma 3: sliding layers' own rope
        local_theta, local_scaling = _rope(d, d.get("rope_local_base_freq"), None, "sliding_attention")
    if (rope_scaling or {}).get("partial_rotary_factor", d.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError("partial_rotary_factor != 1 (rope on part of each head) is not supported")
    return dict(
        rope_theta=float(rope_theta if rope_theta is not None else 10000.0),
        rope_scaling=rope_scaling,
        local_rope_theta=None if local_theta is None else float(local_theta),
        local_rope_scaling=local_scaling,
        mrope_section=mrope_section,
    )


def _moe(d: dict, arch: str, n_layers: int) -> dict[str, Any]:
    """The mixture-of-experts fields, checked: {} for a dense model."""
    experts = int(d.get("num_local_experts") or d.get("num_experts") or 0)
    if not experts:
        return {}
    k = int(d.get("num_experts_per_tok") or 0)
    if not 1 <= k <= experts:
        raise ValueError(
            f"num_experts_per_tok={k} must be between 1 and the model's {experts} experts "
            "(num_experts / num_local_experts); the checkpoint's config is inconsistent"
        )
    step = int(d.get("decoder_sparse_step") or 1)
    dense = set(d.get("mlp_only_layers") or [])
    # Mixtral's router keeps the top k of a softmax and renormalizes them, unconditionally
    # (the same as a softmax over the top k logits).
    norm = True if arch == "MixtralForCausalLM" else bool(d.get("norm_topk_prob", False))
    return dict(
        num_experts=experts,
        num_experts_per_tok=k,
        moe_intermediate_size=int(d.get("moe_intermediate_size") or d["intermediate_size"]),
        norm_topk_prob=norm,
        moe_layers=[i not in dense and (i + 1) % step == 0 for i in range(n_layers)],
        shared_expert_intermediate_size=int(d.get("shared_expert_intermediate_size") or 0),
    )


def _per_layer_type_rope(d: dict) -> bool:
    rp = d.get("rope_parameters")
    return isinstance(rp, dict) and isinstance(rp.get("full_attention"), dict)


def _rope(d: dict, theta: float | None, scaling: dict | None, layer_type: str) -> tuple[float, dict | None]:
    """(theta, scaling or None) of one layer type. transformers >= 5 nests them under
    rope_parameters, per layer type for models whose layer types differ (Gemma 3)."""
    rp = d.get("rope_parameters")
    if _per_layer_type_rope(d):
        rp = rp.get(layer_type)
    if isinstance(rp, dict):
        theta = rp.get("rope_theta", theta)
        if rp.get("rope_type", "default") != "default":
            scaling = rp
    if scaling and (scaling.get("rope_type") or scaling.get("type")) in ("longrope", "su"):
        # LongRoPE picks its factors against the pretraining length, kept beside the scaling
        # in older configs (Phi-3).
        scaling = {"original_max_position_embeddings": d.get("original_max_position_embeddings"), **scaling}
        if not scaling.get("factor") and scaling["original_max_position_embeddings"]:
            scaling["factor"] = d["max_position_embeddings"] / scaling["original_max_position_embeddings"]
    if theta is None:
        theta = 10000.0
    return theta, scaling


def _layer_windows(d: dict, n_layers: int, window: int | None) -> list[int | None]:
    """Which layers use a sliding window, following the transformers config conventions."""
    if not window:
        return [None] * n_layers
    layer_types = d.get("layer_types")
    if layer_types:
        return [int(window) if t == "sliding_attention" else None for t in layer_types]
    model_type = d.get("model_type")
    if model_type == "gemma2":  # configs from before layer_types: even layers slide
        return [int(window) if i % 2 == 0 else None for i in range(n_layers)]
    if model_type in ("gemma3_text", "gemma3"):  # one global layer every sliding_window_pattern
        pattern = int(d.get("sliding_window_pattern") or d.get("_sliding_window_pattern") or 6)
        return [int(window) if (i + 1) % pattern else None for i in range(n_layers)]
    if d.get("model_type") == "qwen2" or "use_sliding_window" in d:
        if not d.get("use_sliding_window", False):
            return [None] * n_layers
        first = int(d.get("max_window_layers", 0))
        return [int(window) if i >= first else None for i in range(n_layers)]
    return [int(window)] * n_layers
