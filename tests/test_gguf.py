"""GGUF reading: SmolLM2 against transformers, corrupt files, and small synthetic files."""

from __future__ import annotations

import functools
import math
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from pagedllm.loading.gguf import GGUFError, read_gguf
from pagedllm.tokenizer import IncrementalDetokenizer

Q = gguf.GGMLQuantizationType


# ------------------------------------------------------------------------------------------------
# SmolLM2 against transformers


@pytest.fixture(scope="module")
def hf_smollm2_state(hf_smollm2_model):
    return {name: t.detach() for name, t in hf_smollm2_model.state_dict().items()}


def test_smollm2_config(smollm2_checkpoint):
    cfg = smollm2_checkpoint.config
    expected = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 49152,
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "head_dim": 64,
        "rope_theta": 100000.0,
        "rope_scaling": None,
        "max_position_embeddings": 8192,
        "tie_word_embeddings": True,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "sliding_window": None,
        "attention_bias": False,
    }
    assert {k: cfg[k] for k in expected} == expected
    assert cfg["rms_norm_eps"] == pytest.approx(1e-5)


def test_smollm2_tensors_match_transformers(smollm2_checkpoint, hf_smollm2_state):
    names = smollm2_checkpoint.tensor_names()
    assert len(names) == len(set(names)) == 272
    # transformers lists the tied lm_head too; the GGUF (and we) do not.
    assert set(names) == set(hf_smollm2_state) - {"lm_head.weight"}
    seen = 0
    for name, tensor in smollm2_checkpoint.tensors(torch.float32):
        ref = hf_smollm2_state[name]
        assert tensor.dtype == torch.float32
        assert tensor.shape == ref.shape, name
        if not torch.equal(tensor, ref):  # exact is expected; allow float noise only
            assert (tensor - ref).abs().max().item() <= 1e-6, name
        seen += 1
    assert seen == 272


def test_smollm2_tensor_types(smollm2_checkpoint):
    types = smollm2_checkpoint.tensor_types()
    assert types["model.embed_tokens.weight"] == "Q8_0"
    assert types["model.layers.0.self_attn.q_proj.weight"] == "Q4_1"
    assert types["model.norm.weight"] == "F32"


def test_truncated_file(smollm2_gguf_path, tmp_path):
    data = smollm2_gguf_path.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: int(len(data) * 0.6)])
    with pytest.raises(
        GGUFError, match=r"file is truncated: tensor \S+ needs \d+ bytes at offset \d+ but the file has \d+"
    ):
        read_gguf(cut)
    cut.write_bytes(data[:100_000])  # inside the tokenizer metadata
    with pytest.raises(GGUFError, match="truncated") as err:
        read_gguf(cut)
    assert str(cut) in str(err.value)


def test_not_gguf(tmp_path):
    for name, content in [("text.gguf", b"hello, I am not a model\n"), ("empty.gguf", b""), ("short.gguf", b"GG")]:
        path = tmp_path / name
        path.write_bytes(content)
        with pytest.raises(GGUFError, match="not a GGUF file") as err:
            read_gguf(path)
        assert str(path) in str(err.value)
    with pytest.raises(GGUFError, match="no such file"):
        read_gguf(tmp_path / "missing.gguf")
    bad_version = tmp_path / "v99.gguf"
    bad_version.write_bytes(b"GGUF" + (99).to_bytes(4, "little") + bytes(16))
    with pytest.raises(GGUFError, match="unsupported GGUF version 99"):
        read_gguf(bad_version)


# ------------------------------------------------------------------------------------------------
# synthetic files

HIDDEN, HEADS, KV_HEADS, FF, LAYERS = 64, 4, 2, 128, 2
HEAD_DIM = HIDDEN // HEADS


# A tiny byte-level vocabulary: three control tokens, the 256 byte symbols, a few merges.
@functools.lru_cache(maxsize=1)
def _byte_symbols() -> tuple[str, ...]:
    from pagedllm.loading.gguf.tokenizer import _bytes_to_unicode

    mapping = _bytes_to_unicode()
    return tuple(mapping[b] for b in range(256))


GPT2_MERGES = [
    "Ġ t",
    "h e",
    "Ġt he",
    "l l",
    "ll o",
    "Ġ w",
    "o r",
    "Ġw or",
    "Ġwor l",
    "Ġworl d",
    "he llo",
    "1 2",
    "3 4",
    "12 3",
    "4 5",
    "Ġ 1",
]


def _gpt2_vocab() -> tuple[list[str], list[int], list[str]]:
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *_byte_symbols()]
    tokens += ["".join(m.split(" ")) for m in GPT2_MERGES]
    types = [3, 3, 3] + [1] * (len(tokens) - 3)
    return tokens, types, GPT2_MERGES


def _spm_vocab() -> tuple[list[str], list[int], list[float]]:
    pieces = [
        "▁",
        "h",
        "e",
        "l",
        "o",
        "w",
        "r",
        "d",
        "t",
        "▁h",
        "▁t",
        "he",
        "ll",
        "llo",
        "▁the",
        "▁hello",
        "▁w",
        "or",
        "▁wor",
        "ld",
        "▁world",
        "▁he",
        "el",
        "lo",
    ]
    tokens = ["<unk>", "<s>", "</s>", *[f"<0x{b:02X}>" for b in range(256)], *pieces]
    types = [2, 3, 3] + [6] * 256 + [1] * len(pieces)
    scores = [0.0, 0.0, 0.0] + [0.0] * 256 + [-float(i) for i in range(len(pieces))]
    return tokens, types, scores


def _llama_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's converter permutation (HF rotate_half layout -> interleaved pairs)."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _unpermute_reference(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Index-by-index inverse, independent of the implementation under test."""
    out = np.empty_like(w)
    head_dim = w.shape[0] // n_heads
    half = head_dim // 2
    for h in range(n_heads):
        for j in range(head_dim):
            src = h * head_dim + (2 * j if j < half else 2 * (j - half) + 1)
            out[h * head_dim + j] = w[src]
    return out


def _hf_weights(vocab: int, arch: str, tied: bool, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)

    def mat(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) * 0.5).astype(np.float32)

    weights = {"token_embd.weight": mat(vocab, HIDDEN), "output_norm.weight": 1 + mat(1, HIDDEN)[0]}
    if not tied:
        weights["output.weight"] = mat(vocab, HIDDEN)
    for i in range(LAYERS):
        p = f"blk.{i}."
        weights |= {
            p + "attn_norm.weight": 1 + mat(1, HIDDEN)[0],
            p + "ffn_norm.weight": 1 + mat(1, HIDDEN)[0],
            p + "attn_q.weight": mat(HEADS * HEAD_DIM, HIDDEN),
            p + "attn_k.weight": mat(KV_HEADS * HEAD_DIM, HIDDEN),
            p + "attn_v.weight": mat(KV_HEADS * HEAD_DIM, HIDDEN),
            p + "attn_output.weight": mat(HIDDEN, HEADS * HEAD_DIM),
            p + "ffn_gate.weight": mat(FF, HIDDEN),
            p + "ffn_up.weight": mat(FF, HIDDEN),
            p + "ffn_down.weight": mat(HIDDEN, FF),
        }
        if arch == "qwen2":
            weights |= {
                p + "attn_q.bias": mat(1, HEADS * HEAD_DIM)[0],
                p + "attn_k.bias": mat(1, KV_HEADS * HEAD_DIM)[0],
                p + "attn_v.bias": mat(1, KV_HEADS * HEAD_DIM)[0],
            }
    return weights


def write_tiny_gguf(
    path: Path,
    qtype: Q = Q.F32,
    *,
    arch: str = "llama",
    tokenizer: str = "gpt2",
    tied: bool = True,
    sliding_window: int | None = None,
    with_tensors: bool = True,
    pre: str = "default",
    extra=None,
) -> dict[str, np.ndarray]:
    """Write a tiny model; returns, per GGUF tensor name, what gguf itself dequantizes it to, in
    HF layout (Q/K rows un-permuted by the reference inverse for llama)."""
    if tokenizer == "gpt2":
        tokens, types, merges = _gpt2_vocab()
    else:
        tokens, types, scores = _spm_vocab()
    writer = gguf.GGUFWriter(str(path), arch=arch)
    writer.add_name("tiny test model")
    writer.add_block_count(LAYERS)
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FF)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(10000.0)
    writer.add_vocab_size(len(tokens))
    if arch == "llama":
        writer.add_rope_dimension_count(HEAD_DIM)
    if sliding_window:
        writer.add_sliding_window(sliding_window)
    writer.add_tokenizer_model(tokenizer)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    if tokenizer == "gpt2":
        writer.add_tokenizer_pre(pre)
        writer.add_token_merges(merges)
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
        writer.add_add_bos_token(False)
    else:
        writer.add_token_scores(scores)
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
        writer.add_unk_token_id(0)
    writer.add_chat_template("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}")
    if extra:
        extra(writer)

    expected: dict[str, np.ndarray] = {}
    if with_tensors:
        for name, hf in _hf_weights(len(tokens), arch, tied).items():
            stored = hf
            n_heads = HEADS if ".attn_q." in name else KV_HEADS if ".attn_k." in name else None
            if arch == "llama" and n_heads:
                stored = _llama_permute(hf, n_heads)
            if hf.ndim == 1 or qtype == Q.F32:
                writer.add_tensor(name, stored)
                back = stored
            elif qtype == Q.F16:
                writer.add_tensor(name, stored.astype(np.float16))
                back = stored.astype(np.float16).astype(np.float32)
            else:
                packed = gguf.quants.quantize(stored, qtype)
                writer.add_tensor(name, packed, raw_dtype=qtype)
                back = gguf.quants.dequantize(packed, qtype)
            if arch == "llama" and n_heads:
                back = _unpermute_reference(back, n_heads)
            expected[name] = back
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected


def _hf_name(gguf_name: str) -> str:
    from pagedllm.loading.gguf.arch import _hf_tensor_name

    return _hf_tensor_name(gguf_name)


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1], ids=lambda q: q.name)
def test_synthetic_types_read_back(tmp_path, qtype):
    path = tmp_path / f"tiny-{qtype.name}.gguf"
    expected = write_tiny_gguf(path, qtype)
    ckpt = read_gguf(path)
    got = dict(ckpt.tensors(torch.float32))
    assert set(got) == {_hf_name(n) for n in expected}
    for name, ref in expected.items():
        tensor = got[_hf_name(name)]
        assert tuple(tensor.shape) == ref.shape, name
        assert torch.equal(tensor, torch.from_numpy(np.ascontiguousarray(ref))), name
    if qtype == Q.F32:
        # Exact round trip of the original HF weights through llama.cpp's permutation and back.
        original = _hf_weights(len(_gpt2_vocab()[0]), "llama", tied=True)
        for name, ref in original.items():
            assert torch.equal(got[_hf_name(name)], torch.from_numpy(ref)), name


def test_synthetic_dtype_cast(tmp_path):
    path = tmp_path / "tiny.gguf"
    expected = write_tiny_gguf(path, Q.Q8_0)
    for name, tensor in read_gguf(path).tensors(torch.bfloat16):
        assert tensor.dtype == torch.bfloat16
        ref = torch.from_numpy(expected[next(n for n in expected if _hf_name(n) == name)]).to(torch.bfloat16)
        assert torch.equal(tensor, ref)


def test_synthetic_matches_transformers(tmp_path):
    """Untied Q4_1 llama with n_kv_heads != n_heads, and a qwen2 with biases, against transformers."""
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    for arch in ("llama", "qwen2"):
        folder = tmp_path / arch
        folder.mkdir()
        write_tiny_gguf(folder / "m.gguf", Q.Q4_1, arch=arch, tied=False)
        ckpt = read_gguf(folder / "m.gguf")
        model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), gguf_file="m.gguf", dtype=torch.float32)
        ref = model.state_dict()
        ours = dict(ckpt.tensors(torch.float32))
        assert set(ours) == set(ref), arch
        for name, tensor in ours.items():
            assert torch.equal(tensor, ref[name]), f"{arch} {name}"
        assert ckpt.config["tie_word_embeddings"] is False
        for key in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "rms_norm_eps",
            "max_position_embeddings",
        ):
            assert ckpt.config[key] == getattr(model.config, key), (arch, key)


def test_synthetic_qwen2_and_mistral_configs(tmp_path):
    expected = write_tiny_gguf(tmp_path / "q.gguf", Q.F32, arch="qwen2")
    ckpt = read_gguf(tmp_path / "q.gguf")
    assert ckpt.config["architectures"] == ["Qwen2ForCausalLM"]
    assert ckpt.config["model_type"] == "qwen2"
    assert ckpt.config["attention_bias"] is True
    assert ckpt.config["head_dim"] == HEAD_DIM
    got = dict(ckpt.tensors())
    # Qwen2 is stored unpermuted: Q/K (and their biases) come back exactly as written.
    for name in ("blk.0.attn_q.weight", "blk.0.attn_q.bias", "blk.1.attn_k.bias"):
        assert torch.equal(got[_hf_name(name)], torch.from_numpy(expected[name]))

    write_tiny_gguf(tmp_path / "m.gguf", Q.F32, sliding_window=128, with_tensors=False)
    cfg = read_gguf(tmp_path / "m.gguf").config
    assert cfg["architectures"] == ["MistralForCausalLM"]
    assert cfg["sliding_window"] == 128


@pytest.mark.parametrize(
    "kind,pre", [("gpt2", "default"), ("gpt2", "smollm"), ("gpt2", "llama-bpe"), ("gpt2", "qwen2"), ("llama", None)]
)
def test_synthetic_tokenizers_match_transformers(tmp_path, kind, pre):
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    texts = [
        "hello the world",
        " the  hello\n\tworld ",
        "ünïcode 🦀 ok",
        "<|im_start|>hello<|im_end|>",
        "",
        "llo",
        "I'll say 12345 or 1234 3.14!\r\n\n  x",
        "don't WORLD's",
    ]
    write_tiny_gguf(tmp_path / "t.gguf", tokenizer=kind, with_tensors=False, pre=pre or "default")
    ours = read_gguf(tmp_path / "t.gguf").tokenizer
    ref = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="t.gguf")
    assert ours.vocab_size == len(ref)
    assert ours.add_bos_token is (kind == "llama")
    for text in texts:
        ids = ours.encode(text)
        assert ids == ref(text)["input_ids"], text
        for skip in (True, False):
            assert ours.decode(ids, skip) == ref.decode(ids, skip_special_tokens=skip), text
            # Streaming works for SentencePiece-style decoders (leading-space strip) too.
            detok = IncrementalDetokenizer(ours, skip_special_tokens=skip)
            streamed = "".join(detok.add([i]) for i in ids) + detok.flush()
            assert streamed == ours.decode(ids, skip), text


def test_rope_scaling_llama3_from_rope_freqs(tmp_path):
    theta, head_dim = 500000.0, 128
    factor, low, high, original = 8.0, 1.0, 4.0, 8192

    # What llama.cpp's converter stores for Llama 3.1.
    divisors = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi / theta ** (-i / head_dim)
        if wavelen < original / high:
            divisors.append(1.0)
        elif wavelen > original / low:
            divisors.append(factor)
        else:
            s = (original / wavelen - low) / (high - low)
            divisors.append(1 / ((1 - s) / factor + s))

    def extra(writer):
        writer.add_tensor("rope_freqs.weight", np.array(divisors, dtype=np.float32))

    # Metadata only, with a real Llama 3 head size so that several frequencies fall in the smooth band.
    path = tmp_path / "llama3.gguf"
    tokens, types, merges = _gpt2_vocab()
    writer = gguf.GGUFWriter(str(path), arch="llama")
    for add, value in [
        ("add_block_count", 1),
        ("add_context_length", 131072),
        ("add_embedding_length", 256),
        ("add_feed_forward_length", 512),
        ("add_head_count", 2),
        ("add_head_count_kv", 1),
        ("add_layer_norm_rms_eps", 1e-5),
        ("add_rope_freq_base", theta),
        ("add_rope_dimension_count", head_dim),
        ("add_vocab_size", len(tokens)),
    ]:
        getattr(writer, add)(value)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    extra(writer)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    ckpt = read_gguf(path)
    scaling = ckpt.config["rope_scaling"]
    assert scaling["rope_type"] == "llama3"
    assert scaling["factor"] == pytest.approx(factor)
    assert scaling["low_freq_factor"] == pytest.approx(low, abs=1e-3)
    assert scaling["high_freq_factor"] == pytest.approx(high, abs=1e-3)
    assert scaling["original_max_position_embeddings"] == original
    assert "rope_freqs.weight" not in [n for n, _ in ckpt.tensors()]


def test_rope_scaling_linear_metadata(tmp_path):
    def extra(writer):
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(4.0)

    write_tiny_gguf(tmp_path / "lin.gguf", with_tensors=False, extra=extra)
    assert read_gguf(tmp_path / "lin.gguf").config["rope_scaling"] == {"rope_type": "linear", "factor": 4.0}


def test_unsupported_tensor_type(tmp_path):
    def extra(writer):
        writer.add_tensor("blk.0.attn_q.weight", np.zeros((4, 2 * 40), dtype=np.uint8), raw_dtype=Q.Q8_1)

    path = tmp_path / "q81.gguf"
    write_tiny_gguf(path, with_tensors=False, extra=extra)
    with pytest.raises(
        GGUFError, match=r"unsupported tensor type Q8_1 for tensor blk\.0\.attn_q\.weight; supported: .*Q4_1"
    ):
        read_gguf(path)


def test_unsupported_architecture(tmp_path):
    path = tmp_path / "bert.gguf"
    writer = gguf.GGUFWriter(str(path), arch="bert")
    writer.add_block_count(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(GGUFError, match="unsupported architecture 'bert'"):
        read_gguf(path)


def test_synthetic_truncated_by_one_byte(tmp_path):
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, Q.Q4_0)
    data = path.read_bytes()
    shutil.copy(path, tmp_path / "ok.gguf")
    path.write_bytes(data[:-1])
    with pytest.raises(GGUFError, match=rf"but the file has {len(data) - 1}$"):
        read_gguf(path)
    read_gguf(tmp_path / "ok.gguf")


@pytest.mark.parametrize("dequantize", [False, True], ids=["quantized", "dequantized"])
def test_nan_block_scale_is_refused_at_load(tmp_path, dequantize):
    """A NaN (or inf) block scale never reaches the logits: the load fails naming the tensor."""
    from pagedllm import LLM

    path = tmp_path / "nan.gguf"
    write_tiny_gguf(path, Q.Q4_0)
    reader = gguf.GGUFReader(str(path))
    t = next(t for t in reader.tensors if t.name == "blk.1.ffn_down.weight")
    offset = int(t.data_offset) + 18 * 3  # the fp16 scale of the fourth block
    del reader
    data = bytearray(path.read_bytes())
    data[offset : offset + 2] = np.array([np.nan], dtype=np.float16).tobytes()
    path.write_bytes(bytes(data))
    with pytest.raises(GGUFError, match=r"blk\.1\.ffn_down\.weight \(Q4_0\).*NaN or inf scale"):
        LLM(str(path), dtype="float32", kv_cache_memory_mb=4, dequantize_weights=dequantize)


def test_quantized_load_matches_dequantized_and_leaks_no_float_copy(tmp_path):
    """Every kernel format from a real file: the quantized model's long-prefill logits (tile
    dequantize + GEMM) equal the dequantized model's, and no float weight matrix is allocated."""
    from pagedllm import LLM

    for qtype in (Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1):
        path = tmp_path / f"{qtype.name}.gguf"
        write_tiny_gguf(path, qtype, tied=False)
        q = LLM(str(path), dtype="float32", kv_cache_memory_mb=4)
        d = LLM(str(path), dtype="float32", kv_cache_memory_mb=4, dequantize_weights=True)
        # q, k, v, o, gate, up, down per layer, the embedding and the untied head.
        assert q.engine.weights.formats[qtype.name] == LAYERS * 7 + 2
        assert not any(p.dim() == 2 for p in q.engine.model.parameters())
        prompt = list(range(3, 60))  # 57 rows: the GEMM route
        err = (q.prompt_logits(prompt) - d.prompt_logits(prompt)).abs().max().item()
        assert err < 1e-4, (qtype.name, err)
