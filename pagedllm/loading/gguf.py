"""Reading GGUF checkpoints: validation, a transformers-style config, HF-named dequantized tensors
and the tokenizer the file describes.

transformers (`from_pretrained(..., gguf_file=...)`) is the reference: the config, every tensor and
the tokenizer built here are meant to equal what it produces from the same file.
"""

from __future__ import annotations

import functools
import logging
import math
import mmap
import os
import re
import struct
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pagedllm.quant.formats import QuantTensor
from pagedllm.tokenizer import Tokenizer
from pagedllm.tokenizer import template_guard

logger = logging.getLogger(__name__)

GGUF_MAGIC = b"GGUF"
_DEFAULT_ALIGNMENT = 32

# GGUF metadata value types (gguf.GGUFValueType) of strings and arrays.
_VT_STRING = 8
_VT_ARRAY = 9

# llama.cpp token types (tokenizer.ggml.token_type).
_TOKEN_CONTROL = 3
_TOKEN_USER_DEFINED = 4

# GGUF architecture -> (HF architecture class, HF model_type).
_ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", "llama"),
    "mistral": ("MistralForCausalLM", "mistral"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
    "gemma3": ("Gemma3ForCausalLM", "gemma3_text"),
    # Mixtures of experts ("llama" with an expert_count is Mixtral)
    "qwen2moe": ("Qwen2MoeForCausalLM", "qwen2_moe"),
    "qwen3moe": ("Qwen3MoeForCausalLM", "qwen3_moe"),
    "olmoe": ("OlmoeForCausalLM", "olmoe"),
}
_MIXTRAL = ("MixtralForCausalLM", "mixtral")
# How llama.cpp routes each MoE architecture: whether the top-k weights are renormalized
# (its build_moe_ffn's norm_w), unless the file says (expert_weights_norm).
_MOE_NORM_TOPK = {"llama": True, "qwen2moe": False, "qwen3moe": True, "olmoe": False}
# llama.cpp's converter permutes Q/K rows of these architectures for its interleaved rope.
_PERMUTED_QK_ARCHS = {"llama", "mistral"}

_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    # MoE: the router, and Qwen2-MoE's shared expert and its gate
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
# All of a layer's experts in one 3-D tensor [experts, rows, cols] (GGUF order: cols, rows,
# experts); each expert is handed on as its own HF-named matrix.
_EXPERT_TENSORS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
# Older Mixtral files: one tensor per expert, blk.N.ffn_gate.E.weight.
_PER_EXPERT_RE = re.compile(r"blk\.(\d+)\.ffn_(gate|up|down)\.(\d+)\.weight")
# Gemma's layers have four norms; llama.cpp names them apart from Llama's two.
_GEMMA_LAYER_TENSORS = {
    **_LAYER_TENSORS,
    "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_GEMMA_ARCHS = {"gemma3"}
# What llama.cpp assumes of gemma3 files rather than storing: one global layer in six, and
# the sliding layers' rope base.
_GEMMA3_SWA_PATTERN = 6
_GEMMA3_LOCAL_ROPE_BASE = 10000.0
# Tensors llama.cpp stores that have no HF parameter (rope_freqs feeds config.rope_scaling instead).
_NON_HF_TENSORS = {"rope_freqs.weight"}
_LAYER_TENSOR_RE = re.compile(r"blk\.(\d+)\.([a-z_]+)\.(weight|bias)")

# Split regexes for byte-level BPE vocabularies, by tokenizer.ggml.pre. Any other value (default,
# gpt2, smollm, ...) uses the GPT-2 regex built into the ByteLevel pre-tokenizer, as transformers does.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PRE_TOKENIZER_SPLITS = {
    **dict.fromkeys(
        ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2", "dbrx",
         "smaug-bpe"),
        _LLAMA3_SPLIT,
    ),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "megrez"), _QWEN2_SPLIT),
}


class GGUFError(ValueError):
    """A GGUF file that cannot be used, with the path and what is wrong."""


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

    def quantized_names(self) -> set[str]:
        """HF names of the tensors `tensors(keep_quantized=True)` yields as QuantTensor."""
        return {hf for t in self._reader.tensors if _keeps_blocks(t) for hf, _ in _hf_tensor_names(t, self.arch)}

    def tensors(self, dtype: torch.dtype = torch.float32,
                keep_quantized: bool = False) -> Iterator[tuple[str, torch.Tensor | QuantTensor]]:
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
                raise GGUFError(f"{self.path}: tensor {tensor.name} ({tensor.tensor_type.name}) has blocks "
                                "with a NaN or inf scale; the file is corrupt")
            if arch in _GEMMA_ARCHS and hf_name.endswith("norm.weight"):
                array = array - 1  # llama.cpp stores Gemma's 1 + weight; HF names mean weight
            if hf_name.endswith("shared_expert_gate.weight"):
                array = array.reshape(1, -1)  # llama.cpp stores the [1, hidden] gate as a vector
            if not array.flags.writeable:  # memmap views (F32) are read-only; torch wants to own the data
                array = np.array(array)
            yield hf_name, torch.from_numpy(array).to(dtype)

    def _expert_tensors(self, tensor: Any, dtype: torch.dtype,
                        keep_quantized: bool) -> Iterator[tuple[str, torch.Tensor | QuantTensor]]:
        """A 3-D expert tensor as one HF-named matrix per expert: views of the file's blocks, or
        dequantized (the whole tensor at once, then sliced)."""
        import gguf

        names = _hf_tensor_names(tensor, self.arch)
        if not names:
            logger.warning("%s: skipping tensor %s, which has no HF counterpart", self.path, tensor.name)
            return
        cols, rows, experts = (int(d) for d in tensor.shape)
        if keep_quantized and _keeps_blocks(tensor):
            from ..quant.kernels import bad_scale_blocks

            per = int(tensor.n_bytes) // experts
            with warnings.catch_warnings():  # read-only views of the mmap'd file: never written
                warnings.simplefilter("ignore", UserWarning)
                data = torch.from_numpy(tensor.data.reshape(experts, rows, -1))
            for (hf_name, e), block in zip(names, data):
                qt = QuantTensor(tensor.tensor_type.name, block, (rows, cols))
                if bad_scale_blocks(qt):
                    raise GGUFError(f"{self.path}: tensor {tensor.name} ({qt.fmt}) has blocks with a NaN or inf "
                                    f"scale (expert {e}); the file is corrupt")
                qt.release = functools.partial(_release_pages, self._reader, int(tensor.data_offset) + e * per, per)
                yield hf_name, qt
            return
        try:
            array = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        except (NotImplementedError, ValueError) as exc:
            raise GGUFError(f"{self.path}: cannot dequantize tensor {tensor.name}: {exc}") from exc
        array = array.reshape(experts, rows, cols)
        if tensor.tensor_type.name not in ("F32", "F16", "BF16") and not np.isfinite(array).all():
            raise GGUFError(f"{self.path}: tensor {tensor.name} ({tensor.tensor_type.name}) has blocks "
                            "with a NaN or inf scale; the file is corrupt")
        for hf_name, e in names:
            yield hf_name, torch.from_numpy(np.array(array[e])).to(dtype)

    def _quant_tensor(self, tensor: Any, heads: int | None) -> QuantTensor:
        from ..quant.kernels import bad_scale_blocks

        rows, cols = int(tensor.shape[1]), int(tensor.shape[0])
        with warnings.catch_warnings():  # a read-only view of the mmap'd file: never written
            warnings.simplefilter("ignore", UserWarning)
            data = torch.from_numpy(tensor.data.reshape(rows, -1))
        qt = QuantTensor(tensor.tensor_type.name, data, (rows, cols))
        bad = bad_scale_blocks(qt)
        if bad:
            raise GGUFError(f"{self.path}: tensor {tensor.name} ({qt.fmt}) has {bad} block(s) with a NaN or "
                            "inf scale; the file is corrupt")
        if heads is not None:
            # Undo llama.cpp's q/k row permutation on whole block rows; the copy replaces the
            # file's pages, which are handed back so they are not held twice.
            half = rows // heads // 2
            index = torch.arange(rows).view(heads, half, 2).transpose(1, 2).reshape(-1)
            qt = qt.permute_rows(index)
            _release_pages(self._reader, int(tensor.data_offset), int(tensor.n_bytes))
        else:  # packing at placement copies it: then its file pages are handed back too
            qt.release = functools.partial(_release_pages, self._reader, int(tensor.data_offset),
                                           int(tensor.n_bytes))
        return qt


def _keeps_blocks(tensor: Any) -> bool:
    from ..quant.formats import FORMATS

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
        path, config["architectures"][0], config["num_hidden_layers"], len(reader.tensors),
    )
    # The vocabulary's lists live on in the tokenizer; as Python objects they would hold tens
    # of MB (a 152k vocabulary) for the life of the engine.
    for key in [k for k in metadata if k.startswith("tokenizer.ggml.") and isinstance(metadata[k], list)]:
        del metadata[key]
    return GGUFCheckpoint(path=path, config=config, tokenizer=tokenizer, metadata=metadata, _reader=reader)


_LORA_SUFFIXES = (".lora_a", ".lora_b")


@dataclass
class GGUFLoRA:
    """A llama.cpp LoRA adapter file (convert_lora_to_gguf.py): per HF module name (e.g.
    "model.layers.0.self_attn.q_proj"), its float32 (A [r, in], B [out, r]) as the file stores
    them; for `permuted_qk` architectures, q/k's B rows are still in llama.cpp's rope order."""

    path: Path
    arch: str
    alpha: float  # adapter.lora.alpha; llama.cpp scales each pair by alpha / its rank (0: by 1)
    pairs: dict[str, tuple[torch.Tensor, torch.Tensor]]

    @property
    def permuted_qk(self) -> bool:
        return self.arch in _PERMUTED_QK_ARCHS

    @property
    def hf_architecture(self) -> str | None:
        return _ARCHITECTURES[self.arch][0] if self.arch in _ARCHITECTURES else None

    def hf_pairs(self, n_heads: int, n_kv_heads: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """The pairs in HF order: q/k's B rows (their outputs) taken back out of llama.cpp's rope
        order, as the base's q/k weights are (`n_heads`, `n_kv_heads`: the base model's)."""
        if not self.permuted_qk:
            return dict(self.pairs)
        out = {}
        for name, (a, b) in self.pairs.items():
            heads = n_heads if name.endswith(".q_proj") else n_kv_heads if name.endswith(".k_proj") else None
            if heads is not None:
                if b.shape[0] % (2 * heads):
                    raise GGUFError(f"{self.path}: {name} lora_b has {b.shape[0]} rows, which {heads} heads "
                                    "cannot share: the adapter is for another base model")
                b = torch.from_numpy(_undo_rope_permute(b.numpy(), heads).copy())
            out[name] = (a, b)
        return out


def read_gguf_lora(path: str | os.PathLike) -> GGUFLoRA:
    """Validate and read a GGUF LoRA adapter. Every problem is raised as GGUFError."""
    import gguf

    path = Path(path)
    reader = _scan_file(path)
    try:
        _check_tensors(path, reader.tensors)
        meta = reader.metadata
        kind, adapter = meta.get("general.type"), meta.get("adapter.type")
        if kind != "adapter":
            raise GGUFError(f"{path}: general.type is {kind!r}, not 'adapter': this is a model file, not a "
                            "LoRA adapter (give it as the model, or convert the adapter with llama.cpp's "
                            "convert_lora_to_gguf.py)")
        if adapter != "lora":
            raise GGUFError(f"{path}: adapter.type is {adapter!r}; only LoRA adapters ('lora') are supported")
        arch = meta.get("general.architecture")
        if not isinstance(arch, str):
            raise GGUFError(f"{path}: metadata has no general.architecture")
        alpha = meta.get("adapter.lora.alpha", 0.0)
        if not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
            raise GGUFError(f"{path}: adapter.lora.alpha is {alpha!r}, not a number")
        halves: dict[str, list] = {}
        for t in reader.tensors:
            base, suffix = t.name[:-7], t.name[-7:]
            if suffix not in _LORA_SUFFIXES:
                raise GGUFError(f"{path}: tensor {t.name} is not a LoRA A/B weight (*.weight.lora_a / "
                                "*.weight.lora_b); this adapter holds weights pagedllm cannot apply")
            hf = _hf_tensor_name(base, arch)
            if hf is None or not hf.endswith(".weight"):
                raise GGUFError(f"{path}: tensor {t.name} targets {base}, which LoRA cannot apply to here "
                                "(q/k/v/o and gate/up/down of dense layers)")
            if len(t.shape) != 2:
                raise GGUFError(f"{path}: tensor {t.name} has {len(t.shape)} dimensions, expected 2")
            try:
                array = gguf.quants.dequantize(t.data, t.tensor_type)
            except (NotImplementedError, ValueError) as exc:
                raise GGUFError(f"{path}: cannot dequantize tensor {t.name}: {exc}") from exc
            array = np.array(array, dtype=np.float32).reshape(int(t.shape[1]), int(t.shape[0]))
            if not np.isfinite(array).all():
                raise GGUFError(f"{path}: tensor {t.name} ({t.tensor_type.name}) holds NaN or inf values")
            halves.setdefault(hf[: -len(".weight")], [None, None])[_LORA_SUFFIXES.index(suffix)] = array
    finally:
        reader.mm.close()
    if not halves:
        raise GGUFError(f"{path}: the adapter holds no LoRA tensors")
    pairs = {}
    for name, (a, b) in halves.items():
        if a is None or b is None:
            raise GGUFError(f"{path}: {name} has lora_{'a' if a is None else 'b'} missing")
        if a.shape[0] != b.shape[1]:
            raise GGUFError(f"{path}: {name} has lora_a of rank {a.shape[0]} but lora_b of rank {b.shape[1]}")
        pairs[name] = (torch.from_numpy(a), torch.from_numpy(b))
    return GGUFLoRA(path, arch, float(alpha), pairs)


# --------------------------------------------------------------------------------------------------
# validation: our own header walk, so that truncated or corrupt files give exact messages


class _Truncated(Exception):
    pass


class _Cursor:
    def __init__(self, buf: Any, endian: str) -> None:
        self.buf = buf
        self.pos = 0
        self.endian = endian

    def take(self, n: int) -> int:
        start = self.pos
        if n < 0 or start + n > len(self.buf):
            raise _Truncated
        self.pos = start + n
        return start

    def u32(self) -> int:
        return struct.unpack_from(self.endian + "I", self.buf, self.take(4))[0]

    def u64(self) -> int:
        return struct.unpack_from(self.endian + "Q", self.buf, self.take(8))[0]

    def string(self) -> bytes:
        n = self.u64()
        start = self.take(n)
        return bytes(self.buf[start : start + n])


def _scan_file(path: Path) -> "_GGUFFile":
    if not path.exists():
        raise GGUFError(f"{path}: no such file")
    if not path.is_file():
        raise GGUFError(f"{path}: not a regular file")
    try:
        size = path.stat().st_size
        with open(path, "rb") as fh:
            magic = fh.read(4)
            if magic != GGUF_MAGIC:
                raise GGUFError(f"{path}: not a GGUF file (magic {magic!r}, expected {GGUF_MAGIC!r})")
            buf = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        try:
            return _walk_header(path, buf)
        except _Truncated:
            buf.close()
            raise GGUFError(
                f"{path}: file is truncated: the header runs past the end of the file ({size} bytes)"
            ) from None
        except BaseException:
            buf.close()
            raise
    except OSError as exc:
        raise GGUFError(f"{path}: cannot read the file: {exc}") from exc


# Numeric metadata value types -> numpy dtype characters.
_VT_NUMPY = {0: "u1", 1: "i1", 2: "u2", 3: "i2", 4: "u4", 5: "i4", 6: "f4", 7: "?", 10: "u8", 11: "i8", 12: "f8"}


def _read_value(cur: _Cursor, value_type: int) -> Any:
    """One metadata value as plain Python (str, int, float, bool, or a list of them)."""
    if value_type in _VT_NUMPY:
        dt = np.dtype(_VT_NUMPY[value_type]).newbyteorder(cur.endian)
        return np.frombuffer(cur.buf, dt, 1, cur.take(dt.itemsize))[0].item()
    if value_type == _VT_STRING:
        return cur.string().decode("utf-8")
    if value_type == _VT_ARRAY:
        item_type, count = cur.u32(), cur.u64()
        if item_type in _VT_NUMPY:  # one read for the whole array (token scores, types)
            dt = np.dtype(_VT_NUMPY[item_type]).newbyteorder(cur.endian)
            return np.frombuffer(cur.buf, dt, count, cur.take(dt.itemsize * count)).tolist()
        if item_type == _VT_STRING:
            return _read_strings(cur, count)
        return [_read_value(cur, item_type) for _ in range(count)]
    raise ValueError(f"unknown metadata value type {value_type}")


def _read_strings(cur: _Cursor, count: int) -> list[str]:
    """An array of strings (a vocabulary, its merges): the same reads as `cur.string()`, in one
    tight loop, since a 49k vocabulary and its merges are ~100k strings on the way to a first token."""
    buf, pos, end = cur.buf, cur.pos, len(cur.buf)
    length = struct.Struct(cur.endian + "Q").unpack_from
    out = []
    append = out.append
    for _ in range(count):
        if pos + 8 > end:
            raise _Truncated
        n = length(buf, pos)[0]
        pos += 8
        if pos + n > end:
            raise _Truncated
        append(str(buf[pos:pos + n], "utf-8"))
        pos += n
    cur.pos = pos
    return out


@dataclass
class _Tensor:
    """A tensor of the file: its header entry and a read-only numpy view of its bytes."""

    name: str
    shape: tuple[int, ...]  # GGUF order: fastest-varying first
    tensor_type: Any  # gguf.GGMLQuantizationType
    data_offset: int
    n_bytes: int
    _buf: Any = field(repr=False, default=None)

    @property
    def data(self) -> np.ndarray:
        """The bytes as gguf-py's reader shapes them: typed F32/F16 arrays in numpy order, else
        uint8 rows of blocks."""
        import gguf

        dims = tuple(reversed(self.shape))
        typed = {gguf.GGMLQuantizationType.F32: np.float32, gguf.GGMLQuantizationType.F16: np.float16}
        if self.tensor_type in typed:
            dt = np.dtype(typed[self.tensor_type])
            return np.frombuffer(self._buf, dt, self.n_bytes // dt.itemsize, self.data_offset).reshape(dims)
        flat = np.frombuffer(self._buf, np.uint8, self.n_bytes, self.data_offset)
        return flat.reshape(*dims[:-1], -1) if dims else flat


@dataclass
class _GGUFFile:
    """The decoded header of a GGUF file and a read-only mmap of it. Our own walk rather than
    gguf-py's GGUFReader, which builds numpy views for every token and merge: 200 MB and
    seconds for a 49k vocabulary, where plain lists take a few MB."""

    metadata: dict[str, Any]
    tensors: list[_Tensor]
    mm: Any = field(repr=False, default=None)


def _walk_header(path: Path, buf: Any) -> _GGUFFile:
    import gguf

    # Files written on big-endian hosts have a byte-swapped version; gguf's reader detects it the same way.
    cur = _Cursor(buf, "<")
    cur.take(4)
    version = cur.u32()
    if version and version & 0xFFFF == 0:
        cur.endian = ">"
        version = struct.unpack_from(">I", buf, 4)[0]
    if version not in (2, 3):
        raise GGUFError(f"{path}: unsupported GGUF version {version} (supported: 2, 3)")
    n_tensors, n_kv = cur.u64(), cur.u64()

    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key = cur.string().decode("utf-8", errors="replace")
        value_type = cur.u32()
        try:
            metadata[key] = _read_value(cur, value_type)
        except (UnicodeDecodeError, ValueError) as exc:
            raise GGUFError(f"{path}: cannot decode metadata key {key!r}: {exc}") from None
    alignment = metadata.get("general.alignment", _DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise GGUFError(f"{path}: invalid general.alignment {alignment} (must be a power of two)")

    raw = []
    for _ in range(n_tensors):
        name = cur.string().decode("utf-8", errors="replace")
        n_dims = cur.u32()
        if n_dims > 8:
            raise GGUFError(f"{path}: tensor {name} claims {n_dims} dimensions; the file is corrupt")
        dims = tuple(cur.u64() for _ in range(n_dims))
        raw.append((name, dims, cur.u32(), cur.u64()))
    data_start = -(-cur.pos // alignment) * alignment

    tensors = []
    for name, dims, type_id, rel_offset in raw:
        n_elements = math.prod(dims)
        try:
            qtype = gguf.GGMLQuantizationType(type_id)
            block, type_size = gguf.GGML_QUANT_SIZES[qtype]
        except (ValueError, KeyError):
            raise GGUFError(
                f"{path}: unknown tensor type id {type_id} for tensor {name}; supported: {_supported_type_names()}"
            ) from None
        if dims and dims[0] % block:
            raise GGUFError(f"{path}: tensor {name} has row length {dims[0]}, not a multiple of its block {block}")
        tensors.append(_Tensor(name, dims, qtype, data_start + rel_offset, n_elements // block * type_size, buf))
    return _GGUFFile(metadata, tensors, buf)


def _supported_types() -> set[int]:
    import gguf

    return {int(gguf.GGMLQuantizationType.F32), int(gguf.GGMLQuantizationType.F16)} | {
        int(t) for t in gguf.quants._type_traits
    }


def _supported_type_names() -> str:
    import gguf

    return ", ".join(sorted(gguf.GGMLQuantizationType(t).name for t in _supported_types()))


def _check_tensors(path: Path, infos: list["_Tensor"]) -> None:
    import gguf

    size = path.stat().st_size
    supported = _supported_types()
    for info in infos:
        if int(info.tensor_type) not in supported:
            type_name = info.tensor_type.name
            raise GGUFError(
                f"{path}: unsupported tensor type {type_name} for tensor {info.name}; "
                f"supported: {_supported_type_names()}"
            )
        if info.data_offset + info.n_bytes > size:
            raise GGUFError(
                f"{path}: file is truncated: tensor {info.name} needs {info.n_bytes} bytes at offset "
                f"{info.data_offset} but the file has {size}"
            )


# --------------------------------------------------------------------------------------------------
# metadata and config


def _require(path: Path, meta: dict, key: str) -> Any:
    if key not in meta:
        raise GGUFError(f"{path}: metadata key {key!r} is missing")
    return meta[key]


def _build_config(path: Path, meta: dict, tensor_names: set[str], reader: Any) -> dict[str, Any]:
    arch = meta["general.architecture"]
    if arch not in _ARCHITECTURES:
        raise GGUFError(
            f"{path}: unsupported architecture {arch!r}; supported: {', '.join(sorted(_ARCHITECTURES))}"
        )

    def get(name: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{name}", default)

    hidden = int(_require(path, meta, f"{arch}.embedding_length"))
    n_heads = int(_require(path, meta, f"{arch}.attention.head_count"))
    n_kv_heads = get("attention.head_count_kv", n_heads)
    if isinstance(n_kv_heads, list):  # some archs store one count per layer
        n_kv_heads = max(n_kv_heads)
    head_dim = get("attention.key_length")
    if head_dim is None and arch in _PERMUTED_QK_ARCHS:
        head_dim = get("rope.dimension_count")
    head_dim = int(head_dim) if head_dim is not None else hidden // n_heads
    sliding_window = get("attention.sliding_window")
    rope_theta = float(get("rope.freq_base", 10000.0))

    hf_arch, model_type = _ARCHITECTURES[arch]
    if arch == "llama" and sliding_window:
        hf_arch, model_type = _ARCHITECTURES["mistral"]
    n_layers = int(_require(path, meta, f"{arch}.block_count"))
    moe = _moe_config(path, meta, arch, hidden, n_layers, reader)
    if moe and arch == "llama":
        hf_arch, model_type = _MIXTRAL
    # Qwen-MoE files keep the experts' size apart; the dense size serves only dense layers.
    if moe and arch in ("qwen2moe", "qwen3moe"):
        ffn = int(get("feed_forward_length") or moe["moe_intermediate_size"])
    else:
        ffn = int(_require(path, meta, f"{arch}.feed_forward_length"))

    tokens = meta.get("tokenizer.ggml.tokens")
    vocab_size = get("vocab_size") or (len(tokens) if tokens else None)
    if vocab_size is None:
        raise GGUFError(f"{path}: cannot tell the vocabulary size (no {arch}.vocab_size and no tokenizer tokens)")

    eos_ids = _eos_token_ids(meta)
    config: dict[str, Any] = {
        "architectures": [hf_arch],
        "model_type": model_type,
        "vocab_size": int(vocab_size),
        "hidden_size": hidden,
        "intermediate_size": ffn,
        "num_hidden_layers": n_layers,
        "num_attention_heads": n_heads,
        "num_key_value_heads": int(n_kv_heads),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": rope_theta,
        "rope_scaling": _rope_scaling(path, meta, arch, head_dim, rope_theta, reader),
        "max_position_embeddings": int(get("context_length", 4096)),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": eos_ids[0] if len(eos_ids) == 1 else (eos_ids or None),
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
        "sliding_window": int(sliding_window) if sliding_window else None,
        # Qwen2 always has q/k/v biases; elsewhere the tensors say.
        "attention_bias": arch == "qwen2" or "blk.0.attn_q.bias" in tensor_names,
        "mlp_bias": False,
        **moe,
    }
    if model_type == "qwen2_moe":
        config["qkv_bias"] = "blk.0.attn_q.bias" in tensor_names
    if arch == "olmoe" and get("attention.clamp_kqv"):
        config["clip_qkv"] = float(get("attention.clamp_kqv"))
    if model_type == "qwen2":
        config["use_sliding_window"] = bool(sliding_window)
    if arch == "gemma3":
        # As llama.cpp runs these files: the attention scale is 1/sqrt(head_dim) (Gemma 3 27B,
        # whose query_pre_attn_scalar differs, is not told apart by the file).
        config.update(hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=head_dim,
                      sliding_window_pattern=_GEMMA3_SWA_PATTERN,
                      rope_local_base_freq=_GEMMA3_LOCAL_ROPE_BASE,
                      hidden_act="gelu_pytorch_tanh")
    return config


def _moe_config(path: Path, meta: dict, arch: str, hidden: int, n_layers: int, reader: Any) -> dict[str, Any]:
    """The config's MoE fields from `{arch}.expert_*` and the expert tensors, whose shapes are
    checked against them here (a mismatch names the tensor); {} for a dense file."""
    experts = int(meta.get(f"{arch}.expert_count") or 0)
    if arch in _MOE_NORM_TOPK and arch != "llama" and not experts:
        raise GGUFError(f"{path}: {arch} is a mixture of experts but {arch}.expert_count is missing")
    if not experts:
        return {}
    used = int(meta.get(f"{arch}.expert_used_count") or 0)
    if not 1 <= used <= experts:
        raise GGUFError(f"{path}: {arch}.expert_used_count = {used} must be between 1 and "
                        f"{arch}.expert_count = {experts}")
    if arch in ("qwen2moe", "qwen3moe"):
        inter = int(_require(path, meta, f"{arch}.expert_feed_forward_length"))
    else:
        inter = int(_require(path, meta, f"{arch}.feed_forward_length"))
    shared = int(meta.get(f"{arch}.expert_shared_feed_forward_length") or 0)
    by_name = {t.name: t for t in reader.tensors}
    want = {"ffn_gate_exps": (hidden, inter, experts), "ffn_up_exps": (hidden, inter, experts),
            "ffn_down_exps": (inter, hidden, experts)}
    dense_layers = []
    for i in range(n_layers):
        found = [p for p in want if f"blk.{i}.{p}.weight" in by_name]
        if not found and f"blk.{i}.ffn_gate.0.weight" in by_name:  # one tensor per expert
            found = ["per-expert"]
            for e in range(experts):
                for p, shape in (("gate", (hidden, inter)), ("up", (hidden, inter)), ("down", (inter, hidden))):
                    t = by_name.get(f"blk.{i}.ffn_{p}.{e}.weight")
                    if t is None or tuple(t.shape) != shape:
                        raise GGUFError(f"{path}: tensor blk.{i}.ffn_{p}.{e}.weight "
                                        f"{'is missing' if t is None else f'has shape {tuple(t.shape)}'}; "
                                        f"expected {shape} for {experts} experts of feed-forward length {inter}")
        for p in found if found != ["per-expert"] else []:
            t = by_name[f"blk.{i}.{p}.weight"]
            if tuple(t.shape) != want[p]:
                raise GGUFError(f"{path}: tensor blk.{i}.{p}.weight has shape {tuple(t.shape)}, expected "
                                f"{want[p]} ({arch}.expert_count = {experts}, expert feed-forward length {inter})")
        if found and found != ["per-expert"] and len(found) != 3:
            missing = sorted(set(want) - set(found))
            raise GGUFError(f"{path}: layer {i} has {', '.join(found)} but no {', '.join(missing)} tensor")
        if not found:
            dense_layers.append(i)
            continue
        router = by_name.get(f"blk.{i}.ffn_gate_inp.weight")
        if router is None or tuple(router.shape) != (hidden, experts):
            raise GGUFError(f"{path}: tensor blk.{i}.ffn_gate_inp.weight (the router) "
                            f"{'is missing' if router is None else f'has shape {tuple(router.shape)}'}; "
                            f"expected {(hidden, experts)}")
    if len(dense_layers) == n_layers:
        raise GGUFError(f"{path}: {arch}.expert_count = {experts} but the file has no expert tensors "
                        "(blk.N.ffn_gate_exps / ffn_up_exps / ffn_down_exps.weight)")
    norm = meta.get(f"{arch}.expert_weights_norm")
    return {
        "num_experts": experts,
        "num_local_experts": experts,
        "num_experts_per_tok": used,
        "moe_intermediate_size": inter,
        "shared_expert_intermediate_size": shared,
        "norm_topk_prob": _MOE_NORM_TOPK[arch] if norm is None else bool(norm),
        "decoder_sparse_step": 1,
        "mlp_only_layers": dense_layers,
    }


def _eos_token_ids(meta: dict) -> list[int]:
    """EOS plus llama.cpp's end-of-turn / end-of-message tokens, which also end a generation."""
    ids: list[int] = []
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        value = meta.get(key)
        if value is not None and int(value) not in ids:
            ids.append(int(value))
    return ids


def _rope_scaling(path: Path, meta: dict, arch: str, head_dim: int, theta: float, reader: Any) -> dict | None:
    scaling_type = meta.get(f"{arch}.rope.scaling.type")
    factor = meta.get(f"{arch}.rope.scaling.factor")
    original = meta.get(f"{arch}.rope.scaling.original_context_length")
    rope_freqs = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if rope_freqs is not None:
        # Llama 3.x: llama.cpp stores the per-frequency divisors instead of the parameters.
        import gguf

        divisors = gguf.quants.dequantize(rope_freqs.data, rope_freqs.tensor_type).reshape(-1)
        return _llama3_scaling_from_divisors(path, divisors.astype(np.float64), head_dim, theta, original)
    if scaling_type in (None, "none") or not factor:
        return None
    scaling: dict[str, Any] = {"rope_type": str(scaling_type), "factor": float(factor)}
    if original:
        scaling["original_max_position_embeddings"] = int(original)
    if scaling_type == "yarn":
        for gguf_key, hf_key in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow"),
                                 ("attn_factor", "attention_factor")):
            value = meta.get(f"{arch}.rope.scaling.{gguf_key}")
            if value is not None:
                scaling[hf_key] = float(value)
    return scaling


def _llama3_scaling_from_divisors(
    path: Path, divisors: np.ndarray, head_dim: int, theta: float, original: int | None
) -> dict[str, Any]:
    """Recover llama3 rope_scaling parameters from llama.cpp's rope_freqs tensor.

    The converter writes, per frequency, 1 (short wavelengths), `factor` (long ones) or, in between,
    1 / ((1 - s) / factor + s) with s = (orig / wavelen - low) / (high - low), i.e. s is linear in
    1 / wavelen. Fitting that line gives orig / (high - low) and -low / (high - low); the third
    unknown comes from the metadata's original context length or, failing that, low_freq_factor = 1
    (true of every released Llama 3 model).
    """
    factor = float(divisors.max())
    result: dict[str, Any] = {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": int(original) if original else 8192,
    }
    if factor <= 1.0:
        return result
    inv_freq = theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / inv_freq[: len(divisors)]
    mid = (divisors > 1.0 + 1e-4) & (divisors < factor - 1e-4)
    if mid.sum() < 2:
        logger.warning("%s: too few rope_freqs points to fit llama3 scaling; assuming Llama 3.1 defaults", path)
        return result
    smooth = (1.0 / divisors[mid] - 1.0 / factor) / (1.0 - 1.0 / factor)
    slope, intercept = np.polyfit(1.0 / wavelen[mid], smooth, 1)
    if original:
        span = original / slope
        low = -intercept * span
    else:
        low = 1.0
        span = -1.0 / intercept
        original = slope * span
    result.update(
        low_freq_factor=round(float(low), 4),
        high_freq_factor=round(float(low + span), 4),
        original_max_position_embeddings=int(round(float(original))),
    )
    return result


# --------------------------------------------------------------------------------------------------
# tensors


def _hf_tensor_names(tensor: Any, arch: str) -> list[tuple[str, int | None]]:
    """The HF names a file tensor is handed on under, with the expert index of each where the
    tensor holds experts (a 3-D tensor: one name per expert)."""
    match = _LAYER_TENSOR_RE.fullmatch(tensor.name)
    if match and match.group(2) in _EXPERT_TENSORS and len(tensor.shape) == 3:
        layer, part, _ = match.groups()
        return [(f"model.layers.{layer}.mlp.experts.{e}.{_EXPERT_TENSORS[part]}.weight", e)
                for e in range(int(tensor.shape[2]))]
    per_expert = _PER_EXPERT_RE.fullmatch(tensor.name)
    if per_expert:
        layer, part, e = per_expert.groups()
        return [(f"model.layers.{layer}.mlp.experts.{e}.{part}_proj.weight", int(e))]
    hf = _hf_tensor_name(tensor.name, arch)
    return [] if hf is None else [(hf, None)]


def _hf_tensor_name(gguf_name: str, arch: str = "llama") -> str | None:
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    names = _GEMMA_LAYER_TENSORS if arch in _GEMMA_ARCHS else _LAYER_TENSORS
    match = _LAYER_TENSOR_RE.fullmatch(gguf_name)
    if match and match.group(2) in names:
        layer, part, kind = match.groups()
        return f"model.layers.{layer}.{names[part]}.{kind}"
    return None


def _undo_rope_permute(array: np.ndarray, n_heads: int) -> np.ndarray:
    """Invert llama.cpp's Q/K row permutation (it interleaves each head's two rotary halves).

    llama.cpp reorders each head's rows from [first half, second half] to pairs (x0, x_half, x1, ...);
    HF's rotate_half wants the halves back, so view rows as (head, pair, 2) and swap the last two axes.
    """
    rows = array.shape[0]
    half = rows // n_heads // 2
    return array.reshape(n_heads, half, 2, *array.shape[1:]).swapaxes(1, 2).reshape(array.shape)


# --------------------------------------------------------------------------------------------------
# tokenizer


def _build_tokenizer(path: Path, meta: dict) -> Tokenizer:
    import tokenizers

    model = meta.get("tokenizer.ggml.model")
    tokens = meta.get("tokenizer.ggml.tokens")
    if not tokens:
        raise GGUFError(f"{path}: the file has no tokenizer (tokenizer.ggml.tokens is missing)")
    token_types = meta.get("tokenizer.ggml.token_type") or []
    if model == "gpt2":
        tk = _byte_level_bpe(meta, tokens)
        default_specials: tuple[str, ...] = ("<|endoftext|>",)
        add_bos_default = False
    elif model == "llama":
        tk = _sentencepiece_bpe(path, meta, tokens)
        default_specials = ("<unk>", "<s>", "</s>")
        add_bos_default = True  # llama.cpp adds BOS for SentencePiece vocabularies unless told not to
    else:
        raise GGUFError(f"{path}: unsupported tokenizer model {model!r}; supported: gpt2, llama")

    def token_at(key: str) -> str | None:
        index = meta.get(key)
        return tokens[index] if index is not None and 0 <= index < len(tokens) else None

    bos, eos = token_at("tokenizer.ggml.bos_token_id"), token_at("tokenizer.ggml.eos_token_id")
    unk, pad = token_at("tokenizer.ggml.unknown_token_id"), token_at("tokenizer.ggml.padding_token_id")
    _add_gguf_added_tokens(tk, model, tokens, token_types)
    # transformers also registers the named special tokens (and its tokenizer class's defaults) as
    # special, so decode(skip_special_tokens=True) drops them; only ones already in the vocabulary,
    # so the vocabulary never grows past what the model's embedding covers.
    named = [t for t in (*default_specials, bos, eos, unk, pad) if t is not None]
    already = {tok.content for tok in tk.get_added_tokens_decoder().values()}
    extra = [t for t in dict.fromkeys(named) if t not in already and tk.token_to_id(t) is not None]
    if extra:
        tk.add_special_tokens([tokenizers.AddedToken(t, special=True, normalized=False) for t in extra])

    tokenizer = Tokenizer(
        tk,
        bos_token=bos,
        eos_token=eos,
        add_bos_token=bool(meta.get("tokenizer.ggml.add_bos_token", add_bos_default)),
        add_eos_token=bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        chat_template=meta.get("tokenizer.chat_template"),
        eos_token_ids=_eos_token_ids(meta),
        pad_token=pad,
        unk_token=unk,
        fim_token_ids={k: int(meta[f"tokenizer.ggml.fim_{k}_token_id"]) for k in ("pre", "suf", "mid", "rep", "sep")
                       if f"tokenizer.ggml.fim_{k}_token_id" in meta},
    )
    # A template is code, and this one came with a (maybe downloaded) file: check it runs.
    tokenizer.chat_template_source = f"GGUF metadata (tokenizer.chat_template of {path.name})"
    template_guard.check_gguf_template(tokenizer)
    return tokenizer


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte alphabet: printable Latin-1 bytes stand for themselves, the rest map to 256+."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def _merge_pairs(merges: list[str]) -> list[tuple[str, str]]:
    pairs = []
    for merge in merges:
        left, sep, right = merge.partition(" ")
        if sep and left and right:
            pairs.append((left, right))
    return pairs


def _byte_level_bpe(meta: dict, tokens: list[str]) -> Any:
    from tokenizers import Regex, Tokenizer as HFTokenizer, decoders, models, pre_tokenizers

    spelling = _bytes_to_unicode()
    # A token written with characters outside the byte alphabet (llama.cpp stores some that way)
    # is respelled in it, so lookups of its bytes work. One regex search a token: a set per
    # token cost ~0.1 s of a cold start on a 49k vocabulary.
    outside = re.compile("[^" + re.escape("".join(spelling.values())) + "]").search
    vocab = {
        "".join(spelling[b] for b in tok.encode("utf-8")) if outside(tok) else tok: i
        for i, tok in enumerate(tokens)
    }
    merges = _merge_pairs(meta.get("tokenizer.ggml.merges") or [])
    tk = HFTokenizer(
        models.BPE(vocab=vocab, merges=merges, dropout=None, continuing_subword_prefix="", end_of_word_suffix="",
                   fuse_unk=False)
    )
    split = _PRE_TOKENIZER_SPLITS.get(meta.get("tokenizer.ggml.pre"))
    if split is None:
        tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        tk.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(split), behavior="isolated"),
             pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        )
    tk.decoder = decoders.ByteLevel()
    return tk


_GEMMA_ARCHS = ("gemma", "gemma2", "gemma3")


def _sentencepiece_bpe(path: Path, meta: dict, tokens: list[str]) -> Any:
    from tokenizers import Tokenizer as HFTokenizer, decoders, models, pre_tokenizers

    gemma = meta.get("general.architecture") in _GEMMA_ARCHS
    if gemma:
        # Gemma files store a token of two or more spaces as spaces; the text it matches has ▁s.
        tokens = ["▁" * len(t) if " " in t and not t.strip() else t for t in tokens]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    if meta.get("tokenizer.ggml.merges"):
        merges = _merge_pairs(meta["tokenizer.ggml.merges"])
    else:
        scores = meta.get("tokenizer.ggml.scores")
        if not scores or len(scores) != len(tokens):
            raise GGUFError(f"{path}: SentencePiece vocabulary has neither merges nor one score per token")
        if gemma:  # Gemma's scores do not follow its merge order; the file's token order does
            scores = [-float(i) for i in range(len(tokens))]
        merges = _merges_from_scores(tokens, scores)
    tk = HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=True, byte_fallback=True, dropout=None))
    tk.normalizer = None
    # add_space_prefix false (Gemma): no "▁" before the text, and none to strip when decoding.
    prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    tk.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first" if prefix else "never",
                                                split=False)
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    tk.decoder = decoders.Sequence(steps + [decoders.Strip(" ", 1, 0)] if prefix else steps)
    return tk


def _merges_from_scores(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """Recover BPE merges from a SentencePiece vocabulary: every split of a token into two tokens is a
    merge, ranked by the merged token's score (best first), ties by the pieces' lengths then ids."""
    vocab = {tok: i for i, tok in enumerate(tokens)}
    score_of = dict(zip(tokens, scores))
    ranked: list[tuple[str, str, float]] = []
    for piece, score in score_of.items():
        splits = [
            (piece[:k], piece[k:], score)
            for k in range(1, len(piece))
            if piece[:k] in vocab and piece[k:] in vocab
        ]
        splits.sort(key=lambda m: (vocab[m[0]], vocab[m[1]]))
        ranked.extend(splits)
    ranked.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in ranked]


def _add_gguf_added_tokens(tk: Any, model: str, tokens: list[str], token_types: list[int]) -> None:
    """Control tokens become special added tokens, user-defined ones plain added tokens, so neither is
    split by BPE. In a byte-level vocabulary a control token outside the byte alphabet is a llama.cpp
    mislabel whose text is not in the vocabulary; adding it would grow the vocabulary, so skip it."""
    from tokenizers import AddedToken

    alphabet = set(_bytes_to_unicode().values()) if model == "gpt2" else None
    control = [
        AddedToken(tok, special=True, normalized=False)
        for tok, kind in zip(tokens, token_types)
        if kind == _TOKEN_CONTROL and (alphabet is None or set(tok) <= alphabet)
    ]
    if control:
        tk.add_special_tokens(control)
    user_defined = [tok for tok, kind in zip(tokens, token_types) if kind == _TOKEN_USER_DEFINED]
    vocab = tk.get_vocab(with_added_tokens=True) if user_defined else {}
    user = [AddedToken(tok, special=False, normalized=False) for tok in user_defined if tok in vocab]
    if user:
        tk.add_tokens(user)
