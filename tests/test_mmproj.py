"""llama.cpp's `--mmproj` files (issue 29, GGUF): a Gemma 3 vision-language model run from two
GGUF files, the language model's and the multimodal projector's, both written by llama.cpp's own
converter (convert_hf_to_gguf.py, and with --mmproj) from a random-weight float32 folder.

The reference is transformers on that folder (and pagedllm on the folder): the same prompt ids
and pixels from the processor made from the files' metadata, every position's prefill logits
and the same greedy tokens, for 1 to 3 images a prompt batched with a text-only prompt, and a
chat written by the chat template the text GGUF carries."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from llama_cpp_convert import convert
from models import VLM_MARKER, build_vlm_checkpoint
from pagedllm import LLM, SamplingParams

gguf = pytest.importorskip("gguf")
pytest.importorskip("PIL")
from test_vlm import _image  # noqa: E402

# slow: whole models, servers or builds; `make test-fast` leaves it out
pytestmark = pytest.mark.slow

IMG = VLM_MARKER["gemma3"]
NEW = 8
# What a gemma3 GGUF can say about its language model: llama.cpp stores neither the layer types nor
# query_pre_attn_scalar, and assumes one global layer in six and a scale of 1/sqrt(head_dim).
GGUF_TEXT = dict(
    num_hidden_layers=6, query_pre_attn_scalar=16, layer_types=["sliding_attention"] * 5 + ["full_attention"]
)
# The pairs tested: an f32 text GGUF and f32 mmproj, which hold the folder's numbers (the
# converter writes the projector's matrix in f16 whatever the type; the folder's is f16-exact),
# and a Q8_0 text GGUF beside an f16 mmproj, as the files are handed out.
MMPROJ_TYPE = {"f32": "f32", "q8_0": "f16"}
# The Q8_0 language model on the quantized kernels, whose short-prompt dot products quantize
# the activations to 8 bits as llama.cpp's do: logits within this of the same weights in float
# (measured 0.14 on logits up to 8.4).
KERNEL_TOL = 0.3


def _hub_layout(folder: Path) -> None:
    """The folder's weights as the Hub's Gemma 3 files name them (vision_tower.vision_model.*:
    what llama.cpp's converter reads; transformers 5 saves without vision_model), the input
    projection rounded to f16 values (the converter always writes it as F16)."""
    from safetensors.torch import load_file, save_file

    f = folder / "model.safetensors"
    sd = load_file(f)
    out = {}
    for k, v in sd.items():
        if k.startswith("vision_tower.") and not k.startswith("vision_tower.vision_model."):
            k = "vision_tower.vision_model." + k[len("vision_tower.") :]
        out[k] = v.half().float() if k.endswith("mm_input_projection_weight") else v
    save_file(out, f, metadata={"format": "pt"})


def _as_stored(ref, text_gguf: Path):
    """transformers' model holding the q8_0 / f16 pair's numbers: its language model read from
    the text GGUF by transformers' own GGUF loader (dequantized), its tower's matrices rounded to
    f16 as the f16 mmproj stores them (1-D tensors and the embeddings stay f32 there)."""
    import copy

    import transformers as tf

    out = copy.deepcopy(ref)
    text = tf.AutoModelForCausalLM.from_pretrained(text_gguf.parent, gguf_file=text_gguf.name, dtype=torch.float32)
    missing, unexpected = out.model.language_model.load_state_dict(text.model.state_dict(), strict=False)
    assert not missing and not unexpected
    with torch.no_grad():
        for name, p in out.model.vision_tower.named_parameters():
            if p.dim() >= 2 and "embeddings." not in name:
                p.copy_(p.half().float())
    return out.eval()


@pytest.fixture(scope="module")
def pair(tmp_path_factory, hf_smollm2_tokenizer, llama_cpp):
    """(folder, {kind: (text GGUF, mmproj)}, transformers on the folder, its processor, images,
    cases, processor inputs, {kind: (transformers' logits, greedy tokens) with the kind's weights})."""
    import transformers as tf

    root = tmp_path_factory.mktemp("mmproj")
    folder = build_vlm_checkpoint("gemma3", root / "hf", hf_smollm2_tokenizer, seed=3, text_overrides=GGUF_TEXT)
    _hub_layout(folder)
    files = {}
    for kind, ptype in MMPROJ_TYPE.items():
        text, proj = root / f"text-{kind}.gguf", root / f"mmproj-{ptype}.gguf"
        convert(llama_cpp, "convert_hf_to_gguf.py", "--outtype", kind, "--outfile", text, folder)
        convert(llama_cpp, "convert_hf_to_gguf.py", "--mmproj", "--outtype", ptype, "--outfile", proj, folder)
        files[kind] = (text, proj)
    ref = tf.Gemma3ForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
    proc = tf.AutoProcessor.from_pretrained(folder)
    images = [_image(i, w, h) for i, (w, h) in enumerate([(90, 70), (50, 130), (128, 128)])]
    cases = [
        (f"What is in {IMG} this picture? Say it briefly.", images[:1]),
        (f"Compare {IMG} with {IMG}, please.", images[1:3]),
        (f"{IMG} first, {IMG} second and {IMG} third: which is brightest?", [images[2], images[0], images[1]]),
        ("A question with no picture at all, just words.", []),
    ]
    inputs = [proc(text=[text], images=[ims] if ims else None, return_tensors="pt") for text, ims in cases]
    want = {}
    for kind, model in (("f32", ref), ("q8_0", _as_stored(ref, files["q8_0"][0]))):
        logits, tokens = [], []
        for inp in inputs:
            with torch.no_grad():
                logits.append(model(**inp).logits[0])
                out = model.generate(**inp, max_new_tokens=NEW, do_sample=False, eos_token_id=None, pad_token_id=0)
            tokens.append(out[0, inp["input_ids"].shape[1] :].tolist())
        want[kind] = (logits, tokens)
    return folder, files, ref, proc, images, cases, inputs, want


GREEDY = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)


def _reqs(cases):
    return [{"prompt": t, "multi_modal_data": {"image": ims}} if ims else t for t, ims in cases]


def test_mmproj_tensors_are_the_folders(pair):
    """Every tensor of the mmproj file, read back under its checkpoint name, equals transformers'
    own weight (the f32 file: exactly, but for the projector's norm, which llama.cpp stores as
    1 + weight: to float32's rounding there)."""
    from pagedllm.loading.mmproj import read_mmproj

    _, files, ref, *_ = pair
    mm = read_mmproj(files["f32"][1])
    want = {
        k.removeprefix("model."): v
        for k, v in ref.state_dict().items()
        if "vision_tower" in k or "multi_modal_projector" in k
    }
    got = dict(mm.tensors())
    assert len(got) == mm.num_tensors() == len([k for k in want if ".head." not in k])
    for name, t in got.items():
        key = name.replace("vision_tower.vision_model.", "vision_tower.")
        torch.testing.assert_close(t, want[key], rtol=0, atol=1e-7 if "norm" in name else 0, msg=name)


@pytest.mark.parametrize("kind", list(MMPROJ_TYPE))
def test_gguf_pair_matches_transformers(pair, kind):
    """The text GGUF and its mmproj: the processor made from their metadata gives transformers'
    ids and pixels; every position's logits within 1e-4 of transformers with the files' numbers
    (f32: the folder itself; q8_0 + f16: the text GGUF as transformers' GGUF loader reads it, the
    tower rounded as the f16 file stores it), and the same greedy tokens for 1-, 2- and 3-image
    prompts batched with a text-only one. The f32 pair also gives pagedllm's tokens on the folder."""
    folder, files, _, _, _, cases, inputs, want = pair
    want_logits, want_tokens = want[kind]
    text, proj = files[kind]
    llm = LLM(str(text), mmproj=str(proj), dtype="float32", kv_cache_memory_mb=16, dequantize_weights=True)
    assert llm.engine.model_config.architecture == "Gemma3ForConditionalGeneration"
    worst = 0.0
    for (prompt, ims), inp, ref_logits in zip(cases, inputs, want_logits):
        mm = llm.processor.process(prompt, ims)
        assert mm.prompt_token_ids == inp["input_ids"][0].tolist()
        assert [im.num_embeds for im in mm.images] == [16] * len(ims)
        if ims:
            got_pixels = torch.cat([im.pixels["pixel_values"] for im in mm.images])
            assert torch.equal(got_pixels, inp["pixel_values"])
        got = llm.prompt_logits(mm)
        worst = max(worst, (got - ref_logits).abs().max().item())
    print(f"{kind} text GGUF + {MMPROJ_TYPE[kind]} mmproj: prefill logits within {worst:.2e} of transformers")
    assert worst < 1e-4
    assert len({tuple(t) for t in want_tokens}) > 1  # the prompts do lead to different answers
    outs = llm.generate(_reqs(cases), GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want_tokens
    assert llm.engine.runner.encoder_stats["images_encoded"] == 3
    if kind == "f32":
        hf = LLM(str(folder), dtype="float32", kv_cache_memory_mb=16)  # the Hub-layout folder itself
        assert [o.outputs[0].token_ids for o in hf.generate(_reqs(cases), GREEDY, use_tqdm=False)] == want_tokens


def test_quantized_text_gguf_runs_on_the_kernels(pair):
    """The Q8_0 language model beside its f16 mmproj as a user runs it: the matrices stay Q8_0
    blocks on the quantized kernels; logits within KERNEL_TOL of transformers on the same numbers."""
    _, files, _, _, _, cases, _, want = pair
    text, proj = files["q8_0"]
    llm = LLM(str(text), mmproj=str(proj), dtype="float32", kv_cache_memory_mb=16)
    assert llm.engine.weights.formats.get("Q8_0", 0) >= 7 * GGUF_TEXT["num_hidden_layers"], llm.engine.weights.summary()
    worst = max(
        (llm.prompt_logits(llm.processor.process(p, ims)) - w).abs().max().item()
        for (p, ims), w in zip(cases, want["q8_0"][0])
    )
    print(f"q8_0 text GGUF on the kernels + f16 mmproj: prefill logits within {worst:.2e} of transformers")
    assert worst < KERNEL_TOL


def test_gguf_pair_chat_uses_the_gguf_template(pair):
    """A chat with an image part: the prompt is written by the text GGUF's chat template, and
    the answer is transformers' for the folder's processor and template."""
    _, files, ref, proc, images, *_ = pair
    llm = LLM(str(files["f32"][0]), mmproj=str(files["f32"][1]), dtype="float32", kv_cache_memory_mb=16)
    assert llm.tokenizer.chat_template == proc.chat_template
    msgs = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Look at this:"},
                {"type": "image", "image": images[1]},
                {"type": "text", "text": "What colour dominates?"},
            ],
        }
    ]
    got = llm.chat(msgs, GREEDY, use_tqdm=False)
    text = proc.apply_chat_template(
        [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "Look at this:"},
                    {"type": "image"},
                    {"type": "text", "text": "What colour dominates?"},
                ],
            }
        ],
        add_generation_prompt=True,
        tokenize=False,
    )
    inp = proc(text=[text], images=[[images[1]]], return_tensors="pt", add_special_tokens=False)
    assert got.prompt_token_ids == inp["input_ids"][0].tolist()
    with torch.no_grad():
        out = ref.generate(**inp, max_new_tokens=NEW, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert got.outputs[0].token_ids == out[0, inp["input_ids"].shape[1] :].tolist()


def test_serve_mmproj_answers_an_image(pair, tmp_path_factory):
    """`pagedllm serve TEXT.gguf --mmproj FILE` (llama-server's spelling): the openai client
    sends a data-URL image and gets the offline chat's answer."""
    import base64
    import io

    openai = pytest.importorskip("openai")
    from test_server import serving

    _, files, _, _, images, *_ = pair
    text, proj = files["f32"]
    buf = io.BytesIO()
    images[1].save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    msgs = [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": url}},
                {"type": "text", "text": "What is in this picture?"},
            ],
        }
    ]
    llm = LLM(str(text), mmproj=str(proj), dtype="float32", kv_cache_memory_mb=16)
    want = llm.chat(msgs, GREEDY, use_tqdm=False).outputs[0].text
    started = serving(
        tmp_path_factory, "mmproj-serve", [str(text), "--mmproj", str(proj), "--dtype", "float32", "--pa-gpu-mem", "16"]
    )
    server = next(started)
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=300)
        r = client.chat.completions.create(
            model=client.models.list().data[0].id,
            messages=msgs,
            max_tokens=NEW,
            temperature=0.0,
            extra_body={"ignore_eos": True},
        )
        assert r.choices[0].message.content == want
    finally:
        started.close()


def test_cli_mmproj_flag_in_the_mistralrs_gguf_form(pair):
    """`gguf -m DIR -f FILE --mmproj FILE`: the flag reaches the engine in mistral.rs's form too."""
    from pagedllm.cli.main import build_parser, command_config
    from pagedllm.llm import LLM

    _, files, *_ = pair
    text, proj = files["f32"]
    argv = ["gguf", "-m", str(text.parent), "-f", text.name, "--mmproj", str(proj), "--dtype", "float32"]
    args = build_parser(argv).parse_args(argv)
    config = command_config(args)
    assert config.load.mmproj == str(proj)
    assert LLM(config=config).processor is not None


def _rewrite(src: Path, dst: Path, **changes) -> Path:
    """A copy of an mmproj file with some metadata values replaced (and, for projection_dim, a
    projector matrix of that width: a consistent file from another model; for
    feed_forward_length, one layer's matrix of another: a corrupt file)."""
    import numpy as np

    r = gguf.GGUFReader(str(src))
    w = gguf.GGUFWriter(str(dst), arch="clip")
    for key, field in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        value = changes.get(key, field.contents())
        vtype = field.types[0]
        if vtype == gguf.GGUFValueType.ARRAY:
            w.add_array(key, value)
        else:
            w.add_key_value(key, value, vtype)
    for t in r.tensors:
        data = t.data
        if t.name == "mm.input_projection.weight" and "clip.vision.projection_dim" in changes:
            data = np.zeros((data.shape[0], changes["clip.vision.projection_dim"]), dtype=data.dtype)
        if t.name == "v.blk.1.ffn_up.weight" and "clip.vision.feed_forward_length" in changes:
            data = np.zeros((changes["clip.vision.feed_forward_length"] + 8, data.shape[1]), dtype=data.dtype)
        w.add_tensor(t.name, data, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def test_mmproj_refusals(pair, tmp_path, smollm2_gguf_path):
    """An mmproj that cannot go with the model: each refused before any weight is read, with
    both files named and what to do."""
    folder, files, *_ = pair
    text, proj = files["f32"]
    other = _rewrite(proj, tmp_path / "mmproj-idefics3.gguf", **{"clip.projector_type": "idefics3"})
    with pytest.raises(
        ValueError,
        match=r"projector type 'idefics3' \(clip.projector_type\) is not supported; "
        r"supported: gemma3",
    ):
        LLM(str(text), mmproj=str(other), dtype="float32")
    wide = _rewrite(proj, tmp_path / "mmproj-wide.gguf", **{"clip.vision.projection_dim": 128})
    with pytest.raises(
        ValueError,
        match="mmproj-wide.gguf projects images to 128 dimensions but the language "
        "model text-f32.gguf has hidden size 96",
    ):
        LLM(str(text), mmproj=str(wide), dtype="float32")
    bad = _rewrite(proj, tmp_path / "mmproj-bad.gguf", **{"clip.vision.feed_forward_length": 64})
    with pytest.raises(ValueError, match=r"vision tower does not fit its config: .*encoder.layers.1.mlp.fc1.weight"):
        LLM(str(text), mmproj=str(bad), dtype="float32")
    with pytest.raises(
        ValueError,
        match=f"mmproj-f32.gguf is a 'gemma3' projector, for a 'gemma3' language "
        f"model, but {smollm2_gguf_path.name} is a 'llama' model",
    ):
        LLM(str(smollm2_gguf_path), mmproj=str(proj))
    with pytest.raises(ValueError, match="general.architecture is 'gemma3'.*not an mmproj file"):
        LLM(str(text), mmproj=str(text), dtype="float32")
    with pytest.raises(ValueError, match="mmproj goes with a GGUF language model"):
        LLM(str(folder), mmproj=str(proj), dtype="float32")
    with pytest.raises(FileNotFoundError, match="mmproj file .* not found"):
        LLM(str(text), mmproj=str(tmp_path / "nope.gguf"), dtype="float32")
