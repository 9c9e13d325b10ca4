"""`pagedllm bench compare` and `bench make-gguf` run end to end on a tiny random GGUF; llama.cpp's
side runs when llama-cpp-python is installed and is skipped, with what to install, when it is not.
No timing is asserted: the figures are measurements, the tests check the machinery."""

from __future__ import annotations

import copy
import functools
import json

import gguf
import pytest

from pagedllm.bench import compare, compare_child, make_gguf
from pagedllm.cli.main import build_parser, main
from pagedllm.quant import kernels


@pytest.fixture(scope="module", autouse=True)
def _tokenizer_read_once():
    """Every file made here copies the default model's tokenizer, which make-gguf reads from its
    GGUF (8 s of gguf-py's field parsing each time); the module reads it once per vocabulary
    size and hands each file its own copy. What is tested is the file written around it."""
    read = functools.lru_cache(make_gguf.tokenizer_metadata)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(make_gguf, "tokenizer_metadata", lambda vocab: copy.deepcopy(read(vocab)))
        yield


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory, smollm2_gguf_path):  # the tokenizer comes from the default model
    path = tmp_path_factory.mktemp("compare") / "tiny.gguf"
    assert main(["bench", "make-gguf", str(path), "--shape", "tiny", "--type", "F16"]) == 0
    return path


@pytest.mark.slow
def test_make_gguf_writes_the_shape(tiny_gguf):
    shape = make_gguf.SHAPES["tiny"]
    reader = gguf.GGUFReader(str(tiny_gguf))
    field = lambda k: reader.fields[k].contents()  # noqa: E731
    assert field("general.architecture") == "qwen2"
    assert (
        field("qwen2.embedding_length"),
        field("qwen2.block_count"),
        field("qwen2.attention.head_count"),
        field("qwen2.attention.head_count_kv"),
        field("qwen2.feed_forward_length"),
    ) == (shape.hidden, shape.layers, shape.heads, shape.kv_heads, shape.intermediate)
    tokens = field("tokenizer.ggml.tokens")
    assert len(tokens) == len(set(tokens)) == shape.vocab  # padded with unique tokens
    tensors = {t.name: t for t in reader.tensors}
    assert "output.weight" not in tensors  # tied, as Qwen2.5-0.5B
    assert tuple(tensors["token_embd.weight"].shape) == (shape.hidden, shape.vocab)
    assert tensors["blk.0.attn_q.weight"].tensor_type == gguf.GGMLQuantizationType.F16
    assert "blk.1.attn_v.bias" in tensors


def test_make_gguf_qwen3_shape(tmp_path, smollm2_gguf_path):
    """Qwen3's dense shape is llama.cpp's `qwen3`: per-head q/k norms, no q/k/v biases, a head dim
    apart from hidden / heads; llama.cpp quantizes it and both engines open it, ours on the
    all-layer native decode."""
    pytest.importorskip("llama_cpp", reason="llama-cpp-python not installed (make bench-deps)")
    from pagedllm import LLM, SamplingParams

    path = tmp_path / "q3.gguf"
    assert main(["bench", "make-gguf", str(path), "--shape", "tiny-qwen3", "--type", "Q8_0"]) == 0
    shape = make_gguf.SHAPES["tiny-qwen3"]
    reader = gguf.GGUFReader(str(path))
    assert reader.fields["general.architecture"].contents() == "qwen3"
    assert reader.fields["qwen3.attention.key_length"].contents() == shape.head_dim == 32
    tensors = {t.name: t for t in reader.tensors}
    assert tuple(tensors["blk.1.attn_q_norm.weight"].shape) == (shape.head_dim,)
    assert tuple(tensors["blk.1.attn_q.weight"].shape) == (shape.hidden, shape.heads * shape.head_dim)
    assert not any(n.endswith(".bias") for n in tensors)
    llm = LLM(str(path), kv_cache_memory_mb=8)
    from pagedllm.models.decode_stack import stack_plan

    assert stack_plan(llm.engine.model) is not None
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


@pytest.mark.parametrize("shape_name, arch", [("tiny-olmoe", "olmoe"), ("tiny-qwen3moe", "qwen3moe")])
def test_make_gguf_moe_shapes(shape_name, arch, tmp_path, smollm2_gguf_path):
    """MoE shapes are written as llama.cpp's architecture, experts in 3-D tensors, quantized by
    llama.cpp, and the file opens in both engines with the shape's experts."""
    pytest.importorskip("llama_cpp", reason="llama-cpp-python not installed (make bench-deps)")
    path = tmp_path / f"{shape_name}.gguf"
    assert main(["bench", "make-gguf", str(path), "--shape", shape_name, "--type", "Q8_0", "--layers", "1"]) == 0
    shape = make_gguf.SHAPES[shape_name]
    reader = gguf.GGUFReader(str(path))
    field = lambda k: reader.fields[k].contents()  # noqa: E731
    assert field("general.architecture") == arch
    assert (field(f"{arch}.expert_count"), field(f"{arch}.expert_used_count"), field(f"{arch}.block_count")) == (
        shape.experts,
        shape.experts_used,
        1,
    )
    tensors = {t.name: t for t in reader.tensors}
    for kind in ("gate", "up"):
        t = tensors[f"blk.0.ffn_{kind}_exps.weight"]
        assert tuple(t.shape) == (shape.hidden, shape.intermediate, shape.experts)
        assert t.tensor_type == gguf.GGMLQuantizationType.Q8_0  # llama.cpp quantized it
    assert tuple(tensors["blk.0.ffn_down_exps.weight"].shape) == (shape.intermediate, shape.hidden, shape.experts)
    assert tensors["blk.0.ffn_gate_inp.weight"].tensor_type == gguf.GGMLQuantizationType.F32  # the router
    assert "output.weight" in tensors  # untied, as the real models
    # A token reads only its routed experts' share of the expert tensors.
    exps = sum(int(t.n_bytes) for n, t in tensors.items() if "_exps." in n)
    rest = sum(int(t.n_bytes) for n, t in tensors.items() if "_exps." not in n and n != "token_embd.weight")
    assert compare.weight_bytes(path)["per_token_bytes"] == rest + exps * shape.experts_used // shape.experts
    from pagedllm.loading.gguf import read_gguf

    cfg = read_gguf(path).config
    assert cfg["architectures"][0] == {"olmoe": "OlmoeForCausalLM", "qwen3moe": "Qwen3MoeForCausalLM"}[arch]


def _compare(path, tmp_path, *extra):
    out = tmp_path / "compare.json"
    rc = main(
        [
            "bench",
            "compare",
            str(path),
            "--measures",
            "decode1",
            "--max-tokens",
            "4",
            "--prompt-tokens",
            "8",
            "--context",
            "64",
            "--repeats",
            "1",
            "--bandwidth-mib",
            "8",
            "--output",
            str(out),
            *extra,
        ]
    )
    assert rc == 0
    return json.loads(out.read_text())


@pytest.mark.slow
def test_compare_without_llama_cpp(tiny_gguf, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(compare, "_has_llama_cpp", lambda: False)
    result = _compare(tiny_gguf, tmp_path)
    ours = result["measures"]["decode1"]["pagedllm"]
    assert ours["tok_s"] > 0 and ours["peak_rss_mb"] > 0
    # what the engine holds beyond a bare `import torch`, as the project judges memory
    assert 50 < ours["torch_rss_mb"] < ours["peak_rss_mb"]
    assert ours["engine_rss_mb"] == pytest.approx(ours["peak_rss_mb"] - ours["torch_rss_mb"])
    assert len(ours["first_output"]) == 4  # ignore_eos: exactly max_tokens
    assert "make bench-deps" in result["measures"]["decode1"]["llama.cpp"]["skipped"]
    assert result["read_bandwidth"]["gb_s"] > 0
    assert result["streaming"]["pagedllm"]["gb_s"] > 0
    out = capsys.readouterr().out
    assert "llama.cpp not run: llama-cpp-python is not installed" in out
    less = next(line for line in out.splitlines() if "ours less `import torch`" in line)
    assert f"({ours['torch_rss_mb']:.0f} MB)" in less and f"{ours['engine_rss_mb']:.0f}" in less.split(")")[1]


@pytest.mark.slow
def test_compare_caps_our_isa(tiny_gguf, tmp_path, monkeypatch, capsys):
    """--isa caps our kernels in the child processes, names the level they ran at, and takes
    float32 (auto's choice without AVX-512 BF16) unless --dtype says otherwise."""
    from pagedllm.native import cpu_kernels

    if cpu_kernels() is None:
        pytest.skip("native kernels not built here")
    monkeypatch.setattr(compare, "_has_llama_cpp", lambda: False)
    monkeypatch.delenv("PAGEDLLM_NATIVE_ISA", raising=False)
    result = _compare(tiny_gguf, tmp_path, "--isa", "base")
    ours = result["measures"]["decode1"]["pagedllm"]
    assert ours["isa"] == "base" and ours["dtype"] == "torch.float32"
    assert result["isa_cap"] == "base" and result["engine_kwargs"]["dtype"] == "float32"
    assert "instruction sets: pagedllm base kernels (capped with --isa base)" in capsys.readouterr().out
    uncapped = _compare(tiny_gguf, tmp_path)["measures"]["decode1"]["pagedllm"]
    assert uncapped["isa"] == str(cpu_kernels().native_isa())


def test_compare_refuses_an_isa_not_built(tiny_gguf, tmp_path, capsys):
    """--isa naming a level the kernels were not compiled at is refused before anything runs:
    the capped library would run a lower level and the figures would be that level's."""
    from pagedllm.native import built_levels, cpu_kernels

    if cpu_kernels() is None:
        pytest.skip("native kernels not built here")
    built = built_levels(cpu_kernels())  # (either build of avxvnni is that level)
    missing = [lv for lv in compare.ISA_LEVELS if lv not in built]
    if not missing:
        pytest.skip("this build holds every level")
    out = tmp_path / "compare.json"
    rc = main(["bench", "compare", str(tiny_gguf), "--measures", "decode1", "--isa", missing[0], "--output", str(out)])
    assert rc == 1 and not out.exists()
    err = capsys.readouterr().err
    assert f"--isa {missing[0]}" in err and "PAGEDLLM_ISA_LEVELS=all" in err


def test_compare_with_llama_cpp(tiny_gguf, tmp_path):
    pytest.importorskip("llama_cpp", reason="llama-cpp-python not installed (make bench-deps)")
    result = _compare(tiny_gguf, tmp_path)
    row = result["measures"]["decode1"]
    for engine in ("pagedllm", "llama.cpp"):
        assert row[engine]["tok_s"] > 0 and row[engine]["peak_rss_mb"] > 0
        assert len(row[engine]["first_output"]) == 4


def test_compare_in_rounds(tiny_gguf, tmp_path):
    """--rounds 2: each engine twice, each batch-1 run after a bandwidth measurement of its own."""
    pytest.importorskip("llama_cpp", reason="llama-cpp-python not installed (make bench-deps)")
    result = _compare(tiny_gguf, tmp_path, "--rounds", "2")
    row = result["measures"]["decode1"]
    for engine in ("pagedllm", "llama.cpp"):
        assert len(row[engine]["tok_s_rounds"]) == 2 and len(row[engine]["read_bandwidth_gb_s_rounds"]) == 2
    assert len(row["ratio_rounds"]["tok_s"]) == 2
    assert len(result["read_bandwidth"]["measurements"]) == 4
    assert 0 < result["streaming"]["pagedllm"]["share_of_bandwidth"]


def test_engine_options_are_passed_only_when_given():
    def kwargs(*argv):
        return compare.pagedllm_kwargs(build_parser(list(argv)).parse_args(list(argv)))

    assert kwargs("bench", "compare", "x.gguf") == {}
    assert kwargs("bench", "compare", "x.gguf", "--dequantize-weights", "--dtype", "float32") == {
        "dequantize_weights": True,
        "dtype": "float32",
    }


def test_report_ratios_and_streaming():
    row = {
        "kv_tokens": 1024,
        "sequences": 1,
        "prompt_tokens": 16,
        "max_tokens": 128,
        "pagedllm": {"tok_s": 30.0, "peak_rss_mb": 600.0},
        "llama.cpp": {"tok_s": 20.0, "peak_rss_mb": 400.0},
    }
    result = {
        "model": "m.gguf",
        "threads": 2,
        "repeats": 3,
        "measures": {"decode1": row},
        "machine": {"cpu": "test cpu", "cpu_flags": ["avx2"]},
        "weights": {"total_bytes": 500e6, "per_token_bytes": 400e6, "tied_embeddings": True},
        "read_bandwidth": {"gb_s": 40.0, "runs": [40.0] * 7, "mib": 1024},
    }
    result["streaming"] = compare.streaming(result)
    assert result["streaming"]["pagedllm"]["gb_s"] == pytest.approx(12.0)  # 400 MB x 30 tok/s
    assert result["streaming"]["llama.cpp"]["share_of_bandwidth"] == pytest.approx(0.2)
    assert result["streaming"]["ceiling_tok_s"] == pytest.approx(100.0)
    text = compare.format_report(result)
    assert "1.50x" in text  # both the decode ratio and the RSS ratio
    assert text.count("1.50x") == 2
    assert "pagedllm 30%, llama.cpp 20%" in text
    # ours less `import torch` (the project's measure of memory) against llama.cpp's whole peak
    row["pagedllm"] |= {"torch_rss_mb": 300.0, "engine_rss_mb": 300.0}
    row["llama.cpp"]["engine_rss_mb"] = 400.0
    line = next(t for t in compare.format_report(result).splitlines() if "less `import torch`" in t)
    assert "(300 MB)" in line and line.split()[-3:] == ["300", "400", "0.75x"], line


@pytest.mark.slow
def test_multiply_adds_per_token_are_the_matrices_a_token_goes_through(tiny_gguf):
    """The tiny Qwen2 shape, counted from its config rather than from the file: q, k, v, o, gate,
    up and down in every layer, and the tied embedding once as the head (no norms, no biases)."""
    sh = make_gguf.SHAPES["tiny"]
    kv = sh.kv_heads * sh.head_dim
    layer = sh.hidden * (sh.hidden + 2 * kv) + sh.hidden * sh.hidden + 3 * sh.hidden * sh.intermediate
    got = compare.weight_bytes(tiny_gguf)
    assert got["per_token_macs"] == sh.layers * layer + sh.vocab * sh.hidden
    assert not got["quantized"]  # F16: no int8 peak measured for it


@pytest.mark.slow
def test_a_quantized_file_is_told_from_a_float_one(smollm2_gguf_path):
    assert compare.weight_bytes(smollm2_gguf_path)["quantized"]  # Q4_1


@pytest.mark.slow
@pytest.mark.skipif(kernels.kernel_path()[0] is None, reason="no native integer path here")
def test_many_sequences_are_set_against_the_int8_peak(tmp_path, capsys):
    """On the default model (Q4_1): the peak measured in a child of its own before the run, and
    the share of it reached in the report."""
    out = tmp_path / "compare.json"
    assert (
        main(
            [
                "bench",
                "compare",
                "default",
                "--measures",
                "parallel",
                "--parallel",
                "2",
                "--max-tokens",
                "4",
                "--prompt-tokens",
                "8",
                "--repeats",
                "1",
                "--peak-seconds",
                "0.1",
                "--peer",
                "none",
                "--output",
                str(out),
            ]
        )
        == 0
    )
    result = json.loads(out.read_text())
    assert result["int8_peak"]["gmac_s"] > 0 and len(result["int8_peak"]["measurements"]) == 1
    assert result["measures"]["parallel"]["pagedllm"]["int8_peak_gmac_s"] == result["int8_peak"]["gmac_s"]
    # The share is the run's multiply-adds a second over the peak measured before it. (Not
    # asserted below 1: a 0.1 s peak taken on a busy machine can read lower than the run.)
    par = result["measures"]["parallel"]["pagedllm"]
    assert result["compute"]["pagedllm"]["share_of_peak"] == pytest.approx(
        par["tok_s"] * result["weights"]["per_token_macs"] / 1e9 / par["int8_peak_gmac_s"]
    )
    assert result["compute"]["pagedllm"]["share_of_peak"] > 0
    assert "share reached at 2 sequences: pagedllm " in capsys.readouterr().out


def test_report_the_share_of_the_int8_peak():
    """Each engine's many-sequence runs against the peak measured just before each: the median
    of those shares (not the rate's median over the peaks' median)."""
    ours = compare._over_rounds(
        [
            {"tok_s": t, "tok_s_runs": [t], "peak_rss_mb": 900.0, "int8_peak_gmac_s": p}
            for t, p in [(100.0, 400.0), (60.0, 200.0), (90.0, 300.0)]
        ]
    )
    peer = compare._over_rounds(
        [
            {"tok_s": t, "tok_s_runs": [t], "peak_rss_mb": 800.0, "int8_peak_gmac_s": p}
            for t, p in [(50.0, 400.0), (30.0, 300.0), (40.0, 400.0)]
        ]
    )
    row = {
        "kv_tokens": 8192,
        "sequences": 32,
        "prompt_tokens": 16,
        "max_tokens": 128,
        "pagedllm": ours,
        "llama.cpp": peer,
    }
    result = {
        "model": "m.gguf",
        "threads": 2,
        "repeats": 1,
        "rounds": 3,
        "measures": {"parallel": row},
        "machine": {"cpu": "test cpu", "cpu_flags": ["avx512_vnni"]},
        "weights": {"total_bytes": 1.1e9, "per_token_bytes": 1.0e9, "per_token_macs": 2.0e9, "tied_embeddings": False},
        "int8_peak": {
            "gmac_s": 350.0,
            "isa": "avx512-vnni",
            "seconds": 0.5,
            "measurements": [400.0, 400.0, 200.0, 300.0, 300.0, 400.0],
        },
    }
    c = compare.compute_share(result)
    # ours: 200/400, 120/200, 180/300 -> 0.5, 0.6, 0.6; the peer's: 100/400, 60/300, 80/400 -> 0.25, 0.2, 0.2
    assert c["pagedllm"]["share_of_peak"] == pytest.approx(0.6)
    assert c["llama.cpp"]["share_of_peak"] == pytest.approx(0.2)
    assert c["pagedllm"]["gmac_s"] == pytest.approx(180.0)  # the median rate (90 tok/s) x 2 G
    result["compute"] = c
    text = compare.format_report(result)
    assert "int8 dot-product peak 350 GMAC/s (avx512-vnni, 2 threads" in text
    assert "median of 6" in text and "2.00 G multiply-adds" in text
    assert "share reached at 32 sequences: pagedllm 60%, llama.cpp 20%" in text
    assert "AMX" not in text
    result["int8_peak"]["amx_rows"] = 16  # a CPU where our wide bf16 steps take AMX tiles instead
    assert "our bfloat16 steps of 16+ rows multiply on AMX tiles here" in compare.format_report(result)


def test_rounds_report_the_median_of_their_ratios_and_shares():
    """With --rounds, the ratio is the median of the rounds' ratios (not the ratio of medians) and
    each run's share is against the bandwidth measured just before it."""
    rounds = [(30.0, 20.0, 40.0, 80.0), (10.0, 20.0, 20.0, 20.0), (33.0, 30.0, 60.0, 60.0)]  # ours, peer, bws
    ours = compare._over_rounds(
        [{"tok_s": a, "tok_s_runs": [a], "peak_rss_mb": 600.0, "read_bandwidth_gb_s": bw} for a, _, bw, _ in rounds]
    )
    peer = compare._over_rounds(
        [
            {"tok_s": b, "tok_s_runs": [b], "peak_rss_mb": 400.0 + i, "read_bandwidth_gb_s": bw}
            for i, (_, b, _, bw) in enumerate(rounds)
        ]
    )
    assert ours["tok_s"] == 30.0 and peer["tok_s"] == 20.0 and peer["peak_rss_mb"] == 402.0
    row = {
        "kv_tokens": 1024,
        "sequences": 1,
        "prompt_tokens": 16,
        "max_tokens": 128,
        "pagedllm": ours,
        "llama.cpp": peer,
        "ratio_rounds": {"tok_s": [a / b for a, b, _, _ in rounds]},
    }
    bws = [compare_child.bandwidth_child({"threads": 1, "mib": 8, "repeats": 1}) for _ in range(2)]
    result = {
        "model": "m.gguf",
        "threads": 2,
        "repeats": 1,
        "rounds": 3,
        "measures": {"decode1": row},
        "machine": {"cpu": "test cpu", "cpu_flags": ["avx2"]},
        "weights": {"total_bytes": 500e6, "per_token_bytes": 400e6, "tied_embeddings": True},
        "read_bandwidth": compare._bandwidth_over(bws),
    }
    s = compare.streaming(result)
    # ours: 12/40, 4/20, 13.2/60 -> median 0.22; the peer's: 8/80, 8/20, 12/60 -> median 0.2
    assert s["pagedllm"]["share_of_bandwidth"] == pytest.approx(0.22)
    assert s["llama.cpp"]["share_of_bandwidth"] == pytest.approx(0.2)
    assert len(result["read_bandwidth"]["measurements"]) == 2
    result["streaming"] = s
    text = compare.format_report(result)
    assert "1.10x" in text  # median of 1.5, 0.5, 1.1 (the ratio of the medians would be 1.50x)
    assert "3 rounds" in text and "pagedllm 22%, llama.cpp 20%" in text


def test_compare_refuses_a_non_gguf(tmp_path, capsys):
    bad = tmp_path / "model.safetensors"
    bad.write_bytes(b"x")
    assert main(["bench", "compare", str(bad)]) == 1
    assert "needs a .gguf file" in capsys.readouterr().err


def test_a_childs_peak_rss_is_its_own():
    """Each engine's process reports its own peak: ru_maxrss would carry this (larger) parent's
    peak across fork and exec, which once floored both engines' figures at the bench's own."""
    import subprocess
    import sys
    from pathlib import Path

    from pagedllm.bench import llamacpp_peer

    ballast = bytearray(400 * 2**20)
    ballast[::4096] = b"\1" * len(ballast[::4096])  # every page touched: the parent is > 400 MB
    code = (
        "import runpy, sys; m = runpy.run_path(sys.argv[1]); "
        "x = bytearray(50 * 2**20); x[::4096] = b'1' * len(x[::4096]); print(m['peak_rss_mb']())"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(Path(llamacpp_peer.__file__))], capture_output=True, text=True, check=True
    ).stdout
    peak = float(out)
    del ballast
    assert 50 < peak < 200, peak  # its own 50 MB and an interpreter, not the parent's 400+


def _long(path, tmp_path, caches, *extra):
    out = tmp_path / "long.json"
    assert (
        main(
            [
                "bench",
                "compare",
                str(path),
                "--measures",
                "",
                "--long-context",
                "96,160",
                "--long-tokens",
                "4",
                "--long-caches",
                caches,
                "--repeats",
                "1",
                "--output",
                str(out),
                *extra,
            ]
        )
        == 0
    )
    return json.loads(out.read_text())


@pytest.mark.slow
def test_long_context_prefills_then_decodes_at_depth(tiny_gguf, tmp_path, capsys):
    """Each (length, cache) pair is one row with both rates, our cache named beside llama.cpp's
    nearest."""
    result = _long(tiny_gguf, tmp_path, "auto,int8", "--peer", "none")
    assert list(result["measures"]) == ["long-96-auto", "long-96-int8", "long-160-auto", "long-160-int8"]
    row = result["measures"]["long-160-int8"]
    assert (row["prompt_tokens"], row["cache"], row["peer_cache"]) == (160, "int8", "q8_0")
    assert result["measures"]["long-96-auto"]["peer_cache"] == "f16"
    assert row["pagedllm"]["tok_s"] > 0 and row["pagedllm"]["decode_tok_s"] > 0
    assert len(row["pagedllm"]["first_output"]) == 4  # the first token, then 3 at depth
    text = capsys.readouterr().out
    assert "prefill of 160 tokens, cache int8 / q8_0" in text and "then decode at that depth" in text
    assert "flash attention on" in text


def test_long_context_with_llama_cpp(tiny_gguf, tmp_path):
    """llama.cpp's side of the same rows, flash attention on. (Its q8_0 cache needs head dims in
    32s, which the tiny shape's are not: the f16 row only.)"""
    pytest.importorskip("llama_cpp", reason="llama-cpp-python not installed (make bench-deps)")
    row = _long(tiny_gguf, tmp_path, "auto")["measures"]["long-160-auto"]
    for engine in ("pagedllm", "llama.cpp"):
        assert row[engine]["tok_s"] > 0 and row[engine]["decode_tok_s"] > 0
        assert len(row[engine]["first_output"]) == 4


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--long-context", "4096", "--long-caches", "f8e4m3"], "no llama.cpp counterpart"),
        (["--long-context", "4k"], "token counts separated by commas"),
        (["--long-context", "4096", "--long-tokens", "1"], "--long-tokens must be at least 2"),
    ],
)
def test_long_context_refuses_bad_flags(tiny_gguf, flags, message, capsys):
    assert main(["bench", "compare", str(tiny_gguf), *flags]) == 1
    assert message in capsys.readouterr().err
