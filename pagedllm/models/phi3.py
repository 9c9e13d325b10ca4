"""Phi-3 / Phi-3.5: the Llama architecture, stored with q/k/v and gate/up already fused.

The checkpoint's `qkv_proj` and `gate_up_proj` are our fused projections as they are (q|k|v
rows and gate|up rows, in that order), so the name map passes them through. LongRoPE
("longrope"/"su") scaling lives in rope.py.
"""
from .llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    pass
