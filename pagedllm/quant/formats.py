"""Weights kept in GGUF's block formats: what each format is, and a tensor that holds one.

A `QuantTensor` is a 2-D weight [rows, cols] whose bytes are the format's blocks, row after
row, exactly as a GGUF file stores them (a uint8 tensor [rows, row_bytes], often a view of
the mmap'd file). Blocks run along a row, so stacking rows (fusing q/k/v, gate/up) or
permuting them (undoing llama.cpp's rope permutation) keeps every block whole.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

# name -> (ggml type id, values per block, bytes per block): the formats the native kernels run.
FORMATS: dict[str, tuple[int, int, int]] = {
    "Q4_0": (2, 32, 18),
    "Q4_1": (3, 32, 20),
    "Q5_0": (6, 32, 22),
    "Q5_1": (7, 32, 24),
    "Q8_0": (8, 32, 34),
    "Q2_K": (10, 256, 84),
    "Q3_K": (11, 256, 110),
    "Q4_K": (12, 256, 144),
    "Q5_K": (13, 256, 176),
    "Q6_K": (14, 256, 210),
}


class QuantFormatError(ValueError):
    """A quantized weight that cannot be used as it is: the message names the tensor."""


@dataclass
class QuantTensor:
    """A weight of `shape` (rows, cols) stored as `fmt` blocks in `data` [rows, row_bytes]."""

    fmt: str
    data: torch.Tensor
    shape: tuple[int, int]

    def __post_init__(self) -> None:
        if self.fmt not in FORMATS:
            raise QuantFormatError(f"unsupported quantized format {self.fmt}; supported: {', '.join(FORMATS)}")
        rows, cols = self.shape
        _, vals, nbytes = FORMATS[self.fmt]
        if cols % vals:
            raise QuantFormatError(f"{self.fmt} rows hold blocks of {vals} values; {cols} is not a multiple")
        want = (rows, cols // vals * nbytes)
        if self.data.dtype != torch.uint8 or tuple(self.data.shape) != want:
            raise QuantFormatError(
                f"{self.fmt} data for a {rows}x{cols} weight must be uint8 {want}, got "
                f"{self.data.dtype} {tuple(self.data.shape)}")

    @property
    def type_id(self) -> int:
        return FORMATS[self.fmt][0]

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def permute_rows(self, index: torch.Tensor) -> "QuantTensor":
        return QuantTensor(self.fmt, self.data.index_select(0, index), self.shape)
