"""Images in prompts: the input type the engine schedules (inputs.py), the LRU of image
embeddings the encoder fills (cache.py), the model's own processor that turns images and text
into placeholder tokens and pixel tensors (processor.py), and reading images from what a user or
client sends: data URLs, http(s) URLs, local files (media.py)."""

from .cache import EncoderCache
from .inputs import ImageItem, MultiModalInput

__all__ = ["EncoderCache", "ImageItem", "MultiModalInput"]
