"""The GGUF container: our own walk of the header (metadata, tensor table) over a read-only
mmap, so that truncated or corrupt files give exact messages, and the checks every tensor passes
(a type gguf can dequantize, bytes inside the file)."""

from __future__ import annotations

import math
import mmap
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

GGUF_MAGIC = b"GGUF"
_DEFAULT_ALIGNMENT = 32

# GGUF metadata value types (gguf.GGUFValueType) of strings and arrays.
_VT_STRING = 8
_VT_ARRAY = 9


class GGUFError(ValueError):
    """A GGUF file that cannot be used, with the path and what is wrong."""


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
        append(str(buf[pos : pos + n], "utf-8"))
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
