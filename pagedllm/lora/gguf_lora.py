"""A llama.cpp GGUF LoRA adapter (written by its convert_lora_to_gguf.py) read onto the same
pairs a PEFT folder gives (pairs.py), for users whose bases and adapters are GGUF files.

The file is read by pagedllm/loading/gguf.py (HF module names, float32 A/B, q/k's B rows back in
HF order); here each pair is scaled as llama.cpp scales it (adapter.lora.alpha / the pair's rank;
by 1 when the file has no alpha) and checked against the base like a PEFT adapter's.
"""

from __future__ import annotations

from pathlib import Path

from ..loading.gguf import GGUFError, read_gguf_lora
from .pairs import AdapterWeights, stack_adapter, target_of

# GGUF architecture -> HF architectures llama.cpp converts to it beyond its own (Mistral's
# checkpoints are converted as "llama").
_ALSO = {"llama": {"MistralForCausalLM"}}


def load_gguf_adapter(path: str | Path, model, max_rank: int) -> AdapterWeights:
    path = Path(path)
    try:
        lora = read_gguf_lora(path)
    except GGUFError as e:
        raise ValueError(f"LoRA adapter {str(path)!r}: {e}") from None
    cfg = model.config
    ok = {lora.hf_architecture} | _ALSO.get(lora.arch, set())
    if cfg.architecture not in ok:
        raise ValueError(
            f"LoRA adapter {str(path)!r} is for a {lora.arch!r} model, but the base model is "
            f"{cfg.architecture}: the adapter is for another base model"
        )
    rank = max(a.shape[0] for a, _ in lora.pairs.values())
    if rank > max_rank:
        raise ValueError(
            f"adapter {str(path)!r} has rank {rank}, above max_lora_rank={max_rank}; "
            f"start the engine with max_lora_rank >= {rank}"
        )
    try:
        pairs = lora.hf_pairs(cfg.num_heads, cfg.num_kv_heads)
    except GGUFError as e:
        raise ValueError(str(e)) from None
    parts: dict[str, dict[int | None, list]] = {}
    for hf, (a, b) in pairs.items():
        mod_name, shard = target_of(path, model, hf)
        scale = lora.alpha / a.shape[0] if lora.alpha else 1.0
        parts.setdefault(mod_name, {})[shard] = [a, b * scale]
    return stack_adapter(path, model, parts, rank, lora.alpha, 1.0, max_rank)
