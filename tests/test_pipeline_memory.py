"""The per-rank memory limit (`max_rank_memory_mb`, `--max-rank-memory-mb`): a model whose
weights exceed it on one rank is refused with a message naming `-pp`, and runs when split into
two stages, each under it, giving pp=1's and transformers' float32 greedy tokens; each stage's
weight and KV bytes in the KV trace are within 10% of half of pp=1's."""

from __future__ import annotations

import pytest
import torch

from models import build_checkpoint
from procs import descendants
from pagedllm import LLM, SamplingParams
from pagedllm.loading.loader import check_rank_memory

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
KW = dict(dtype="float32", block_size=16, kv_cache_context_len=512)


def test_the_limit_names_the_stages_that_fit():
    check_rank_memory(100 * 2**20, 100.0)  # at the limit: fits
    check_rank_memory(10**12, None)  # no limit
    with pytest.raises(
        ValueError,
        match=r"the model's weights take 250\.0 MB, over max_rank_memory_mb=100 "
        r"\(--max-rank-memory-mb\).*--pipeline-parallel-size \(-pp\) 3 or more",
    ):
        check_rank_memory(250 * 2**20, 100.0)
    with pytest.raises(ValueError, match=r"rank 3's weights \(stage 1 of 2\) take 80\.0 MB.*-pp\) 4 or more"):
        check_rank_memory(80 * 2**20, 50.0, rank=3, pp=2, tp=2)
    for bad in (0, -1, "10", True):
        with pytest.raises(ValueError, match="max_rank_memory_mb must be a number of MB > 0"):
            LLM("nowhere", max_rank_memory_mb=bad)


def test_the_cli_flag_reaches_llm():
    from pagedllm.cli.main import build_parser, command_config

    argv = ["serve", "m", "-pp", "2", "--max-rank-memory-mb", "40"]
    assert command_config(build_parser(argv).parse_args(argv)).parallel.max_rank_memory_mb == 40.0


@pytest.mark.slow
def test_refused_at_pp1_runs_at_pp2(tmp_path, hf_smollm2_tokenizer):
    import transformers as tf

    tok = hf_smollm2_tokenizer
    # Eight layers and an untied head (as heavy as the embedding): two stages of 4 + 4 layers.
    path = build_checkpoint("llama", tmp_path / "m", tok, len(tok), num_hidden_layers=8)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, len(tok), (n,), generator=g).tolist() for n in (5, 40, 90)]
    ref = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        want = [
            ref.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)[
                0, len(p) :
            ].tolist()
            for p in prompts
        ]

    one = LLM(str(path), **KW)
    assert [o.token_ids for o in one.generate(prompts, GREEDY, use_tqdm=False)] == want
    t1 = one.kv_cache_trace()
    whole_mb = t1.rank_weight_mb[0]
    limit = 0.6 * whole_mb  # over half the weights, under all of them
    del one

    before = descendants()
    with pytest.raises(
        ValueError,
        match=r"the model's weights take .* MB, over max_rank_memory_mb=.* "
        r"--pipeline-parallel-size \(-pp\) 2 or more",
    ):
        LLM(str(path), max_rank_memory_mb=limit, **KW)
    # A limit no two stages fit either: refused, and the stage process it started is gone.
    with pytest.raises(ValueError, match=r"rank 0's weights \(stage 0 of 2\) .*-pp\) [3-9] or more"):
        LLM(str(path), pipeline_parallel_size=2, max_rank_memory_mb=0.3 * whole_mb, **KW)
    assert descendants() <= before

    with LLM(str(path), pipeline_parallel_size=2, max_rank_memory_mb=limit, **KW) as llm:
        got = [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
        t2 = llm.kv_cache_trace()
    assert got == want
    assert descendants() <= before
    # Acceptance 2 of issue 65: each rank's weight and KV bytes within 10% of 1/P of pp=1's.
    assert t2.capacity_blocks == t1.capacity_blocks
    assert all(w <= limit for w in t2.rank_weight_mb)
    for w, kv in zip(t2.rank_weight_mb, t2.rank_kv_mb):
        assert abs(w / (whole_mb / 2) - 1) < 0.10, (t2.rank_weight_mb, whole_mb)
        assert abs(kv / (t1.rank_kv_mb[0] / 2) - 1) < 0.10, (t2.rank_kv_mb, t1.rank_kv_mb)
