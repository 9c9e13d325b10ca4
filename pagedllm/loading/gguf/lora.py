"""llama.cpp LoRA adapter files (convert_lora_to_gguf.py): `read_gguf_lora`."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .arch import _ARCHITECTURES, _PERMUTED_QK_ARCHS, _hf_tensor_name, _undo_rope_permute
from .container import GGUFError, _check_tensors, _scan_file


_LORA_SUFFIXES = (".lora_a", ".lora_b")


@dataclass
class GGUFLoRA:
    """A llama.cpp LoRA adapter file (convert_lora_to_gguf.py): per HF module name (e.g.
    "model.layers.0.self_attn.q_proj"), its float32 (A [r, in], B [out, r]) as the file stores
    them; for `permuted_qk` architectures, q/k's B rows are still in llama.cpp's rope order."""

    path: Path
    arch: str
    alpha: float  # adapter.lora.alpha; llama.cpp scales each pair by alpha / its rank (0: by 1)
    pairs: dict[str, tuple[torch.Tensor, torch.Tensor]]

    @property
    def permuted_qk(self) -> bool:
        return self.arch in _PERMUTED_QK_ARCHS

    @property
    def hf_architecture(self) -> str | None:
        return _ARCHITECTURES[self.arch][0] if self.arch in _ARCHITECTURES else None

    def hf_pairs(self, n_heads: int, n_kv_heads: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """The pairs in HF order: q/k's B rows (their outputs) taken back out of llama.cpp's rope
        order, as the base's q/k weights are (`n_heads`, `n_kv_heads`: the base model's)."""
        if not self.permuted_qk:
            return dict(self.pairs)
        out = {}
        for name, (a, b) in self.pairs.items():
            heads = n_heads if name.endswith(".q_proj") else n_kv_heads if name.endswith(".k_proj") else None
            if heads is not None:
                if b.shape[0] % (2 * heads):
                    raise GGUFError(
                        f"{self.path}: {name} lora_b has {b.shape[0]} rows, which {heads} heads "
                        "cannot share: the adapter is for another base model"
                    )
                b = torch.from_numpy(_undo_rope_permute(b.numpy(), heads).copy())
            out[name] = (a, b)
        return out


def read_gguf_lora(path: str | os.PathLike) -> GGUFLoRA:
    """Validate and read a GGUF LoRA adapter. Every problem is raised as GGUFError."""
    import gguf

    path = Path(path)
    reader = _scan_file(path)
    try:
        _check_tensors(path, reader.tensors)
        meta = reader.metadata
        kind, adapter = meta.get("general.type"), meta.get("adapter.type")
        if kind != "adapter":
            raise GGUFError(
                f"{path}: general.type is {kind!r}, not 'adapter': this is a model file, not a "
                "LoRA adapter (give it as the model, or convert the adapter with llama.cpp's "
                "convert_lora_to_gguf.py)"
            )
        if adapter != "lora":
            raise GGUFError(f"{path}: adapter.type is {adapter!r}; only LoRA adapters ('lora') are supported")
        arch = meta.get("general.architecture")
        if not isinstance(arch, str):
            raise GGUFError(f"{path}: metadata has no general.architecture")
        alpha = meta.get("adapter.lora.alpha", 0.0)
        if not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
            raise GGUFError(f"{path}: adapter.lora.alpha is {alpha!r}, not a number")
        halves: dict[str, list] = {}
        for t in reader.tensors:
            base, suffix = t.name[:-7], t.name[-7:]
            if suffix not in _LORA_SUFFIXES:
                raise GGUFError(
                    f"{path}: tensor {t.name} is not a LoRA A/B weight (*.weight.lora_a / "
                    "*.weight.lora_b); this adapter holds weights pagedllm cannot apply"
                )
            hf = _hf_tensor_name(base, arch)
            if hf is None or not hf.endswith(".weight"):
                raise GGUFError(
                    f"{path}: tensor {t.name} targets {base}, which LoRA cannot apply to here "
                    "(q/k/v/o and gate/up/down of dense layers)"
                )
            if len(t.shape) != 2:
                raise GGUFError(f"{path}: tensor {t.name} has {len(t.shape)} dimensions, expected 2")
            try:
                array = gguf.quants.dequantize(t.data, t.tensor_type)
            except (NotImplementedError, ValueError) as exc:
                raise GGUFError(f"{path}: cannot dequantize tensor {t.name}: {exc}") from exc
            array = np.array(array, dtype=np.float32).reshape(int(t.shape[1]), int(t.shape[0]))
            if not np.isfinite(array).all():
                raise GGUFError(f"{path}: tensor {t.name} ({t.tensor_type.name}) holds NaN or inf values")
            halves.setdefault(hf[: -len(".weight")], [None, None])[_LORA_SUFFIXES.index(suffix)] = array
    finally:
        reader.mm.close()
    if not halves:
        raise GGUFError(f"{path}: the adapter holds no LoRA tensors")
    pairs = {}
    for name, (a, b) in halves.items():
        if a is None or b is None:
            raise GGUFError(f"{path}: {name} has lora_{'a' if a is None else 'b'} missing")
        if a.shape[0] != b.shape[1]:
            raise GGUFError(f"{path}: {name} has lora_a of rank {a.shape[0]} but lora_b of rank {b.shape[1]}")
        pairs[name] = (torch.from_numpy(a), torch.from_numpy(b))
    return GGUFLoRA(path, arch, float(alpha), pairs)
