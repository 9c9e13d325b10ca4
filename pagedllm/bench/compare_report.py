"""`pagedllm bench compare`'s report: the run's result (bench/compare.py) as the text table it
prints, with the weight-streaming and int8-peak shares and the instruction sets each engine ran."""

from __future__ import annotations

import statistics

ENGINES = ("pagedllm", "llama.cpp")


_LABELS = {
    "decode1": "decode, batch 1 (tok/s)",
    "parallel": "{n} sequences decoded together (tok/s)",
    "prefill": "prefill of {p} tokens (tok/s)",
}


def format_report(result: dict) -> str:
    m, w = result["machine"], result["weights"]
    lines = [
        f"model: {result['model']} ({w['total_bytes'] / 1e6:.0f} MB of tensors, "
        f"{w['per_token_bytes'] / 1e6:.0f} MB read per token)",
        f"cpu: {m.get('cpu') or m.get('machine')}; flags: {' '.join(m['cpu_flags']) or 'none of note'}; "
        f"{result['threads']} threads; medians of {result['repeats']}"
        + (
            f" runs in each of {result['rounds']} rounds (engines alternating; ratios: medians of the rounds')"
            if result.get("rounds", 1) > 1
            else ""
        ),
        "",
    ]
    head = f"{'':<42}{'pagedllm':>12}{'llama.cpp':>12}{'ratio':>9}"
    lines += [head, "-" * len(head)]
    for kind, row in result["measures"].items():
        if "cache" in row:  # the long-context test: two rates a row
            caches = f"cache {row['cache']} / {row['peer_cache']}"
            lines.append(_row(f"prefill of {row['prompt_tokens']} tokens, {caches}", row, "tok_s", "{:.1f}"))
            lines.append(_row("  then decode at that depth", row, "decode_tok_s", "{:.2f}"))
            continue
        label = _LABELS[kind].format(n=row["sequences"], p=row["prompt_tokens"])
        lines.append(_row(label, row, "tok_s", "{:.1f}"))
    for kind, row in result["measures"].items():
        lines.append(_row(f"peak RSS, {kind} (MB; KV room {row['kv_tokens']} tokens)", row, "peak_rss_mb", "{:.0f}"))
        if "torch_rss_mb" in row.get("pagedllm", {}):  # llama.cpp's cell: its whole peak again
            lines.append(
                _row(
                    f"  ours less `import torch` ({row['pagedllm']['torch_rss_mb']:.0f} MB)",
                    row,
                    "engine_rss_mb",
                    "{:.0f}",
                )
            )
    lines += _streaming_lines(result) + _compute_lines(result)
    lines += isa_lines(result)
    dtypes = {r["pagedllm"]["dtype"] for r in result["measures"].values() if "dtype" in r.get("pagedllm", {})}
    opts = ", ".join(f"{k}={v}" for k, v in result.get("engine_kwargs", {}).items())
    lines.append(
        f"pagedllm compute dtype {'/'.join(sorted(dtypes)) or '?'}{'; ' + opts if opts else ''}; "
        "ratio = pagedllm / llama.cpp (for RSS, lower is better)"
    )
    if any("cache" in r for r in result["measures"].values()):
        lines.append(
            "long context: llama.cpp with flash attention on; caches named ours / llama.cpp's "
            "(auto = the compute dtype)"
        )
    for engine in ENGINES:
        skipped = {r[engine]["skipped"] for r in result["measures"].values() if "skipped" in r.get(engine, {})}
        lines += [f"{engine} not run: {why}" for why in skipped]
    return "\n".join(lines)


def _streaming_lines(result: dict) -> list[str]:
    """Batch 1's weight-streaming rate against the read bandwidth measured in the same run."""
    s = result.get("streaming")
    if not s:
        return []
    lines: list[str] = []
    cells = [f"{s[e]['gb_s']:.1f}" if e in s else "-" for e in ENGINES]
    lines.append(f"{'weights streamed at batch 1 (GB/s)':<42}{cells[0]:>12}{cells[1]:>12}")
    if s["read_bandwidth_gb_s"]:
        shares = ", ".join(f"{e} {s[e]['share_of_bandwidth']:.0%}" for e in ENGINES if e in s)
        rb = result["read_bandwidth"]
        pages = (
            f"; in 4 KiB pages {rb['gb_s_4k']:.1f}, in 2 MiB pages {rb['gb_s_huge']:.1f}" if rb.get("gb_s_huge") else ""
        )
        many = (
            f"; median of {len(rb['measurements'])} measurements, each just before an engine's "
            f"batch-1 run, whose share is against it"
            if rb.get("measurements")
            else ""
        )
        lines.append(
            f"read bandwidth {s['read_bandwidth_gb_s']:.1f} GB/s (sum of a {rb['mib']} MiB tensor, "
            f"median of {len(rb['runs'])}{pages}{many}): batch-1 ceiling "
            f"{s['ceiling_tok_s']:.0f} tok/s; share reached: {shares}"
        )
    return lines


def _compute_lines(result: dict) -> list[str]:
    """The many-sequence runs' share of the CPU's int8 dot-product peak."""
    c = result.get("compute")
    if not (c and any(e in c for e in ENGINES)):
        return []
    lines: list[str] = []
    pk = result["int8_peak"]
    n = result["measures"]["parallel"]["sequences"]
    shares = ", ".join(f"{e} {c[e]['share_of_peak']:.0%}" for e in ENGINES if e in c)
    many = f", median of {len(pk['measurements'])}" if len(pk.get("measurements", [])) > 1 else ""
    lines.append(
        f"int8 dot-product peak {pk['gmac_s']:.0f} GMAC/s ({pk['isa']}, {result['threads']} threads, "
        f"measured just before each {n}-sequence run{many}); {c['per_token_macs'] / 1e9:.2f} G "
        f"multiply-adds of weights per token; share reached at {n} sequences: {shares}"
        + (
            f" (our bfloat16 steps of {pk['amx_rows']}+ rows multiply on AMX tiles here, which "
            "this peak does not bound)"
            if pk.get("amx_rows")
            else ""
        )
    )
    return lines


def isa_lines(result: dict) -> list[str]:
    """The instruction sets each engine's kernels ran with: ours, the native level (and its
    cap); llama.cpp's, the CPU features its build was compiled with (ggml's system info)."""

    def seen(engine: str) -> list[str]:
        return sorted({r[engine]["isa"] for r in result["measures"].values() if "isa" in r.get(engine, {})})

    ours, peer = seen("pagedllm"), seen("llama.cpp")
    if not ours and not peer:
        return []
    cap = result.get("isa_cap")
    return [
        f"instruction sets: pagedllm {'/'.join(ours) or '?'} kernels"
        + (f" (capped with --isa {cap})" if cap else " (this CPU's best)")
        + (f"; llama.cpp built with {'; '.join(peer)}" if peer else "")
    ]


def _row(label: str, row: dict, key: str, fmt: str) -> str:
    vals = [row.get(e, {}).get(key) for e in ENGINES]
    cells = [fmt.format(v) if v is not None else "-" for v in vals]
    rounds = row.get("ratio_rounds", {}).get(key)
    if rounds:  # the median of the rounds' ratios: each round ran both engines minutes apart
        ratio = f"{statistics.median(rounds):.2f}x"
    else:
        ratio = f"{vals[0] / vals[1]:.2f}x" if None not in vals and vals[1] else "-"
    return f"{label:<42}{cells[0]:>12}{cells[1]:>12}{ratio:>9}"
