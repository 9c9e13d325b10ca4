"""The child processes of `pagedllm bench compare` (bench/compare.py) on pagedllm's side: one
measurement each, in a fresh process, so that its peak RSS is its own. Run as
`python -m pagedllm.bench.compare_child ENGINE SPEC.json OUT.json`, ENGINE one of pagedllm,
bandwidth (the read bandwidth) and int8peak (the CPU's int8 dot-product peak). The native
kernels' level is the CPU's best, capped by PAGEDLLM_NATIVE_ISA where the parent set it
(`--isa`); each result names the level it ran at.
"""

from __future__ import annotations

import json
import logging
import statistics
import sys
import time
from pathlib import Path

from .. import tuning
from .llamacpp_peer import peak_rss_mb, rss_mb


def pagedllm_child(spec: dict) -> dict:
    import torch

    torch.set_num_threads(spec["threads"])
    # The project judges memory as what the engine holds beyond a bare `import torch` (torch is
    # its runtime): the report sets that against llama.cpp's whole process.
    torch_mb = rss_mb()
    from .. import LLM

    n_seq = len(spec["prompts"])
    long = spec["measure"] == "long"
    # A long prompt is chunked as the engine chooses; the short tests prefill in one chunk.
    chunk = {} if long else {"max_num_batched_tokens": max(1024, len(spec["prompts"][0]) + 1)}
    llm = LLM(
        spec["model"],
        kv_cache_context_len=spec["kv_tokens"],
        max_num_seqs=n_seq,
        max_model_len=spec["kv_tokens"] // n_seq,
        enable_prefix_caching=False,
        seed=0,
        **chunk,
        **spec["engine_kwargs"],
    )
    eng = llm.engine
    # Warm-up: the timed work once, untimed. Our CPU pools commit a KV page when it is first
    # written (kv/cache.py) and a first touch cost some 35 us a page on the machine measured, so
    # a first run read 20-50% slower than the next ones; llama.cpp commits its cache when the
    # context is made. A long prompt warms up on a short stand-in (its run takes minutes).
    warm = ([p[:8] for p in spec["prompts"]], 3) if long else (spec["prompts"], spec["max_tokens"])
    drive(llm.driver, *warm)
    rates, decode_rates, outputs = [], [], None
    for _ in range(spec["repeats"]):
        prefill_s, decode_s, decoded, outputs = drive(llm.driver, spec["prompts"], spec["max_tokens"])
        if spec["measure"] in ("prefill", "long"):
            rates.append(len(spec["prompts"][0]) / prefill_s)
        if spec["measure"] != "prefill":
            decode_rates.append(decoded / decode_s)
    out = {
        "tok_s": rates if rates else decode_rates,
        "outputs": outputs,
        "peak_rss_mb": peak_rss_mb(),
        "dtype": str(eng.dtype),
        "weights": eng.weights.summary() if eng.weights is not None else None,
        "isa": native_level(),
    }
    if torch_mb is not None:
        out["torch_rss_mb"] = torch_mb
        out["engine_rss_mb"] = out["peak_rss_mb"] - torch_mb
    if long:
        out["decode_tok_s"] = decode_rates
    return out


def native_level() -> str:
    """The level our native kernels run at here (the CPU's best under PAGEDLLM_NATIVE_ISA's cap),
    or why none does."""
    from ..native import cpu_kernels

    ops = cpu_kernels()
    return str(ops.native_isa()) if ops is not None else "none (PyTorch paths)"


def drive(driver, prompts: list[list[int]], max_tokens: int) -> tuple[float, float, int, list[list[int]]]:
    """Greedy, EOS ignored. Seconds until every sequence has its first token (the prefill), seconds
    of the steps after that, tokens those steps made, and the outputs."""
    from ..sampling.params import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    from ..engine.driver import Item

    ids = driver.add([Item(None, p, params) for p in prompts])
    made: dict[str, list[int]] = {}
    steps = driver.steps(ids)
    for outs in steps:
        for out in outs:
            made[out.request_id] = out.outputs[0].token_ids
        if len(made) == len(ids) and all(made.values()):
            break
    t1 = time.perf_counter()
    at_t1 = sum(len(t) for t in made.values())
    for outs in steps:
        for out in outs:
            made[out.request_id] = out.outputs[0].token_ids
    t2 = time.perf_counter()
    outputs = [list(made[i]) for i in ids]
    return t1 - t0, t2 - t1, sum(map(len, outputs)) - at_t1, outputs


def bandwidth_child(spec: dict) -> dict:
    """Read bandwidth: a float32 tensor of `mib` MiB summed with the bench's threads, in plain
    pages and, where the kernels put packed weights in 2 MiB pages, in those too (reading them
    is faster on some machines, so the ceiling is the faster of the two)."""
    import torch

    from ..quant.kernels import weight_buffer

    torch.set_num_threads(spec["threads"])
    n = spec["mib"] * 2**20 // 4
    tensors = {"4k": torch.ones(n, dtype=torch.float32)}  # pages touched before timing
    huge = weight_buffer((n,), torch.float32)  # (None where the slabs are off)
    if huge is not None:
        tensors["huge"] = huge.fill_(1.0)
    runs: dict[str, list[float]] = {k: [] for k in tensors}
    for x in tensors.values():
        x.sum()
    for _ in range(spec["repeats"]):
        for name, x in tensors.items():  # (alternated: the machine's speed drifts)
            t0 = time.perf_counter()
            x.sum()
            runs[name].append(x.numel() * 4 / (time.perf_counter() - t0) / 1e9)
    medians = {k: statistics.median(v) for k, v in runs.items()}
    return {
        "gb_s": max(medians.values()),
        "runs": runs["4k"],
        "mib": spec["mib"],
        "gb_s_4k": medians["4k"],
        "gb_s_huge": medians.get("huge"),
        "runs_huge": runs.get("huge"),
    }


def int8_peak_child(spec: dict) -> dict:
    """The int8 dot-product peak with the bench's threads (quant/kernels.py), on the integer
    path our kernels take here; gmac_s None where there is none."""
    import torch

    from ..quant import kernels

    torch.set_num_threads(spec["threads"])
    isa = kernels.kernel_path()[0]
    gmac_s = kernels.int8_peak_gmacs(spec["seconds"], isa) if isa else None
    return {"gmac_s": gmac_s, "isa": isa, "threads": spec["threads"], "amx_rows": kernels.amx_rows()}


def main(argv: list[str]) -> int:
    engine, spec_path, out_path = argv
    spec = json.loads(Path(spec_path).read_text())
    logging.basicConfig(level=logging.WARNING)
    tuning.configure(**spec.get("tuning", {}))
    children = {"bandwidth": bandwidth_child, "int8peak": int8_peak_child}
    result = children.get(engine, pagedllm_child)(spec)
    Path(out_path).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 4:
        sys.exit("use `pagedllm bench compare MODEL.gguf` (this module is its child process)")
    sys.exit(main(sys.argv[1:]))
