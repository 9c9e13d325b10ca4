"""`pagedllm bench compare MODEL.gguf`: pagedllm beside llama.cpp on the same GGUF file, in one run.

Every figure comes from a fresh process of one engine doing one measurement (a warm-up that
does the timed work once, then `--repeats` timed runs; the median is reported), so each
engine's peak RSS (VmHWM of that process) is its own. Both engines get the same threads, the
same prompt tokens, greedy decoding with EOS ignored, and the same KV room:

- decode at batch 1: a short prompt, then `--max-tokens` tokens; the rate counts the steps after
  the first token (prefill excluded);
- `--parallel` sequences decoded together (32): aggregate output tok/s of the decode steps, the KV
  room being `--parallel` x (prompt + max-tokens, rounded up to 256) tokens
  (llama.cpp: n_ctx of that size with n_seq_max = --parallel);
- one `--prefill-tokens` prefill (512; llama.cpp n_batch = n_ubatch = 512);
- with `--long-context 8192,16384,...`, at each length: one prompt of that many tokens (the
  prefill rate), then `--long-tokens` tokens decoded at that depth (the decode rate), once per
  cache of `--long-caches` against llama.cpp's nearest: our auto (the compute dtype) and bf16 /
  f16 against its f16 cache, our int8 against its q8_0; llama.cpp runs with flash attention on,
  its fastest path at length. Our prefill takes the engine's default chunk
  (max_num_batched_tokens); llama.cpp its 512-token ubatches;
- at batch 1, the weight-streaming rate: the bytes of weights read per token (the GGUF's tensor
  data, less an untied embedding table, which is only row-gathered) x tok/s, against a read
  bandwidth measured in the same run (a large float32 tensor summed with the same threads);
- for `--parallel` sequences, the share of the CPU's int8 dot-product peak: the multiply-adds of
  the weights per token (their values, less an untied embedding table) x tok/s, against the peak
  measured just before each engine's run (vpdpbusd or vpmaddubsw on register chains with the
  same threads: what both engines' integer kernels issue). Such a step is bound by these
  products, not by the bytes it reads; attention's share is not counted.

With `--rounds N`, every figure is measured N times, each a fresh process of each engine, the
engines' order alternating; each batch-1 run gets a bandwidth measurement of its own just before
it. The ratios and shares reported are the medians of the rounds': on a machine whose read
bandwidth drifts by half within minutes (docs/benchmarks/from-code.md), one engine's run after
the other's compares the machine's moods, not the engines.

llama.cpp runs through llama-cpp-python (optional: `make bench-deps`); without it our side still
runs and the report says what to install.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import statistics
import subprocess
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

from .. import tuning
from .common import machine_info, write_json
from .compare_report import ENGINES, format_report
from .llamacpp_peer import MISSING_HINT

logger = logging.getLogger(__name__)

MEASURES = ("decode1", "parallel", "prefill")
ISA_LEVELS = ("base", "avx2", "avxvnni", "avx512vnni", "avx512bf16")  # as pagedllm/native/__init__.py
CPU_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "avx_vnni", "amx_tile", "amx_bf16", "amx_int8")
# Our KV cache dtype -> llama.cpp's cache type that stores about as many bits.
PEER_CACHE = {"auto": "f16", "bf16": "f16", "f16": "f16", "int8": "q8_0"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "model",
        nargs="?",
        default="default",
        metavar="MODEL.gguf",
        help="a GGUF file; 'default' is the embedded SmolLM2 Q4_1",
    )
    p.add_argument("--threads", type=int, default=2, help="threads of both engines (default 2)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per figure; medians reported")
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="fresh processes of both engines per figure, in alternating order, the read "
        "bandwidth measured just before each batch-1 run; the ratio and the share of "
        "bandwidth are the medians of the rounds' (a machine whose speed drifts between "
        "runs: 3)",
    )
    _workload_arguments(p)
    _engine_arguments(p)
    p.add_argument("--output", default=None, help="JSON file (default bench-results/compare-<model>.json)")


def _workload_arguments(p: argparse.ArgumentParser) -> None:
    """What each figure runs: tokens, sequences, lengths, the measures taken."""
    p.add_argument("--max-tokens", type=int, default=128, help="tokens generated per sequence")
    p.add_argument("--prompt-tokens", type=int, default=16, help="prompt length of the decode tests")
    p.add_argument(
        "--context", type=int, default=1024, help="KV room of the batch-1 and prefill tests, in tokens (default 1024)"
    )
    p.add_argument("--parallel", type=int, default=32, help="sequences decoded together (default 32)")
    p.add_argument("--prefill-tokens", type=int, default=512)
    p.add_argument(
        "--measures",
        default=",".join(MEASURES),
        help=f"comma-separated subset of {','.join(MEASURES)} ('' with --long-context: that test only)",
    )
    p.add_argument(
        "--long-context",
        default="",
        metavar="N[,N...]",
        help="prompt lengths of the long-context test (e.g. 8192,16384,32768; default: not run)",
    )
    p.add_argument("--long-tokens", type=int, default=32, help="tokens decoded at depth in the long-context test")
    p.add_argument(
        "--long-caches",
        default="auto,int8",
        metavar="CACHE[,CACHE...]",
        help=f"our KV caches in the long-context test, each against llama.cpp's nearest "
        f"({', '.join(f'{k}: {v}' for k, v in PEER_CACHE.items())}); default auto,int8",
    )


def _engine_arguments(p: argparse.ArgumentParser) -> None:
    """Which engines run, how they are set up, and what the machine is measured for."""
    p.add_argument("--peer", choices=["llama.cpp", "none"], default="llama.cpp")
    p.add_argument(
        "--bandwidth-mib", type=int, default=1024, help="size of the tensor summed to measure read bandwidth (0: skip)"
    )
    p.add_argument(
        "--peak-seconds",
        type=float,
        default=0.5,
        help="seconds measuring the CPU's int8 dot-product peak before each many-sequence run (0: skip)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the prompt tokens")
    p.add_argument(
        "--dtype",
        default=None,
        help="pagedllm's dtype (default: the engine's choice; with --isa below avx512bf16, "
        "float32: what the engine's auto picks on a CPU without AVX-512 BF16)",
    )
    p.add_argument(
        "--isa",
        choices=ISA_LEVELS,
        default=None,
        help="cap our native kernels at this instruction-set level (PAGEDLLM_NATIVE_ISA in "
        "our processes), e.g. avx2 to measure an AVX2-only machine on a newer one; "
        "llama.cpp runs whatever its build was compiled for (the report names both)",
    )
    p.add_argument(
        "--dequantize-weights",
        action="store_true",
        default=None,
        help="pagedllm keeps today's dequantized float weights (passed only when given)",
    )


# -- the parent: plan, spawn, report --------------------------------------------------------------


def run(args: argparse.Namespace) -> dict | int:
    try:
        return _run(args)
    except RuntimeError as e:  # a child failed: its message says which and why
        print(f"error: {e}", file=sys.stderr)
        return 1


def _run(args: argparse.Namespace) -> dict:
    model = _model_path(args.model)
    _check_isa_built(args.isa)
    long_lengths, long_caches = _long_plan(args)
    measures = _measures(args.measures) if args.measures or not long_lengths else []
    out = args.output or f"bench-results/compare-{model.stem}.json"
    peer_ok = args.peer == "llama.cpp" and _has_llama_cpp()
    if args.peer == "llama.cpp" and not peer_ok:
        print(f"llama.cpp side skipped: {MISSING_HINT}", file=sys.stderr)
    engine_kwargs = pagedllm_kwargs(args)
    weights = weight_bytes(model)
    vocab = weights.pop("vocab")
    result: dict = {
        "model": str(model),
        "machine": {**machine_info(), **cpu_info(), "threads": args.threads},
        "threads": args.threads,
        "repeats": args.repeats,
        "rounds": max(1, args.rounds),
        "weights": weights,
        "engine_kwargs": engine_kwargs,
        "isa_cap": args.isa,
        "measures": {},
    }
    # (int8 products are what a quantized file's matrices run on; float ones take the GEMM)
    machine = _MachineRuns(
        args,
        args.bandwidth_mib > 0 and "decode1" in measures,
        args.peak_seconds > 0 and "parallel" in measures and weights["quantized"] and not args.dequantize_weights,
    )
    plan = [(kind, _spec(kind, args, str(model), vocab)) for kind in measures]
    plan += [
        (f"long-{n}-{cache}", _long_spec(n, cache, args, str(model), vocab))
        for n in long_lengths
        for cache in long_caches
    ]
    for kind, spec in plan:
        spec["engine_kwargs"] = engine_kwargs | spec.pop("cache_kwargs", {})
        spec["isa"] = args.isa
        spec["tuning"] = asdict(tuning.current())  # (a child process starts from the defaults)
        result["measures"][kind] = _measure(kind, spec, args, peer_ok, machine)
        result.update(machine.summary())
        write_json(out, result)  # what is done so far survives an interrupted run
    if "decode1" in result["measures"]:
        result["streaming"] = streaming(result)
    if "parallel" in result["measures"] and "int8_peak" in result:
        result["compute"] = compute_share(result)
    print(format_report(result))
    print(f"results written to {write_json(out, result)}")
    return result


class _MachineRuns:
    """The machine's read bandwidth and int8 dot-product peak, each measured in a process of
    its own just before the engine run it is the ceiling of (the machine's speed drifts)."""

    def __init__(self, args: argparse.Namespace, bandwidth: bool, peak: bool) -> None:
        self.args, self.measure_bw, self.measure_peak = args, bandwidth, peak
        self.bw_runs: list[dict] = []
        self.peak_runs: list[dict] = []

    def before(self, kind: str) -> tuple[dict | None, dict | None]:
        a = self.args
        bw = pk = None
        if self.measure_bw and kind == "decode1":
            bw = _spawn("bandwidth", {"mib": a.bandwidth_mib, "threads": a.threads, "repeats": 7, "isa": a.isa})
            self.bw_runs.append(bw)
        if self.measure_peak and kind == "parallel":
            pk = _spawn("int8peak", {"threads": a.threads, "seconds": a.peak_seconds, "isa": a.isa})
            if pk.get("gmac_s"):
                self.peak_runs.append(pk)
        return bw, pk

    def summary(self) -> dict:
        out: dict = {}
        if self.bw_runs:
            out["read_bandwidth"] = _bandwidth_over(self.bw_runs)
        if self.peak_runs:
            runs = self.peak_runs
            out["int8_peak"] = {
                "gmac_s": statistics.median(r["gmac_s"] for r in runs),
                "isa": runs[0]["isa"],
                "seconds": self.args.peak_seconds,
                "amx_rows": runs[0].get("amx_rows", 0),
                "measurements": [r["gmac_s"] for r in runs],
            }
        return out


def _measure(kind: str, spec: dict, args: argparse.Namespace, peer_ok: bool, machine: _MachineRuns) -> dict:
    """One figure: each engine in a fresh process per round, the engines' order alternating."""
    row: dict = {
        "kv_tokens": spec["kv_tokens"],
        "sequences": len(spec["prompts"]),
        "prompt_tokens": len(spec["prompts"][0]),
        "max_tokens": spec["max_tokens"],
    }
    if spec["measure"] == "long":
        row |= {"cache": spec["engine_kwargs"]["kv_cache_dtype"], "peer_cache": spec["peer_cache"]}
    runs: dict[str, list[dict]] = {e: [] for e in ENGINES}
    for rnd in range(max(1, args.rounds)):
        for engine in ENGINES if rnd % 2 == 0 else ENGINES[::-1]:  # (the machine's speed drifts)
            if engine == "llama.cpp" and not peer_ok:
                row[engine] = {"skipped": MISSING_HINT if args.peer == "llama.cpp" else "--peer none"}
                continue
            bw, pk = machine.before(kind)
            tag = f" (round {rnd + 1} of {args.rounds})" if args.rounds > 1 else ""
            print(f"{kind}: {engine}{tag} ...", file=sys.stderr, end=" ", flush=True)
            got = _summarise(_spawn(engine, spec))
            if bw is not None:
                got["read_bandwidth_gb_s"] = bw["gb_s"]
            if pk is not None and pk.get("gmac_s"):
                got["int8_peak_gmac_s"] = pk["gmac_s"]
            runs[engine].append(got)
            extra = f", decode at depth {got['decode_tok_s']:.2f} tok/s" if "decode_tok_s" in got else ""
            print(f"{got['tok_s']:.1f} tok/s{extra}, peak RSS {got['peak_rss_mb']:.0f} MB", file=sys.stderr, flush=True)
    for engine, got in runs.items():
        if got:
            row[engine] = _over_rounds(got)
    if all(runs.values()):
        keys = [k for k in ("tok_s", "decode_tok_s") if k in runs["pagedllm"][0]]
        row["ratio_rounds"] = {k: [a[k] / b[k] for a, b in zip(runs["pagedllm"], runs["llama.cpp"])] for k in keys}
    return row


def pagedllm_kwargs(args: argparse.Namespace) -> dict:
    """Engine options given on the command line, and only those: an option the engine does not
    know yet (dequantize_weights, before quantized weights land) is never passed by default."""
    dtype = args.dtype
    if dtype is None and getattr(args, "isa", None) not in (None, "avx512bf16"):
        dtype = "float32"  # auto's choice where the CPU has no AVX-512 BF16
    return {k: v for k, v in (("dtype", dtype), ("dequantize_weights", args.dequantize_weights)) if v is not None}


def _model_path(model: str) -> Path:
    from ..loading.source import default_model_path

    path = default_model_path() if model == "default" else Path(model).expanduser()
    if path.suffix != ".gguf" or not path.is_file():
        raise FileNotFoundError(f"{path}: bench compare needs a .gguf file (llama.cpp reads only GGUF)")
    return path


def _measures(text: str) -> list[str]:
    wanted = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in wanted if m not in MEASURES]
    if bad or not wanted:
        raise ValueError(f"--measures: unknown {bad or 'empty list'}; choose from {', '.join(MEASURES)}")
    return wanted


def _long_plan(args: argparse.Namespace) -> tuple[list[int], list[str]]:
    """The long-context test's prompt lengths and our caches, checked before anything runs."""
    try:
        lengths = [int(x) for x in args.long_context.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--long-context takes token counts separated by commas, got {args.long_context!r}") from None
    if any(n < 2 for n in lengths):
        raise ValueError(f"--long-context: every length must be at least 2 tokens, got {lengths}")
    caches = [c.strip() for c in args.long_caches.split(",") if c.strip()]
    bad = [c for c in caches if c not in PEER_CACHE]
    if bad or (lengths and not caches):
        raise ValueError(
            f"--long-caches: {bad or 'empty list'} has no llama.cpp counterpart; choose from {', '.join(PEER_CACHE)}"
        )
    if args.long_tokens < 2:
        raise ValueError(f"--long-tokens must be at least 2 (the first token ends the prefill), got {args.long_tokens}")
    return lengths, caches


def _check_isa_built(isa: str | None) -> None:
    """Refuses `--isa` naming a level our kernels were not compiled at: a capped library runs the
    best level it holds below the cap, and a build for one machine holds only the baseline and
    the host's best (setup.py), so `--isa avx2` there measured the baseline, not AVX2."""
    if isa is None:
        return
    from ..native import built_levels, cpu_kernels

    ops = cpu_kernels()
    built = built_levels(ops) if ops is not None else []
    if isa not in built:
        raise RuntimeError(
            f"--isa {isa}: our native kernels hold the levels {', '.join(built) or 'none'}, "
            f"not {isa}; rebuild them with every level (PAGEDLLM_ISA_LEVELS=all python "
            f"setup.py build_ext --inplace, or make wheel) to measure it"
        )


def _has_llama_cpp() -> bool:
    import importlib.util

    return importlib.util.find_spec("llama_cpp") is not None


def _random_prompt(rng: random.Random, n: int, vocab: int) -> list[int]:
    # Ordinary tokens only: the first few hundred ids of these vocabularies are control tokens
    # and single bytes; the random tail of a padded vocabulary is never reached.
    return [rng.randrange(256, min(vocab, 32000)) for _ in range(n)]


def _spec(kind: str, args: argparse.Namespace, model: str, vocab: int) -> dict:
    """What one child does: the same for both engines."""
    rng = random.Random(args.seed)

    def prompt(n: int) -> list[int]:
        return _random_prompt(rng, n, vocab)

    if kind == "prefill":
        prompts, max_tokens = [prompt(args.prefill_tokens)], 1
        kv = max(args.context, args.prefill_tokens + 1)
    elif kind == "decode1":
        prompts, max_tokens = [prompt(args.prompt_tokens)], args.max_tokens
        kv = max(args.context, args.prompt_tokens + args.max_tokens)
    else:
        prompts, max_tokens = [prompt(args.prompt_tokens) for _ in range(args.parallel)], args.max_tokens
        per_seq = -(-(args.prompt_tokens + args.max_tokens) // 256) * 256
        kv = per_seq * args.parallel
    return {
        "measure": kind,
        "model": model,
        "threads": args.threads,
        "repeats": args.repeats,
        "prompts": prompts,
        "max_tokens": max_tokens,
        "kv_tokens": kv,
    }


def _long_spec(n: int, cache: str, args: argparse.Namespace, model: str, vocab: int) -> dict:
    """One prompt of n tokens, then `--long-tokens` decoded at that depth, with one of our caches
    against llama.cpp's nearest and its flash attention on."""
    return {
        "measure": "long",
        "model": model,
        "threads": args.threads,
        "repeats": args.repeats,
        "prompts": [_random_prompt(random.Random(args.seed + n), n, vocab)],
        "max_tokens": args.long_tokens,
        "kv_tokens": n + args.long_tokens,
        "cache_kwargs": {"kv_cache_dtype": cache},
        "peer_cache": PEER_CACHE[cache],
        "flash_attn": True,
    }


def _spawn(engine: str, spec: dict) -> dict:
    """One fresh process for one measurement of one engine; its JSON result."""
    env = dict(os.environ, OMP_NUM_THREADS=str(spec["threads"]))
    if spec.get("isa") and engine != "llama.cpp":  # (--isa caps our kernels only)
        env["PAGEDLLM_NATIVE_ISA"] = spec["isa"]
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [env.get("PYTHONPATH")])])
    with tempfile.TemporaryDirectory(prefix="pagedllm-compare-") as tmp:
        spec_path, out_path = Path(tmp) / "spec.json", Path(tmp) / "out.json"
        spec_path.write_text(json.dumps(spec))
        if engine == "llama.cpp":  # by path: that process must not import torch
            cmd = [sys.executable, str(Path(__file__).with_name("llamacpp_peer.py"))]
        else:
            cmd = [sys.executable, "-m", "pagedllm.bench.compare_child", engine]
        proc = subprocess.run([*cmd, str(spec_path), str(out_path)], env=env, capture_output=True, text=True)
        if proc.returncode != 0 or not out_path.exists():
            tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-15:])
            if proc.returncode == -4:  # SIGILL: a -DGGML_NATIVE=ON build made on another CPU
                tail += (
                    "\n(illegal instruction: the installed llama-cpp-python was built for another "
                    "CPU; run `make bench-deps` again on this one)"
                )
            raise RuntimeError(f"the {engine} process failed (exit {proc.returncode}):\n{tail}")
        result = json.loads(out_path.read_text())
    if "error" in result:
        raise RuntimeError(f"{engine}: {result['error']}")
    return result


def _over_rounds(got: list[dict]) -> dict:
    """One engine's figures over the rounds: the medians of the rounds' medians, every run kept,
    the highest peak RSS."""
    out = dict(got[0])
    for key in ("tok_s", "decode_tok_s", "read_bandwidth_gb_s", "int8_peak_gmac_s"):
        if key in out:
            out[key] = statistics.median(g[key] for g in got)
            if len(got) > 1:
                out[f"{key}_rounds"] = [g[key] for g in got]
    for key in ("tok_s_runs", "decode_tok_s_runs"):
        if key in out:
            out[key] = [v for g in got for v in g[key]]
    out["peak_rss_mb"] = max(g["peak_rss_mb"] for g in got)
    if all("engine_rss_mb" in g for g in got):
        out["engine_rss_mb"] = max(g["engine_rss_mb"] for g in got)
    return out


def _bandwidth_over(runs: list[dict]) -> dict:
    """The read bandwidth over every measurement of the run: medians of their medians."""
    out = dict(runs[0])
    if len(runs) > 1:
        out["gb_s"] = statistics.median(r["gb_s"] for r in runs)
        out["gb_s_4k"] = statistics.median(r["gb_s_4k"] for r in runs)
        if all(r.get("gb_s_huge") for r in runs):
            out["gb_s_huge"] = statistics.median(r["gb_s_huge"] for r in runs)
        out["runs"] = [v for r in runs for v in r["runs"]]
        out["measurements"] = [r["gb_s"] for r in runs]
    return out


def _summarise(r: dict) -> dict:
    rates = r["tok_s"]
    out = {
        "tok_s": statistics.median(rates),
        "tok_s_runs": rates,
        "peak_rss_mb": r["peak_rss_mb"],
        # ours beyond `import torch` (compare_child); llama.cpp has no such runtime: its whole peak
        "engine_rss_mb": r.get("engine_rss_mb", r["peak_rss_mb"]),
    }
    if "decode_tok_s" in r:  # the long-context test: tok_s is its prefill rate
        out |= {"decode_tok_s": statistics.median(r["decode_tok_s"]), "decode_tok_s_runs": r["decode_tok_s"]}
    if r.get("outputs"):
        out["first_output"] = r["outputs"][0][:16]
    for key in ("dtype", "isa", "torch_rss_mb"):
        if key in r:
            out[key] = r[key]
    return out


def weight_bytes(model: Path) -> dict:
    """Bytes of the GGUF's tensors, and of those read per generated token: all of them, less an
    untied embedding table (only its prompt rows are gathered; a tied one is the output head), and
    of a mixture of experts' 3-D expert tensors (`*_exps`) only the share a token routes to
    (expert_used_count of expert_count). The same count in values of the matrices (2-D and up:
    one multiply-add each per token) is `per_token_macs`. Also the vocabulary size, read from the
    same header, and whether any matrix is quantized (not F32, F16 or BF16)."""
    import gguf

    reader = gguf.GGUFReader(str(model))
    sizes = {t.name: int(t.n_bytes) for t in reader.tensors}
    values = {t.name: int(t.n_elements) for t in reader.tensors if len(t.shape) >= 2}
    floats = (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.BF16)
    quantized = any(t.tensor_type not in floats for t in reader.tensors if t.name in values)
    arch = reader.fields["general.architecture"].contents()
    experts = reader.fields.get(f"{arch}.expert_count")
    used = reader.fields.get(f"{arch}.expert_used_count")
    routed = (
        (int(used.contents()), int(experts.contents()))
        if experts is not None and used is not None and int(experts.contents()) > 0
        else None
    )
    tied = "output.weight" not in sizes

    def per_token(counts: dict[str, int]) -> int:
        n = sum(counts.values()) - (0 if tied else counts.get("token_embd.weight", 0))
        if routed:
            exps = sum(v for name, v in counts.items() if "_exps." in name)
            n -= exps - exps * routed[0] // routed[1]
        return n

    return {
        "total_bytes": sum(sizes.values()),
        "per_token_bytes": per_token(sizes),
        "per_token_macs": per_token(values),
        "quantized": quantized,
        "tied_embeddings": tied,
        "vocab": len(reader.fields["tokenizer.ggml.tokens"].data),
    }


def streaming(result: dict) -> dict:
    per_token = result["weights"]["per_token_bytes"]
    bw = result.get("read_bandwidth", {}).get("gb_s")
    out: dict = {"read_bandwidth_gb_s": bw, "ceiling_tok_s": bw * 1e9 / per_token if bw else None}
    for engine in ENGINES:
        r = result["measures"]["decode1"].get(engine, {})
        if "tok_s" in r:
            gb_s = r["tok_s"] * per_token / 1e9
            out[engine] = {"gb_s": gb_s, "share_of_bandwidth": gb_s / bw if bw else None}
            # Each run against the bandwidth measured just before it, where it was: the machine's
            # bandwidth can drift by half between runs minutes apart.
            rates = r.get("tok_s_rounds", [r["tok_s"]])
            own = r.get("read_bandwidth_gb_s_rounds") or (
                [r["read_bandwidth_gb_s"]] if "read_bandwidth_gb_s" in r else []
            )
            if own:
                out[engine]["share_of_bandwidth"] = statistics.median(
                    t * per_token / 1e9 / b for t, b in zip(rates, own)
                )
    return out


def compute_share(result: dict) -> dict:
    """The many-sequence rate as multiply-adds of the weights a second, against the int8
    dot-product peak: each run against the peak measured just before it (the machine's speed
    drifts between runs minutes apart), the median over the rounds."""
    macs = result["weights"]["per_token_macs"]
    out: dict = {"per_token_macs": macs, "int8_peak_gmac_s": result["int8_peak"]["gmac_s"]}
    for engine in ENGINES:
        r = result["measures"]["parallel"].get(engine, {})
        if "tok_s" not in r or "int8_peak_gmac_s" not in r:
            continue
        rates = r.get("tok_s_rounds", [r["tok_s"]])
        peaks = r.get("int8_peak_gmac_s_rounds", [r["int8_peak_gmac_s"]])
        out[engine] = {
            "gmac_s": r["tok_s"] * macs / 1e9,
            "share_of_peak": statistics.median(t * macs / 1e9 / p for t, p in zip(rates, peaks)),
        }
    return out


def cpu_info() -> dict:
    flags: set[str] = set()
    name = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "flags" and not flags:
                flags = set(value.split())
            elif key.strip() == "model name" and not name:
                name = value.strip()
    except OSError:  # not Linux: leave the flags unknown rather than guess
        pass
    return {"cpu": name, "cpu_flags": [f for f in CPU_FLAGS if f in flags]}


# -- the report ----------------------------------------------------------------------------------
