"""What a request names its adapter by, as vLLM's `LoRARequest(lora_name, lora_int_id, lora_path)`."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    lora_name: str
    lora_int_id: int  # > 0, unique per adapter: the slot table and the prefix cache key by it
    lora_path: str  # a PEFT adapter folder, or a llama.cpp GGUF LoRA file
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(
                f"LoRARequest {self.lora_name!r}: lora_int_id must be an integer >= 1 "
                f"(0 is the base model), got {self.lora_int_id!r}"
            )
        if not self.lora_path:
            raise ValueError(
                f"LoRARequest {self.lora_name!r}: lora_path is empty; give the adapter's folder or .gguf file"
            )

    @property
    def cache_key(self) -> tuple:
        """What the prefix cache keys this adapter's blocks by: two adapters never share K/V."""
        return ("lora", self.lora_int_id, str(self.lora_path))
