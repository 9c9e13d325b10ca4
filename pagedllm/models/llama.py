"""The Llama family: Llama 2/3, SmolLM, and (through small subclasses) Mistral and Qwen2.

The model works on a flat run of tokens from many sequences ([T] ids and
positions); attention storage is behind `self.attn`, set by the runner.
q/k/v and gate/up projections are fused at load time so each is one matmul.
Under tensor parallelism (`tp`) each rank builds the model with its share of the heads,
intermediate rows and vocabulary, and loads only those slices (models/parallel.py).
Under pipeline parallelism (`stage`, models/stages.py) a rank builds and loads only its run of
layers: the first stage embeds, the last applies the final norm and the head, and the others
take and return hidden states.
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from ..attention.backend import AttentionContext
from ..config import ModelConfig
from ..quant import kernels as qk
from ..quant.formats import QuantTensor
from .decode_stack import decode_stack
from .norm import RMSNorm
from .linear import Embedding, Linear
from .parallel import ShardLayout, narrow
from .rope import RotaryEmbedding, apply_rope
from .stages import Stage, whole


class Attention(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        layer_idx: int,
        qk_norm: type[nn.Module] | None = None,
        shard: ShardLayout | None = None,
        tp=None,
    ) -> None:
        super().__init__()
        shard = shard or ShardLayout.of(cfg, 0, 1)
        # This rank's heads (all of them without tensor parallelism).
        self.num_heads, self.num_kv_heads, self.head_dim = shard.q_heads, shard.kv_heads, cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = Linear(
            self.q_size, cfg.hidden_size, bias=cfg.attention_bias if cfg.o_proj_bias is None else cfg.o_proj_bias
        )
        self.o_proj.tp = tp
        self.window = cfg.layer_windows[layer_idx] if cfg.layer_windows else None
        self.scale = (cfg.query_pre_attn_scalar or self.head_dim) ** -0.5
        self.softcap = cfg.attn_logit_softcapping
        # Qwen3, Gemma 3: an RMSNorm over each q and k head before rope.
        self.q_norm = qk_norm(self.head_dim, cfg.rms_norm_eps) if qk_norm else None
        self.k_norm = qk_norm(self.head_dim, cfg.rms_norm_eps) if qk_norm else None
        self.attn = None  # set by the model runner: an attention backend layer

    def forward(
        self,
        rope: tuple[torch.Tensor, torch.Tensor],
        x: torch.Tensor,
        meta: AttentionContext,
        norm: nn.Module | None = None,
        residual: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """residual + o_proj(attention(norm(x)))."""
        qkv = self.qkv_proj.fused(x, norm=norm)
        if self.q_norm is not None:
            qkv = self._norm_qk(qkv)
        # A pure decode step on the native paged backend: rope, the cache write and attention
        # in one call (the same values as the ops below); None where the backend has no such path.
        o = self.attn.decode_qkv(qkv, rope, meta, self.num_heads, self.num_kv_heads)
        if o is None:
            t = x.shape[0]
            qk, v = qkv.split([self.q_size + self.kv_size, self.kv_size], dim=-1)
            # Rotate q and k heads together: one set of rope ops per layer, not two.
            qk = apply_rope(qk.view(t, self.num_heads + self.num_kv_heads, self.head_dim), *rope)
            q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
            v = v.view(t, self.num_kv_heads, self.head_dim)
            o = self.attn(q, k, v, meta).reshape(t, self.q_size)
        return self.o_proj.fused(o, residual=residual)

    def _native_qk_norm(self, qkv: torch.Tensor) -> bool:
        """Whether the q/k norms run as the native call the all-layer decode makes (`qk.qk_norm`):
        quantized projections (whose decode steps that call also serves), plain RMSNorms."""
        return (
            self.qkv_proj.qparts is not None
            and type(self.q_norm) is RMSNorm
            and type(self.k_norm) is RMSNorm
            and self.q_norm.eps == self.k_norm.eps
            and qkv.is_contiguous()
            and qkv.device.type == "cpu"
            and qk.qk_norm_available()
        )

    def _norm_qk(self, qkv: torch.Tensor) -> torch.Tensor:
        if self._native_qk_norm(qkv):
            return qk.qk_norm(
                qkv, self.q_norm.weight, self.k_norm.weight, self.num_heads, self.num_kv_heads, self.q_norm.eps
            )
        t = qkv.shape[0]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self.q_norm(q.reshape(t, self.num_heads, self.head_dim)).view(t, self.q_size)
        k = self.k_norm(k.reshape(t, self.num_kv_heads, self.head_dim)).view(t, self.kv_size)
        return torch.cat((q, k, v), dim=-1)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, shard: ShardLayout | None = None, tp=None, inter: int | None = None) -> None:
        """`inter`: the intermediate size where it is not the config's (an MoE expert)."""
        super().__init__()
        self.inter = inter or (shard.inter if shard is not None else cfg.intermediate_size)
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * self.inter, bias=cfg.mlp_bias)
        self.down_proj = Linear(self.inter, cfg.hidden_size, bias=cfg.mlp_bias)
        self.down_proj.tp = tp

    def forward(
        self, x: torch.Tensor, norm: nn.Module | None = None, residual: torch.Tensor | None = None
    ) -> torch.Tensor:
        """residual + down(silu(gate) * up), gate|up = gate_up(norm(x))."""
        return self.down_proj.fused(self.gate_up_proj.fused(x, norm=norm, silu_mul=True), residual=residual)


class DecoderLayer(nn.Module):
    qk_norm: type[nn.Module] | None = None  # the per-head q/k norm, for families that have one
    attn_cls: type[Attention] = Attention
    # The native all-layer decode reproduces this class's forward (`_stack_plan`); a subclass
    # that changes nothing else but qk_norm says so in its own body (not inherited).
    stack_decode = True

    def __init__(self, cfg: ModelConfig, layer_idx: int, shard: ShardLayout | None = None, tp=None) -> None:
        super().__init__()
        self.self_attn = self.attn_cls(cfg, layer_idx, self.qk_norm, shard, tp)
        self.mlp = MLP(cfg, shard, tp)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], h: torch.Tensor, meta: AttentionContext) -> torch.Tensor:
        # The norms and residual adds travel with the projections, which fold them into one
        # native call where they can (quantized weights, few rows).
        h = self.self_attn(rope, h, meta, norm=self.input_layernorm, residual=h)
        return self.mlp(h, norm=self.post_attention_layernorm, residual=h)


class MissingLayer(nn.Module):
    """The place of a layer another pipeline stage runs: no weights, never called (its index
    keeps the checkpoint's layer names lined up with the modules)."""

    def forward(self, *args, **kwargs):
        raise RuntimeError("this layer runs on another pipeline stage")


class LlamaForCausalLM(nn.Module):
    # HF checkpoint name fragment -> (our parameter fragment, shard index)
    packed = {
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", 1),
        "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }
    layer_cls: type[nn.Module] = DecoderLayer
    norm_cls: type[nn.Module] = RMSNorm
    lora_state = None  # set by the LoRA manager (pagedllm/lora): the step's adapter row groups

    # What the family is (models/contract.py). Whether it can be cut into pipeline stages (the
    # vision-language ones cannot yet: their image tower feeds the first stage's embeddings).
    pipeline_stages = True
    vision = False
    mrope = False

    def __init__(self, cfg: ModelConfig, max_positions: int, tp=None, stage: Stage | None = None) -> None:
        """`tp`: a TPInfo (pagedllm/distributed) when this is one rank's shard, else None.
        `stage`: the pipeline stage this rank runs (models/stages.py), None for all layers."""
        super().__init__()
        self.config = cfg
        if stage is not None and not stage.whole and not self.pipeline_stages:
            raise ValueError(
                f"pipeline parallelism does not split {type(self).__name__} yet (use pipeline_parallel_size=1)"
            )
        if stage is not None and stage.num_layers != cfg.num_layers:
            raise ValueError(f"stage {stage} was planned for {stage.num_layers} layers; the model has {cfg.num_layers}")
        self.stage = st = stage or whole(cfg)
        self.tp = tp if tp is not None and tp.size > 1 else None
        self.shard = sh = ShardLayout.of(cfg, *((tp.rank, tp.size) if self.tp else (0, 1)))
        self.rope = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling)
        # Sliding layers with their own rope (Gemma 3's local base frequency).
        self.rope_local = None
        if cfg.local_rope_theta is not None:
            self.rope_local = RotaryEmbedding(cfg.head_dim, max_positions, cfg.local_rope_theta, cfg.local_rope_scaling)
        # An uninitialised table: the checkpoint fills it. (nn.Embedding's own init draws
        # normal_ values, whose meta-device kernel imports sympy: 2 s of startup.) The last
        # stage of a tied model keeps the table too, as its head's weight.
        self.embed_tokens = None
        if st.first or (st.last and cfg.tie_word_embeddings):
            self.embed_tokens = Embedding(sh.vocab, cfg.hidden_size, _weight=torch.empty(sh.vocab, cfg.hidden_size))
            self.embed_tokens.tp, self.embed_tokens.vocab_start = self.tp, sh.vocab_start
        self.layers = nn.ModuleList(
            MissingLayer()
            if not st.holds(i)
            else self.layer_cls(cfg, i, sh, self.tp)
            if self.tp
            else self.layer_cls(cfg, i)
            for i in range(cfg.num_layers)
        )
        # The layers this rank runs, kept once: slicing the ModuleList each step builds a new one.
        self._run = tuple(self.layers[st.start : st.end])
        self.norm = self.norm_cls(cfg.hidden_size, cfg.rms_norm_eps) if st.last else None
        # The head's vocabulary rows this rank computes: all of them on the last stage, unless the
        # first stage shares them (models/stages.py `share_head`).
        self.head_rows = st.head_rows(sh.vocab)
        self.lm_head = (
            Linear(cfg.hidden_size, self.head_rows[1] - self.head_rows[0], bias=False)
            if self.head_rows is not None
            else None
        )

    def stage_layers(self) -> list[nn.Module]:
        """The layers this rank runs, in order (all of them without pipeline parallelism)."""
        return list(self._run)

    def drop_head(self) -> None:
        """An embedding model: no LM head (its checkpoint may hold none); the final-norm hidden
        states are the output (engine/pooling.py)."""
        self.lm_head = None

    def tie_weights(self) -> None:
        if not self.config.tie_word_embeddings or self.lm_head is None:
            return
        table = self.embed_tokens
        lo, hi = self.head_rows
        whole_table = (lo, hi) == (0, table.num_embeddings)
        if table.qweight is not None:  # the head reads the same quantized blocks
            self.lm_head.set_quantized([table.qweight if whole_table else table.qweight.rows(lo, hi)])
        elif whole_table:
            self.lm_head.weight = table.weight
        else:  # a stage sharing the head: its rows of the table, a view
            self.lm_head.weight = nn.Parameter(table.weight[lo:hi], requires_grad=False)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionContext,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`inputs_embeds`: the step's input embeddings where images are among its tokens; on a
        pipeline stage after the first, the previous stage's hidden states (required). The last
        stage returns the final-norm hidden states, the others their last layer's output."""
        if inputs_embeds is None and not self.stage.first:
            raise ValueError(f"pipeline stage {self.stage.index} runs on the previous stage's hidden states")
        h = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        rope = self.rope.lookup(positions, h.dtype)
        stacked = self._decode_stack(h, rope, meta)
        if stacked is not None:
            return self._final_norm(stacked)
        local = self.rope_local.lookup(positions, h.dtype) if self.rope_local is not None else rope
        for layer in self._run:
            h = layer(local if layer.self_attn.window is not None else rope, h, meta)
        return self._final_norm(h)

    def _final_norm(self, h: torch.Tensor) -> torch.Tensor:
        if self.norm is None:  # a pipeline stage before the last: the next stage goes on from h
            return h
        # One native call where it is a plain RMSNorm, on both paths so the all-layer decode keeps
        # the per-layer path's bits; ATen's chain of small ops is a visible share of a small
        # model's decode step.
        return qk.rms_norm(h, self.norm) if type(self.norm) is RMSNorm else self.norm(h)

    def _decode_stack(
        self, h: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], meta: AttentionContext
    ) -> torch.Tensor | None:
        """All the layers of a decode-only step in one native call, or None (models/decode_stack.py)."""
        return decode_stack(self, h, rope, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """[rows, vocab] float32 logits. Vocab-parallel: this rank's columns are gathered to
        rank 0, which gets the whole rows; the other ranks get None."""
        if self.lm_head.qparts is not None and not self.lm_head.permutes:  # float32 from the kernel: no bf16 ties
            logits = qk.head_logits(hidden, self.lm_head.qparts)
        else:
            logits = self.lm_head(hidden).float()
        if self.tp is None:
            return logits
        return self.tp.gather_columns(logits, self.shard.vocab_total)

    def expert_paths(self) -> list:
        """A mixture of experts' routed blocks (models/moe.py); a dense model has none."""
        return []

    def attention_modules(self) -> list[Attention]:
        """This stage's attention layers in order (their KV cache holds only these)."""
        return [layer.self_attn for layer in self.stage_layers()]

    # -- weights ----------------------------------------------------------
    def shard_sizes(self, name: str) -> list[int]:
        """Rows of each checkpoint part of our fused parameter `name` (q|k|v or gate|up)."""
        a = self.layers[self.stage.start].self_attn
        if name.split(".")[-2] == "qkv_proj":
            return [a.q_size, a.kv_size, a.kv_size]
        # gate|up: the halves of this layer's projection (an MoE expert's may be narrower)
        return [self.get_submodule(name.rsplit(".", 1)[0]).out_features // 2] * 2

    def shard_slice(self, name: str, shard: int | None) -> tuple[int, int, int] | None:
        """(dim, start, length) of our parameter `name` (fused part `shard`) that this rank holds
        of the checkpoint's tensor; None: all of it (replicated, or no tensor parallelism)."""
        if self.tp is None:
            if self.stage.shares_head and name.startswith("lm_head."):
                lo, hi = self.head_rows
                return 0, lo, hi - lo
            return None
        sh, d = self.shard, self.config.head_dim
        part, leaf = name.split(".")[-2:]
        if part == "qkv_proj":
            return (0, sh.q_start * d, sh.q_heads * d) if shard == 0 else (0, sh.kv_start * d, sh.kv_heads * d)
        if part == "gate_up_proj":
            return 0, sh.inter_start, sh.inter
        if part in ("embed_tokens", "lm_head"):
            return 0, sh.vocab_start, sh.vocab
        if leaf == "weight" and part == "o_proj":  # row-parallel: its bias is added once, whole
            return 1, sh.q_start * d, sh.q_heads * d
        if leaf == "weight" and part == "down_proj":
            return 1, sh.inter_start, sh.inter
        return None

    def map_weight_name(self, name: str) -> tuple[str, int | None] | None:
        """HF name -> (our name, shard index or None); None to skip."""
        if "rotary_emb" in name:
            return None
        name = name.removeprefix("model.")
        if name == "lm_head.weight" and (self.config.tie_word_embeddings or self.lm_head is None):
            return None
        if not self._on_stage(name):
            return None
        for frag, (ours, shard) in self.packed.items():
            if f".{frag}." in name:
                return name.replace(frag, ours), shard
        return name, None

    def _on_stage(self, name: str) -> bool:
        """Whether our parameter `name` lives on this pipeline stage."""
        st = self.stage
        if st.whole:
            return True
        if name.startswith("layers."):
            return st.holds(int(name.split(".", 2)[1]))
        if name.startswith("embed_tokens."):
            return self.embed_tokens is not None
        if name.startswith("lm_head."):
            return self.lm_head is not None
        if name.startswith("norm."):
            return st.last
        return True

    def expect_quantized(self, hf_names: set[str]) -> None:
        """Before materializing (the model is on the meta device): the weights named will
        arrive quantized, so their float parameters are dropped instead of allocated."""
        for hf_name in hf_names:
            mapped = self.map_weight_name(hf_name)
            if mapped is not None:
                module = self.get_submodule(mapped[0].rsplit(".", 1)[0])
                module.weight = None
        if (
            self.config.tie_word_embeddings
            and self.embed_tokens is not None
            and self.embed_tokens.weight is None
            and self.lm_head is not None
        ):
            self.lm_head.weight = None

    @torch.no_grad()
    def load_weights(
        self, weights: Iterable[tuple[str, torch.Tensor | QuantTensor]], dtype: torch.dtype = torch.float32
    ) -> None:
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        seen_shards: dict[str, dict[int, QuantTensor | None]] = {}
        for hf_name, tensor in weights:
            mapped = self.map_weight_name(hf_name)
            if mapped is None:
                continue
            name, shard = mapped
            cut = self.shard_slice(name, shard)
            if cut is not None:
                tensor = narrow(tensor, *cut, hf_name)
                if name not in params and not isinstance(tensor, QuantTensor):
                    params[name] = self._float_weight(name, tensor, dtype)
            if isinstance(tensor, QuantTensor):
                self._place_quantized(name, shard, tensor, hf_name, dtype, seen_shards, loaded)
                continue
            param = params.get(name)
            if param is None:
                raise ValueError(f"checkpoint tensor {hf_name!r} has no place in {type(self).__name__}")
            if shard is None:
                _copy_checked(param, tensor, hf_name)
                loaded.add(name)
            else:
                sizes = self.shard_sizes(name)
                start = sum(sizes[:shard])
                _copy_checked(param.narrow(0, start, sizes[shard]), tensor, hf_name)
                seen_shards.setdefault(name, {})[shard] = None
                if len(seen_shards[name]) == len(sizes):
                    loaded.add(name)
        self.tie_weights()
        if self.config.tie_word_embeddings and self.lm_head is not None:
            loaded.add("lm_head.weight")
        expected = set(params) | {n for n in seen_shards} | loaded
        missing = sorted(expected - loaded)
        if missing:
            raise ValueError(f"checkpoint is missing weights: {missing[:8]}{' ...' if len(missing) > 8 else ''}")

    def _float_weight(self, name: str, t: torch.Tensor, dtype: torch.dtype) -> nn.Parameter:
        """A float parameter for a weight expected quantized whose slice came dequantized
        (a row-parallel split off the format's blocks: models/parallel.py)."""
        module = self.get_submodule(name.rsplit(".", 1)[0])
        module.weight = nn.Parameter(
            torch.empty(t.shape, dtype=dtype, device=self.rope.cos.device), requires_grad=False
        )
        return module.weight

    def _place_quantized(
        self,
        name: str,
        shard: int | None,
        qt: QuantTensor,
        hf_name: str,
        dtype: torch.dtype,
        seen: dict,
        loaded: set[str],
    ) -> None:
        module = self.get_submodule(name.rsplit(".", 1)[0])
        if isinstance(module, Embedding):
            module.set_quantized(qt, dtype)
            loaded.add(name)
            return
        if not isinstance(module, Linear):
            raise ValueError(f"checkpoint tensor {hf_name!r} is quantized but {name} is not a linear weight")
        role = name.rsplit(".", 2)[-2]
        module.act_role = role if role in qk.ROLES else None
        if shard is None:
            if qt.shape != (module.out_features, module.in_features):
                raise ValueError(
                    f"weight {hf_name!r} has shape {qt.shape}, expected {(module.out_features, module.in_features)}"
                )
            module.set_quantized([qt])
            loaded.add(name)
            return
        sizes = self.shard_sizes(name)
        if qt.shape != (sizes[shard], module.in_features):
            raise ValueError(f"weight {hf_name!r} has shape {qt.shape}, expected {(sizes[shard], module.in_features)}")
        parts = seen.setdefault(name, {})
        parts[shard] = qt
        if len(parts) == len(sizes):
            if any(p is None for p in parts.values()):
                raise ValueError(f"{name}: some shards are quantized and others are not")
            module.set_quantized([parts[i] for i in range(len(sizes))])  # one kernel call, no copy
            loaded.add(name)


def _copy_checked(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(f"weight {name!r} has shape {tuple(src.shape)}, expected {tuple(dst.shape)}")
    dst.copy_(src)
