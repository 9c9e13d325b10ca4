"""The pipeline stage plan (models/stages.py): contiguous cuts balanced by weight bytes, the
embedding on the first stage and the head on the last, checked against every possible cut."""

from __future__ import annotations

import itertools
import random
from pathlib import Path

import pytest

from pagedllm.config import ModelConfig
from pagedllm.models.stages import (
    HEAD_SHARE_ROWS,
    Stage,
    bytes_by_part,
    estimated_bytes,
    plan_stages,
    share_head,
    stage_load,
)


def _best_by_search(layer_bytes, size, embed, head) -> float:
    """The smallest largest-stage load over every cut (what the plan must reach)."""
    n = len(layer_bytes)
    best = None
    for cuts in itertools.combinations(range(1, n), size - 1):
        bounds = (0, *cuts, n)
        worst = max(_load(layer_bytes, bounds[s], bounds[s + 1], s, size, embed, head) for s in range(size))
        best = worst if best is None else min(best, worst)
    return best


def _load(layer_bytes, i, j, s, size, embed, head) -> float:
    """Stage s holding layers [i, j): the mean of its share of the weight bytes and of the layers."""
    total = sum(layer_bytes) + embed + head
    held = sum(layer_bytes[i:j]) + (embed if s == 0 else 0) + (head if s == size - 1 else 0)
    return (held / max(1, total) + (j - i) / len(layer_bytes)) / 2


def _stage_bytes(stages, layer_bytes, embed, head) -> list[int]:
    return [sum(layer_bytes[s.start : s.end]) + (embed if s.first else 0) + (head if s.last else 0) for s in stages]


def _stage_loads(stages, layer_bytes, embed, head) -> list[float]:
    return [stage_load(s, layer_bytes, embed, head) for s in stages]


def _check_shape(stages, n, size) -> None:
    assert len(stages) == size
    assert stages[0].start == 0 and stages[-1].end == n
    for a, b in zip(stages, stages[1:]):
        assert a.end == b.start  # contiguous, no layer twice, none dropped
    assert all(s.end > s.start for s in stages)  # every stage runs a layer
    assert [s.first for s in stages] == [True] + [False] * (size - 1)
    assert [s.last for s in stages] == [False] * (size - 1) + [True]


@pytest.mark.parametrize("seed", range(40))
def test_plan_is_an_optimal_contiguous_cut(seed):
    rng = random.Random(seed)
    n = rng.randint(1, 9)
    size = rng.randint(1, n)
    layer_bytes = [rng.randint(1, 100) for _ in range(n)]
    embed, head = rng.randint(0, 300), rng.randint(0, 300)
    stages = plan_stages(layer_bytes, size, embed, head)
    _check_shape(stages, n, size)
    assert max(_stage_loads(stages, layer_bytes, embed, head)) == pytest.approx(
        _best_by_search(layer_bytes, size, embed, head), abs=1e-12
    )


def test_even_layers_split_evenly_and_a_big_vocabulary_shortens_the_end_stages():
    stages = plan_stages([10] * 24, 2)
    assert [(s.start, s.end) for s in stages] == [(0, 12), (12, 24)]
    stages = plan_stages([10] * 24, 4)
    assert [(s.start, s.end) for s in stages] == [(0, 6), (6, 12), (12, 18), (18, 24)]
    # An embedding and head of 4 layers' bytes each: the middle stages carry more layers, the
    # end stages' KV pages (a layer's share) counted beside their bytes.
    stages = plan_stages([10] * 24, 4, embed_bytes=40, head_bytes=40)
    assert [len(s.layers) for s in stages] == [5, 7, 7, 5]


def test_bad_sizes_are_refused_with_the_limit():
    with pytest.raises(ValueError, match="at most 3"):
        plan_stages([1, 1, 1], 4)
    with pytest.raises(ValueError, match=">= 1"):
        plan_stages([1, 1, 1], 0)


def _cfg(**over) -> ModelConfig:
    d = dict(
        architectures=["LlamaForCausalLM"],
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=1000,
        max_position_embeddings=512,
    )
    d.update(over)
    return ModelConfig.from_hf_dict(d)


def test_hybrid_kv_gemma3_cuts_across_window_kinds():
    """Gemma 3's global layer sits among sliding ones; a stage holds whole layers of either kind."""
    cfg = _cfg(
        architectures=["Gemma3ForCausalLM"],
        model_type="gemma3_text",
        head_dim=16,
        sliding_window=48,
        layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
        hidden_activation="gelu_pytorch_tanh",
        query_pre_attn_scalar=16,
    )
    assert cfg.layer_windows.count(None) == 1
    layers, embed, head = estimated_bytes(cfg)
    stages = plan_stages(layers, 2, embed, head)
    _check_shape(stages, 4, 2)
    assert max(_stage_loads(stages, layers, embed, head)) == pytest.approx(
        _best_by_search(layers, 2, embed, head), abs=1e-12
    )


def test_moe_layers_weigh_their_experts():
    """Mixtral-shaped: every layer's experts count, so MoE layers outweigh a dense one."""
    cfg = _cfg(architectures=["MixtralForCausalLM"], num_local_experts=8, num_experts_per_tok=2)
    layers, embed, head = estimated_bytes(cfg)
    dense, _, _ = estimated_bytes(_cfg())
    assert all(m > d for m, d in zip(layers, dense))
    stages = plan_stages(layers, 2, embed, head)
    _check_shape(stages, 4, 2)


def test_checkpoint_bytes_by_part():
    names = [
        ("model.embed_tokens.weight", 1000),
        ("lm_head.weight", 1000),
        ("model.norm.weight", 8),
        ("model.layers.0.self_attn.q_proj.weight", 50),
        ("model.layers.0.mlp.experts.3.w1.weight", 70),
        ("model.layers.1.input_layernorm.weight", 8),
        ("model.layers.1.self_attn.o_proj.weight", 40),
    ]
    assert bytes_by_part(names, 2, tie_word_embeddings=False) == ([120, 48], 1000, 1008)
    tied = [x for x in names if x[0] != "lm_head.weight"]
    assert bytes_by_part(tied, 2, tie_word_embeddings=True) == ([120, 48], 1000, 1008)


def _gguf_reference_parts(path, num_layers: int):
    """(per-layer, embedding, final norm + head) bytes as the gguf package reads the file."""
    import gguf

    layers, embed, head = [0] * num_layers, 0, 0
    names = set()
    for t in gguf.GGUFReader(str(path)).tensors:
        names.add(t.name)
        if t.name.startswith("blk."):
            layers[int(t.name.split(".")[1])] += int(t.n_bytes)
        elif t.name == "token_embd.weight":
            embed += int(t.n_bytes)
        elif t.name in ("output.weight", "output_norm.weight"):
            head += int(t.n_bytes)
    if "output.weight" not in names:  # tied: the last stage holds its own copy of the table
        head += embed
    return layers, embed, head


def test_plan_weighs_the_gguf_files_own_bytes(smollm2_gguf_path):
    """The plan balances the bytes the file stores, as the gguf package reads them (SmolLM2:
    tied embeddings, so the last stage counts its copy of the table)."""
    from pagedllm.loading.loader import checkpoint_part_bytes, read_config
    from pagedllm.loading.source import resolve

    src = resolve(str(smollm2_gguf_path))
    cfg = read_config(src)
    got = checkpoint_part_bytes(src, cfg)
    assert got == _gguf_reference_parts(smollm2_gguf_path, cfg.num_layers)


QWEN_05B = Path.home() / ".cache/pagedllm/models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"


@pytest.mark.slow  # the gguf package reads the whole file's 151k-token vocabulary in Python
@pytest.mark.skipif(
    not QWEN_05B.exists(),
    reason="the real Qwen2.5-Coder-0.5B GGUF is not here (../shared/models/fetch-qwen-coder.sh fetches it)",
)
def test_real_q4_k_m_file_is_cut_by_its_own_bytes():
    """llama.cpp's Q4_K_M mix keeps Qwen2.5-Coder-0.5B's head at Q8_0 (145 MB) and its embedding
    at Q5_0 (94 MB): a plan from the config (equal tables) cuts 12/12 and leaves the stages' weights
    12% apart; one from the file's bytes gives the first stage a layer more (13/11), each stage's
    weights and layers (its KV pages) within 10% of half."""
    from pagedllm.distributed.stage import plan_for
    from pagedllm.loading.source import resolve

    src = resolve(str(QWEN_05B))
    layers, embed, head = _gguf_reference_parts(QWEN_05B, 24)
    stages = plan_for(src, 2)
    _check_shape(stages, 24, 2)
    half = (sum(layers) + embed + head) / 2
    assert all(abs(b / half - 1) < 0.1 for b in _stage_bytes(stages, layers, embed, head))
    assert all(abs(len(s.layers) / 12 - 1) < 0.1 for s in stages)
    assert stages[0].end > 12


def test_plan_weighs_the_safetensors_files_own_bytes(tmp_path, hf_smollm2_tokenizer):
    """A folder's bytes from its safetensors headers, as the safetensors package reads the tensors."""
    from safetensors import safe_open

    from models import build_checkpoint
    from pagedllm.loading.loader import checkpoint_part_bytes, read_config
    from pagedllm.loading.source import resolve

    path = build_checkpoint("qwen2", tmp_path / "m", hf_smollm2_tokenizer, vocab_size=hf_smollm2_tokenizer.vocab_size)
    src = resolve(str(path))
    cfg = read_config(src)
    with safe_open(str(path / "model.safetensors"), framework="pt") as st:
        named = [(k, st.get_tensor(k).nbytes) for k in st.keys()]
    assert checkpoint_part_bytes(src, cfg) == bytes_by_part(named, cfg.num_layers, cfg.tie_word_embeddings)
    assert sum(checkpoint_part_bytes(src, cfg)[0]) > 0


def _decode_reads(stages, layer_bytes, head, vocab) -> list[float]:
    """Bytes a stage reads in a decode step: its layers and its rows of the head."""
    out = []
    for s in stages:
        rows = s.head_rows(vocab)
        out.append(sum(layer_bytes[s.start : s.end]) + (head * (rows[1] - rows[0]) / vocab if rows else 0))
    return out


@pytest.mark.parametrize("seed", range(30))
def test_shared_head_evens_decode_reads_within_the_plans_largest_stage(seed):
    """The first stage takes the head's first rows, the last the rest, in whole runs of
    HEAD_SHARE_ROWS: the stages' decode reads come closer (never further apart, never past
    each other by more than a run of rows), and an untied head's copied rows never lift the
    first stage's weights above the plan's largest stage."""
    rng = random.Random(seed)
    n = rng.randint(2, 12)
    size = rng.randint(2, min(4, n))
    layer_bytes = [rng.randint(50, 100) for _ in range(n)]
    vocab = rng.choice([1000, 4096, 32000, 151936])
    embed, tied = rng.randint(100, 600), rng.random() < 0.5
    head = embed + 8 if tied else rng.randint(100, 900)
    plan = plan_stages(layer_bytes, size, embed, head)
    shared = share_head(plan, layer_bytes, embed, head, vocab, tied)
    _check_shape(shared, n, size)
    assert [(s.start, s.end) for s in shared] == [(s.start, s.end) for s in plan]
    assert all(s.head is None for s in shared[1:-1])
    before = _decode_reads(plan, layer_bytes, head, vocab)
    after = _decode_reads(shared, layer_bytes, head, vocab)
    run = head * HEAD_SHARE_ROWS / vocab
    if not shared[0].shares_head:
        assert shared == plan
    else:
        lo, hi = shared[0].head
        assert lo == 0 and hi % HEAD_SHARE_ROWS == 0 and shared[-1].head == (hi, vocab)
        assert abs(after[0] - after[-1]) <= abs(before[0] - before[-1])
        assert after[0] <= after[-1] + 2 * run  # the first stage took no more than evens them
        if not tied:
            weights = _stage_bytes(plan, layer_bytes, embed, head)
            assert weights[0] + head * hi / vocab <= max(weights) + 1e-9
    if before[0] + 2 * run < before[-1] and tied:
        assert shared[0].shares_head  # something to even, and a tied head's rows cost nothing


def test_shared_head_where_the_first_stage_reads_more_already():
    layers = [10] * 8
    plan = [Stage(0, 2, 0, 7, 8), Stage(1, 2, 7, 8, 8)]  # 70 against 10 + a 40-byte head
    assert share_head(plan, layers, 40, 40, 4096, tied=True) == plan


def test_first_stage_loads_its_rows_of_the_head():
    first = Stage(0, 2, 0, 2, 4, head=(0, 512))
    last = Stage(1, 2, 2, 4, 4, head=(512, 1000))
    assert first.keeps_tensor("lm_head.weight", False) and last.keeps_tensor("lm_head.weight", False)
    assert not first.keeps_tensor("model.norm.weight", False) and last.keeps_tensor("model.norm.weight", False)
    assert first.head_rows(1000) == (0, 512) and last.head_rows(1000) == (512, 1000)
    assert Stage(1, 2, 2, 4, 4).head_rows(1000) == (0, 1000) and Stage(0, 2, 0, 2, 4).head_rows(1000) is None
