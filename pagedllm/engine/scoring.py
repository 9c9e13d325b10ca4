"""Offline prompt scoring (logits of a prompt, perplexity over windows) as scheduled work.

Each prompt becomes one of the engine's own scoring requests (`LLMEngine.add_scoring_request`):
the scheduler chunks its prefill (at most `chunk_size` tokens a step for it) beside whatever else
runs, the runner's one `execute` computes the logits of its positions, and the engine keeps what
the request asked for: whole rows, or each next token's logprob (and argmax) reduced in the step.
The driver's loop runs the requests to the end; they leave no blocks, rows or sampler state
behind. `LLM.prompt_logits` and `LLM.score_prompts` are these.
"""

from __future__ import annotations

from typing import Sequence as Seq

import torch

from .driver import EngineDriver
from .sequence import Sequence


def prompt_logits(
    driver: EngineDriver, token_ids: list[int], chunk_size: int | None = None, lora_request=None
) -> torch.Tensor:
    """Logits [T, vocab] (float32, on the CPU) at every position of a prompt, computed through the
    same KV cache and attention path as generation, `chunk_size` tokens a step (1 = token by token
    through the decode path; None = the scheduler's max_num_batched_tokens)."""
    [seq] = _run(driver, [token_ids], "logits", chunk_size, lora_request)
    return torch.stack(seq.prompt_scores)


def score_prompts(
    driver: EngineDriver, prompts: Seq[list[int]], chunk_size: int | None = 1, top1: list[torch.Tensor] | None = None
) -> list[torch.Tensor]:
    """For each prompt, log p(token[t+1] | tokens[:t+1]) for every t ([T-1] float32), with all
    prompts advancing together, `chunk_size` tokens each a step (1 = every token through the
    batched decode path, reading K/V back from the cache). For perplexity over many windows at
    once: each scored row is reduced to its logprob in the step, so no whole row is kept. Prompts
    that do not fit the KV cache together wait until others finish. A list passed as `top1`
    receives each prompt's argmax predictions ([T-1] int64) too."""
    seqs = _run(driver, prompts, "logprob" if top1 is None else "logprob_top1", chunk_size)
    if top1 is None:
        return [torch.tensor(s.prompt_scores[1:], dtype=torch.float32) for s in seqs]
    pairs = [s.prompt_scores[1:] for s in seqs]
    top1[:] = [torch.tensor([a for _, a in p], dtype=torch.int64) for p in pairs]
    return [torch.tensor([v for v, _ in p], dtype=torch.float32) for p in pairs]


def _run(
    driver: EngineDriver, prompts: Seq[list[int]], keep: str, chunk_size: int | None, lora_request=None
) -> list[Sequence]:
    """Add a scoring request per prompt (all or none) and step until they are done (leaving
    early, an error or Ctrl-C included, aborts them); their sequences, with prompt_scores."""
    engine = driver.engine
    seqs: list[Sequence] = []
    try:
        for p in prompts:
            seqs.append(engine.add_scoring_request(p, keep, chunk_size, lora_request))
    except BaseException:
        driver.abort([s.request_id for s in seqs])
        raise
    for _ in driver.steps([s.request_id for s in seqs]):
        pass
    return seqs


KEEP_ROWS = ("entries", "logits")  # score kinds whose logits rows go to the engine whole


def next_token_scores(
    logits: torch.Tensor, items: list[tuple[Sequence, int, int, int]]
) -> list[tuple[Sequence, int, list]]:
    """Next-token scoring's rows (items: sequence, first position, first row, rows), each
    reduced to the next prompt token's logprob, with the argmax beside it where the sequence asks
    ("logprob_top1"), so no whole row outlives the step. One reduction over all their rows at
    once, as one [rows, vocab] block: a lone row's logsumexp may split the vocabulary among
    threads and round otherwise."""
    idx = [k for _, _, k0, c in items for k in range(k0, k0 + c)]
    block = logits if len(idx) == logits.shape[0] else logits[torch.tensor(idx, device=logits.device)]
    tgt = torch.tensor(
        [t for seq, lo, _, c in items for t in seq.prompt_token_ids[lo + 1 : lo + 1 + c]], device=logits.device
    )
    lp = block.gather(1, tgt[:, None])[:, 0] - block.logsumexp(-1)
    top1 = any(seq.score_kind == "logprob_top1" for seq, *_ in items)
    if top1:  # carried beside the logprob, exactly as an integer
        lp = torch.stack([lp.double(), block.argmax(-1).double()], dim=1)
    vals = lp.cpu().tolist()
    out, j = [], 0
    for seq, lo, _, c in items:
        part = vals[j : j + c]
        if top1:
            part = [(v, int(a)) for v, a in part] if seq.score_kind == "logprob_top1" else [v for v, _ in part]
        out.append((seq, lo, part))
        j += c
    return out
