"""Which layers a pipeline-parallel stage runs: the model cut into P contiguous runs of layers.

The embedding belongs to the first stage and the final norm and LM head to the last. A stage
holds two things that grow with its cut: its weights (the embedding and head counted where they
live) and the KV pages of its layers, which follow the number of layers whatever their bytes.
Their ratio depends on the KV budget, unknown when the model is cut, so a stage's load is the
mean of its share of the weight bytes and its share of the layers, and the cut minimises the
largest stage's load (the largest stage is what has to fit on one node). The same two shares
stand for a step's time: a decode step costs about the weights a stage reads (the head's
matmul included), a prefill chunk about its layers. Where the embedding and head weigh alike
the cut is the bytes' cut; a quantized file whose head is wider than its embedding (llama.cpp's
Q4_K_M: Q8_0 against Q5_0) gives the first stage a layer or two more. Among equal cuts the
earliest-layer-heavy one is taken, so the plan is deterministic.

No cut of whole layers evens both kinds of step, since only a decode step pays for the head
over every row: so, once the layers are cut, the first stage takes some of the head's rows
(`share_head`), as far as its weights allow.

Hybrid-KV models (Gemma 2/3: sliding layers beside global ones) and mixtures of experts are
cut the same way: a stage holds whole layers, whatever their attention window or experts, and
its KV cache holds the groups its own layers fall in.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Iterable

from ..config import ModelConfig


@dataclass(frozen=True)
class Stage:
    """Stage `index` of `size`: layers [start, end) of `num_layers`; `head`: the rows [lo, hi)
    of the LM head's vocabulary it computes where the first and last stage share the head
    (`share_head`), None for the whole head on the last stage and none elsewhere."""

    index: int
    size: int
    start: int
    end: int
    num_layers: int
    head: tuple[int, int] | None = None

    @property
    def first(self) -> bool:
        """This stage embeds the tokens."""
        return self.index == 0

    @property
    def last(self) -> bool:
        """This stage applies the final norm and the LM head."""
        return self.index == self.size - 1

    @property
    def layers(self) -> range:
        return range(self.start, self.end)

    def holds(self, layer: int) -> bool:
        return self.start <= layer < self.end

    def head_rows(self, vocab: int) -> tuple[int, int] | None:
        """The vocabulary rows [lo, hi) of the LM head this stage computes, None for none."""
        if self.head is not None:
            return self.head
        return (0, vocab) if self.last else None

    @property
    def shares_head(self) -> bool:
        """The first stage computes part of the head's rows, the last stage the rest."""
        return self.head is not None

    @property
    def whole(self) -> bool:
        """The only stage: no pipeline parallelism."""
        return self.size == 1

    def keeps_tensor(self, name: str, tie_word_embeddings: bool) -> bool:
        """Whether a checkpoint tensor (HF name) is one this stage loads; a loader skips the
        others before reading them."""
        if self.whole:
            return True
        m = _LAYER.search(name)
        if m is not None:
            return self.holds(int(m.group(1)))
        if "embed_tokens" in name:
            return self.first or (self.last and tie_word_embeddings)
        if "lm_head" in name:
            return self.last or self.head is not None
        if name.removeprefix("model.") == "norm.weight":
            return self.last
        return True


def check_pp(num_layers: int, size: int) -> None:
    if size < 1:
        raise ValueError(f"pipeline_parallel_size must be >= 1, got {size}")
    if size > num_layers:
        raise ValueError(
            f"pipeline_parallel_size={size} is more stages than the model's {num_layers} layers "
            f"(each stage runs at least one layer); use at most {num_layers}"
        )


def plan_stages(layer_bytes: list[int], size: int, embed_bytes: int = 0, head_bytes: int = 0) -> list[Stage]:
    """Cut layers with these weight bytes into `size` contiguous stages, the first also holding
    `embed_bytes` and the last `head_bytes` (the final norm and LM head; with tied embeddings the
    head's copy of the table), minimising the largest stage's load: the mean of its share of
    the weight bytes and its share of the layers (`stage_load`)."""
    n = len(layer_bytes)
    check_pp(n, size)
    if any(b < 0 for b in layer_bytes) or embed_bytes < 0 or head_bytes < 0:
        raise ValueError("weight bytes must be non-negative")
    prefix = [0]
    for b in layer_bytes:
        prefix.append(prefix[-1] + b)
    total = max(1, prefix[-1] + embed_bytes + head_bytes)

    def cost(s: int, i: int, j: int) -> int:  # stage s holding layers [i, j): its load x 2 n total, exact
        held = prefix[j] - prefix[i] + (embed_bytes if s == 0 else 0) + (head_bytes if s == size - 1 else 0)
        return held * n + (j - i) * total

    # best[s][j]: the smallest largest-stage bytes cutting layers [0, j) into stages 0..s.
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(size)]
    cut = [[0] * (n + 1) for _ in range(size)]
    for j in range(1, n + 1):
        best[0][j] = cost(0, 0, j)
    for s in range(1, size):
        for j in range(s + 1, n + 1):
            # Latest start first, so that ties leave the earlier stages the more layers.
            for i in range(j - 1, s - 1, -1):
                v = max(best[s - 1][i], cost(s, i, j))
                if v < best[s][j]:
                    best[s][j], cut[s][j] = v, i
    bounds, j = [n], n
    for s in range(size - 1, 0, -1):
        j = cut[s][j]
        bounds.append(j)
    bounds.append(0)
    bounds.reverse()
    return [Stage(s, size, bounds[s], bounds[s + 1], n) for s in range(size)]


def stage_load(stage: Stage, layer_bytes: list[int], embed_bytes: int = 0, head_bytes: int = 0) -> float:
    """A stage's load as `plan_stages` weighs it: the mean of its share of the weight bytes and
    its share of the layers."""
    total = sum(layer_bytes) + embed_bytes + head_bytes
    held = (
        sum(layer_bytes[stage.start : stage.end])
        + (embed_bytes if stage.first else 0)
        + (head_bytes if stage.last else 0)
    )
    return (held / max(1, total) + len(stage.layers) / stage.num_layers) / 2


# The head's rows go from stage to stage in whole runs of this many: a multiple of the packed
# layout's 16-row groups (quant/formats.py), so a quantized head splits without a copy.
HEAD_SHARE_ROWS = 128


def share_head(
    stages: list[Stage], layer_bytes: list[int], embed_bytes: int, head_bytes: int, vocab: int, tied: bool
) -> list[Stage]:
    """The stages with the LM head's vocabulary rows shared between the first and the last.

    A prefill chunk costs each stage about its layers, but a decode step costs the last stage
    its layers and the head's matmul over every row too: with the layers cut evenly for the
    prefill (and for the KV pages, which follow the layers), decode steps leave the first stage
    waiting for the last. The head's rows are independent (each logit is one row's dot product),
    so the first stage can compute some of them: the last stage sends it the steps' final hidden
    states, a few kB a row, before it computes its own rows, and the first stage computes its
    rows while the last computes the rest (distributed/pipeline.py). The share evens the two
    stages' bytes read in a decode step (their layers and head rows), but never lifts the first
    stage's weights above the largest stage's of the plan, so that the model fits wherever the
    plan fit: an untied head's rows are a copy on the first stage, while a tied head's are the
    embedding table's, which the first stage holds anyway, and cost nothing."""
    if len(stages) < 2 or head_bytes <= 0 or vocab < 2 * HEAD_SHARE_ROWS:
        return stages
    first, last = stages[0], stages[-1]
    mine = sum(layer_bytes[first.start : first.end])
    theirs = sum(layer_bytes[last.start : last.end])
    share = (theirs + head_bytes - mine) / (2 * head_bytes)
    if not tied:
        loads = [
            sum(layer_bytes[s.start : s.end]) + (embed_bytes if s.first else 0) + (head_bytes if s.last else 0)
            for s in stages
        ]
        share = min(share, (max(loads) - loads[0]) / head_bytes)
    rows = int(max(0.0, min(share, 1.0)) * vocab) // HEAD_SHARE_ROWS * HEAD_SHARE_ROWS
    if rows <= 0 or rows >= vocab:
        return stages
    return [replace(first, head=(0, rows)), *stages[1:-1], replace(last, head=(rows, vocab))]


def whole(cfg: ModelConfig) -> Stage:
    """The single stage of a model run without pipeline parallelism."""
    return Stage(0, 1, 0, cfg.num_layers, cfg.num_layers)


_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def bytes_by_part(
    tensors: Iterable[tuple[str, int]], num_layers: int, tie_word_embeddings: bool
) -> tuple[list[int], int, int]:
    """(per-layer bytes, embedding bytes, final norm + head bytes) from a checkpoint's
    (HF tensor name, stored bytes) pairs: what the file holds, quantized or not. A tied head
    counts the embedding's bytes again on the last stage, which holds its own copy."""
    layers, embed, head = [0] * num_layers, 0, 0
    for name, nbytes in tensors:
        m = _LAYER.search(name)
        if m is not None and int(m.group(1)) < num_layers:
            layers[int(m.group(1))] += nbytes
        elif "embed_tokens" in name:
            embed += nbytes
        elif "lm_head" in name or name.endswith("norm.weight"):
            head += nbytes
    if tie_word_embeddings:
        head += embed
    return layers, embed, head


def estimated_bytes(cfg: ModelConfig, bytes_per_value: float = 2.0) -> tuple[list[int], int, int]:
    """(per-layer bytes, embedding bytes, head bytes) from the config alone, at one width for
    every weight: for a plan made before a checkpoint's tensor sizes are known."""
    h, d = cfg.hidden_size, cfg.head_dim
    attn = h * d * (2 * cfg.num_heads + 2 * cfg.num_kv_heads)
    layers = []
    for i in range(cfg.num_layers):
        moe = bool(cfg.moe_layers and cfg.moe_layers[i])
        if moe:
            mlp = cfg.num_experts * 3 * h * cfg.moe_intermediate_size + cfg.num_experts * h
            mlp += 3 * h * (cfg.shared_expert_intermediate_size or 0)
        else:
            mlp = 3 * h * cfg.intermediate_size
        layers.append(int((attn + mlp + 4 * h) * bytes_per_value))
    embed = int(cfg.vocab_size * h * bytes_per_value)
    return layers, embed, embed + int(h * bytes_per_value)
