"""Gemma 3 with images (`Gemma3ForConditionalGeneration`): Gemma 3's language model, a SigLIP
vision tower and Gemma 3's projector (average pool to `mm_tokens_per_image`, RMSNorm, matmul).

The language model is the text family's (gemma3.py), reading `model.language_model.*`. The
tower and projector are transformers' own modules (SiglipVisionModel,
Gemma3MultiModalProjector), built from the checkpoint's vision config at load: they run once
per image (pagedllm/multimodal), outside the paged text path, so there is nothing of ours to
gain by rewriting them. They are kept beside the text model, not registered as its children:
the loader's meta-device build and materialisation are the text model's.

What the engine asks of a vision-language family: `encode_images(pixels)` (one embedding
matrix [placeholder tokens, hidden] per image) and `bidirectional_images` (image tokens attend
to each other both ways, as the reference's token_type_ids mask does: the scheduler then
never ends a prefill chunk inside an image).
"""

from __future__ import annotations

import logging

import torch

from ..config import ModelConfig
from .gemma3 import Gemma3ForCausalLM

logger = logging.getLogger(__name__)

_VISION_PREFIXES = ("model.vision_tower.", "vision_tower.")
_PROJECTOR_PREFIXES = ("model.multi_modal_projector.", "multi_modal_projector.")


class Gemma3ForConditionalGeneration(Gemma3ForCausalLM):
    pipeline_stages = False  # the image tower feeds the first stage's embeddings
    vision = True
    bidirectional_images = True  # token_type_ids: each image's tokens attend to the whole image
    image_layout = "runs"  # one run of placeholders per image (multimodal/processor.py)

    def __init__(self, cfg: ModelConfig, max_positions: int, tp=None) -> None:
        super().__init__(cfg, max_positions, tp)
        self.image_token_id = int(cfg.vision["image_token_index"])
        self.__dict__["_vision"] = None  # (tower, projector) once loaded; not child modules

    def map_weight_name(self, name: str) -> tuple[str, int | None] | None:
        # transformers saves the language model as language_model.model.* (or model.language_model.*)
        for old in ("model.language_model.", "language_model.model."):
            if name.startswith(old):
                return super().map_weight_name("model." + name[len(old) :])
        if name == "language_model.lm_head.weight":
            return super().map_weight_name("lm_head.weight")
        return super().map_weight_name(name)

    def load_weights(self, weights, dtype: torch.dtype = torch.float32) -> None:
        tower, projector = {}, {}

        def text_only():
            for name, t in weights:
                if name.startswith(_VISION_PREFIXES):
                    key = name.split("vision_tower.", 1)[1]
                    # SigLIP's pooling head is left out: Gemma 3 reads the patches
                    if not key.removeprefix("vision_model.").startswith("head."):
                        tower[key] = t
                elif name.startswith(_PROJECTOR_PREFIXES):
                    projector[name.split("multi_modal_projector.", 1)[1]] = t
                else:
                    yield name, t

        super().load_weights(text_only(), dtype)
        self._build_vision(tower, projector, dtype)

    def _build_vision(self, tower_sd: dict, proj_sd: dict, dtype: torch.dtype) -> None:
        import transformers as tf

        device = self.norm.weight.device
        full = tf.Gemma3Config(**{k: v for k, v in self.config.vision.items() if k != "architectures"})
        vcfg = full.vision_config
        vcfg.vision_use_head = False
        with torch.device("meta"):
            tower = tf.SiglipVisionModel(vcfg)
            projector = tf.models.gemma3.modeling_gemma3.Gemma3MultiModalProjector(full)
        tower_sd = _tower_layout(tower_sd, set(tower.state_dict()))
        for mod, sd, what in ((tower, tower_sd, "vision tower"), (projector, proj_sd, "projector")):
            sd = {k: v.to(device=device, dtype=dtype) for k, v in sd.items()}
            try:
                missing, unexpected = mod.load_state_dict(sd, strict=False, assign=True)
            except RuntimeError as e:  # torch's "size mismatch for <name>: ..." lines
                raise ValueError(
                    f"checkpoint's {what} does not fit its config: {str(e).split(':', 1)[-1].strip()}"
                ) from None
            if missing or unexpected:
                raise ValueError(
                    f"checkpoint's {what} does not fit {self.config.architecture}: missing "
                    f"{missing[:4]}, unexpected {unexpected[:4]}"
                )
        emb = tower.embeddings  # its one buffer is not in the checkpoint
        emb.position_ids = torch.arange(emb.num_positions, device=device).expand((1, -1))
        self.__dict__["_vision"] = (tower.eval(), projector.eval())
        logger.info(
            "vision tower: SigLIP %d layers, %d px images, %d tokens an image",
            vcfg.num_hidden_layers,
            vcfg.image_size,
            full.mm_tokens_per_image,
        )

    @torch.inference_mode()
    def encode_images(self, pixels: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
        """One [mm_tokens_per_image, hidden] matrix per image (its processor tensors), in the
        compute dtype: the tower and projector over all of them at once."""
        if self._vision is None:
            raise RuntimeError("internal: the vision tower is not loaded")
        tower, projector = self._vision
        dtype = self.norm.weight.dtype
        pv = torch.cat([p["pixel_values"] for p in pixels]).to(self.norm.weight.device, dtype)
        feats = projector(tower(pixel_values=pv).last_hidden_state)
        return list(feats.to(dtype).unbind(0))


def _tower_layout(sd: dict, keys: set[str]) -> dict:
    """The tower's weights under the installed transformers' SigLIP names: the Hub's files (and
    llama.cpp's mmproj, read back) say `vision_model.encoder...`, which transformers 5 loads
    into a SiglipVisionModel that has no `vision_model` level (it renames on load); 4.x keeps it."""
    out = {}
    for k, v in sd.items():
        if k not in keys:
            if k.startswith("vision_model.") and k[len("vision_model.") :] in keys:
                k = k[len("vision_model.") :]
            elif "vision_model." + k in keys:
                k = "vision_model." + k
        out[k] = v
    return out
