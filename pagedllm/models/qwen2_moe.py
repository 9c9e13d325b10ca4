"""Qwen2-MoE: Qwen2's attention (q/k/v biases, none on o_proj) with sparse MoE blocks beside a
shared expert that every row runs, scaled by sigmoid(shared_expert_gate(x)) (models/moe.py)."""

from ..config import ModelConfig
from .moe import MoeForCausalLM


class Qwen2MoeForCausalLM(MoeForCausalLM):
    def __init__(self, cfg: ModelConfig, max_positions: int, tp=None, stage=None) -> None:
        cfg.o_proj_bias = False
        super().__init__(cfg, max_positions, tp, stage)
