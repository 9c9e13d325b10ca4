"""Contiguous KV per sequence, grown as needed: the path for `paged_attention=False`.

Each sequence owns one K and one V buffer per layer; attention runs one
sequence at a time. Block accounting still happens in the block manager so
capacity and preemption behave the same as the paged path. A quantized cache
(int8, f8e4m3) stores quantized buffers (+ int8's per-token scales) here too and
dequantizes the sequence's context when it attends.
"""

from __future__ import annotations

import torch

from ..kv import cache as kv_cache
from ..kv.quant import KVCodec, KVQuantMode, get_mode
from .metadata import AttentionMetadata
from .paged import sdpa_one


class _SeqKV:
    """One sequence's K/V of one layer: values [cap, H, D] and, for int8, scales [cap, H].

    Allocated unwritten (`torch.empty`): only the first `used` rows were ever written, and
    nothing reads or copies past them."""

    def __init__(self, cap: int, heads: int, dim: int, dtype: torch.dtype, scaled: bool, device: torch.device) -> None:
        self.data = [kv_cache.empty_pool((cap, heads, dim), dtype, device) for _ in range(2)]
        self.scales = [kv_cache.empty_pool((cap, heads), torch.float32, device) for _ in range(2)] if scaled else None
        self.used = 0

    @property
    def capacity(self) -> int:
        return self.data[0].shape[0]

    def tensors(self) -> list[torch.Tensor]:
        return self.data + (self.scales or [])

    def grown(self, cap: int, used: int) -> "_SeqKV":
        heads, dim = self.data[0].shape[1:]
        new = _SeqKV(cap, heads, dim, self.data[0].dtype, self.scales is not None, self.data[0].device)
        for dst, src in zip(new.tensors(), self.tensors()):
            _bytes(dst)[:used] = _bytes(src)[:used]
        new.used = used
        return new

    def clone(self) -> "_SeqKV":
        return self.grown(self.capacity, self.used)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())


def _bytes(t: torch.Tensor) -> torch.Tensor:
    # float8 has no CPU copy kernels for slices on every torch; bytes always work.
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


class ContiguousBackend:
    name = "torch-contiguous"
    uses_block_tables = False
    num_groups = 1  # one buffer per sequence holds every layer: no KV groups

    def __init__(
        self,
        dtype: torch.dtype,
        device: torch.device,
        mode: KVQuantMode | str = "auto",
        head_scales: torch.Tensor | None = None,
    ) -> None:
        self.dtype = dtype  # the compute dtype
        self.device = device
        self.mode = mode if isinstance(mode, KVQuantMode) else get_mode(mode)
        self.storage_dtype = self.mode.storage(dtype)
        # [num_layers, 2, H] for f8e4m3, on the device the K/V are quantized on
        self.head_scales = None if head_scales is None else head_scales.to(device, torch.float32)
        # seq_id -> layer -> its K/V
        self.store: dict[int, dict[int, _SeqKV]] = {}

    def layer(self, index: int, window: int | None, scale: float, softcap: float | None = None) -> "ContiguousLayer":
        hs = None if self.head_scales is None else self.head_scales[index]
        return ContiguousLayer(self, index, window, scale, KVCodec(self.mode, hs), softcap)

    def describe_decode(self) -> str:
        return f"{self.name}: one SDPA call per sequence over its contiguous buffer (paged attention off)"

    def free_seq(self, seq_id: int) -> None:
        self.store.pop(seq_id, None)

    def fork_seq(self, parent_id: int, child_id: int) -> None:
        """n > 1: the child starts from a private copy of the parent's K/V."""
        parent = self.store.get(parent_id)
        if parent is not None:
            self.store[child_id] = {i: kv.clone() for i, kv in parent.items()}

    @property
    def num_seqs_held(self) -> int:
        return len(self.store)

    @property
    def nbytes_held(self) -> int:
        """Bytes of every buffer held now (an upper bound on what is resident)."""
        return sum(kv.nbytes for per_layer in self.store.values() for kv in per_layer.values())

    def buffers(self, seq_id: int, layer: int, needed: int, like: torch.Tensor) -> _SeqKV:
        per_layer = self.store.setdefault(seq_id, {})
        kv = per_layer.get(layer)
        if kv is None or kv.capacity < needed:
            old = kv.capacity if kv is not None else 0
            cap = max(64, needed, 2 * old)
            if kv is None:
                kv = _SeqKV(cap, like.shape[1], like.shape[2], self.storage_dtype, self.mode.token_scales, self.device)
            else:
                kv = kv.grown(cap, kv.used)
            per_layer[layer] = kv
        return kv


class ContiguousLayer:
    def __init__(
        self,
        backend: ContiguousBackend,
        index: int,
        window: int | None,
        scale: float,
        codec: KVCodec,
        softcap: float | None = None,
    ) -> None:
        self.backend, self.index, self.window, self.scale = backend, index, window, scale
        self.codec, self.softcap = codec, softcap

    def decode_qkv(self, qkv, rope, meta, hq, hkv) -> None:  # no fused decode on this backend
        return None

    def stack_kv(self, dtype) -> None:
        return None

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        out = torch.empty_like(q)
        codec = self.codec
        for i, sid in enumerate(meta.seq_ids):
            s, e = meta.query_start_loc[i], meta.query_start_loc[i + 1]
            ctx = meta.context_lens[i]
            kv = self.backend.buffers(sid, self.index, ctx, k)
            lo = ctx - (e - s)
            for j, x in enumerate((k[s:e], v[s:e])):
                data, sc = codec.encode(x, j)
                _bytes(kv.data[j])[lo:ctx] = _bytes(data.to(kv.data[j].dtype))
                if sc is not None:
                    kv.scales[j][lo:ctx] = sc
            kv.used = ctx
            if lo == 0 and not codec.mode.quantized:  # a whole prompt: its own K/V, no copy
                keys, vals = k[s:e], v[s:e]
            else:
                ks, vs = (None, None) if kv.scales is None else (kv.scales[0][:ctx], kv.scales[1][:ctx])
                keys = codec.decode(kv.data[0][:ctx], ks, 0, q.dtype)
                vals = codec.decode(kv.data[1][:ctx], vs, 1, q.dtype)
            out[s:e] = sdpa_one(
                q[s:e], keys, vals, meta.prefill_mask(i, self.window, q.device), self.scale, self.softcap
            )
        return out
