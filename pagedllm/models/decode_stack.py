"""The native all-layer decode of a decoder-only model (quant/kernels.py `decode_layers`): a
decode-only step of few rows whose projections are all quantized runs every layer in one
native call, without the interpreter between layers. Its plan (the flattened weights, norms,
biases and MoE blocks) is made once per model and kept on it (`model._plan`); where any layer
cannot take part, the plan is None and the layers run one by one."""

from __future__ import annotations

from typing import Any

import torch

from ..attention.backend import AttentionContext
from ..quant import kernels as qk
from .linear import Linear
from .norm import RMSNorm


def decode_stack(
    model: Any, h: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], meta: AttentionContext
) -> torch.Tensor | None:
    """A decode-only step with every projection quantized and few rows: all the layers in
    one native call (the same five calls a layer makes below, without the interpreter
    between them); None where that does not apply."""
    if h.dim() != 2 or h.shape[0] > qk.int_rows():
        return None
    plan = stack_plan(model)
    if plan is None:
        return None
    lora = None
    if model.lora_state is not None and model.lora_state.active:
        # (adapters on MoE layers, or a test that asks for it: the layers one by one)
        if not qk.decode_layers_take_lora() or plan["moe_layers"]:
            return None
        lora = _stack_lora(model)
    kv = meta.decode_stack(plan["attns"], h.dtype, plan["pools"])  # None: not a decode-only native paged step
    if kv is None:
        return None
    a = model.layers[model.stage.start].self_attn
    out = qk.decode_layers(h, plan, kv, rope, a.num_heads, a.num_kv_heads, a.scale, lora)
    for i, mlp in plan["moe_layers"]:  # this step's expert ids are the stack's (trace)
        mlp.ids_from(plan["moe"], i)
    return out


def _stack_lora(model: Any) -> tuple:
    """The step's adapters for `decode_stack`: a native LoRAStack of every projection's
    used slots in its order (A's native copy, B^T's panels and their index; None where
    that slot leaves the projection alone), made again only when an adapter came or went
    or the step's slots changed, and the step's row groups. One object crosses into the
    native call each step, not a list element per projection and slot (each costs a
    conversion there); only the used slots are in it, as most steps use few of `max_loras`."""
    state = model.lora_state
    used = tuple(s for s, _ in state.groups)
    cached = getattr(model, "_lora_flat", None)
    if cached is None or cached[0] != (state.version, used):
        a, panels, index = [], [], []
        for layer in model.stage_layers():
            for p in (
                layer.self_attn.qkv_proj,
                layer.self_attn.o_proj,
                layer.mlp.gate_up_proj,
                layer.mlp.down_proj,
            ):
                a += [p.lora.a_native[s] for s in used]
                panels += [p.lora.panels[s] for s in used]
                index += [p.lora.panel_index[s] for s in used]
        cached = model._lora_flat = ((state.version, used), qk.lora_stack(a, panels, index, len(used)))
    return cached[1], list(range(len(used))), [rows for _, rows in state.groups]


def stack_plan(model: Any) -> dict | None:
    """The flattened weights of `decode_stack`, made once; None unless every layer is a
    plain decoder layer whose four projections are quantized."""
    plan = getattr(model, "_plan", False)
    if plan is not False:
        if plan is not None:
            # The runner (or a calibration pass) may have set other attention layers since;
            # then the pools found for the old ones go. (Plain attribute reads: this runs every
            # step, and walking the modules instead costs a visible share of one.)
            attns = [a.attn for a in plan["attn_modules"]]
            if attns != plan["attns"]:
                plan["attns"], plan["pools"] = attns, {}
        return plan
    model._plan = None
    layers = model.stage_layers()
    if not qk.decode_layers_available() or not layers or model.tp is not None:
        return None  # (tensor-parallel layers all-reduce between their projections)
    acc: dict[str, Any] = {k: [] for k in ("weights", "types", "parts", "kdims", "norms", "biases", "qk_norms")}
    acc["eps"] = {layer.input_layernorm.eps for layer in layers} | {
        layer.post_attention_layernorm.eps for layer in layers
    }
    sparse, clips = [], set()
    for layer in layers:
        entry = _add_layer(layer, acc)
        if entry is None:
            return None
        sparse.append(entry or None)
        clips.add(getattr(layer.self_attn, "clip", None))  # (OLMoE's attention clamps q, k and v)
    if len(acc["eps"]) != 1 or len(clips) != 1:
        return None
    if acc["qk_norms"] and len(acc["qk_norms"]) != 2 * len(layers):
        return None
    clip = clips.pop()
    if clip is not None and (not acc["qk_norms"] or not qk.decode_layers_take_moe()):
        return None
    attn_modules = [layer.self_attn for layer in layers]
    model._plan = {
        **acc,
        "eps": acc["eps"].pop(),
        "attn_modules": attn_modules,
        "attns": [a.attn for a in attn_modules],
        "pools": {},
        "moe": qk.moe_stack(sparse) if any(e is not None for e in sparse) or clip is not None else None,
        "qkv_clip": float(clip or 0.0),
        "moe_layers": [(i, layer.mlp) for i, layer in enumerate(layers) if sparse[i] is not None],
    }
    return model._plan


def _add_layer(layer: Any, acc: dict[str, Any]) -> Any:
    """Add one layer's weights to the plan being made: its MoE block's stack entry, False for a
    dense MLP, or None where the layer cannot run in the stack."""
    if (
        not type(layer).__dict__.get("stack_decode")
        or type(layer.input_layernorm) is not RMSNorm
        or type(layer.post_attention_layernorm) is not RMSNorm
    ):
        return None
    a = layer.self_attn
    if a.q_norm is not None:  # Qwen3 (per head), OLMoE (whole projections): in the stack if it takes them
        if type(a.q_norm) is not RMSNorm or type(a.k_norm) is not RMSNorm or not qk.decode_layers_take_qk_norms():
            return None
        if a.q_norm.weight.numel() != a.head_dim and not qk.decode_layers_take_moe():
            return None
        acc["qk_norms"] += [a.q_norm.weight, a.k_norm.weight]
        acc["eps"] |= {a.q_norm.eps, a.k_norm.eps}
    # A sparse MoE block (models/moe.py) runs whole in the stack where it can; it then
    # has no dense MLP weights there.
    entry = layer.mlp.stack_entry(type(layer.post_attention_layernorm)) if hasattr(layer.mlp, "stack_entry") else False
    if entry is None or (entry is not False and not qk.decode_layers_take_moe()):
        return None
    projs = [a.qkv_proj, a.o_proj] + ([layer.mlp.gate_up_proj, layer.mlp.down_proj] if entry is False else [])
    if any(type(p) is not Linear or p.qparts is None or p.permutes for p in projs):
        return None
    for p in projs:
        acc["weights"] += [q.data for q in p.qparts]
        acc["types"] += [q.type_id for q in p.qparts]
        acc["parts"].append(len(p.qparts))
        acc["kdims"].append(p.in_features)
        acc["biases"].append(p.bias)
    if entry is not False:
        acc["parts"] += [0, 0]
        acc["kdims"] += [0, 0]
        acc["biases"] += [None, None]
    acc["norms"] += [layer.input_layernorm.weight, layer.post_attention_layernorm.weight]
    return entry
