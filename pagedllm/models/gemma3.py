"""Gemma 3 (text): Gemma 2's layer shape with q/k norms, one global layer every
`sliding_window_pattern` (or as `layer_types` say), and the sliding layers' own rope base
(`rope_local_base_freq`); no attention soft-capping."""

from .gemma2 import Gemma2DecoderLayer, Gemma2ForCausalLM
from .llama import RMSNorm


class Gemma3DecoderLayer(Gemma2DecoderLayer):
    qk_norm = RMSNorm  # (1 + weight), like every Gemma norm: the loader adds the one


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    layer_cls = Gemma3DecoderLayer
