"""An adapter's low-rank pairs on our (possibly fused) linear layers, whatever file they came
from (a PEFT folder: peft.py; a llama.cpp GGUF LoRA file: gguf_lora.py): each targeted HF module
mapped to our layer, every shape checked against the base, fused parts stacked, the scale
folded into B once."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch


@dataclass
class AdapterWeights:
    """One adapter's low-rank pairs, keyed by our linear layer's module name, float32 on the CPU;
    B already carries the scale."""

    path: Path
    rank: int
    alpha: float
    pairs: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in self.pairs.values())


def target_of(folder: Path, model, hf: str) -> tuple[str, int | None]:
    """(our linear layer's module name, its fused part or None) for the HF module `hf` an
    adapter targets, or a ValueError when LoRA cannot apply there."""
    leaf = hf.rsplit(".", 1)[-1]
    if leaf in ("lm_head", "embed_tokens"):
        raise ValueError(
            f"adapter {str(folder)!r} targets {leaf}; LoRA on {leaf} is not supported "
            "(target the attention and MLP projections)"
        )
    mapped = model.map_weight_name(hf + ".weight")
    if mapped is None:
        raise ValueError(f"adapter {str(folder)!r}: {hf} has no place in the base model")
    ours, shard = mapped
    mod_name = ours.rsplit(".", 1)[0]
    try:
        module = model.get_submodule(mod_name)
    except AttributeError:
        module = None
    if module is None or getattr(module, "lora", None) is None:
        raise ValueError(
            f"adapter {str(folder)!r} targets {hf}, which is not a projection LoRA can "
            "apply to in this model (q/k/v/o and gate/up/down of dense layers)"
        )
    return mod_name, shard


def stack_adapter(
    folder: Path, model, parts: dict[str, dict[int | None, list]], rank: int, alpha: float, scale: float, max_rank: int
) -> AdapterWeights:
    """The adapter's pairs on our layers from `parts` (our module -> fused part -> [A, B]), B
    times `scale`."""
    if not parts:
        raise ValueError(f"adapter {str(folder)!r} holds no LoRA weights")
    out = AdapterWeights(folder, rank, alpha)
    for mod_name, shards in parts.items():
        out.pairs[mod_name] = _stack(folder, model, mod_name, shards, scale, max_rank)
    return out


def _stack(
    folder: Path, model, mod_name: str, shards: dict, scale: float, max_rank: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's (A, B): its parts' A rows stacked, each part's scaled B in its own rows and
    columns (zero elsewhere), after checking each shape against the base layer."""
    module = model.get_submodule(mod_name)
    fused = None not in shards
    sizes = model.shard_sizes(mod_name + ".weight") if fused else [module.out_features]
    a_rows, b_blocks = [], []
    col = 0
    for shard in sorted(shards, key=lambda s: -1 if s is None else s):
        a, b = shards[shard]
        where = f"{mod_name}" + (f" part {shard}" if shard is not None else "")
        if a is None or b is None:
            raise ValueError(f"adapter {str(folder)!r}: {where} has lora_{'A' if a is None else 'B'} missing")
        out_rows = sizes[0 if shard is None else shard]
        if a.dim() != 2 or a.shape[1] != module.in_features:
            raise ValueError(
                f"adapter {str(folder)!r}: {where} lora_A has shape {tuple(a.shape)}, but the base "
                f"layer takes {module.in_features} inputs: the adapter is for another base model"
            )
        if b.dim() != 2 or b.shape != (out_rows, a.shape[0]):
            raise ValueError(
                f"adapter {str(folder)!r}: {where} lora_B has shape {tuple(b.shape)}, expected "
                f"{(out_rows, a.shape[0])} for this base model: the adapter is for another base model"
            )
        if a.shape[0] > max_rank:
            raise ValueError(f"adapter {str(folder)!r}: {where} has rank {a.shape[0]}, above max_lora_rank={max_rank}")
        start = 0 if shard is None else sum(sizes[:shard])
        a_rows.append(a)
        b_blocks.append((start, out_rows, col, b * scale))
        col += a.shape[0]
    big_a = torch.cat(a_rows, 0)
    big_b = torch.zeros(module.out_features, col)
    for start, rows, c0, b in b_blocks:
        big_b[start : start + rows, c0 : c0 + b.shape[1]] = b
    return big_a, big_b
