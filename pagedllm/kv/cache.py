"""The physical KV cache: one pool of fixed-size blocks per layer, its scales, and its sizing."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

import psutil
import torch

from ..config import CacheConfig, cdiv
from .quant import KVCodec, KVQuantMode, as_bytes, get_mode

logger = logging.getLogger(__name__)

# Share of the memory left after the weights that the cache takes when no size is given.
DEFAULT_FRACTION = {"cuda": 0.9, "mps": 0.5, "cpu": 0.15}


@dataclass
class KVCacheSpec:
    """Shape and element type of the cache. `compute_dtype` is what attention reads;
    `dtype` is what the cache stores (the same for kv_cache_dtype="auto")."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    compute_dtype: torch.dtype
    kv_cache_dtype: str = "auto"
    # Where the f8e4m3 scales came from ("checkpoint" / "calibrated ..."), set by the engine.
    scale_source: str = ""

    def __post_init__(self) -> None:
        self.mode: KVQuantMode = get_mode(self.kv_cache_dtype)
        self.kv_cache_dtype = self.mode.name
        if not self.scale_source:
            self.scale_source = {"int8": "computed per token on write"}.get(self.mode.name, "none")

    @property
    def dtype(self) -> torch.dtype:
        return self.mode.storage(self.compute_dtype)

    @property
    def bytes_per_token(self) -> int:
        """K and V of one token in every layer, per-token scales included."""
        return self.mode.bytes_per_token(self.num_layers, self.num_kv_heads, self.head_dim, self.compute_dtype)

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_token * self.block_size

    @property
    def fixed_bytes(self) -> int:
        """Bytes that do not scale with blocks (f8e4m3's per-(layer, head) scales)."""
        return self.mode.fixed_bytes(self.num_layers, self.num_kv_heads)

    def info(self) -> dict:
        m = self.mode
        return {
            "kv_cache_dtype": m.name,
            "dtype": dtype_name(self.dtype),
            "compute_dtype": dtype_name(self.compute_dtype),
            "quant_mode": m.quant_mode,
            "scale_granularity": m.scale_granularity,
            "scale_source": self.scale_source,
            "bytes_per_token": self.bytes_per_token,
        }


@dataclass
class CachePlan:
    num_blocks: int
    source: str  # which setting decided the size, for the log and the trace

    def info(self, spec: KVCacheSpec) -> dict:
        """What the trace reports: dtype, quantization, and capacity in tokens."""
        usable = self.num_blocks - 1  # block 0 is the null block
        return {
            **spec.info(),
            "num_blocks": usable,
            "block_size": spec.block_size,
            "capacity_tokens": usable * spec.block_size,
            "memory_mb": (self.num_blocks * spec.bytes_per_block + spec.fixed_bytes) / 2**20,
            "sized_by": self.source,
        }

    def describe(self, spec: KVCacheSpec) -> str:
        i = self.info(spec)
        quant = ""
        if spec.mode.quantized:
            quant = (
                f", {i['quant_mode']}, scales {i['scale_granularity']} "
                f"({i['scale_source']}), compute {i['compute_dtype']}"
            )
        return (
            f"KV cache: ceiling {i['memory_mb']:.1f} MB, {i['num_blocks']} blocks of {spec.block_size} "
            f"tokens = {i['capacity_tokens']} token slots ({self.source}); "
            f"dtype {i['kv_cache_dtype']} ({i['dtype']}){quant}"
        )


def dtype_name(dt: torch.dtype) -> str:
    return str(dt).removeprefix("torch.")


def empty_pool(shape: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """K/V storage allocated without being written: on the CPU a page is committed only when
    a token is first written into it. What it holds before that is garbage, possibly NaN, and
    no attention path may read it (tests swap this for a NaN fill to prove that)."""
    return torch.empty(shape, dtype=dtype, device=device)


def available_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    if device.type == "mps":
        return int(psutil.virtual_memory().available)  # unified memory
    return int(psutil.virtual_memory().available)


def plan_cache(
    spec: KVCacheSpec,
    cfg: CacheConfig,
    device: torch.device,
    max_model_len: int,
    max_num_seqs: int,
    blocks_for: Callable[[int], int] | None = None,
    num_tables: int = 1,
    also: KVCacheSpec | None = None,
) -> CachePlan:
    """Turn exactly one of the three size settings (or the default) into a block count.

    A byte budget pays for the per-token scales too (int8), so it buys
    bytes_per_token(auto) / bytes_per_token(mode) times the blocks of `auto`.
    With KV groups (kv/groups.py) a sequence has `num_tables` tables: kv_cache_context_len
    tokens buy that many blocks in each, and `blocks_for(tokens)` (the most blocks a sequence
    of that length holds, sliding groups' windows counted) caps the default size.
    `also`: a second model's cache over the same block ids (a draft model's: one pool of
    blocks for both, engine/block_pool.py): every block costs a page in each, so a
    byte budget buys blocks of both sizes together; `num_tables` and `blocks_for` then count
    both models' tables."""
    bpb = spec.bytes_per_block
    fixed = spec.fixed_bytes
    if also is not None:
        bpb += also.bytes_per_block
        fixed += also.fixed_bytes
    if blocks_for is None:
        blocks_for = lambda n: cdiv(n, spec.block_size)  # noqa: E731
    if cfg.kv_cache_memory_mb is not None:
        n = int(max(0, cfg.kv_cache_memory_mb * 2**20 - fixed) // bpb)
        plan = CachePlan(n, f"kv_cache_memory_mb={cfg.kv_cache_memory_mb:g}")
    elif cfg.kv_cache_context_len is not None:
        n = cdiv(cfg.kv_cache_context_len, spec.block_size) * num_tables
        plan = CachePlan(n, f"kv_cache_context_len={cfg.kv_cache_context_len}")
    else:
        avail = available_memory_bytes(device)
        # No point reserving more than every sequence at full length could use.
        cap = blocks_for(max_model_len) * max_num_seqs
        if cfg.kv_cache_memory_fraction is not None:
            frac = cfg.kv_cache_memory_fraction
            n = int(avail * frac // bpb)
            note = f"kv_cache_memory_fraction={frac:g} of {avail / 2**20:.0f} MB free"
            if device.type == "cpu" and n > cap:
                # A ceiling no sequence could ever fill only misleads the load log.
                n, note = cap, note + ", capped at max_num_seqs x max_model_len"
            plan = CachePlan(n, note)
        else:
            frac = DEFAULT_FRACTION.get(device.type, 0.15)
            n = int(avail * frac // bpb)
            plan = CachePlan(
                min(n, cap), f"default: {frac:g} of {avail / 2**20:.0f} MB free, capped at max_num_seqs x max_model_len"
            )
    plan.num_blocks += 1  # the null block
    if plan.num_blocks < 2:
        raise ValueError(
            f"the KV cache budget ({plan.source}) holds no block of {spec.block_size} tokens "
            f"({bpb / 2**20:.3f} MB each); give it more memory"
        )
    return plan


class KVLayer:
    """One layer's view of the cache: K/V pages [num_blocks, block_size, H, D] in the
    storage dtype and, for int8, their scales [num_blocks, block_size, H].

    `write` quantizes the new tokens into their slots; `read` reads slots by id and
    dequantizes only those, straight into the compute dtype."""

    def __init__(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        k_scale: torch.Tensor | None,
        v_scale: torch.Tensor | None,
        codec: KVCodec,
    ) -> None:
        self.k, self.v = k, v
        self.k_scale, self.v_scale = k_scale, v_scale
        self.codec = codec
        self.num_blocks, self.block_size = k.shape[0], k.shape[1]
        self.block_shape = tuple(k.shape[1:])
        # Flat views by slot: [slots, H, D] for writes, [slots, H * D] for reads (index_select
        # on a 2-D contiguous tensor is a row memcpy; on more dims it goes element-wise).
        self._k_slots = as_bytes(k).view(-1, *k.shape[2:])
        self._v_slots = as_bytes(v).view(-1, *v.shape[2:])
        self._k_rows = self._k_slots.flatten(1)
        self._v_rows = self._v_slots.flatten(1)
        if k_scale is not None:
            self._ks_slots = k_scale.view(-1, k_scale.shape[-1])
            self._vs_slots = v_scale.view(-1, v_scale.shape[-1])
        # The scales the native kernels read beside the values: int8's per (token, head) pools,
        # f8e4m3's per-head [H] rows; (None, None) for a plain cache.
        self.scales: tuple[torch.Tensor | None, torch.Tensor | None] = (k_scale, v_scale)
        if codec.head_scales is not None:
            self.scales = (codec.head_scales[0].contiguous(), codec.head_scales[1].contiguous())

    @property
    def dtype(self) -> torch.dtype:
        return self.k.dtype

    @property
    def quantized(self) -> bool:
        return self.codec.mode.quantized

    def write(self, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """k, v: [T, H, D] of the new tokens; slot_mapping: [T] flat slot ids."""
        kq, ks = self.codec.encode(k, 0)
        vq, vs = self.codec.encode(v, 1)
        self._k_slots.index_copy_(0, slot_mapping, as_bytes(kq.to(self.k.dtype)))
        self._v_slots.index_copy_(0, slot_mapping, as_bytes(vq.to(self.v.dtype)))
        if ks is not None:
            self._ks_slots.index_copy_(0, slot_mapping, ks)
            self._vs_slots.index_copy_(0, slot_mapping, vs)

    def read(self, slots: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of the token slots in `slots` (any shape S), as S + [H, D] in `dtype`.

        Attention reads by slot, never by whole block: a block's tail past the context may
        never have been written (the CPU pools are uninitialised) or hold a failed request's
        NaN, and a masked NaN still poisons SDPA (0 * NaN). Callers point positions they do
        not need at slot 0, in the zeroed null block."""
        ids = slots.reshape(-1)
        shape = (*slots.shape, *self.block_shape[1:])
        kq = self._k_rows.index_select(0, ids).view(self.k.dtype).view(shape)
        vq = self._v_rows.index_select(0, ids).view(self.v.dtype).view(shape)
        ks = vs = None
        if self.k_scale is not None:
            ks = self._ks_slots.index_select(0, ids).view(shape[:-1])
            vs = self._vs_slots.index_select(0, ids).view(shape[:-1])
        return self.codec.decode(kq, ks, 0, dtype), self.codec.decode(vq, vs, 1, dtype)


class PagedKVCache:
    """K and V pools, [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim], in the
    storage dtype; int8 adds float32 scales [num_layers, 2, num_blocks, block_size, num_kv_heads]
    and f8e4m3 holds fixed per-head scales [num_layers, 2, num_kv_heads].

    On the CPU the pools are allocated without being written (`torch.empty`): the OS
    commits a page when a block's first token lands in it, so resident memory follows the
    blocks really used, not the budget. Only the null block (0) is zeroed: attention reads
    only slots that were written, and points everything else at it (see `KVLayer.read`).
    Elsewhere (CUDA, MPS) the pools are zero-filled as reserved up front.
    """

    def __init__(
        self,
        spec: KVCacheSpec,
        num_blocks: int,
        device: torch.device,
        head_scales: torch.Tensor | None = None,
        layer_slots: list[int] | None = None,
    ) -> None:
        """`layer_slots[i]`: which of the spec's layer slots model layer i uses (KV groups,
        kv/groups.py: a page holds one group's layers); by default layer i is slot i."""
        self.spec = spec
        self.num_blocks = num_blocks
        self.layer_slots = layer_slots if layer_slots is not None else list(range(spec.num_layers))
        mode = spec.mode
        shape = (spec.num_layers, 2, num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)
        self.lazy = device.type == "cpu"
        self.data = self._alloc(shape, spec.dtype, device)
        self.scales: torch.Tensor | None = None
        if mode.token_scales:
            self.scales = self._alloc(shape[:-1], torch.float32, device)
        for t in self._block_tensors():
            t[:, :, 0].zero_()  # the null block
        self.head_scales: torch.Tensor | None = None
        if mode.head_scales:
            want = (len(self.layer_slots), 2, spec.num_kv_heads)
            if head_scales is None or tuple(head_scales.shape) != want:
                raise ValueError(f"{mode.name} needs head scales of shape {want}")
            self.head_scales = head_scales.to(device=device, dtype=torch.float32)
        self._layers = [self._make_layer(i) for i in range(len(self.layer_slots))]

    def _alloc(self, shape: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        if self.lazy:
            return empty_pool(shape, dtype, device)
        return torch.zeros(shape, dtype=dtype, device=device)

    def _make_layer(self, i: int) -> KVLayer:
        hs = None if self.head_scales is None else self.head_scales[i]
        j = self.layer_slots[i]
        ks = vs = None
        if self.scales is not None:
            ks, vs = self.scales[j, 0], self.scales[j, 1]
        return KVLayer(self.data[j, 0], self.data[j, 1], ks, vs, KVCodec(self.spec.mode, hs))

    def layer(self, i: int) -> KVLayer:
        return self._layers[i]

    def committed_bytes(self, blocks_touched: int) -> int:
        """Estimated resident bytes: the blocks ever handed out (`blocks_touched`, from the block
        manager) plus the null block and the fixed scales; everything when the pools were zeroed."""
        if not self.lazy:
            return self.nbytes
        return (blocks_touched + 1) * self.spec.bytes_per_block + self.spec.fixed_bytes

    @property
    def nbytes(self) -> int:
        n = self.data.numel() * self.data.element_size()
        for t in (self.scales, self.head_scales):
            if t is not None:
                n += t.numel() * t.element_size()
        return n

    # -- block copies (prefix caching, copy-on-write) ----------------------
    def copy_blocks(self, src_ids: torch.Tensor, dst_ids: torch.Tensor) -> None:
        """Copy whole blocks src_ids[i] -> dst_ids[i] in every layer: K, V and their scales.
        Bytes are moved, never computed on, so an unwritten tail travels as it is and stays
        unread (the engine copies partial blocks with `copy_block_prefix`)."""
        src = torch.as_tensor(src_ids, dtype=torch.int64, device=self.data.device)
        dst = torch.as_tensor(dst_ids, dtype=torch.int64, device=self.data.device)
        for t in self._block_tensors():
            t.index_copy_(2, dst, t.index_select(2, src))

    def copy_block_prefix(self, src: int, dst: int, n: int) -> None:
        """Copy the first n token slots of block src into block dst, in every layer."""
        if n <= 0:
            return
        for t in self._block_tensors():
            t[:, :, dst, :n] = t[:, :, src, :n]

    def _block_tensors(self) -> list[torch.Tensor]:
        ts = [as_bytes(self.data)]
        if self.scales is not None:
            ts.append(self.scales)
        return ts
