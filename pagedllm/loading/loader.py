"""Build a model from a source: config -> model family -> weights -> tokenizer."""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import torch
from tqdm.auto import tqdm

from ..config import ModelConfig
from ..kv.calibration import kv_scale_key
from ..models import materialize, model_class
from ..tokenizer import Tokenizer
from .source import ModelSource

logger = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    model: torch.nn.Module
    config: ModelConfig
    tokenizer: Tokenizer
    source: ModelSource
    weight_bytes: int
    # KV-cache scales the checkpoint carries (fp8 KV), by (layer, 0=K / 1=V / 2=both).
    kv_scales: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)


def load_model(source: ModelSource, dtype: torch.dtype, device: torch.device,
               max_positions: int | None = None) -> LoadedModel:
    if source.kind == "gguf":
        from .gguf import read_gguf

        ckpt = read_gguf(source.path)
        hf_config = ckpt.config
        tokenizer = (Tokenizer.from_pretrained_dir(source.tokenizer_dir)
                     if source.tokenizer_dir else ckpt.tokenizer)
        weights = ckpt.tensors(dtype)
        total = len(ckpt.tensor_names())
    else:
        hf_config = _read_json(source.path / "config.json")
        tokenizer = Tokenizer.from_pretrained_dir(source.tokenizer_dir or source.path)
        files = sorted(source.path.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"{source.path} has no *.safetensors weight files")
        weights = _safetensors(files, dtype)
        total = None

    cfg = ModelConfig.from_hf_dict(hf_config)
    if not cfg.eos_token_ids and tokenizer.eos_token_id is not None:
        cfg.eos_token_ids = [tokenizer.eos_token_id]
    cls = model_class(cfg.architecture)
    positions = max_positions or cfg.max_position_embeddings
    with torch.device("meta"):
        model = cls(cfg, positions)
    model = materialize(model, device, dtype)
    for m in model.modules():
        if hasattr(m, "reset_buffers"):
            m.reset_buffers()
    model.rope.to(device)
    model.tie_weights()
    desc = f"loading {source.path.name}"
    kv_scales: dict[tuple[int, int], torch.Tensor] = {}
    weights = _set_aside_kv_scales(weights, kv_scales)
    model.load_weights(tqdm(weights, total=total, desc=desc, unit="tensor", leave=False,
                            disable=None))
    model.eval()
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    logger.info("loaded %s (%s, %d layers, %.1f MB of weights in %s)", source.name,
                cfg.architecture, cfg.num_layers, nbytes / 2**20, dtype)
    return LoadedModel(model, cfg, tokenizer, source, nbytes, kv_scales)


def _set_aside_kv_scales(weights: Iterator[tuple[str, torch.Tensor]],
                         out: dict[tuple[int, int], torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    """KV-cache scales are not weights: keep them for the cache (kv/calibration.py)."""
    for name, t in weights:
        key = kv_scale_key(name)
        if key is None:
            yield name, t
        else:
            out[key] = t.float()


def _read_json(path: Path) -> dict:
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found")
    with open(path) as f:
        return json.load(f)


def _safetensors(files: list[Path], dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    for f in files:
        with safe_open(str(f), framework="pt", device="cpu") as st:
            for name in st.keys():
                t = st.get_tensor(name)
                # KV-cache scales keep their float32 precision.
                yield name, t if kv_scale_key(name) is not None else t.to(dtype)
