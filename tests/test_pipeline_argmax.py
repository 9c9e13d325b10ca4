"""A greedy step under pipeline parallelism (StepPlan.argmax_only): the last stage sends each
logits row's largest value and its column instead of the row, and rank 0 rebuilds rows the
sampler takes to the same tokens as the whole rows, failing the same rows, beside rank 0's
own columns of a shared head or without them."""

from __future__ import annotations

import pytest
import torch

from pagedllm.distributed.stage import argmax_summary, logits_from_argmax
from pagedllm.sampling.metadata import SamplingMetadata
from pagedllm.sampling.params import SamplingParams
from pagedllm.sampling.sampler import Sampler


def _rows(seed: int, rows: int, vocab: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, vocab, generator=g) * 8
    x[0] = x[0].round()  # ties: the first of equal values wins
    x[1] = 3.0  # a flat row: column 0
    x[2, vocab // 2] = float("nan")  # fails its request
    x[3, -1] = float("-inf")
    return x


@pytest.mark.parametrize("split", [0, 1, 64, 999])
@pytest.mark.parametrize("seed", range(4))
def test_greedy_tokens_from_the_summary_equal_the_whole_rows(split, seed):
    whole = _rows(seed, 6, 1000)
    mine = whole[:, :split].clone() if split else None
    rebuilt = logits_from_argmax(argmax_summary(whole[:, split:].contiguous()), mine, 1000)
    assert rebuilt.shape == whole.shape
    params = [SamplingParams(temperature=0.0, max_tokens=4) for _ in range(6)]
    meta = SamplingMetadata(params, list(range(6)), [[1]] * 6, [1] * 6, [None] * 6, [0] * 6)
    assert all(p.argmax_only for p in params)
    want = Sampler(torch.device("cpu"))(whole.clone(), meta, check_finite=True).token_ids
    got = Sampler(torch.device("cpu"))(rebuilt, meta, check_finite=True).token_ids
    assert got == want
    assert want[2] == -1 and want[1] == 0  # the NaN row fails; the flat row takes its first column


def test_only_plain_greedy_rows_are_summarised():
    assert SamplingParams(temperature=0.0).argmax_only
    assert not SamplingParams(temperature=0.7).argmax_only
    assert not SamplingParams(temperature=0.0, logprobs=2).argmax_only
    assert not SamplingParams(temperature=0.0, repetition_penalty=1.2).argmax_only
    assert not SamplingParams(temperature=0.0, logit_bias={5: 2.0}).argmax_only
