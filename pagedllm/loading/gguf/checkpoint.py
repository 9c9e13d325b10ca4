"""Opening a GGUF model file: `read_gguf` validates it and gives a `GGUFCheckpoint`, whose
tensors come under HF names, dequantized or as the file's own blocks (QuantTensor, mmap'd)."""

from __future__ import annotations

import functools
import logging
import mmap
import os
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pagedllm.quant.formats import QuantTensor
from pagedllm.tokenizer import Tokenizer

from .arch import _GEMMA_ARCHS, _NON_HF_TENSORS, _PERMUTED_QK_ARCHS, _hf_tensor_names, _undo_rope_permute
from .config import _build_config
from .container import GGUFError, _check_tensors, _scan_file
from .tokenizer import _build_tokenizer

logger = logging.getLogger(__name__)


@dataclass
class GGUFCheckpoint:
    """A validated GGUF file: config, tokenizer and lazily dequantized tensors under HF names."""

    path: Path
    config: dict
    tokenizer: Tokenizer
    metadata: dict = field(repr=False, default_factory=dict)
    _reader: Any = field(repr=False, default=None)

    @property
    def arch(self) -> str:
        return self.metadata["general.architecture"]

    def tensor_names(self) -> list[str]:
        return [hf for t in self._reader.tensors for hf, _ in _hf_tensor_names(t, self.arch)]

    def tensor_types(self) -> dict[str, str]:
        """HF tensor name -> GGML storage type name (e.g. "Q4_1"), for reporting."""
        return {hf: t.tensor_type.name for t in self._reader.tensors for hf, _ in _hf_tensor_names(t, self.arch)}

    def tensor_bytes(self) -> list[tuple[str, int]]:
        """(HF name, bytes the file stores) for every tensor with an HF counterpart; a tensor of
        experts shares its bytes among its experts' names."""
        out = []
        for t in self._reader.tensors:
            names = _hf_tensor_names(t, self.arch)
            out.extend((hf, int(t.n_bytes) // len(names)) for hf, _ in names)
        return out

    def quantized_names(self) -> set[str]:
        """HF names of the tensors `tensors(keep_quantized=True)` yields as QuantTensor."""
        return {hf for t in self._reader.tensors if _keeps_blocks(t) for hf, _ in _hf_tensor_names(t, self.arch)}

    def tensors(
        self, dtype: torch.dtype = torch.float32, keep_quantized: bool = False
    ) -> Iterator[tuple[str, torch.Tensor | QuantTensor]]:
        """Yield (HF name, tensor in HF [out, in] orientation), one tensor at a time: `dtype`
        floats, or with `keep_quantized` the file's own blocks (QuantTensor, mmap'd) for every
        matrix in a format the kernels run."""
        import gguf

        arch = self.metadata["general.architecture"]
        n_heads = self.config["num_attention_heads"]
        n_kv_heads = self.config["num_key_value_heads"]
        for tensor in self._reader.tensors:
            if len(tensor.shape) == 3:
                yield from self._expert_tensors(tensor, dtype, keep_quantized)
                continue
            names = _hf_tensor_names(tensor, arch)
            hf_name = names[0][0] if names else None
            if hf_name is None:
                if tensor.name not in _NON_HF_TENSORS:
                    logger.warning("%s: skipping tensor %s, which has no HF counterpart", self.path, tensor.name)
                continue
            heads = None
            if arch in _PERMUTED_QK_ARCHS:
                heads = n_heads if ".attn_q." in tensor.name else n_kv_heads if ".attn_k." in tensor.name else None
            if keep_quantized and _keeps_blocks(tensor):
                yield hf_name, self._quant_tensor(tensor, heads)
                continue
            try:
                array = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
            except (NotImplementedError, ValueError) as exc:
                raise GGUFError(f"{self.path}: cannot dequantize tensor {tensor.name}: {exc}") from exc
            array = array.reshape(tuple(reversed([int(d) for d in tensor.shape])))
            if heads is not None:
                array = _undo_rope_permute(array, heads)
            if tensor.tensor_type.name not in ("F32", "F16", "BF16") and not np.isfinite(array).all():
                raise GGUFError(
                    f"{self.path}: tensor {tensor.name} ({tensor.tensor_type.name}) has blocks "
                    "with a NaN or inf scale; the file is corrupt"
                )
            if arch in _GEMMA_ARCHS and hf_name.endswith("norm.weight"):
                array = array - 1  # llama.cpp stores Gemma's 1 + weight; HF names mean weight
            if hf_name.endswith("shared_expert_gate.weight"):
                array = array.reshape(1, -1)  # llama.cpp stores the [1, hidden] gate as a vector
            if not array.flags.writeable:  # memmap views (F32) are read-only; torch wants to own the data
                array = np.array(array)
            yield hf_name, torch.from_numpy(array).to(dtype)

    def _expert_tensors(
        self, tensor: Any, dtype: torch.dtype, keep_quantized: bool
    ) -> Iterator[tuple[str, torch.Tensor | QuantTensor]]:
        """A 3-D expert tensor as one HF-named matrix per expert: views of the file's blocks, or
        dequantized (the whole tensor at once, then sliced)."""
        import gguf

        names = _hf_tensor_names(tensor, self.arch)
        if not names:
            logger.warning("%s: skipping tensor %s, which has no HF counterpart", self.path, tensor.name)
            return
        cols, rows, experts = (int(d) for d in tensor.shape)
        if keep_quantized and _keeps_blocks(tensor):
            from pagedllm.quant.kernels import bad_scale_blocks

            per = int(tensor.n_bytes) // experts
            with warnings.catch_warnings():  # read-only views of the mmap'd file: never written
                warnings.simplefilter("ignore", UserWarning)
                data = torch.from_numpy(tensor.data.reshape(experts, rows, -1))
            for (hf_name, e), block in zip(names, data):
                qt = QuantTensor(tensor.tensor_type.name, block, (rows, cols))
                if bad_scale_blocks(qt):
                    raise GGUFError(
                        f"{self.path}: tensor {tensor.name} ({qt.fmt}) has blocks with a NaN or inf "
                        f"scale (expert {e}); the file is corrupt"
                    )
                qt.release = functools.partial(_release_pages, self._reader, int(tensor.data_offset) + e * per, per)
                yield hf_name, qt
            return
        try:
            array = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        except (NotImplementedError, ValueError) as exc:
            raise GGUFError(f"{self.path}: cannot dequantize tensor {tensor.name}: {exc}") from exc
        array = array.reshape(experts, rows, cols)
        if tensor.tensor_type.name not in ("F32", "F16", "BF16") and not np.isfinite(array).all():
            raise GGUFError(
                f"{self.path}: tensor {tensor.name} ({tensor.tensor_type.name}) has blocks "
                "with a NaN or inf scale; the file is corrupt"
            )
        for hf_name, e in names:
            yield hf_name, torch.from_numpy(np.array(array[e])).to(dtype)

    def _quant_tensor(self, tensor: Any, heads: int | None) -> QuantTensor:
        from pagedllm.quant.kernels import bad_scale_blocks

        rows, cols = int(tensor.shape[1]), int(tensor.shape[0])
        with warnings.catch_warnings():  # a read-only view of the mmap'd file: never written
            warnings.simplefilter("ignore", UserWarning)
            data = torch.from_numpy(tensor.data.reshape(rows, -1))
        qt = QuantTensor(tensor.tensor_type.name, data, (rows, cols))
        bad = bad_scale_blocks(qt)
        if bad:
            raise GGUFError(
                f"{self.path}: tensor {tensor.name} ({qt.fmt}) has {bad} block(s) with a NaN or "
                "inf scale; the file is corrupt"
            )
        if heads is not None:
            # Undo llama.cpp's q/k row permutation on whole block rows; the copy replaces the
            # file's pages, which are handed back so they are not held twice.
            half = rows // heads // 2
            index = torch.arange(rows).view(heads, half, 2).transpose(1, 2).reshape(-1)
            qt = qt.permute_rows(index)
            _release_pages(self._reader, int(tensor.data_offset), int(tensor.n_bytes))
        else:  # packing at placement copies it: then its file pages are handed back too
            qt.release = functools.partial(_release_pages, self._reader, int(tensor.data_offset), int(tensor.n_bytes))
        return qt


def _keeps_blocks(tensor: Any) -> bool:
    from pagedllm.quant.formats import FORMATS

    return tensor.tensor_type.name in FORMATS and len(tensor.shape) in (2, 3)


def _release_pages(reader: Any, offset: int, nbytes: int) -> None:
    """Drop our mapping of a file range we copied (the page cache keeps it; RSS stops counting it)."""
    mm = getattr(reader, "mm", None)
    if mm is None or not hasattr(mm, "madvise"):
        return
    page = mmap.PAGESIZE
    start = -(-offset // page) * page
    stop = (offset + nbytes) // page * page
    if stop > start:
        try:
            mm.madvise(mmap.MADV_DONTNEED, start, stop - start)
        except (OSError, ValueError):
            pass


def read_gguf(path: str | os.PathLike) -> GGUFCheckpoint:
    """Validate and open a GGUF file. Every problem is raised as GGUFError."""
    path = Path(path)
    reader = _scan_file(path)
    _check_tensors(path, reader.tensors)
    metadata = reader.metadata
    if "general.architecture" not in metadata:
        raise GGUFError(f"{path}: metadata has no general.architecture")
    tensor_names = {t.name for t in reader.tensors}
    try:
        config = _build_config(path, metadata, tensor_names, reader)
    except GGUFError:
        raise
    except (TypeError, ValueError, KeyError, IndexError) as exc:  # metadata of the wrong type or shape
        raise GGUFError(f"{path}: invalid model metadata: {type(exc).__name__}: {exc}") from exc
    try:
        tokenizer = _build_tokenizer(path, metadata)
    except GGUFError:
        raise
    except Exception as exc:  # tokenizers raises plain Exception, e.g. for a merge of unknown tokens
        raise GGUFError(f"{path}: cannot build the tokenizer from the file's metadata: {exc}") from exc
    logger.info(
        "opened %s: %s, %d layers, %d tensors",
        path,
        config["architectures"][0],
        config["num_hidden_layers"],
        len(reader.tensors),
    )
    # The vocabulary's lists live on in the tokenizer; as Python objects they would hold tens
    # of MB (a 152k vocabulary) for the life of the engine.
    for key in [k for k in metadata if k.startswith("tokenizer.ggml.") and isinstance(metadata[k], list)]:
        del metadata[key]
    return GGUFCheckpoint(path=path, config=config, tokenizer=tokenizer, metadata=metadata, _reader=reader)
