"""Adapter slots: at most `max_loras` adapters in memory, least recently used evicted beyond
that and read again from disk when a request needs it back."""

from __future__ import annotations

import logging
from collections import OrderedDict

import torch
from torch import nn

from .layers import LinearLoRA, LoRAState
from .pairs import AdapterWeights
from .peft import load_adapter
from .request import LoRARequest

logger = logging.getLogger(__name__)

# The dense projections an adapter may target (a fused layer takes its parts' adapters).
TARGET_LEAVES = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


class LoRAManager:
    def __init__(
        self, model: nn.Module, max_loras: int, max_lora_rank: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        if not isinstance(max_loras, int) or max_loras < 1:
            raise ValueError(f"max_loras must be an integer >= 1, got {max_loras!r}")
        if not isinstance(max_lora_rank, int) or max_lora_rank < 1:
            raise ValueError(f"max_lora_rank must be an integer >= 1, got {max_lora_rank!r}")
        self.model, self.max_loras, self.max_rank = model, max_loras, max_lora_rank
        self.dtype, self.device = dtype, device
        self.state = LoRAState()
        self.layers: dict[str, LinearLoRA] = {}
        for name, module in model.named_modules():
            if name.rsplit(".", 1)[-1] in TARGET_LEAVES and ".experts" not in name and hasattr(module, "fused"):
                module.lora = self.layers[name] = LinearLoRA(self.state, max_loras)
        if not self.layers:
            raise ValueError(f"{type(model).__name__} has no projections LoRA adapters can apply to")
        logger.info(
            "LoRA: %d adapter slots of rank <= %d over %d projections", max_loras, max_lora_rank, len(self.layers)
        )
        model.lora_state = self.state
        self.slots: OrderedDict[int, int] = OrderedDict()  # lora_int_id -> slot, least recent first
        self.loaded: dict[int, LoRARequest] = {}
        self.bytes: dict[int, int] = {}
        self.num_loads = 0

    # -- slots -------------------------------------------------------------
    def check(self, req: LoRARequest) -> None:
        """Read and check the adapter for this base model (a clear ValueError otherwise); it takes a
        slot now if one is free, so the first step need not read it again."""
        if req.lora_int_id in self.slots:
            known = self.loaded[req.lora_int_id]
            if str(known.lora_path) != str(req.lora_path):
                raise ValueError(
                    f"lora_int_id {req.lora_int_id} is held by adapter {known.lora_name!r} "
                    f"({known.lora_path}); give {req.lora_name!r} another id"
                )
            return
        weights = load_adapter(req.lora_path, self.model, self.max_rank)
        if len(self.slots) < self.max_loras:
            self._place(req, weights, self._free_slot())

    def activate(self, reqs: dict[int, LoRARequest]) -> dict[int, int]:
        """Slots for the step's adapters (lora_int_id -> slot), loading those not in memory in
        place of the least recently used ones the step does not need."""
        if len(reqs) > self.max_loras:
            raise RuntimeError(f"internal: a step uses {len(reqs)} adapters but max_loras={self.max_loras}")
        for lid, req in reqs.items():
            if lid in self.slots:
                self.slots.move_to_end(lid)
                continue
            if len(self.slots) < self.max_loras:
                slot = self._free_slot()
            else:
                victim = next(v for v in self.slots if v not in reqs)
                slot = self._evict(victim)
            self._place(req, load_adapter(req.lora_path, self.model, self.max_rank), slot)
        return {lid: self.slots[lid] for lid in reqs}

    def remove(self, lora_int_id: int) -> bool:
        """Drop an adapter from memory (unload); False if it was not held."""
        if lora_int_id not in self.slots:
            return False
        self._evict(lora_int_id)
        return True

    def _free_slot(self) -> int:
        used = set(self.slots.values())
        return next(s for s in range(self.max_loras) if s not in used)

    def _evict(self, lid: int) -> int:
        slot = self.slots.pop(lid)
        req = self.loaded.pop(lid)
        self.bytes.pop(lid, None)
        for layer in self.layers.values():
            layer.set_slot(slot, None)
        logger.info("LoRA adapter %r left slot %d", req.lora_name, slot)
        return slot

    def _place(self, req: LoRARequest, w: AdapterWeights, slot: int) -> None:
        for name, layer in self.layers.items():
            pair = w.pairs.get(name)
            layer.set_slot(
                slot, None if pair is None else tuple(t.to(self.device, self.dtype).contiguous() for t in pair)
            )
        self.slots[req.lora_int_id] = slot
        self.loaded[req.lora_int_id] = req
        self.bytes[req.lora_int_id] = sum(layer.slot_nbytes(slot) for layer in self.layers.values())
        self.num_loads += 1
        logger.info(
            "LoRA adapter %r (rank %d, %d layers, %.2f MB) loaded into slot %d of %d",
            req.lora_name,
            w.rank,
            len(w.pairs),
            self.bytes[req.lora_int_id] / 2**20,
            slot,
            self.max_loras,
        )

    @property
    def memory_bytes(self) -> int:
        return sum(self.bytes.values())
