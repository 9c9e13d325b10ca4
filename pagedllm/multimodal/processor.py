"""Images and text to a MultiModalInput, by the model folder's own transformers processor
(`AutoProcessor`): its resizing, normalisation and placeholder expansion, not ours.

Each image becomes one run of the model's image placeholder token in the prompt's ids; the run
and the processor's tensors of that image are its ImageItem (inputs.py). Chat messages take
OpenAI content parts (text, image_url) or transformers' (image); the processor's chat template
writes the prompt with one image marker per image, which the processor then expands.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from .inputs import ImageItem, MultiModalInput, image_hash
from .media import MediaPolicy, load_image

logger = logging.getLogger(__name__)

VISION_EXTRA = "pip install 'pagedllm[vision]' (transformers and Pillow)"
_TEXT_KEYS = {"input_ids", "attention_mask", "token_type_ids", "mm_token_type_ids"}


class ImageProcessor:
    """`layout`: how the family's processor lays an image out (see `_items`): "runs" (one run of
    placeholders per image, its tensors' first dimension one entry per image: Gemma 3),
    "tiles" (Idefics3: an image is tiles, one run each, the last after a global-image token;
    its tensors [1, tiles, ...]) or "patches" (Qwen2.5-VL: one run per image; pixel_values is
    every image's patches one after another, image_grid_thw [images, 3] says how many each)."""

    def __init__(
        self,
        folder: Path,
        image_token_id: int,
        bidirectional: bool,
        max_images: int,
        layout: str = "runs",
        hf: Any = None,
    ) -> None:
        """`hf`: the transformers processor when it does not come from `folder` (a GGUF model's,
        `gguf_processor`)."""
        self.hf = load_hf_processor(folder) if hf is None else hf
        if getattr(self.hf, "image_processor", None) is None:
            raise ValueError(
                f"{folder} has no image processor config (preprocessor_config.json / "
                "processor_config.json); a vision-language model folder needs its processor files"
            )
        self.image_token_id = image_token_id
        self.bidirectional = bidirectional
        self.max_images = max_images
        self.layout = layout
        tok = self.hf.tokenizer
        self.global_image_id = tok.convert_tokens_to_ids("<global-img>") if layout == "tiles" else None
        # What a prompt writes where an image goes (the processor expands it).
        self.marker = getattr(self.hf, "boi_token", None) or getattr(self.hf, "image_token", None)
        if layout == "patches" and self.marker and "<|vision_start|>" in tok.get_vocab():
            self.marker = f"<|vision_start|>{self.marker}<|vision_end|>"  # Qwen's chat template writes this

    def process(self, prompt: str, images: list, add_special_tokens: bool = True) -> MultiModalInput:
        """The prompt's ids with each image's placeholder run, and the images' tensors. The prompt
        holds one marker (`self.marker`) per image; a prompt with none gets them in front."""
        images = list(images)
        if len(images) > self.max_images:
            raise ValueError(
                f"{len(images)} images in one prompt but this model takes at most "
                f"{self.max_images} (limit_mm_per_prompt)"
            )
        for i, im in enumerate(images):
            if not hasattr(im, "convert") or not hasattr(im, "tobytes"):
                raise ValueError(f"image {i} is a {type(im).__name__}, not a PIL image")
        if images and self.marker and self.marker not in prompt:
            prompt = " ".join([self.marker] * len(images)) + "\n" + prompt
        images = [im.convert("RGB") if im.mode != "RGB" else im for im in images]
        try:
            out = self.hf(
                text=[prompt],
                images=[images] if images else None,
                return_tensors="pt",
                add_special_tokens=add_special_tokens,
            )
        except ValueError as e:
            raise ValueError(f"the model's processor refused the prompt and images: {e}") from None
        ids = out["input_ids"][0].tolist()
        tensors = {k: v for k, v in out.items() if k not in _TEXT_KEYS and hasattr(v, "shape")}
        items = self._items(ids, images, tensors)
        return MultiModalInput(ids, items, prompt, self.bidirectional)

    def _items(self, ids: list[int], images: list, tensors: dict) -> list[ImageItem]:
        runs = _runs(ids, self.image_token_id)
        if self.layout in ("runs", "patches"):
            groups = [[r] for r in runs]
        else:  # tiles: an image's runs end with the one after its global-image token
            groups, cur = [], []
            for a, b in runs:
                cur.append((a, b))
                if a > 0 and ids[a - 1] == self.global_image_id:
                    groups.append(cur)
                    cur = []
            if cur:
                groups.append(cur)
        if len(groups) != len(images):
            raise ValueError(
                f"the prompt has {len(groups)} image places after processing but {len(images)} "
                f"images were given; write one {self.marker!r} per image"
            )
        items, tile, patch = [], 0, 0
        for i, (im, g) in enumerate(zip(images, groups)):
            a, b = g[0][0], g[-1][1]
            if self.layout == "runs":
                pixels, pos = {k: v[i : i + 1] for k, v in tensors.items()}, None
            elif self.layout == "patches":
                grid = tensors["image_grid_thw"][i : i + 1]
                n = int(grid.prod())
                pixels, pos = {"pixel_values": tensors["pixel_values"][patch : patch + n], "image_grid_thw": grid}, None
                patch += n
            else:
                pixels = {k: v[:, tile : tile + len(g)] for k, v in tensors.items()}
                pos = [p - a for r0, r1 in g for p in range(r0, r1)]
                tile += len(g)
            items.append(ImageItem(image_hash(im), a, b - a, pixels, pos))
        return items

    def chat(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        policy: MediaPolicy | None = None,
        **template_kwargs,
    ) -> MultiModalInput:
        """A conversation whose content parts may hold images (OpenAI image_url parts, or
        {"type": "image", "image": PIL image})."""
        images: list = []
        convo = [_hf_message(m, images, policy) for m in messages]
        text = self.hf.apply_chat_template(
            convo, add_generation_prompt=add_generation_prompt, tokenize=False, **template_kwargs
        )
        # The template writes the special tokens (BOS) itself, as transformers' tokenize=True does.
        return self.process(text, images, add_special_tokens=False)


def load_hf_processor(folder: Path | str):
    """The folder's own transformers processor (`AutoProcessor`). transformers builds one that
    also takes videos (Qwen2.5-VL's) only where torchvision is installed, which has no CPU build
    beside a CPU torch on PyPI; images need none of it, so without torchvision such a processor
    is built from the folder's image processor and tokenizer alone (the same class, its own
    resizing, normalisation and placeholder expansion)."""
    try:
        import transformers as tf
    except ImportError:
        raise ValueError(f"this model takes images, which need transformers: {VISION_EXTRA}") from None
    try:
        return tf.AutoProcessor.from_pretrained(str(folder))
    except ImportError as e:
        if "torchvision" not in str(e).lower():
            raise
        name = _processor_class(Path(folder))
        cls = getattr(tf, name, None) if name else None
        if cls is None or "video_processor" not in cls.get_attributes():
            raise ValueError(f"the processor of {folder} needs torchvision: {e}") from None
        logger.info("%s without its video processor (no torchvision): images only", name)

        class ImagesOnly(cls):
            def check_argument_for_proper_class(self, argument_name, argument):
                if argument_name == "video_processor" and argument is None:
                    return None
                return super().check_argument_for_proper_class(argument_name, argument)

        tok = tf.AutoTokenizer.from_pretrained(str(folder))
        return ImagesOnly(
            image_processor=tf.AutoImageProcessor.from_pretrained(str(folder)),
            tokenizer=tok,
            video_processor=None,
            chat_template=_chat_template(Path(folder), tok),
        )


def _processor_class(folder: Path) -> str | None:
    for f in ("processor_config.json", "preprocessor_config.json"):
        if (folder / f).is_file():
            name = json.loads((folder / f).read_text()).get("processor_class")
            if name:
                return name
    return None


def _chat_template(folder: Path, tok) -> str | None:
    """The processor's chat template (chat_template.jinja / .json), else the tokenizer's."""
    if (folder / "chat_template.jinja").is_file():
        return (folder / "chat_template.jinja").read_text()
    if (folder / "chat_template.json").is_file():
        return json.loads((folder / "chat_template.json").read_text()).get("chat_template")
    return getattr(tok, "chat_template", None)


def gguf_processor(settings: dict[str, Any], tokenizer, config: dict[str, Any]) -> Any:
    """transformers' own Gemma 3 processor for a GGUF language model and its mmproj file (no
    folder): the image processor (a fixed-size resize and SigLIP's normalisation) set from the
    mmproj's metadata (`settings`: image_size, image_mean, image_std), the GGUF's tokenizer
    (pagedllm's, wrapped as a transformers tokenizer with the image tokens named) and chat
    template. `config`: the model's transformers-style config, with the image tokens' ids."""
    try:
        import transformers as tf
        from tokenizers import Tokenizer as HFTokenizer
    except ImportError:
        raise ValueError(f"this model takes images, which need transformers: {VISION_EXTRA}") from None
    if config["architectures"][0] != "Gemma3ForConditionalGeneration":
        raise ValueError(f"internal: no GGUF image processor for {config['architectures'][0]}")
    names = {k: tokenizer.id_to_token(config[f"{k}_index"]) for k in ("boi_token", "eoi_token", "image_token")}
    # A copy: the wrapper must not change the engine's own tokenizer (its post-processor adds BOS
    # as the GGUF says, and the wrapper keeps it).
    backend = HFTokenizer.from_str(tokenizer.backend.to_str())
    hf_tok = tf.PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=tokenizer.bos_token,
        eos_token=tokenizer.eos_token,
        unk_token=tokenizer.unk_token,
        pad_token=tokenizer.pad_token,
        extra_special_tokens=names,
    )
    size = int(settings["image_size"])
    images = tf.Gemma3ImageProcessor(
        size={"height": size, "width": size}, image_mean=settings["image_mean"], image_std=settings["image_std"]
    )
    return tf.Gemma3Processor(
        image_processor=images,
        tokenizer=hf_tok,
        chat_template=tokenizer.chat_template,
        image_seq_length=int(config["mm_tokens_per_image"]),
    )


def _hf_message(m: dict, images: list, policy: MediaPolicy | None) -> dict:
    content = m.get("content")
    if not isinstance(content, list):
        return m
    parts: list[dict[str, Any]] = []
    for p in content:
        kind = p.get("type") if isinstance(p, dict) else None
        if kind == "text":
            parts.append({"type": "text", "text": p.get("text", "")})
        elif kind == "image_url":
            url = p.get("image_url")
            url = url.get("url") if isinstance(url, dict) else url
            if not isinstance(url, str):
                raise ValueError("an image_url content part needs image_url.url (a data: URL, http(s) URL or path)")
            images.append(load_image(url, policy))
            parts.append({"type": "image"})
        elif kind == "image":
            im = p.get("image")
            images.append(load_image(im, policy) if isinstance(im, str) else im)
            parts.append({"type": "image"})
        else:
            raise ValueError(f"content part type {kind!r} is not supported; use text or image_url")
    return {**m, "content": parts}


def _runs(ids: list[int], token: int) -> list[tuple[int, int]]:
    """[start, end) of each run of `token` in ids."""
    runs, start = [], None
    for i, t in enumerate(ids):
        if t == token and start is None:
            start = i
        elif t != token and start is not None:
            runs.append((start, i))
            start = None
    if start is not None:
        runs.append((start, len(ids)))
    return runs
