"""llama.cpp's side of `pagedllm bench compare`, through llama-cpp-python's low-level API.

Run as a script by its path (`python .../llamacpp_peer.py SPEC.json OUT.json`), never as part of
the package: that process imports only the standard library, numpy and llama_cpp, so its peak RSS
is llama.cpp's own and not torch's. One process runs one measurement (`repeats` timed runs after
a warm-up) and writes its figures and its peak RSS as JSON.

The timing follows what pagedllm's side times: decode rates count the steps after the first
token (each step: one llama_decode plus a greedy argmax of the logits, as our step samples), and
the prefill rate times one llama_decode of the whole prompt.
"""

from __future__ import annotations

import contextlib
import json
import resource
import sys
import time
from dataclasses import dataclass
from typing import Any, Iterator

MISSING_HINT = (
    "llama-cpp-python is not installed. Run `make bench-deps` (it installs the wheel kept "
    "in ~/.cache/pagedllm/wheels, or builds one from the PyPI sdist: about 8 minutes on "
    "2 cores), or `pip install 'pagedllm[bench]'`."
)
BATCH = 512  # n_batch = n_ubatch: the 512-token prefill is one ubatch
CACHE_TYPES = {"f16": 1, "q8_0": 8}  # ggml_type of the K/V cache


@dataclass
class Model:
    lib: Any
    model: Any
    ctx: Any
    n_vocab: int


@contextlib.contextmanager
def open_model(
    path: str, n_ctx: int, threads: int, n_seq: int = 1, flash_attn: bool | None = None, cache_type: str = "f16"
) -> Iterator[Model]:
    """A model and one context with `n_ctx` KV cells shared by up to `n_seq` sequences; K and V
    cached as `cache_type` (f16 or q8_0: a quantized V cache needs flash attention); flash
    attention on, off, or (None) as llama.cpp chooses."""
    import llama_cpp as L

    L.llama_backend_init()
    silence(L)
    mparams = L.llama_model_default_params()
    model = L.llama_model_load_from_file(path.encode(), mparams)
    if not model:
        raise RuntimeError(f"llama.cpp could not load {path}")
    cparams = L.llama_context_default_params()
    cparams.n_ctx, cparams.n_seq_max = n_ctx, n_seq
    cparams.n_batch = cparams.n_ubatch = BATCH
    cparams.n_threads = cparams.n_threads_batch = threads
    if flash_attn is not None:  # None: llama.cpp's own choice (auto)
        cparams.flash_attn_type = L.LLAMA_FLASH_ATTN_TYPE_ENABLED if flash_attn else L.LLAMA_FLASH_ATTN_TYPE_DISABLED
    cparams.type_k = cparams.type_v = CACHE_TYPES[cache_type]
    ctx = L.llama_init_from_model(model, cparams)
    if not ctx:
        L.llama_model_free(model)
        why = (
            f" with a {cache_type} cache (llama.cpp quantizes the cache in blocks of 32 along the head "
            "dim, so the model's head dim must be a multiple of 32)"
            if cache_type != "f16"
            else ""
        )
        raise RuntimeError(f"llama.cpp could not make a context of {n_ctx} tokens for {path}{why}")
    try:
        n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
        yield Model(L, model, ctx, n_vocab)
    finally:
        L.llama_free(ctx)
        L.llama_model_free(model)


_QUIET: list = []  # the log callback, kept alive for the process's life


def silence(L: Any) -> None:
    """llama.cpp logs every tensor at load; keep stderr for our own messages."""
    if not _QUIET:
        _QUIET.append(L.llama_log_callback(lambda level, text, user_data: None))
    L.llama_log_set(_QUIET[0], None)


class Runner:
    """Greedy decoding of many sequences with one llama_batch per step."""

    def __init__(self, m: Model, capacity: int) -> None:
        self.m, self.L = m, m.lib
        self.batch = self.L.llama_batch_init(max(capacity, 1), 0, 1)

    def close(self) -> None:
        self.L.llama_batch_free(self.batch)

    def clear(self) -> None:
        self.L.llama_memory_clear(self.L.llama_get_memory(self.m.ctx), True)

    def decode(self, entries: list[tuple[int, int, int, bool]]) -> None:
        """entries: (token, position, sequence id, wants logits)."""
        b = self.batch
        b.n_tokens = len(entries)
        for i, (tok, pos, seq, logits) in enumerate(entries):
            b.token[i], b.pos[i], b.n_seq_id[i] = tok, pos, 1
            b.seq_id[i][0], b.logits[i] = seq, int(logits)
        rc = self.L.llama_decode(self.m.ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc} for a batch of {len(entries)} tokens")

    def argmax(self, rows: int) -> list[int]:
        import numpy as np

        logits = np.ctypeslib.as_array(self.L.llama_get_logits(self.m.ctx), shape=(rows, self.m.n_vocab))
        return logits.argmax(axis=1).tolist()

    def prefill(self, prompts: list[list[int]]) -> list[int]:
        """Each prompt in its own llama_decode call(s), sequence i = prompt i; the first tokens."""
        first = []
        for seq, p in enumerate(prompts):
            for s in range(0, len(p), BATCH):
                chunk = p[s : s + BATCH]
                self.decode([(t, s + j, seq, s + j == len(p) - 1) for j, t in enumerate(chunk)])
            first += self.argmax(1)
        return first

    def generate(self, prompts: list[list[int]], max_tokens: int) -> tuple[float, float, int, list[list[int]]]:
        """All sequences decoded together; (seconds of the prefill, seconds of the decode steps,
        tokens they made, outputs)."""
        self.clear()
        t0 = time.perf_counter()
        outs = [[t] for t in self.prefill(prompts)]
        prefill_s = time.perf_counter() - t0
        pos = [len(p) for p in prompts]
        t0 = time.perf_counter()
        for _ in range(max_tokens - 1):
            self.decode([(o[-1], pos[i], i, True) for i, o in enumerate(outs)])
            for i, t in enumerate(self.argmax(len(outs))):
                outs[i].append(t)
                pos[i] += 1
        dt = time.perf_counter() - t0
        return prefill_s, dt, len(prompts) * (max_tokens - 1), outs

    def prefill_time(self, prompt: list[int]) -> float:
        self.clear()
        t0 = time.perf_counter()
        self.prefill([prompt])
        self.L.llama_synchronize(self.m.ctx)
        return time.perf_counter() - t0


def measure(spec: dict) -> dict:
    prompts, kind = spec["prompts"], spec["measure"]
    with open_model(
        spec["model"],
        spec["kv_tokens"],
        spec["threads"],
        len(prompts),
        flash_attn=spec.get("flash_attn"),
        cache_type=spec.get("peer_cache", "f16"),
    ) as m:
        run = Runner(m, max(BATCH, len(prompts)))
        try:
            # Warm-up: the timed work once untimed (a long prompt: a short stand-in), as our side does.
            if kind == "long":
                run.generate([p[:8] for p in prompts], 3)
            elif kind == "prefill":
                run.prefill_time(prompts[0])
            else:
                run.generate(prompts, spec["max_tokens"])
            rates, decode_rates, outputs = [], [], None
            for _ in range(spec["repeats"]):
                if kind == "prefill":
                    rates.append(len(prompts[0]) / run.prefill_time(prompts[0]))
                    continue
                prefill_s, dt, n, outputs = run.generate(prompts, spec["max_tokens"])
                decode_rates.append(n / dt)
                if kind == "long":  # one prompt: its prefill, then the decode at its depth
                    rates.append(len(prompts[0]) / prefill_s)
        finally:
            run.close()
    out = {
        "tok_s": rates or decode_rates,
        "outputs": outputs,
        "peak_rss_mb": peak_rss_mb(),
        "n_vocab": m.n_vocab,
        "isa": built_isa(m.lib),
    }
    if kind == "long":
        out["decode_tok_s"] = decode_rates
    return out


# ggml's x86 features that set which kernels run (its system info names them `NAME = 1`).
ISA_FEATURES = (
    "AVX",
    "AVX2",
    "F16C",
    "FMA",
    "BMI2",
    "AVX_VNNI",
    "AVX512",
    "AVX512_VBMI",
    "AVX512_VNNI",
    "AVX512_BF16",
    "AMX_INT8",
)


def built_isa(L: Any) -> str:
    """The instruction sets this llama.cpp build's CPU kernels were compiled with, from
    llama_print_system_info ("CPU : SSE3 = 1 | AVX2 = 1 | ..."): what it runs, whatever the CPU has."""
    info = L.llama_print_system_info()
    text = info.decode(errors="replace") if isinstance(info, bytes) else str(info)
    on = {
        part.split("=")[0].split(":")[-1].strip()
        for part in text.replace("\n", "|").split("|")
        if part.split("=")[-1].strip() == "1"
    }
    return " ".join(f for f in ISA_FEATURES if f in on) or "no SIMD features reported"


def _status_mb(field: str) -> float | None:
    """A field of this process's /proc/self/status (VmRSS, VmHWM), in MB; None where not there."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024 / 1e6
    except OSError:
        pass
    return None


def rss_mb() -> float | None:
    """This process's resident set now, in MB (VmRSS); None where /proc is not there."""
    return _status_mb("VmRSS")


def peak_rss_mb() -> float:
    """This process's peak resident set, in MB. On Linux VmHWM, the high-water mark of this
    process's own memory map: ru_maxrss carries the spawning parent's peak across fork and
    exec, so a child that stays smaller than the bench's parent reports the parent's figure."""
    peak = _status_mb("VmHWM")
    if peak is not None:
        return peak
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return rss / 1e6 if sys.platform == "darwin" else rss * 1024 / 1e6


def main(argv: list[str]) -> int:
    spec_path, out_path = argv
    with open(spec_path) as f:
        spec = json.load(f)
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        result: dict = {"error": MISSING_HINT}
    else:
        result = measure(spec)
    with open(out_path, "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
