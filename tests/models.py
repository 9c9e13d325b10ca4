"""Random-weight checkpoints built with transformers and saved like a user's model folder."""

from __future__ import annotations

from pathlib import Path

import torch

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3")
# Families whose sliding window (48) is shorter than the longer test prompts.
SLIDING = {"mistral", "gemma2", "gemma3", "mixtral"}
# Mixtures of experts (8 experts, top 2), tested apart (tests/test_moe.py).
MOE_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")
_MOE = dict(num_experts_per_tok=2, num_experts=8)


def _longrope_factors(n: int, seed: int) -> tuple[list[float], list[float]]:
    g = torch.Generator().manual_seed(seed)
    return ((1 + torch.rand(n, generator=g)).tolist(), (1 + 8 * torch.rand(n, generator=g)).tolist())


def build_checkpoint(
    family: str, out: Path, tokenizer, vocab_size: int, seed: int = 0, intermediate_size: int = 160, **overrides
) -> Path:
    """Save a small random model of `family` with `tokenizer` into `out`; returns `out`.
    `overrides` replace config values (phi3: `original_max_position_embeddings`)."""
    model = build_model(
        family, vocab_size, tokenizer.bos_token_id, tokenizer.eos_token_id, seed, intermediate_size, **overrides
    )
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def build_model(
    family: str,
    vocab_size: int,
    bos_token_id: int | None,
    eos_token_id: int | None,
    seed: int = 0,
    intermediate_size: int = 160,
    **overrides,
):
    """A small random float32 transformers model of `family` (MoE families: `expert_size`
    overrides the experts' intermediate size)."""
    import transformers as tf

    expert = overrides.pop("expert_size", None)

    common = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=intermediate_size,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        rms_norm_eps=1e-5,
        # Wider init than the default 0.02 keeps greedy choices away from near-ties.
        initializer_range=0.15,
        tie_word_embeddings=False,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
    )
    if family == "llama":
        cfg = tf.LlamaConfig(
            **common,
            rope_theta=50000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 128,
            },
        )
    elif family == "mistral":
        cfg = tf.MistralConfig(**common, sliding_window=48)
    elif family == "qwen2":
        cfg = tf.Qwen2Config(**{**common, "tie_word_embeddings": True})
    elif family == "qwen3":  # six query heads over two KV heads, head_dim apart from hidden / heads
        cfg = tf.Qwen3Config(**{**common, "num_attention_heads": 6, "head_dim": 16, "tie_word_embeddings": True})
    elif family == "phi3":  # LongRoPE; short factors while the context stays within the original length
        short, long = _longrope_factors(8, seed)
        orig = overrides.pop("original_max_position_embeddings", common["max_position_embeddings"])
        cfg = tf.Phi3Config(
            **common,
            original_max_position_embeddings=orig,
            rope_parameters={
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "short_factor": short,
                "long_factor": long,
            },
        )
    elif family == "gemma2":
        cfg = tf.Gemma2Config(
            **common,
            head_dim=16,
            query_pre_attn_scalar=24,
            sliding_window=48,
            attn_logit_softcapping=5.0,
            final_logit_softcapping=10.0,
        )
    elif family == "gemma3":  # global layer 2 of 4, linear rope scaling on it only, q/k norms
        cfg = tf.Gemma3TextConfig(
            **{**common, "hidden_size": 96, "num_hidden_layers": 4, "num_attention_heads": 6, "num_key_value_heads": 3},
            head_dim=16,
            query_pre_attn_scalar=20,
            sliding_window=48,
            layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
            },
        )
    elif family == "mixtral":  # sliding window as Mistral's; experts as wide as the config's MLP
        cfg = tf.MixtralConfig(
            **{**common, "intermediate_size": expert or 96},
            sliding_window=48,
            num_local_experts=8,
            num_experts_per_tok=2,
        )
    elif family == "qwen2_moe":  # a shared expert beside the routed ones; no renormalization
        cfg = tf.Qwen2MoeConfig(
            **common,
            **_MOE,
            moe_intermediate_size=expert or 48,
            shared_expert_intermediate_size=96,
            norm_topk_prob=False,
            decoder_sparse_step=1,
            mlp_only_layers=[],
        )
    elif family == "qwen3_moe":  # layer 1 keeps a dense MLP; renormalized top-k
        cfg = tf.Qwen3MoeConfig(
            **{**common, "num_attention_heads": 6},
            **_MOE,
            head_dim=16,
            moe_intermediate_size=expert or 48,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[1],
        )
    elif family == "olmoe":  # q/k norms over the whole projections, clamped q/k/v
        cfg = tf.OlmoeConfig(
            **{**common, "intermediate_size": expert or 48}, **_MOE, norm_topk_prob=False, clip_qkv=4.0
        )
    else:
        raise ValueError(family)
    for k, v in overrides.items():
        setattr(cfg, k, v)
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    if family in (
        "qwen3",
        "gemma2",
        "gemma3",
        "qwen3_moe",
        "olmoe",
    ):  # random norms, so a misread (1 + w) or q/k norm shows
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.normal_(0, 0.3)
    if family in ("qwen2", "qwen2_moe"):  # random biases, so a bias that is dropped cannot go unnoticed
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    return model


def reference_family(
    family: str, out: Path, tokenizer, prompt_lens: list[int], new_tokens: int, seed: int, **overrides
):
    """(checkpoint path, transformers model, random prompts, transformers' greedy tokens) for a
    random-weight `family` model: the float32 reference the engine's outputs are held to.
    `overrides`: config values, as build_checkpoint takes them."""
    import transformers as tf

    path = build_checkpoint(family, out, tokenizer, len(tokenizer), **overrides)
    ref = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, len(tokenizer), (n,), generator=g).tolist() for n in prompt_lens]
    with torch.no_grad():
        want = [
            ref.generate(
                torch.tensor([p]), max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0
            )[0, len(p) :].tolist()
            for p in prompts
        ]
    return path, ref, prompts, want


# A chat template in Gemma 3's turn format whose content parts may hold images: it writes the
# processor's image marker where an image part is, as the real one does (the test tokenizer is
# SmolLM2's, whose own template takes text only).
VLM_CHAT_TEMPLATE = (
    "{% for m in messages %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
    "{% if p['type'] == 'image' %}MARK{% elif p['type'] == 'text' %}{{ p['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
# Each family's image marker in a prompt (what its processor expands).
VLM_MARKER = {
    "gemma3": "<start_of_image>",
    "idefics3": "<image>",
    "qwen2_5_vl": "<|vision_start|><|image_pad|><|vision_end|>",
}


def build_vlm_checkpoint(family: str, out: Path, tokenizer, seed: int = 0, text_overrides: dict | None = None) -> Path:
    """A small random float32 vision-language model of `family` saved as a user's folder: the
    weights, config.json, and the processor (transformers' image processor and `tokenizer` with
    the family's image tokens added), so AutoProcessor reads it back as it reads the real one.
    `text_overrides`: Gemma 3's language model config values to replace."""
    import transformers as tf

    if family == "idefics3":
        return _build_idefics3(out, tokenizer, seed)
    if family == "qwen2_5_vl":
        return _build_qwen2_5_vl(out, tokenizer, seed)
    if family != "gemma3":
        raise ValueError(family)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(out / "_tok")
    marks = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"}
    tok = tf.AutoTokenizer.from_pretrained(out / "_tok", extra_special_tokens=marks)
    tok.add_special_tokens({"additional_special_tokens": list(marks.values())})
    tok = tf.AutoTokenizer.from_pretrained(_resave(tok, out / "_tok"), extra_special_tokens=marks)
    proc = tf.Gemma3Processor(
        image_processor=tf.Gemma3ImageProcessor(size={"height": 112, "width": 112}),
        tokenizer=tok,
        image_seq_length=16,
        chat_template=VLM_CHAT_TEMPLATE.replace("MARK", VLM_MARKER["gemma3"]),
    )
    proc.save_pretrained(out)
    ids = {k: tok.convert_tokens_to_ids(v) for k, v in marks.items()}
    text = dict(
        vocab_size=len(tok),
        hidden_size=96,
        intermediate_size=160,
        num_hidden_layers=4,
        num_attention_heads=6,
        num_key_value_heads=3,
        head_dim=16,
        query_pre_attn_scalar=20,
        sliding_window=48,
        max_position_embeddings=1024,
        rms_norm_eps=1e-5,
        initializer_range=0.15,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        },
    )
    text.update(text_overrides or {})
    # 112 px at 14 px patches: 8 x 8 patches, pooled 2 x 2 into 16 image tokens.
    vision = dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=112, patch_size=14
    )
    cfg = tf.Gemma3Config(
        text_config=text,
        vision_config=vision,
        mm_tokens_per_image=16,
        boi_token_index=ids["boi_token"],
        eoi_token_index=ids["eoi_token"],
        image_token_index=ids["image_token"],
        initializer_range=0.15,
    )
    torch.manual_seed(seed)
    model = tf.Gemma3ForConditionalGeneration(cfg).eval()
    with torch.no_grad():  # random norms and a projector of some size, so a misread one shows
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") and "vision_tower" not in name:
                p.normal_(0, 0.3)
            elif name.endswith("mm_input_projection_weight"):
                p.normal_(0, 0.3)
    model.save_pretrained(out)
    return out


def _resave(tok, path: Path) -> Path:
    tok.save_pretrained(path)
    return path


def _build_idefics3(out: Path, tokenizer, seed: int) -> Path:
    """SmolVLM's shape, small: a Llama language model, 112 px tiles of 14 px patches (64 patches,
    pixel-shuffled by 2 into 16 tokens a tile), images up to 224 px split into 2 x 2 tiles and
    a global one."""
    import transformers as tf

    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(out / "_tok")
    tok = tf.AutoTokenizer.from_pretrained(out / "_tok")
    tok.add_special_tokens(
        {"additional_special_tokens": ["<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>"]}
    )
    tok = tf.AutoTokenizer.from_pretrained(_resave(tok, out / "_tok"))
    ip = tf.Idefics3ImageProcessor(size={"longest_edge": 224}, max_image_size={"longest_edge": 112})
    proc = tf.Idefics3Processor(
        image_processor=ip,
        tokenizer=tok,
        image_seq_len=16,
        chat_template=VLM_CHAT_TEMPLATE.replace("MARK", VLM_MARKER["idefics3"]),
    )
    proc.save_pretrained(out)
    text = dict(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        rms_norm_eps=1e-5,
        initializer_range=0.15,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
    )
    vision = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=112,
        patch_size=14,
        initializer_range=0.15,
    )
    cfg = tf.Idefics3Config(
        text_config=text,
        vision_config=vision,
        scale_factor=2,
        image_token_id=tok.convert_tokens_to_ids("<image>"),
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = tf.Idefics3ForConditionalGeneration(cfg).eval()
    with torch.no_grad():  # a connector of some size, so a misread one shows
        for name, p in model.named_parameters():
            if "connector" in name:
                p.normal_(0, 0.3)
    model.save_pretrained(out)
    return out


def _build_qwen2_5_vl(out: Path, tokenizer, seed: int) -> Path:
    """Qwen2.5-VL's shape, small: a Qwen2 language model with M-RoPE (sections 2, 3, 3 of 8
    frequencies), a vision transformer of 3 blocks (window attention over 56 px windows, block 1
    full attention) over 14 px patches merged 2 x 2, images resized within 56..112 px a side
    (4 to 16 tokens each, by their size). The folder holds what a real one does: weights,
    config.json, preprocessor_config.json and the tokenizer with the vision tokens and the chat
    template (no video processor: transformers builds that only with torchvision)."""
    import json

    import transformers as tf

    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(out / "_tok")
    tok = tf.AutoTokenizer.from_pretrained(out / "_tok")
    marks = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
    tok.add_special_tokens({"additional_special_tokens": marks})
    tok.chat_template = VLM_CHAT_TEMPLATE.replace("MARK", VLM_MARKER["qwen2_5_vl"])
    tok = tf.AutoTokenizer.from_pretrained(_resave(tok, out / "_tok"))
    tok.save_pretrained(out)
    ip = tf.Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=112 * 112)
    ip.save_pretrained(out)
    pre = json.loads((out / "preprocessor_config.json").read_text())
    pre.update(processor_class="Qwen2_5_VLProcessor", image_processor_type="Qwen2VLImageProcessor")
    (out / "preprocessor_config.json").write_text(json.dumps(pre, indent=2))
    ids = {m: tok.convert_tokens_to_ids(m) for m in marks}
    text = dict(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        rms_norm_eps=1e-5,
        initializer_range=0.15,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
    )
    vision = dict(
        depth=3,
        hidden_size=32,
        intermediate_size=64,
        num_heads=2,
        patch_size=14,
        spatial_merge_size=2,
        temporal_patch_size=2,
        window_size=56,
        fullatt_block_indexes=[1],
        out_hidden_size=64,
        initializer_range=0.15,
    )
    cfg = tf.Qwen2_5_VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = tf.Qwen2_5_VLForConditionalGeneration(cfg).eval()
    with torch.no_grad():  # random q/k/v biases and merger, so a dropped or misread one shows
        for name, p in model.named_parameters():
            if name.endswith(("q_proj.bias", "k_proj.bias", "v_proj.bias")) or "merger" in name:
                p.normal_(0, 0.3)
    model.save_pretrained(out)
    return out
