"""Reading GGUF checkpoints: validation, a transformers-style config, HF-named dequantized tensors
and the tokenizer the file describes.

transformers (`from_pretrained(..., gguf_file=...)`) is the reference: the config, every tensor and
the tokenizer built here are meant to equal what it produces from the same file.

The package, by concern: `container` (the file's header and tensor table), `arch` (the
architectures and their tensor names), `config` (metadata to config), `tokenizer`,
`checkpoint` (`read_gguf`: the model's tensors, quantized or not) and `lora` (adapter files).
"""

from .checkpoint import GGUFCheckpoint, read_gguf
from .container import GGUF_MAGIC, GGUFError
from .lora import GGUFLoRA, read_gguf_lora

__all__ = ["GGUF_MAGIC", "GGUFCheckpoint", "GGUFError", "GGUFLoRA", "read_gguf", "read_gguf_lora"]
