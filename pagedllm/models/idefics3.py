"""SmolVLM / Idefics3 (`Idefics3ForConditionalGeneration`): a Llama language model, a SigLIP-like
vision transformer over each image's tiles, and the connector (pixel shuffle, then a linear
projection).

The processor splits an image into tiles plus a downscaled global image; each tile is one run of
`image_seq_len` placeholder tokens, with row/column markers (text) between the runs
(multimodal/processor.py, layout "tiles"). Attention over image tokens is causal, as the
reference's: a prefill chunk may end anywhere in an image.

The language model is the Llama family's, reading `model.text_model.*`; the vision transformer
and connector are transformers' own modules (Idefics3VisionTransformer, Idefics3Connector),
built at load beside the text model as gemma3_vl.py does.
"""

from __future__ import annotations

import logging

import torch

from ..config import ModelConfig
from .llama import LlamaForCausalLM

logger = logging.getLogger(__name__)


class Idefics3ForConditionalGeneration(LlamaForCausalLM):
    pipeline_stages = False  # the image tower feeds the first stage's embeddings
    vision = True
    bidirectional_images = False
    image_layout = "tiles"

    def __init__(self, cfg: ModelConfig, max_positions: int, tp=None) -> None:
        super().__init__(cfg, max_positions, tp)
        self.image_token_id = int(cfg.vision["image_token_id"])
        self.__dict__["_vision"] = None  # (vision transformer, connector) once loaded

    def map_weight_name(self, name: str) -> tuple[str, int | None] | None:
        if name.startswith("model.text_model."):
            name = "model." + name[len("model.text_model.") :]
        return super().map_weight_name(name)

    def load_weights(self, weights, dtype: torch.dtype = torch.float32) -> None:
        tower, connector = {}, {}

        def text_only():
            for name, t in weights:
                if name.startswith("model.vision_model."):
                    tower[name[len("model.vision_model.") :]] = t
                elif name.startswith("model.connector."):
                    connector[name[len("model.connector.") :]] = t
                else:
                    yield name, t

        super().load_weights(text_only(), dtype)
        self._build_vision(tower, connector, dtype)

    def _build_vision(self, tower_sd: dict, conn_sd: dict, dtype: torch.dtype) -> None:
        import transformers as tf
        from transformers.models.idefics3 import modeling_idefics3 as m

        device = self.norm.weight.device
        full = tf.Idefics3Config(**{k: v for k, v in self.config.vision.items() if k != "architectures"})
        with torch.device("meta"):
            tower = m.Idefics3VisionTransformer(full.vision_config)
            connector = m.Idefics3Connector(full)
        for mod, sd, what in ((tower, tower_sd, "vision transformer"), (connector, conn_sd, "connector")):
            sd = {k: v.to(device=device, dtype=dtype) for k, v in sd.items()}
            missing, unexpected = mod.load_state_dict(sd, strict=False, assign=True)
            if missing or unexpected:
                raise ValueError(
                    f"checkpoint's {what} does not fit {self.config.architecture}: missing "
                    f"{missing[:4]}, unexpected {unexpected[:4]}"
                )
        self.__dict__["_vision"] = (tower.eval(), connector.eval(), full.vision_config.patch_size)
        logger.info(
            "vision transformer: %d layers, %d px tiles, pixel shuffle x%d",
            full.vision_config.num_hidden_layers,
            full.vision_config.image_size,
            full.scale_factor,
        )

    @torch.inference_mode()
    def encode_images(self, pixels: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
        """Per image (its tiles [1, tiles, 3, H, W] and pixel mask [1, tiles, H, W]): its tiles'
        embeddings, one [tokens per tile, hidden] block after another, as the reference's
        get_image_features computes them (the patch mask from the pixel mask)."""
        if self._vision is None:
            raise RuntimeError("internal: the vision transformer is not loaded")
        tower, connector, patch = self._vision
        dtype, device = self.norm.weight.dtype, self.norm.weight.device
        out = []
        for p in pixels:
            pv = p["pixel_values"][0].to(device, dtype)
            mask = p.get("pixel_attention_mask")
            if mask is None:
                mask = torch.ones(pv.shape[0], pv.shape[2], pv.shape[3], dtype=torch.bool, device=device)
            else:
                mask = mask[0].to(device)
            grid = mask.unfold(1, patch, patch).unfold(2, patch, patch)
            patch_mask = (grid.sum(dim=(-1, -2)) > 0).bool()
            hidden = tower(pixel_values=pv, patch_attention_mask=patch_mask).last_hidden_state
            feats = connector(hidden)
            out.append(feats.reshape(-1, feats.shape[-1]).to(dtype))
        return out
