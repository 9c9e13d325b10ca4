"""Quantized weights: GGUF block formats, their kernels, and in-situ quantization (ISQ)."""
