"""The draft model's quantized weights in the format its forwards run fastest in.

A draft only proposes: the target verifies every proposal, so how a draft's weights are
rounded changes which proposals are accepted, never the output. A batch-1 draft forward
streams its weights, and a quantized decoder layer's projections run at about the same
values a second in any packed 4- to 8-bit format, so a format with fewer bits a weight
reads fewer bytes in less time. Small models' files hold many layers above 4.5 bits a weight:
Qwen2.5-0.5B's Q4_K_M stores most of its layers as Q5_0, Q6_K and Q8_0 (896 values a row do
not tile Q4_K's 256); its Q4_K parts, as many bits a weight, stay. The decision and its
measurements: docs/design/draft-weights.md.

speculative `draft_weights`: "auto" (the default) requantizes the decoder projections and
the head's scored rows stored in more bits a weight than LIGHT to LIGHT, at load; a type name requantizes every quantized one to it; "file" keeps the file's.
Float (unquantized) weights stay as they are: ISQ (`isq`) quantizes a safetensors draft.
"""

from __future__ import annotations

import logging
from collections import Counter

from ..quant import kernels as qk
from ..quant.formats import FORMATS, QuantTensor
from ..quant.isq import bits_per_weight, requantize

logger = logging.getLogger(__name__)

LIGHT = "Q4_0"


def target_format(setting: str, w: QuantTensor) -> str | None:
    """The format `w` runs in under `setting` ("auto", "file" or a type checked by
    SpeculativeConfig), or None where it stays as it is."""
    if setting == "file" or w.fmt not in FORMATS or w.col_perm is not None:
        return None
    fmt = LIGHT if setting == "auto" else setting
    if fmt == w.fmt or w.shape[1] % FORMATS[fmt][1]:
        return None
    if setting == "auto" and bits_per_weight(w.fmt) <= bits_per_weight(fmt):
        return None
    return fmt


def lighten(model, setting: str) -> str | None:
    """Requantize the decoder projections of `model` (before its first forward: the native
    decode stack's plan holds the weights it was made with) as `setting` says. Returns what
    changed, for the log, or None."""
    if setting == "file":
        return None
    if isinstance(getattr(model, "_plan", None), dict):
        raise RuntimeError("draft weights requantized after the model's decode plan was made")
    moved: Counter[str] = Counter()
    before = after = 0
    for name, module in model.named_modules():
        parts = getattr(module, "qparts", None)
        if parts is None or getattr(module, "act_role", None) not in qk.DECODE_ROLES or module.permutes:
            continue
        fmts = [target_format(setting, w) for w in parts]
        if not any(fmts):
            continue
        new = [w if f is None else requantize(w, f, name=name) for w, f in zip(parts, fmts)]
        moved.update(f"{w.fmt}->{f}" for w, f in zip(parts, fmts) if f is not None)
        before += sum(w.nbytes for w in parts)
        after += sum(w.nbytes for w in new)
        module.qparts = new
    if not moved:
        return None
    what = ", ".join(f"{k} x{n}" for k, n in sorted(moved.items()))
    return f"decoder weights requantized for drafting ({what}): {before / 1e6:.0f} -> {after / 1e6:.0f} MB"
