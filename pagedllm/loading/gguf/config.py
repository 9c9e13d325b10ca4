"""GGUF metadata to a transformers-style config dict (`config.json`'s keys), as transformers
builds it from the same file."""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

import numpy as np

from .arch import _ARCHITECTURES, _MIXTRAL, _MOE_NORM_TOPK, _PERMUTED_QK_ARCHS
from .container import GGUFError

logger = logging.getLogger(__name__)

# What llama.cpp assumes of gemma3 files rather than storing: one global layer in six, and
# the sliding layers' rope base.
_GEMMA3_SWA_PATTERN = 6
_GEMMA3_LOCAL_ROPE_BASE = 10000.0


def _require(path: Path, meta: dict, key: str) -> Any:
    if key not in meta:
        raise GGUFError(f"{path}: metadata key {key!r} is missing")
    return meta[key]


def _build_config(path: Path, meta: dict, tensor_names: set[str], reader: Any) -> dict[str, Any]:
    arch = meta["general.architecture"]
    if arch not in _ARCHITECTURES:
        raise GGUFError(f"{path}: unsupported architecture {arch!r}; supported: {', '.join(sorted(_ARCHITECTURES))}")

    def get(name: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{name}", default)

    hidden = int(_require(path, meta, f"{arch}.embedding_length"))
    n_heads, n_kv_heads, head_dim = _heads(path, meta, arch, hidden)
    sliding_window = get("attention.sliding_window")
    rope_theta = float(get("rope.freq_base", 10000.0))

    hf_arch, model_type = _ARCHITECTURES[arch]
    if arch == "llama" and sliding_window:
        hf_arch, model_type = _ARCHITECTURES["mistral"]
    n_layers = int(_require(path, meta, f"{arch}.block_count"))
    moe = _moe_config(path, meta, arch, hidden, n_layers, reader)
    if moe and arch == "llama":
        hf_arch, model_type = _MIXTRAL
    # Qwen-MoE files keep the experts' size apart; the dense size serves only dense layers.
    if moe and arch in ("qwen2moe", "qwen3moe"):
        ffn = int(get("feed_forward_length") or moe["moe_intermediate_size"])
    else:
        ffn = int(_require(path, meta, f"{arch}.feed_forward_length"))

    tokens = meta.get("tokenizer.ggml.tokens")
    vocab_size = get("vocab_size") or (len(tokens) if tokens else None)
    if vocab_size is None:
        raise GGUFError(f"{path}: cannot tell the vocabulary size (no {arch}.vocab_size and no tokenizer tokens)")

    eos_ids = _eos_token_ids(meta)
    config: dict[str, Any] = {
        "architectures": [hf_arch],
        "model_type": model_type,
        "vocab_size": int(vocab_size),
        "hidden_size": hidden,
        "intermediate_size": ffn,
        "num_hidden_layers": n_layers,
        "num_attention_heads": n_heads,
        "num_key_value_heads": int(n_kv_heads),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": rope_theta,
        "rope_scaling": _rope_scaling(path, meta, arch, head_dim, rope_theta, reader),
        "max_position_embeddings": int(get("context_length", 4096)),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": eos_ids[0] if len(eos_ids) == 1 else (eos_ids or None),
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
        "sliding_window": int(sliding_window) if sliding_window else None,
        # Qwen2 always has q/k/v biases; elsewhere the tensors say.
        "attention_bias": arch == "qwen2" or "blk.0.attn_q.bias" in tensor_names,
        "mlp_bias": False,
        **moe,
    }
    config.update(_family_fields(arch, model_type, meta, tensor_names, head_dim))
    return config


def _family_fields(arch: str, model_type: str, meta: dict, tensor_names: set[str], head_dim: int) -> dict[str, Any]:
    """The config fields one family's files imply and its transformers config spells out."""
    out: dict[str, Any] = {}
    if model_type == "qwen2_moe":
        out["qkv_bias"] = "blk.0.attn_q.bias" in tensor_names
    clamp = meta.get(f"{arch}.attention.clamp_kqv")
    if arch == "olmoe" and clamp:
        out["clip_qkv"] = float(clamp)
    if model_type == "qwen2":
        out["use_sliding_window"] = bool(meta.get(f"{arch}.attention.sliding_window"))
    if arch == "gemma3":
        # As llama.cpp runs these files: the attention scale is 1/sqrt(head_dim) (Gemma 3 27B,
        # whose query_pre_attn_scalar differs, is not told apart by the file).
        out.update(
            hidden_activation="gelu_pytorch_tanh",
            query_pre_attn_scalar=head_dim,
            sliding_window_pattern=_GEMMA3_SWA_PATTERN,
            rope_local_base_freq=_GEMMA3_LOCAL_ROPE_BASE,
            hidden_act="gelu_pytorch_tanh",
        )
    return out


def _heads(path: Path, meta: dict, arch: str, hidden: int) -> tuple[int, int, int]:
    """(attention heads, KV heads, head size)."""
    n_heads = int(_require(path, meta, f"{arch}.attention.head_count"))
    n_kv_heads = meta.get(f"{arch}.attention.head_count_kv", n_heads)
    if isinstance(n_kv_heads, list):  # some archs store one count per layer
        n_kv_heads = max(n_kv_heads)
    head_dim = meta.get(f"{arch}.attention.key_length")
    if head_dim is None and arch in _PERMUTED_QK_ARCHS:
        head_dim = meta.get(f"{arch}.rope.dimension_count")
    return n_heads, int(n_kv_heads), int(head_dim) if head_dim is not None else hidden // n_heads


def _moe_config(path: Path, meta: dict, arch: str, hidden: int, n_layers: int, reader: Any) -> dict[str, Any]:
    """The config's MoE fields from `{arch}.expert_*` and the expert tensors, whose shapes are
    checked against them here (a mismatch names the tensor); {} for a dense file."""
    experts = int(meta.get(f"{arch}.expert_count") or 0)
    if arch in _MOE_NORM_TOPK and arch != "llama" and not experts:
        raise GGUFError(f"{path}: {arch} is a mixture of experts but {arch}.expert_count is missing")
    if not experts:
        return {}
    used = int(meta.get(f"{arch}.expert_used_count") or 0)
    if not 1 <= used <= experts:
        raise GGUFError(
            f"{path}: {arch}.expert_used_count = {used} must be between 1 and {arch}.expert_count = {experts}"
        )
    if arch in ("qwen2moe", "qwen3moe"):
        inter = int(_require(path, meta, f"{arch}.expert_feed_forward_length"))
    else:
        inter = int(_require(path, meta, f"{arch}.feed_forward_length"))
    shared = int(meta.get(f"{arch}.expert_shared_feed_forward_length") or 0)
    by_name = {t.name: t for t in reader.tensors}
    want = {
        "ffn_gate_exps": (hidden, inter, experts),
        "ffn_up_exps": (hidden, inter, experts),
        "ffn_down_exps": (inter, hidden, experts),
    }
    dense_layers = [
        i for i in range(n_layers) if not _check_expert_layer(path, arch, i, by_name, want, experts, inter, hidden)
    ]
    if len(dense_layers) == n_layers:
        raise GGUFError(
            f"{path}: {arch}.expert_count = {experts} but the file has no expert tensors "
            "(blk.N.ffn_gate_exps / ffn_up_exps / ffn_down_exps.weight)"
        )
    norm = meta.get(f"{arch}.expert_weights_norm")
    return {
        "num_experts": experts,
        "num_local_experts": experts,
        "num_experts_per_tok": used,
        "moe_intermediate_size": inter,
        "shared_expert_intermediate_size": shared,
        "norm_topk_prob": _MOE_NORM_TOPK[arch] if norm is None else bool(norm),
        "decoder_sparse_step": 1,
        "mlp_only_layers": dense_layers,
    }


def _check_expert_layer(
    path: Path, arch: str, i: int, by_name: dict, want: dict, experts: int, inter: int, hidden: int
) -> bool:
    """Whether layer `i` is a sparse one (False: dense), its expert and router tensors checked."""
    found = [p for p in want if f"blk.{i}.{p}.weight" in by_name]
    if not found and f"blk.{i}.ffn_gate.0.weight" in by_name:  # one tensor per expert
        found = ["per-expert"]
        for e in range(experts):
            for p, shape in (("gate", (hidden, inter)), ("up", (hidden, inter)), ("down", (inter, hidden))):
                t = by_name.get(f"blk.{i}.ffn_{p}.{e}.weight")
                if t is None or tuple(t.shape) != shape:
                    raise GGUFError(
                        f"{path}: tensor blk.{i}.ffn_{p}.{e}.weight "
                        f"{'is missing' if t is None else f'has shape {tuple(t.shape)}'}; "
                        f"expected {shape} for {experts} experts of feed-forward length {inter}"
                    )
    for p in found if found != ["per-expert"] else []:
        t = by_name[f"blk.{i}.{p}.weight"]
        if tuple(t.shape) != want[p]:
            raise GGUFError(
                f"{path}: tensor blk.{i}.{p}.weight has shape {tuple(t.shape)}, expected "
                f"{want[p]} ({arch}.expert_count = {experts}, expert feed-forward length {inter})"
            )
    if found and found != ["per-expert"] and len(found) != 3:
        missing = sorted(set(want) - set(found))
        raise GGUFError(f"{path}: layer {i} has {', '.join(found)} but no {', '.join(missing)} tensor")
    if not found:
        return False
    router = by_name.get(f"blk.{i}.ffn_gate_inp.weight")
    if router is None or tuple(router.shape) != (hidden, experts):
        raise GGUFError(
            f"{path}: tensor blk.{i}.ffn_gate_inp.weight (the router) "
            f"{'is missing' if router is None else f'has shape {tuple(router.shape)}'}; "
            f"expected {(hidden, experts)}"
        )
    return True


def _eos_token_ids(meta: dict) -> list[int]:
    """EOS plus llama.cpp's end-of-turn / end-of-message tokens, which also end a generation."""
    ids: list[int] = []
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        value = meta.get(key)
        if value is not None and int(value) not in ids:
            ids.append(int(value))
    return ids


def _rope_scaling(path: Path, meta: dict, arch: str, head_dim: int, theta: float, reader: Any) -> dict | None:
    scaling_type = meta.get(f"{arch}.rope.scaling.type")
    factor = meta.get(f"{arch}.rope.scaling.factor")
    original = meta.get(f"{arch}.rope.scaling.original_context_length")
    rope_freqs = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if rope_freqs is not None:
        # Llama 3.x: llama.cpp stores the per-frequency divisors instead of the parameters.
        import gguf

        divisors = gguf.quants.dequantize(rope_freqs.data, rope_freqs.tensor_type).reshape(-1)
        return _llama3_scaling_from_divisors(path, divisors.astype(np.float64), head_dim, theta, original)
    if scaling_type in (None, "none") or not factor:
        return None
    scaling: dict[str, Any] = {"rope_type": str(scaling_type), "factor": float(factor)}
    if original:
        scaling["original_max_position_embeddings"] = int(original)
    if scaling_type == "yarn":
        for gguf_key, hf_key in (
            ("yarn_beta_fast", "beta_fast"),
            ("yarn_beta_slow", "beta_slow"),
            ("attn_factor", "attention_factor"),
        ):
            value = meta.get(f"{arch}.rope.scaling.{gguf_key}")
            if value is not None:
                scaling[hf_key] = float(value)
    return scaling


def _llama3_scaling_from_divisors(
    path: Path, divisors: np.ndarray, head_dim: int, theta: float, original: int | None
) -> dict[str, Any]:
    """Recover llama3 rope_scaling parameters from llama.cpp's rope_freqs tensor.

    The converter writes, per frequency, 1 (short wavelengths), `factor` (long ones) or, in between,
    1 / ((1 - s) / factor + s) with s = (orig / wavelen - low) / (high - low), i.e. s is linear in
    1 / wavelen. Fitting that line gives orig / (high - low) and -low / (high - low); the third
    unknown comes from the metadata's original context length or, failing that, low_freq_factor = 1
    (true of every released Llama 3 model).
    """
    factor = float(divisors.max())
    result: dict[str, Any] = {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": int(original) if original else 8192,
    }
    if factor <= 1.0:
        return result
    inv_freq = theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / inv_freq[: len(divisors)]
    mid = (divisors > 1.0 + 1e-4) & (divisors < factor - 1e-4)
    if mid.sum() < 2:
        logger.warning("%s: too few rope_freqs points to fit llama3 scaling; assuming Llama 3.1 defaults", path)
        return result
    smooth = (1.0 / divisors[mid] - 1.0 / factor) / (1.0 - 1.0 / factor)
    slope, intercept = np.polyfit(1.0 / wavelen[mid], smooth, 1)
    if original:
        span = original / slope
        low = -intercept * span
    else:
        low = 1.0
        span = -1.0 / intercept
        original = slope * span
    result.update(
        low_freq_factor=round(float(low), 4),
        high_freq_factor=round(float(low + span), 4),
        original_max_position_embeddings=int(round(float(original))),
    )
    return result
