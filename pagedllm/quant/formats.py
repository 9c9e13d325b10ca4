"""Weights kept in GGUF's block formats: what each format is, and a tensor that holds one.

A `QuantTensor` is a 2-D weight [rows, cols] whose bytes are the format's blocks, row after
row, exactly as a GGUF file stores them (a uint8 tensor [rows, row_bytes], often a view of
the mmap'd file). Blocks run along a row, so stacking rows (fusing q/k/v, gate/up) or
permuting them (undoing llama.cpp's rope permutation) keeps every block whole.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .. import tuning

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


# Formats repacked at load into 16-row interleaved groups (native/csrc/quant_packed.cpp): one
# SIMD lane per output row, several times faster. Q2_K and Q3_K keep the file's layout.
PACKABLE = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")
PACK_ROWS = 16
PACKED_ID = 100  # a packed weight's kernel type id: PACKED_ID + the ggml type id


def packed_group_bytes(fmt: str, cols: int) -> int:
    """Bytes of one packed group (16 rows of `cols` values): the file's bytes, plus for the
    K-quants their 6-bit sub-block scales widened to bytes."""
    _, vals, nbytes = FORMATS[fmt]
    if fmt in ("Q4_K", "Q5_K"):
        per_block = 256 + (64 if fmt == "Q5_K" else 0) + 32  # values, high bits, sc + m bytes
        return cols // 256 * (64 + 8 * per_block)
    return cols // vals * nbytes * PACK_ROWS


class QuantFormatError(ValueError):
    """A quantized weight that cannot be used as it is: the message names the tensor."""


@dataclass
class QuantTensor:
    """A weight of `shape` (rows, cols) stored as `fmt` blocks in `data` [rows, row_bytes], or,
    `packed`, as 16-row groups [rows / 16, group_bytes]. `release`, when set, hands back the
    file pages `data` views once a copy has replaced them."""

    fmt: str
    data: torch.Tensor
    shape: tuple[int, int]
    packed: bool = False
    release: Callable[[], None] | None = field(default=None, repr=False, compare=False)
    # Columns stored out of the weight's order (GPTQ desc_act): stored column i is the weight's
    # column col_perm[i], so the layer multiplies x[:, col_perm] (quant/checkpoint.py).
    col_perm: torch.Tensor | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.fmt not in FORMATS:
            raise QuantFormatError(f"unsupported quantized format {self.fmt}; supported: {', '.join(FORMATS)}")
        rows, cols = self.shape
        _, vals, nbytes = FORMATS[self.fmt]
        if cols % vals:
            raise QuantFormatError(f"{self.fmt} rows hold blocks of {vals} values; {cols} is not a multiple")
        want = (rows // PACK_ROWS, packed_group_bytes(self.fmt, cols)) if self.packed else (rows, cols // vals * nbytes)
        if self.data.dtype != torch.uint8 or tuple(self.data.shape) != want:
            raise QuantFormatError(
                f"{self.fmt} data for a {rows}x{cols} weight must be uint8 {want}, got "
                f"{self.data.dtype} {tuple(self.data.shape)}"
            )

    @property
    def type_id(self) -> int:
        """The id the native kernels take: the ggml type, offset by PACKED_ID when packed."""
        return FORMATS[self.fmt][0] + (PACKED_ID if self.packed else 0)

    @property
    def can_pack(self) -> bool:
        # (tuning quant_pack=0 keeps the file's layout: the reference for comparisons)
        return tuning.get("quant_pack") and not self.packed and self.fmt in PACKABLE and self.shape[0] % PACK_ROWS == 0

    def pack(self) -> "QuantTensor":
        """The same weight in the packed layout (a copy; the file's pages are handed back)."""
        from ..native import cpu_kernels

        data = cpu_kernels().quant_pack(self.data, FORMATS[self.fmt][0], self.shape[1])
        if self.release is not None:
            self.release()
        return QuantTensor(self.fmt, data, self.shape, packed=True, col_perm=self.col_perm)

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def rows(self, lo: int, hi: int) -> "QuantTensor":
        """Rows [lo, hi) as a view of the same bytes (packed: on 16-row group boundaries)."""
        if self.col_perm is not None:
            raise ValueError("rows of a weight with permuted columns are not taken apart")
        if self.packed:
            if lo % PACK_ROWS or hi % PACK_ROWS:
                raise ValueError(f"a packed weight splits on {PACK_ROWS}-row groups, not at rows {lo}..{hi}")
            return QuantTensor(
                self.fmt, self.data[lo // PACK_ROWS : hi // PACK_ROWS], (hi - lo, self.shape[1]), packed=True
            )
        return QuantTensor(self.fmt, self.data[lo:hi], (hi - lo, self.shape[1]))

    def permute_rows(self, index: torch.Tensor) -> "QuantTensor":
        assert not self.packed
        return QuantTensor(self.fmt, self.data.index_select(0, index), self.shape, col_perm=self.col_perm)
