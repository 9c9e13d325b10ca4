"""llama.cpp's multimodal projector files (`--mmproj`): the vision tower and projector of a
vision-language model whose language model is a GGUF file of its own.

llama.cpp's converter (`convert_hf_to_gguf.py --mmproj`) writes them: general.architecture
"clip", the tower's shape and the image preprocessing under `clip.vision.*`, the projector's
kind under `clip.projector_type`, and tensors under llama.cpp's names (v.blk.N.attn_q, mm.*).
Here they are read back into what the family's vision-language config and checkpoint names
would be, so the model loads them as it loads a folder's (models/gemma3_vl.py). The names are
mapped with gguf's own table (gguf.get_tensor_name_map), the converter's inverse.

Supported: Gemma 3 (projector type "gemma3": SigLIP, average pool, RMSNorm, matmul).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .gguf.container import GGUFError, _check_tensors, _scan_file

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Projector:
    text_arch: str  # general.architecture of the language model's GGUF
    architecture: str  # the transformers class of the whole model
    model_type: str
    # The tokens its prompts use, under transformers' processor attribute names.
    tokens: dict[str, str]
    default_scale: int  # image patches per side / image tokens per side, when the file does not say


_PROJECTORS = {
    "gemma3": _Projector(
        "gemma3",
        "Gemma3ForConditionalGeneration",
        "gemma3",
        {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"},
        default_scale=4,
    ),
}
_VISION_PREFIX = "vision_tower.vision_model."  # the Hub's names for SigLIP's weights
_PROJECTOR_PREFIX = "multi_modal_projector."


class MMProjError(GGUFError):
    """An mmproj file that cannot be used with the given language model, and why."""


@dataclass
class MMProj:
    path: Path
    projector_type: str
    metadata: dict
    _file: Any = field(repr=False, default=None)

    @property
    def projector(self) -> _Projector:
        return _PROJECTORS[self.projector_type]

    def _meta(self, key: str) -> Any:
        if key not in self.metadata:
            raise MMProjError(f"{self.path}: metadata key {key!r} is missing; the mmproj file is incomplete")
        return self.metadata[key]

    def check_text_model(self, text_path: Path, text_arch: str, hidden_size: int) -> None:
        """Refuses a language model this projector does not feed, naming both files."""
        want = self.projector.text_arch
        if text_arch != want:
            raise MMProjError(
                f"the mmproj {self.path.name} is a {self.projector_type!r} projector, for a {want!r} "
                f"language model, but {text_path.name} is a {text_arch!r} model; give the mmproj "
                "file made from the same model as the text GGUF"
            )
        dim = int(self._meta("clip.vision.projection_dim"))
        if dim != hidden_size:
            raise MMProjError(
                f"the mmproj {self.path.name} projects images to {dim} dimensions but the language "
                f"model {text_path.name} has hidden size {hidden_size}: they come from different "
                "models; give the mmproj file made from the same model as the text GGUF"
            )

    def image_settings(self) -> dict[str, Any]:
        """What the image processor needs: square image size, normalisation mean and std."""
        size = int(self._meta("clip.vision.image_size"))
        mean = [float(x) for x in self._meta("clip.vision.image_mean")]
        std = [float(x) for x in self._meta("clip.vision.image_std")]
        return {"image_size": size, "image_mean": mean, "image_std": std}

    def vision_config(self) -> dict[str, Any]:
        """The SigLIP tower's transformers config, from clip.vision.*."""
        m = self._meta
        return {
            "model_type": "siglip_vision_model",
            "hidden_size": int(m("clip.vision.embedding_length")),
            "intermediate_size": int(m("clip.vision.feed_forward_length")),
            "num_hidden_layers": int(m("clip.vision.block_count")),
            "num_attention_heads": int(m("clip.vision.attention.head_count")),
            "image_size": int(m("clip.vision.image_size")),
            "patch_size": int(m("clip.vision.patch_size")),
            "layer_norm_eps": float(self.metadata.get("clip.vision.attention.layer_norm_epsilon", 1e-6)),
            # llama.cpp runs SigLIP with tanh-approximated GELU (clip.use_gelu), as transformers does.
            "hidden_act": "gelu_pytorch_tanh",
            "num_channels": 3,
            "vision_use_head": False,
        }

    def model_config(self, text_config: dict[str, Any], token_id) -> dict[str, Any]:
        """The whole model's transformers-style config: the text GGUF's config as its text_config,
        the tower's from this file, and the image tokens' ids (`token_id(str) -> int | None`, the
        text GGUF's vocabulary)."""
        vision = self.vision_config()
        patches = vision["image_size"] // vision["patch_size"]
        scale = int(self.metadata.get("clip.vision.projector.scale_factor") or self.projector.default_scale)
        if scale < 1 or patches % scale:
            raise MMProjError(
                f"{self.path}: {patches} patches a side do not pool by clip.vision.projector."
                f"scale_factor = {scale}; the file is corrupt"
            )
        ids = {}
        for attr, tok in self.projector.tokens.items():
            tid = token_id(tok)
            if tid is None:
                raise MMProjError(
                    f"the language model's vocabulary has no {tok} token, which "
                    f"{self.projector.architecture}'s image prompts need; is the text GGUF the "
                    f"language model of the model {self.path.name} was made from?"
                )
            ids[attr.replace("_token", "_token_index")] = tid
        text = {k: v for k, v in text_config.items() if k != "architectures"}
        return {
            "architectures": [self.projector.architecture],
            "model_type": self.projector.model_type,
            "text_config": text,
            "vision_config": vision,
            "mm_tokens_per_image": (patches // scale) ** 2,
            **ids,
            "tie_word_embeddings": text.get("tie_word_embeddings", False),
            **{k: text[k] for k in ("bos_token_id", "eos_token_id") if text.get(k) is not None},
        }

    def tensor_names(self) -> dict[str, str]:
        """File tensor name -> checkpoint name, every tensor of the file accounted for."""
        import gguf

        n_blocks = int(self._meta("clip.vision.block_count"))
        tmap = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, n_blocks)
        wanted = _checkpoint_names(self.vision_config(), n_blocks)
        by_file = {}
        for hf in wanted:
            base, suffix = (
                (hf[: -len(".weight")], ".weight")
                if hf.endswith(".weight")
                else (hf[: -len(".bias")], ".bias")
                if hf.endswith(".bias")
                else (hf, "")
            )
            if base.endswith("_weight"):  # Gemma 3's projection is a bare parameter, written as .weight
                base, suffix = base[: -len("_weight")], ".weight"
            name = tmap.get_name(base)
            if name is not None:
                by_file[name + suffix] = hf
        present = {t.name for t in self._file.tensors}
        missing = sorted(set(by_file) - present)
        if missing:
            raise MMProjError(f"{self.path}: tensors {missing[:6]} are missing; the mmproj file is incomplete")
        extra = sorted(present - set(by_file))
        if extra:
            raise MMProjError(
                f"{self.path}: tensors {extra[:6]} have no place in a {self.projector_type!r} "
                "projector; the file is not one pagedllm can read"
            )
        return by_file

    def tensors(self, dtype: torch.dtype = torch.float32) -> Iterator[tuple[str, torch.Tensor]]:
        """(checkpoint name, float tensor in transformers' orientation), one at a time; the file
        is unmapped after the last (each tensor is a copy), so its pages are not held twice."""
        names = self.tensor_names()
        yield from self._read(names, dtype)
        try:
            self._file.mm.close()
        except BufferError:  # a view still alive somewhere: the mapping goes with it
            pass

    def _read(self, names: dict[str, str], dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
        import gguf

        for t in self._file.tensors:
            try:
                array = gguf.quants.dequantize(t.data, t.tensor_type)
            except (NotImplementedError, ValueError) as exc:
                raise MMProjError(f"{self.path}: cannot dequantize tensor {t.name}: {exc}") from exc
            array = np.array(array, dtype=np.float32).reshape(tuple(reversed([int(d) for d in t.shape])))
            if not np.isfinite(array).all():
                raise MMProjError(f"{self.path}: tensor {t.name} ({t.tensor_type.name}) holds NaN or inf values")
            hf = names[t.name]
            if hf.endswith("mm_soft_emb_norm.weight"):
                array = array - 1  # llama.cpp stores Gemma's RMSNorm as 1 + weight; transformers means weight
            yield hf, torch.from_numpy(array).to(dtype)

    def num_tensors(self) -> int:
        return len(self._file.tensors)


def _checkpoint_names(vision: dict[str, Any], n_blocks: int) -> list[str]:
    """The Hub checkpoint names of a SigLIP tower (no pooling head) and Gemma 3's projector."""
    names = [f"{_VISION_PREFIX}embeddings.patch_embedding.{s}" for s in ("weight", "bias")]
    names.append(f"{_VISION_PREFIX}embeddings.position_embedding.weight")
    parts = (
        "layer_norm1",
        "layer_norm2",
        "mlp.fc1",
        "mlp.fc2",
        "self_attn.q_proj",
        "self_attn.k_proj",
        "self_attn.v_proj",
        "self_attn.out_proj",
    )
    names += [
        f"{_VISION_PREFIX}encoder.layers.{i}.{p}.{s}"
        for i in range(n_blocks)
        for p in parts
        for s in ("weight", "bias")
    ]
    names += [f"{_VISION_PREFIX}post_layernorm.{s}" for s in ("weight", "bias")]
    names += [f"{_PROJECTOR_PREFIX}mm_input_projection_weight", f"{_PROJECTOR_PREFIX}mm_soft_emb_norm.weight"]
    return names


def read_mmproj(path: str | os.PathLike) -> MMProj:
    """Validate and open an mmproj file. Every problem is raised as MMProjError (a ValueError)."""
    import gguf

    path = Path(path)
    if not hasattr(gguf.MODEL_ARCH, "MMPROJ"):
        raise MMProjError(f"reading {path.name} needs a newer gguf package (pip install -U 'gguf>=0.17')")
    try:
        file = _scan_file(path)
    except GGUFError as e:
        raise MMProjError(f"mmproj: {e}") from None
    _check_tensors(path, file.tensors)
    meta = file.metadata
    arch, kind = meta.get("general.architecture"), meta.get("general.type")
    if arch != "clip" or kind not in (None, "mmproj"):
        raise MMProjError(
            f"{path}: general.architecture is {arch!r} (general.type {kind!r}), not an mmproj file "
            "('clip'); give llama.cpp's projector file (convert_hf_to_gguf.py --mmproj) as mmproj and "
            "the language model as the model"
        )
    if not meta.get("clip.has_vision_encoder", False):
        raise MMProjError(
            f"{path}: the mmproj file has no vision encoder (clip.has_vision_encoder); only "
            "image projectors are supported"
        )
    ptype = meta.get("clip.projector_type")
    if ptype not in _PROJECTORS:
        raise MMProjError(
            f"{path}: projector type {ptype!r} (clip.projector_type) is not supported; supported: "
            f"{', '.join(sorted(_PROJECTORS))} (for other families, use the model's Hugging Face folder)"
        )
    mm = MMProj(path, ptype, meta, file)
    mm.tensor_names()  # every tensor accounted for before any weight is read
    logger.info("opened mmproj %s: %s projector, %d tensors", path, ptype, len(file.tensors))
    return mm
