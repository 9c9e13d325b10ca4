"""llama.cpp's GGUF LoRA adapters: random PEFT adapters converted by llama.cpp's own
convert_lora_to_gguf.py give the tokens peft's PeftModel gives, and the deltas the PEFT files hold,
on a float base and on a Q8_0 GGUF base written by llama.cpp's convert_hf_to_gguf.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from llama_cpp_convert import convert
from models import build_checkpoint
from pagedllm import LLM, LoRARequest, SamplingParams

pytest.importorskip("peft")
gguf = pytest.importorskip("gguf")
from lora_adapters import base_model as _base, greedy_references, import_peft, make_adapter  # noqa: E402

peft = import_peft()

NEW_TOKENS = 16
PROMPT_LENS = (5, 40)
# (rank, alpha, use_rslora, targets). No rsLoRA: llama.cpp's converter writes lora_alpha and drops
# use_rslora (llama.cpp scales by alpha / r), so an rsLoRA adapter's file means another scale.
ADAPTERS = [
    (8, 16, False, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
    (16, 32, False, ["k_proj", "o_proj", "up_proj", "gate_proj"]),
]
_GGUF_PART = {
    "q_proj": "attn_q",
    "k_proj": "attn_k",
    "v_proj": "attn_v",
    "o_proj": "attn_output",
    "gate_proj": "ffn_gate",
    "up_proj": "ffn_up",
    "down_proj": "ffn_down",
}


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def family(request, tmp_path_factory, hf_smollm2_tokenizer, llama_cpp):
    """(family, base folder, PEFT folders, their GGUF LoRA files, prompts, {adapter or None: peft's
    greedy tokens per prompt})."""
    tok = hf_smollm2_tokenizer
    root = tmp_path_factory.mktemp(f"lora-gguf-{request.param}")
    base = build_checkpoint(request.param, root / "base", tok, len(tok))
    folders = [make_adapter(base, root / f"a{i}", 200 + i, *spec) for i, spec in enumerate(ADAPTERS)]
    files = []
    for i, folder in enumerate(folders):
        files.append(root / f"a{i}.gguf")
        convert(
            llama_cpp, "convert_lora_to_gguf.py", "--base", base, "--outtype", "f32", "--outfile", files[-1], folder
        )
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, len(tok), (n,), generator=g).tolist() for n in PROMPT_LENS]
    refs = {
        None: _base(base),
        **{i: peft.PeftModel.from_pretrained(_base(base), f).eval() for i, f in enumerate(folders)},
    }
    expected = greedy_references(refs, prompts, NEW_TOKENS)
    return request.param, base, folders, files, prompts, expected


def _greedy(llm, prompts, loras):
    sp = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    return [o.token_ids for o in llm.generate(prompts, sp, use_tqdm=False, lora_request=loras)]


def _peft_deltas(folder: Path, alpha: float, r: int) -> dict[str, torch.Tensor]:
    """HF module name -> (alpha / r) * B @ A, from the PEFT file itself."""
    from safetensors.torch import load_file

    t = load_file(str(folder / "adapter_model.safetensors"))
    out = {}
    for key, a in t.items():
        if key.endswith(".lora_A.weight"):
            name = key[: -len(".lora_A.weight")].removeprefix("base_model.model.")
            out[name] = alpha / r * t[key.replace("lora_A", "lora_B")] @ a
    return out


def _our_deltas(llm, path: Path) -> dict[str, torch.Tensor]:
    """HF module name -> B @ A of the pairs pagedllm loads from `path`, each fused part's rows."""
    from pagedllm.lora.peft import load_adapter

    model = llm.engine.lora.model
    w = load_adapter(path, model, 16)
    out = {}
    for hf in [
        f"model.layers.{i}.{blk}.{p}"
        for i in range(model.config.num_layers)
        for blk, ps in (
            ("self_attn", ("q_proj", "k_proj", "v_proj", "o_proj")),
            ("mlp", ("gate_proj", "up_proj", "down_proj")),
        )
        for p in ps
    ]:
        ours, shard = model.map_weight_name(hf + ".weight")
        mod = ours.rsplit(".", 1)[0]
        if mod not in w.pairs:
            continue
        a, b = w.pairs[mod]
        delta = b @ a
        if shard is not None:
            sizes = model.shard_sizes(ours)
            delta = delta[sum(sizes[:shard]) : sum(sizes[: shard + 1])]
        if delta.abs().max() > 0:  # a fused layer's untargeted part stays zero
            out[hf] = delta
    return out


@pytest.mark.slow
def test_gguf_lora_file_and_deltas_match_peft(family):
    """The converter's file, read back through the gguf package, holds every target; the deltas
    pagedllm reads from it equal the PEFT file's (alpha / r) * B @ A."""
    name, base, folders, files, _, _ = family
    llm = LLM(str(base), dtype="float32", kv_cache_memory_mb=16, enable_lora=True, max_loras=2, max_lora_rank=16)
    n_layers = llm.engine.lora.model.config.num_layers
    for (r, alpha, _, targets), folder, f in zip(ADAPTERS, folders, files):
        reader = gguf.GGUFReader(str(f))
        assert reader.fields["general.type"].contents() == "adapter"
        assert reader.fields["adapter.lora.alpha"].contents() == alpha
        want_names = {
            f"blk.{i}.{_GGUF_PART[t]}.weight.lora_{x}" for i in range(n_layers) for t in targets for x in "ab"
        }
        assert {t.name for t in reader.tensors} == want_names
        want, got = _peft_deltas(folder, alpha, r), _our_deltas(llm, f)
        assert got.keys() == want.keys()
        for k in want:
            err = (got[k] - want[k]).abs().max().item()
            assert err < 1e-6, f"{name} {f.name} {k}: delta differs from peft's by {err}"


@pytest.mark.slow
def test_gguf_lora_greedy_matches_peft(family):
    """Each GGUF adapter alone gives peft's tokens; then one batch mixing GGUF adapters, a PEFT
    folder and the base gives each request its own."""
    name, base, folders, files, prompts, expected = family
    llm = LLM(str(base), dtype="float32", kv_cache_memory_mb=16, enable_lora=True, max_loras=3, max_lora_rank=16)
    g = [LoRARequest(f"g{i}", i + 1, str(f)) for i, f in enumerate(files)]
    for i, req in enumerate(g):
        assert _greedy(llm, prompts, [req] * len(prompts)) == expected[i], f"{name} GGUF adapter {i}"
    mix = [(g[0], 0), (LoRARequest("p1", 9, str(folders[1])), 1), (None, None), (g[1], 1)]
    pairs = [(j, req, k) for j in range(len(prompts)) for req, k in mix]
    got = _greedy(llm, [prompts[j] for j, _, _ in pairs], [req for _, req, _ in pairs])
    assert got == [expected[k][j] for j, _, k in pairs]
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_usable_blocks


@pytest.mark.slow
def test_gguf_lora_on_a_quantized_gguf_base(family, llama_cpp, tmp_path):
    """The GGUF user's case: a Q8_0 base written by llama.cpp, its GGUF LoRA (f32, and q8_0 as the
    converter quantizes it: Q8_0 A, F16 B) against the PEFT folder on that same base."""
    name, base, folders, files, prompts, expected = family
    if name != "llama":
        pytest.skip("one family is enough for the quantized base (llama: its q/k rows are permuted)")
    base_q8 = tmp_path / "base-q8_0.gguf"
    convert(llama_cpp, "convert_hf_to_gguf.py", "--outtype", "q8_0", "--outfile", base_q8, base)
    lora_q8 = tmp_path / "a0-q8_0.gguf"
    convert(llama_cpp, "convert_lora_to_gguf.py", "--base", base, "--outtype", "q8_0", "--outfile", lora_q8, folders[0])
    assert {t.tensor_type.name for t in gguf.GGUFReader(str(lora_q8)).tensors} == {"Q8_0", "F16"}
    llm = LLM(str(base_q8), kv_cache_memory_mb=16, enable_lora=True, max_loras=3, max_lora_rank=16)
    assert llm.engine.lora.model.layers[0].self_attn.qkv_proj.qparts is not None  # the base runs quantized
    plain = _greedy(llm, prompts, [None] * len(prompts))
    via_peft = _greedy(llm, prompts, [LoRARequest("p0", 1, str(folders[0]))] * len(prompts))
    assert via_peft != plain
    assert _greedy(llm, prompts, [LoRARequest("g0", 2, str(files[0]))] * len(prompts)) == via_peft
    # Q8_0's rounding moves the deltas a little, no more.
    want, got = _our_deltas(llm, files[0]), _our_deltas(llm, lora_q8)
    for k in want:
        rel = ((got[k] - want[k]).norm() / want[k].norm()).item()
        assert rel < 1e-2, f"{k}: the q8_0 adapter's delta is {rel:.1e} off the f32 one"
    assert _greedy(llm, prompts, [LoRARequest("q0", 3, str(lora_q8))] * len(prompts)) == via_peft


@pytest.mark.slow
def test_gguf_lora_through_the_server(family, tmp_path_factory):
    """`--lora-modules name=FILE.gguf` and the runtime load route take GGUF LoRA files: the openai
    client gets peft's tokens for each."""
    openai = pytest.importorskip("openai")
    httpx = pytest.importorskip("httpx")
    from test_server import serving

    name, base, folders, files, prompts, expected = family
    if name != "llama":
        pytest.skip("one family is enough for the server's paths")
    llm = LLM(str(base), dtype="float32", kv_cache_memory_mb=16, enable_lora=True, max_loras=2, max_lora_rank=16)
    sp = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    want = {}
    for model, req in (
        ("g0", LoRARequest("p0", 1, str(folders[0]))),
        ("g1", LoRARequest("p1", 2, str(folders[1]))),
        ("base", None),
    ):
        out = llm.generate([prompts[1]], sp, use_tqdm=False, lora_request=req)[0]
        assert out.token_ids == expected[None if req is None else int(model[1])][1]
        want[model] = out.text
    server = serving(
        tmp_path_factory,
        "lora-gguf-serve",
        [
            str(base),
            "--served-model-name",
            "base",
            "--dtype",
            "float32",
            "--pa-gpu-mem",
            "32",
            "--enable-lora",
            "--max-loras",
            "2",
            "--max-lora-rank",
            "16",
            "--lora-modules",
            f"g0={files[0]}",
            "--allow-runtime-lora",
        ],
    )
    srv = next(server).get()
    try:
        r = httpx.post(
            f"{srv.url}/v1/load_lora_adapter", json={"lora_name": "g1", "lora_path": str(files[1])}, timeout=60
        )
        assert r.status_code == 200, r.text
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="x", max_retries=0, timeout=300)
        assert {m.id for m in client.models.list().data} == {"base", "g0", "g1"}
        for model in ("g0", "g1", "base"):
            out = client.completions.create(
                model=model, prompt=prompts[1], max_tokens=NEW_TOKENS, temperature=0.0, extra_body={"ignore_eos": True}
            )
            assert out.choices[0].text == want[model], model
    finally:
        server.close()


def _rewrite(src: Path, dst: Path, arch: str | None = None, general_type: str = "adapter") -> Path:
    """A copy of a GGUF LoRA with another architecture or general.type (what a user could give)."""
    r = gguf.GGUFReader(str(src))
    w = gguf.GGUFWriter(str(dst), arch=arch or r.fields["general.architecture"].contents())
    w.add_type(general_type)
    w.add_string("adapter.type", "lora")
    w.add_float32("adapter.lora.alpha", r.fields["adapter.lora.alpha"].contents())
    for t in r.tensors:
        w.add_tensor(t.name, t.data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def test_gguf_lora_refusals(family, tmp_path):
    name, base, _, files, prompts, _ = family
    llm = LLM(str(base), dtype="float32", kv_cache_memory_mb=16, enable_lora=True, max_loras=2, max_lora_rank=8)
    sp = SamplingParams(max_tokens=2)
    with pytest.raises(ValueError, match="rank 16, above max_lora_rank=8"):
        llm.generate(prompts[0], sp, lora_request=LoRARequest("big", 1, str(files[1])))
    other = "qwen2" if name == "llama" else "llama"
    wrong = _rewrite(files[0], tmp_path / "other-arch.gguf", arch=other)
    with pytest.raises(ValueError, match=f"is for a '{other}' model, but the base model is .*another base model"):
        llm.generate(prompts[0], sp, lora_request=LoRARequest("wrong", 2, str(wrong)))
    model_file = _rewrite(files[0], tmp_path / "model.gguf", general_type="model")
    with pytest.raises(ValueError, match="not 'adapter': this is a model file"):
        llm.generate(prompts[0], sp, lora_request=LoRARequest("model", 3, str(model_file)))
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf file")
    with pytest.raises(ValueError, match="not a GGUF file"):
        llm.generate(prompts[0], sp, lora_request=LoRARequest("junk", 4, str(junk)))
    assert not llm.engine.requests
