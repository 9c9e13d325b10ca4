"""PyTorch paged attention: the reference backend that runs on every device.

On the CPU, with a plain (unquantized) cache or a quantized one (int8, f8e4m3), decodes run
the native kernel (`pagedllm/native`): it reads K/V in place by block table, with no gather
copy (quantized values are scaled as they are read). Elsewhere
decodes of the whole batch are one gather of their slots (by block table) and one SDPA
call, with the query heads of each KV head folded into the query-length axis (GQA
without repeating K/V). Prefill chunks attend one sequence at a time: they are compute
bound and differ in length, so padding them together would only waste. A bfloat16 chunk on
a CPU with AVX-512 BF16 runs the native prefill kernel, which also reads its context in place;
others gather a cached prefix and call SDPA.

The cache may be quantized (int8, f8e4m3): `KVLayer.write` quantizes the new
tokens, `KVLayer.read` dequantizes only the slots a step reads. No path reads a slot
that was not written: the native kernel reads each sequence's first `len` slots, the
PyTorch path points everything past a sequence's length at the zeroed null block.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from ..kv.cache import KVLayer, PagedKVCache
from .metadata import AttentionMetadata, causal_mask
from ..native import cpu_kernels, disabled_reason


class PagedAttentionBackend:
    name = "torch-paged"
    uses_block_tables = True

    def __init__(
        self, cache: PagedKVCache, layer_groups: list[int] | None = None, num_groups: int | None = None
    ) -> None:
        """`num_groups`: the block tables a sequence has (None: one past the highest group of
        `layer_groups`); a pipeline stage's layers may fall in fewer groups than the model's."""
        self.cache = cache
        # Per model layer: the KV group whose block tables it reads (kv/groups.py).
        self.layer_groups = layer_groups
        self.num_groups = num_groups or 1 + max(layer_groups or [0])
        # The native kernels read plain float caches: in the compute dtype, or bf16 / f16 under
        # float32 compute (`native_reads`). The decode kernels (and the all-layer decode) also
        # read and write an int8 or f8e4m3 cache with its scales; the bf16 prefill kernel reads one.
        self.native = None
        if cache.data.device.type == "cpu":
            self.native = cpu_kernels()
        self.num_layers = 0
        self.capped_layers = 0  # layers with a score cap (Gemma 2): the native kernels skip them

    @property
    def decode_kernel(self) -> str:
        return "native-cpu" if self.native is not None else "torch"

    def layer(
        self, index: int, window: int | None, scale: float, softcap: float | None = None
    ) -> "PagedAttentionLayer":
        group = self.layer_groups[index] if self.layer_groups else 0
        self.num_layers += 1
        self.capped_layers += softcap is not None
        return PagedAttentionLayer(self.cache.layer(index), window, scale, self.native, softcap, group)

    def describe_decode(self) -> str:
        """The path decode (and prefill) attention really takes, and why (for the KV trace)."""
        spec = self.cache.spec
        dev = self.cache.data.device.type
        capped = self.capped_layers
        if self.native is not None and native_reads(spec.compute_dtype, spec.dtype) and capped < self.num_layers:
            prefill = (
                "the native bf16 prefill kernel, reading the context in place too"
                if native_prefill(self.native, spec.compute_dtype, spec.dtype, spec.head_dim)
                else "SDPA"
            )
            some = (
                f" ({capped} of {self.num_layers} layers cap their attention scores and take the "
                "PyTorch path: the native kernels have no score cap)"
                if capped
                else ""
            )
            scores = (
                ", the scores by AVX-512 BF16 dot products (vdpbf16ps) on the keys as stored"
                if self._bf16_scores(spec)
                else ""
            )
            return (
                f"{self.name} with the native CPU decode kernel: each (sequence, KV head) reads "
                "its K/V in place by block table, all query heads of a KV head at once, with no "
                f"gather copy{scores}; prefill chunks use {prefill}{some}"
            )
        if self.native is not None and spec.mode.scaled and capped < self.num_layers:
            per = "per-token" if spec.mode.token_scales else "per-(layer, head)"
            prefill = (
                "the native bf16 prefill kernel, reading the context in place too and scaling each "
                "row to bf16 as it packs a block of keys"
                if native_prefill(self.native, spec.compute_dtype, spec.dtype, spec.head_dim)
                else "gather a cached prefix, dequantize it and call SDPA"
            )
            return (
                f"{self.name} with the native CPU decode kernel reading the {spec.mode.name} cache in place: "
                f"each (sequence, KV head) scales its K/V rows by their {per} scales as it reads "
                "them, all query heads of a KV head at once, with no gather copy (the new rows are "
                f"quantized in the same call); prefill chunks use {prefill}"
            )
        native_off = disabled_reason()
        why = (
            "every layer caps its attention scores (attn_logit_softcapping, Gemma 2) and the native "
            "kernels have no score cap"
            if self.native is not None and capped
            else f"the native kernel reads a cache in the compute dtype, or bf16 / f16 under float32; this one "
            f"is {spec.dtype} under {spec.compute_dtype}"
            if dev == "cpu" and spec.dtype != spec.compute_dtype and not spec.mode.scaled
            else f"the native CPU kernel is off ({native_off})"
            if dev == "cpu" and native_off
            else "the native CPU kernels are not built or do not load here (see the log)"
            if dev == "cpu"
            else f"no native paged kernel is built for {dev} yet"
        )
        return (
            f"{self.name}: all decodes of a step in one batched gather of their blocks by block "
            f"table and one SDPA call per layer, on {dev}; prefill chunks gather a cached prefix "
            f"and call SDPA; the PyTorch path is used because {why}"
        )

    def _bf16_scores(self, spec) -> bool:
        """Whether the native kernel's scores run on vdpbf16ps: a bf16 model and cache, a head
        dim it unrolls (64, 128), and a CPU with AVX-512 BF16."""
        ask = getattr(self.native, "paged_decode_bf16_scores", None)
        return (
            spec.compute_dtype == spec.dtype == torch.bfloat16
            and spec.head_dim in (64, 128)
            and ask is not None
            and bool(ask())
        )

    def free_seq(self, seq_id: int) -> None:  # blocks are owned by the block manager
        pass

    def fork_seq(self, parent_id: int, child_id: int) -> None:  # forks share blocks
        pass


class PagedAttentionLayer:
    def __init__(
        self, kv: KVLayer, window: int | None, scale: float, native=None, softcap: float | None = None, group: int = 0
    ) -> None:
        self.kv = kv
        self.group = group
        self.block_size = kv.block_size
        self.window = window
        self.scale = scale
        self.softcap = softcap
        self.native = native if softcap is None else None  # the native kernel has no score cap

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        meta = meta.group(self.group)
        self.kv.write(k, v, meta.slot_mapping)
        nd = meta.num_decodes
        if nd == meta.num_seqs:
            return self._decode(q, meta)
        out = torch.empty_like(q)
        if nd:
            out[:nd] = self._decode(q[:nd], meta)
        for i in range(nd, meta.num_seqs):
            s, e = meta.query_start_loc[i], meta.query_start_loc[i + 1]
            out[s:e] = self._prefill(q[s:e], k[s:e], v[s:e], meta, i)
        return out

    def decode_qkv(
        self, qkv: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata, hq: int, hkv: int
    ) -> torch.Tensor | None:
        """A step of decodes only, on the native kernel: rope, the cache write and attention from
        the fused q|k|v projection in one call; None where that path does not apply."""
        if self.native is None or meta.num_decodes != meta.num_seqs or not self._native_kv(qkv.dtype):
            return None
        meta = meta.group(self.group)
        cos, sin = rope
        return self.native.paged_decode_qkv(
            qkv,
            cos,
            sin,
            self.kv.k,
            self.kv.v,
            meta.slot_mapping,
            meta.block_tables,
            meta.decode_context_lens,
            hq,
            hkv,
            self.scale,
            self.window or 0,
            *self.kv.scales,
        )

    def _native_kv(self, dtype: torch.dtype) -> bool:
        """Whether the native decode kernels read and write this layer's cache under `dtype`:
        a plain cache they read (`native_reads`), or a quantized one with its scales."""
        return native_reads(dtype, self.kv.dtype) or self.kv.scales[0] is not None

    def stack_kv(self, dtype: torch.dtype) -> tuple | None:
        """This layer's pools (and a quantized cache's scales) for the fused all-layer decode: the
        native kernel, reading a cache it can read under `dtype`, in KV group 0 (the stack takes
        one set of block tables)."""
        if self.native is None or self.group != 0 or not self._native_kv(dtype):
            return None
        return self.kv.k, self.kv.v, self.window or 0, *self.kv.scales

    def _decode(self, q: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        nd, hq, d = q.shape
        if self.native is not None and self._native_kv(q.dtype):
            if q.stride(-1) != 1:
                q = q.contiguous()
            return self.native.paged_decode(
                q,
                self.kv.k,
                self.kv.v,
                meta.block_tables[:nd],
                meta.decode_context_lens,
                self.scale,
                self.window or 0,
                *self.kv.scales,
            )
        keys, vals = self.kv.read(meta.decode_slots(self.block_size), q.dtype)  # [nd, L, Hkv, D]
        hkv = keys.shape[2]
        mask = meta.decode_mask(self.window, keys.shape[1])
        qh = q.view(nd, hkv, hq // hkv, d)
        out = attend(qh, keys.transpose(1, 2), vals.transpose(1, 2), mask, self.scale, self.softcap)
        return out.reshape(nd, hq, d)

    def _prefill(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata, i: int
    ) -> torch.Tensor:
        n = q.shape[0]
        ctx_len = meta.context_lens[i]
        if (
            self.native is not None
            and native_prefill(self.native, q.dtype, self.kv.dtype, q.shape[-1])
            and not meta.has_image_mask(i)
        ):
            # The chunk's keys are in the cache already (written above): read in place, prefix too.
            return self.native.paged_prefill(
                q, self.kv.k, self.kv.v, meta.block_tables[i], ctx_len, self.scale, self.window or 0, *self.kv.scales
            )
        # Earlier chunks or a cached prefix live only in the cache. A cache stored in another
        # dtype (int8, f8e4m3, or bf16 / f16 under float32) is read back even for the chunk's
        # own tokens, so every query sees the same stored values however the sequence was
        # chunked, preempted or shared through the prefix cache.
        if ctx_len > n or self.kv.dtype != q.dtype:
            k, v = self.kv.read(meta.prefill_slots(i, self.block_size), q.dtype)
        return sdpa_one(q, k, v, meta.prefill_mask(i, self.window, q.device), self.scale, self.softcap)


def native_prefill(ops, compute: torch.dtype, cache: torch.dtype, head_dim: int) -> bool:
    """Whether prefill attention runs on the native kernel (csrc/prefill_attention.cpp): a
    bfloat16 model, a bfloat16, int8 or f8e4m3 cache, head dims in 32s, and AVX-512 BF16 here;
    SDPA otherwise."""
    return compute == torch.bfloat16 and cache in PREFILL_CACHES and head_dim % 32 == 0 and _prefill_available(ops)


# The caches the native prefill kernel reads: bf16 as it is, int8 and f8e4m3 with their scales.
PREFILL_CACHES = (torch.bfloat16, torch.int8, torch.float8_e4m3fn)


@functools.lru_cache(maxsize=None)
def _prefill_available(ops) -> bool:
    return bool(ops.paged_prefill_available())


def native_reads(compute: torch.dtype, cache: torch.dtype) -> bool:
    """Whether the native decode kernel reads a cache of dtype `cache` under `compute`."""
    return cache == compute or (compute == torch.float32 and cache in (torch.bfloat16, torch.float16))


def sdpa_one(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    softcap: float | None = None,
) -> torch.Tensor:
    """Attention of one sequence's n newest queries over its keys. q: [n, Hq, D]; mask from
    `AttentionMetadata.prefill_mask` (None: plain causal)."""
    n = q.shape[0]
    if mask is None and n > 1 and softcap is not None:
        mask = causal_mask(n, k.shape[0], None, q.device, force=True)
    out = attend(
        q.transpose(0, 1)[None],
        k.transpose(0, 1)[None],
        v.transpose(0, 1)[None],
        mask,
        scale,
        softcap,
        is_causal=mask is None and n > 1,
    )
    return out[0].transpose(0, 1)


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    softcap: float | None = None,
    is_causal: bool = False,
) -> torch.Tensor:
    """SDPA over [..., H, L, D] (k/v may have fewer heads: GQA); mask is True where a query may
    attend. With `softcap` (Gemma 2) the scores are capped, cap * tanh(s / cap), before the
    mask and softmax, which SDPA cannot do: then the scores are computed here."""
    gqa = k.shape[-3] != q.shape[-3]
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale, enable_gqa=gqa)
    if gqa:
        rep = q.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(rep, dim=-3), v.repeat_interleave(rep, dim=-3)
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    s = torch.tanh(s / softcap) * softcap
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype), v)
