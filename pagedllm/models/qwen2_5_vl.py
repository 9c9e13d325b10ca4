"""Qwen2.5-VL (`Qwen2_5_VLForConditionalGeneration`): a Qwen2 language model rotated by M-RoPE,
and a vision transformer over each image at its own resolution.

- The vision transformer: the processor resizes an image to a multiple of 28 px within its
  pixel limits and cuts it into 14 px patches (grid t, h, w: `image_grid_thw`); the blocks
  attend within windows of the merged grid, except the full-attention blocks at
  `fullatt_block_indexes`, with a 2D rotary over each patch's (row, column); the patch merger
  joins 2 x 2 patches into one token of the language model's width. It is transformers' own
  module (Qwen2_5_VisionTransformerPretrainedModel), built at load beside the text model as
  gemma3_vl.py does: it runs once per image, in the scheduled step, and its output is cached by
  the image's hash (pagedllm/multimodal).
- M-RoPE: a token has three positions (temporal, height, width). Text tokens have their place in
  the text three times; an image's tokens have (start, start + row, start + column), and the
  text after it goes on from the largest position + 1, so a prompt's positions run behind its
  token indices by `rope_delta` after an image. `rope_index` computes them per prompt, the
  engine keeps them with the prompt (MultiModalInput.rope_positions), and the runner gives
  every step's tokens theirs, generated tokens their index + delta (a recompute after
  preemption gets the same). Text-only requests rotate by their indices, as plain Qwen2 does.
  Only q/k rotation changes (models/rope.py: MRotaryEmbedding); the paged attention does not.
- Image attention in the language model is causal, as the reference's: prefill chunks may cut
  through an image (layout "patches": one run of placeholders per image).
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from ..config import ModelConfig
from .qwen2 import Qwen2ForCausalLM
from .rope import MRotaryEmbedding

logger = logging.getLogger(__name__)

_VISION_PREFIXES = ("model.visual.", "visual.")


class Qwen2_5_VLForConditionalGeneration(Qwen2ForCausalLM):
    pipeline_stages = False  # the image tower feeds the first stage's embeddings
    vision = True
    bidirectional_images = False
    image_layout = "patches"
    mrope = True  # the runner gives image prompts' tokens their M-RoPE positions

    def __init__(self, cfg: ModelConfig, max_positions: int, tp=None) -> None:
        if not cfg.mrope_section:
            raise ValueError("a Qwen2.5-VL config needs rope_parameters.mrope_section (M-RoPE); this one has none")
        super().__init__(cfg, max_positions, tp)
        self.rope = MRotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling, cfg.mrope_section)
        self.image_token_id = int(cfg.vision["image_token_id"])
        self.merge = int(cfg.vision["vision_config"].get("spatial_merge_size", 2))
        self.__dict__["_vision"] = None  # the vision transformer once loaded; not a child module

    def map_weight_name(self, name: str) -> tuple[str, int | None] | None:
        # transformers >= 5 saves model.language_model.*; the published checkpoints model.*
        if name.startswith("model.language_model."):
            name = "model." + name[len("model.language_model.") :]
        return super().map_weight_name(name)

    def load_weights(self, weights, dtype: torch.dtype = torch.float32) -> None:
        tower = {}

        def text_only():
            for name, t in weights:
                if name.startswith(_VISION_PREFIXES):
                    tower[name.split("visual.", 1)[1]] = t
                else:
                    yield name, t

        super().load_weights(text_only(), dtype)
        self._build_vision(tower, dtype)

    def _build_vision(self, sd: dict, dtype: torch.dtype) -> None:
        import transformers as tf
        from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl as m

        device = self.norm.weight.device
        vcfg = tf.Qwen2_5_VLConfig(
            **{k: v for k, v in self.config.vision.items() if k != "architectures"}
        ).vision_config
        with torch.device("meta"):
            tower = m.Qwen2_5_VisionTransformerPretrainedModel(vcfg)
        sd = {k: v.to(device=device, dtype=dtype) for k, v in sd.items()}
        missing, unexpected = tower.load_state_dict(sd, strict=False, assign=True)
        if missing or unexpected:
            raise ValueError(
                f"checkpoint's vision transformer does not fit {self.config.architecture}: missing "
                f"{missing[:4]}, unexpected {unexpected[:4]}"
            )
        rot = tower.rotary_pos_emb  # its buffers are not in the checkpoint
        inv, _ = rot.compute_axial_rope_parameters(vcfg, device=device)
        rot.inv_freq, rot.original_inv_freq = inv, inv.clone()
        self.__dict__["_vision"] = tower.eval()
        logger.info(
            "vision transformer: %d blocks (full attention at %s), %d px patches merged %dx%d",
            vcfg.depth,
            list(vcfg.fullatt_block_indexes),
            vcfg.patch_size,
            self.merge,
            self.merge,
        )

    @torch.inference_mode()
    def encode_images(self, pixels: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
        """One [tokens, hidden] matrix per image (its patches and grid): the vision transformer
        over all of them at once (each attends within itself), split back per image."""
        if self._vision is None:
            raise RuntimeError("internal: the vision transformer is not loaded")
        dtype, device = self.norm.weight.dtype, self.norm.weight.device
        pv = torch.cat([p["pixel_values"] for p in pixels]).to(device, dtype)
        grid = torch.cat([p["image_grid_thw"] for p in pixels]).to(device)
        feats = self._vision(pv, grid_thw=grid).pooler_output
        sizes = (grid.prod(-1) // self.merge**2).tolist()
        return [f.to(dtype) for f in feats.split(sizes)]

    def rope_index(self, mm) -> tuple[np.ndarray, int]:
        """A prompt's M-RoPE positions [3, tokens] and its delta (what a token after the prompt
        adds to its index), from its images' places and grids, as transformers' get_rope_index."""
        return rope_index(
            len(mm.prompt_token_ids),
            [(im.offset, im.end, im.pixels["image_grid_thw"][0].tolist()) for im in mm.images],
            self.merge,
        )


def rope_index(num_tokens: int, images: list[tuple[int, int, list[int]]], merge: int) -> tuple[np.ndarray, int]:
    """images: (first placeholder, end, grid t/h/w in patches) each, in prompt order. Text runs
    take consecutive positions in all three streams; an image's tokens (t, row, column) over its
    merged grid, offset by where it starts; the text after it starts past its largest."""
    pos = np.empty((3, num_tokens), dtype=np.int64)
    cur = done = 0  # the next free position; the first token not placed yet
    for start, end, (t, h, w) in images:
        pos[:, done:start] = cur + np.arange(start - done)
        cur += start - done
        h, w = h // merge, w // merge
        if (end - start) != t * h * w:
            raise ValueError(f"an image's {end - start} placeholder tokens do not match its grid {t}x{h}x{w}")
        tt, hh, ww = np.meshgrid(np.arange(t), np.arange(h), np.arange(w), indexing="ij")
        pos[:, start:end] = np.stack([tt, hh, ww]).reshape(3, -1) + cur
        cur += max(h, w)  # (an image's t is 1)
        done = end
    pos[:, done:] = cur + np.arange(num_tokens - done)
    return pos, int(cur + num_tokens - done - num_tokens)
