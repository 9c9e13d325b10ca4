"""LoRA adapters over one base model: PEFT folders loaded into slots, applied per row.

- request.py: `LoRARequest` (vLLM's), what a request names its adapter by;
- pairs.py: an adapter's per-layer low-rank pairs, checked and stacked for fused projections;
- peft.py: reads a PEFT folder into them (`load_adapter` takes a GGUF LoRA file too);
- gguf_lora.py: llama.cpp's GGUF LoRA files onto the same pairs;
- layers.py: the per-step row groups and each linear layer's slots (the grouped products);
- manager.py: `max_loras` slots, LRU beyond them, adapters reloaded from disk.

The models see none of this by import: the manager sets `lora` on their linear layers and
`lora_state` on the model, which they consult only where it is set.
"""

from .request import LoRARequest

__all__ = ["LoRARequest"]
