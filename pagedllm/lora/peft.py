"""A PEFT LoRA folder (adapter_config.json + adapter_model.safetensors) read for one base model
(llama.cpp's GGUF LoRA files come in through gguf_lora.py onto the same pairs, pairs.py;
`load_adapter` takes either).

Each targeted projection becomes one pair (A [r', in], B [out, r']) on our (possibly fused) layer:
a fused q|k|v or gate|up layer stacks its parts' A rows and places each part's B block-diagonally
(its output rows, its A's columns), so one grouped product serves the whole fused layer. The
scale (lora_alpha / r, or / sqrt(r) with use_rslora) is folded into B once, here.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

from .gguf_lora import load_gguf_adapter
from .pairs import AdapterWeights, stack_adapter, target_of

logger = logging.getLogger(__name__)

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
# Config features whose effect this loader does not reproduce: refused, never ignored.
_UNSUPPORTED = {
    "use_dora": "DoRA (use_dora)",
    "modules_to_save": "modules_to_save (fully trained copies of layers such as lm_head or embed_tokens)",
    "layers_pattern": "layers_pattern",
    "rank_pattern": "rank_pattern (per-layer ranks)",
    "alpha_pattern": "alpha_pattern (per-layer alphas)",
    "fan_in_fan_out": "fan_in_fan_out (Conv1D-style transposed weights)",
    "use_qalora": "QALoRA",
    "lora_bias": "lora_bias (a bias on lora_B)",
}


def read_config(path: str | Path) -> dict:
    """The adapter's config, checked: a LoRA, with no feature this loader would silently drop."""
    folder = Path(path)
    if not folder.is_dir():
        raise ValueError(
            f"LoRA adapter {str(path)!r} is not a folder or a file; give a PEFT adapter folder "
            f"holding {CONFIG} and {WEIGHTS}, or a llama.cpp GGUF LoRA (.gguf)"
        )
    cfg_file = folder / CONFIG
    if not cfg_file.is_file():
        raise ValueError(f"LoRA adapter folder {str(folder)!r} has no {CONFIG}: is it a PEFT adapter?")
    try:
        cfg = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{cfg_file}: not valid JSON ({e})") from None
    kind = cfg.get("peft_type", "LORA")
    if str(kind).upper() != "LORA":
        raise ValueError(f"adapter {str(folder)!r} is a {kind} adapter; only LoRA adapters are supported")
    for key, what in _UNSUPPORTED.items():
        if cfg.get(key):
            raise ValueError(
                f"adapter {str(folder)!r} uses {what}, which pagedllm does not support; "
                "merge it into the base model (peft's merge_and_unload) instead"
            )
    if cfg.get("bias", "none") != "none":
        raise ValueError(f"adapter {str(folder)!r} trains biases (bias={cfg['bias']!r}); only bias='none' is supported")
    if not isinstance(cfg.get("r"), int) or cfg["r"] < 1:
        raise ValueError(f"{cfg_file}: 'r' must be a positive integer, got {cfg.get('r')!r}")
    return cfg


def scale_of(cfg: dict) -> float:
    r, alpha = cfg["r"], cfg.get("lora_alpha", 8)
    return alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r


def load_adapter(path: str | Path, model, max_rank: int) -> AdapterWeights:
    """Read the adapter at `path` (a PEFT folder, or a llama.cpp GGUF LoRA file: gguf_lora.py)
    for `model` (a pagedllm model: its `map_weight_name`, `shard_sizes`, and linear layers with
    `lora` slots); every shape is checked against the base."""
    from safetensors.torch import load_file

    if Path(path).is_file():  # the one place that tells the two formats apart
        return load_gguf_adapter(path, model, max_rank)
    cfg = read_config(path)
    folder = Path(path)
    r = cfg["r"]
    if r > max_rank:
        raise ValueError(
            f"adapter {str(folder)!r} has rank {r}, above max_lora_rank={max_rank}; "
            f"start the engine with max_lora_rank >= {r}"
        )
    wfile = folder / WEIGHTS
    if not wfile.is_file():
        extra = (
            " (adapter_model.bin is not read: save it with safe_serialization)"
            if (folder / "adapter_model.bin").exists()
            else ""
        )
        raise ValueError(f"LoRA adapter folder {str(folder)!r} has no {WEIGHTS}{extra}")
    tensors = load_file(str(wfile))
    parts: dict[str, dict[int | None, list]] = {}  # our module -> shard -> [A, B]
    for key, t in tensors.items():
        if key.endswith(".lora_A.weight"):
            which, base = 0, key[: -len(".lora_A.weight")]
        elif key.endswith(".lora_B.weight"):
            which, base = 1, key[: -len(".lora_B.weight")]
        else:
            raise ValueError(
                f"adapter {str(folder)!r}: tensor {key!r} is not a LoRA A/B weight "
                "(embedding LoRA, DoRA magnitudes and saved modules are not supported)"
            )
        mod_name, shard = target_of(folder, model, base.removeprefix("base_model.model."))
        parts.setdefault(mod_name, {}).setdefault(shard, [None, None])[which] = t.float()
    return stack_adapter(folder, model, parts, r, cfg.get("lora_alpha", 8), scale_of(cfg), max_rank)
