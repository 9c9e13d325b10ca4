"""Qwen2: Llama with biases on the q/k/v projections (none on o_proj)."""

from ..config import ModelConfig
from .llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    def __init__(self, cfg: ModelConfig, max_positions: int, tp=None, stage=None) -> None:
        cfg.attention_bias = True
        cfg.o_proj_bias = False
        super().__init__(cfg, max_positions, tp, stage)
