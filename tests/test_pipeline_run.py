"""Two pipeline stages in two processes (gloo on loopback, 1 thread each), each over its own
paged KV cache of its own layers: rank 0 broadcasts each step's plan, runs stage 0 and sends
its hidden states, rank 1 runs stage 1 and sends back the logits. Greedy decoding through them
gives transformers' float32 tokens for Llama, Qwen2 (tied head), Gemma 3 (sliding and global
KV groups) and a Mixtral-shaped MoE. The plans are written here for one sequence, so the
stages are checked apart from the engine's scheduler (tests/test_pipeline_llm.py drives them
through LLM); a killed stage fails rank 0's step within 30 s."""

from __future__ import annotations

import math
import os
import time

import numpy as np
import pytest
import torch

from models import reference_family
from procs import alive

BLOCK = 16
PROMPT, NEW = 37, 12


def _spec(path):
    from pagedllm.config import CacheConfig
    from pagedllm.distributed.worker import WorkerSpec
    from pagedllm.loading.source import resolve

    return WorkerSpec(resolve(str(path)), torch.float32, "cpu", None, False, None, CacheConfig(block_size=BLOCK), 1)


def _plans(cfg, prompt: list[int]):
    """A step plan maker for one sequence: each KV group its own run of blocks."""
    from pagedllm.engine.model_runner import StepPlan
    from pagedllm.kv.groups import plan_groups

    groups = plan_groups(cfg.layer_windows, cfg.num_layers, hybrid=True)
    width = math.ceil((len(prompt) + NEW) / BLOCK)

    def table(g):
        return np.arange(g * width, (g + 1) * width, dtype=np.int64)

    def plan(ids, start, decode):
        pos = np.arange(start, start + len(ids), dtype=np.int64)
        g_slots = [table(g)[pos // BLOCK] * BLOCK + pos % BLOCK for g in range(groups.num_groups)]
        return StepPlan(
            list(ids),
            pos,
            [0, len(ids)],
            [start + len(ids)],
            1 if decode else 0,
            [0],
            g_slots[0],
            table(0),
            width,
            [len(ids) - 1],
            group_slots=g_slots[1:],
            group_tables=[table(g) for g in range(1, groups.num_groups)],
            group_widths=[width] * (groups.num_groups - 1),
        )

    return plan, groups.num_groups * width


class Stage0:
    """Rank 0's stage of a pipeline driven without an engine: loaded, its cache built, each
    plan's logits rows by `forward(plan)` (what the engine's ModelRunner does, minus sampling)."""

    def __init__(self, ex, spec, num_blocks: int) -> None:
        from pagedllm.distributed.worker import load_part, rank_device
        from pagedllm.engine.model_runner import ModelRunner

        device = rank_device(spec.device, ex.rank)
        self.loaded = load_part(spec, device, **ex.load_args())
        ex.wait_loaded()
        ex.setup(num_blocks)
        cache, backend, _ = ex.build_kv(self.loaded, None, spec.cache_cfg, num_blocks, device, spec.dtype)
        ex.gather_sizes(self.loaded.weight_bytes, cache.nbytes)
        self.ex, self.stage = ex, ex.stage
        self.runner = ModelRunner(self.loaded.model, backend, spec.cache_cfg.block_size, device, sampler=None)

    def forward(self, plan):
        return self.ex.forward(plan, self.runner)[0]


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma3", "mixtral"])
def test_two_stage_greedy_matches_transformers(family, tmp_path, hf_smollm2_tokenizer):
    from pagedllm.distributed.pipeline import PipelineExecutor
    from pagedllm.loading.loader import read_config
    from pagedllm.loading.source import resolve

    path, _, prompts, want = reference_family(family, tmp_path / family, hf_smollm2_tokenizer, [PROMPT], NEW, seed=3)
    prompt = prompts[0]
    plan, num_blocks = _plans(read_config(resolve(str(path))), prompt)
    ex = PipelineExecutor.start(2, _spec(path), timeout_s=15)
    try:
        pids = ex.pids
        assert len(alive(pids)) == 1
        driver = Stage0(ex, _spec(path), num_blocks)
        stage, loaded = driver.stage, driver.loaded
        assert stage.first and not stage.last and loaded.model.norm is None
        # It computes the first rows of the head (models/stages.py share_head), the last stage the rest.
        if stage.shares_head:
            lo, hi = stage.head
            assert lo == 0 < hi < loaded.config.vocab_size and loaded.model.lm_head.out_features == hi
        else:
            assert loaded.model.lm_head is None
        assert len(loaded.model.attention_modules()) == stage.end < loaded.config.num_layers
        got, ids, start = [], prompt, 0
        for step in range(NEW):
            logits = driver.forward(plan(ids, start, decode=step > 0))
            assert logits.shape == (1, loaded.config.vocab_size)
            start += len(ids)
            ids = [int(logits[0].argmax())]
            got.append(ids[0])
        assert got == want[0], family
    finally:
        ex.shutdown()
    assert ex.procs[0].exitcode == 0  # it left on STOP
    assert not alive(pids)


def test_killed_stage_fails_rank0_within_30s(tmp_path, hf_smollm2_tokenizer):
    from pagedllm.distributed.p2p import StageLinkError
    from pagedllm.distributed.pipeline import PipelineExecutor
    from pagedllm.loading.loader import read_config
    from pagedllm.loading.source import resolve
    from models import build_checkpoint

    tok = hf_smollm2_tokenizer
    path = build_checkpoint("llama", tmp_path / "m", tok, len(tok))
    prompt = list(range(5, 5 + PROMPT))
    plan, num_blocks = _plans(read_config(resolve(str(path))), prompt)
    ex = PipelineExecutor.start(2, _spec(path), timeout_s=15)
    try:
        driver = Stage0(ex, _spec(path), num_blocks)
        driver.forward(plan(prompt, 0, decode=False))  # a healthy step first
        os.kill(ex.pids[0], 9)
        t0 = time.monotonic()
        with pytest.raises(StageLinkError, match=r"rank 0 could not .* The requests in flight failed") as err:
            for step in range(1, NEW):  # the failure shows on the next step's plan or hidden states
                driver.forward(plan([7], PROMPT + step - 1, decode=True))
        assert time.monotonic() - t0 < 30
        print(err.value)
        with pytest.raises(StageLinkError):  # and at once on every later step
            driver.forward(plan([7], PROMPT, decode=True))
    finally:
        ex.shutdown()
    assert not alive(ex.pids)
