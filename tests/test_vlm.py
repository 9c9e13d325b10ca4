"""Vision-language models (issue 29) against transformers: random-weight float32 Gemma 3
(`Gemma3ForConditionalGeneration`), SmolVLM / Idefics3 (`Idefics3ForConditionalGeneration`) and
Qwen2.5-VL (`Qwen2_5_VLForConditionalGeneration`: images at their own resolution, M-RoPE
positions), each with its processor saved beside it, real Pillow images.

The reference is transformers' own model and processor on the same folder: prefill logits
(every position) and greedy tokens, with 1 to 3 images a prompt beside text-only prompts, with
prefill chunks around the images (Gemma 3's stop before an image, whose tokens attend to each
other both ways; Idefics3's and Qwen2.5-VL's cut through them), under preemption, and across two chat turns on
one image whose KV blocks the prefix cache serves again."""

from __future__ import annotations

import pytest
import torch

from models import VLM_MARKER, build_vlm_checkpoint
from pagedllm import LLM, SamplingParams
from pagedllm.multimodal.processor import load_hf_processor

pytest.importorskip("PIL")
from PIL import Image  # noqa: E402

# slow: whole models, servers or builds; `make test-fast` leaves it out
pytestmark = pytest.mark.slow

NEW = 8
REF = {
    "gemma3": "Gemma3ForConditionalGeneration",
    "idefics3": "Idefics3ForConditionalGeneration",
    "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
}
# Qwen2.5-VL: tokens of each test image, its sides rounded to 28 px within 56^2..112^2 pixels,
# 14 px patches merged 2 x 2 (90x70 -> 84x56: 6; 50x130 -> 56x140: 10; 128x128 -> 112x112: 16;
# 33x47 -> 56x84: 6).
QWEN_TOKENS = [6, 10, 16, 6]
# Step and encoder budgets of test_chunked_prefill_around_images.
CHUNKED = {"gemma3": (20, 16), "idefics3": (48, 80), "qwen2_5_vl": (12, 16)}


def _image(seed: int, w: int, h: int) -> Image.Image:
    """A real picture-like image: smooth colour gradients and noise, as an RGB PIL image."""
    g = torch.Generator().manual_seed(seed)
    ys, xs = torch.meshgrid(torch.linspace(0, 1, h), torch.linspace(0, 1, w), indexing="ij")
    base = torch.stack([xs, ys, (xs + ys) / 2], -1) * torch.rand(3, generator=g) * 255
    noise = torch.rand(h, w, 3, generator=g) * 60
    return Image.fromarray((base + noise).clamp(0, 255).byte().numpy())


@pytest.fixture(scope="module", params=["gemma3", "idefics3", "qwen2_5_vl"])
def vlm(request, tmp_path_factory, hf_smollm2_tokenizer):
    import transformers as tf

    family = request.param
    IMG = VLM_MARKER[family]
    path = build_vlm_checkpoint(family, tmp_path_factory.mktemp(family), hf_smollm2_tokenizer)
    ref = getattr(tf, REF[family]).from_pretrained(path, dtype=torch.float32).eval()
    # Qwen2.5-VL's processor class also takes videos, which transformers builds only with
    # torchvision: without it, the same class with the folder's image processor and tokenizer.
    proc = load_hf_processor(path) if family == "qwen2_5_vl" else tf.AutoProcessor.from_pretrained(path)
    images = [_image(i, w, h) for i, (w, h) in enumerate([(90, 70), (50, 130), (128, 128), (33, 47)])]
    # (prompt, images): 1, 2 and 3 images, and text alone.
    cases = [
        (f"What is in {IMG} this picture? Say it briefly.", images[:1]),
        (f"Compare {IMG} with {IMG}, please.", images[1:3]),
        (f"{IMG} first, {IMG} second and {IMG} third: which is brightest?", [images[3], images[0], images[2]]),
        ("A question with no picture at all, just words.", []),
    ]
    want_logits, want_tokens = [], []
    for text, ims in cases:
        inp = proc(text=[text], images=[ims] if ims else None, return_tensors="pt")
        with torch.no_grad():
            want_logits.append(ref(**inp).logits[0])
            out = ref.generate(**inp, max_new_tokens=NEW, do_sample=False, eos_token_id=None, pad_token_id=0)
        want_tokens.append(out[0, inp["input_ids"].shape[1] :].tolist())
    return family, path, ref, proc, images, cases, want_logits, want_tokens


def _reqs(cases):
    return [{"prompt": t, "multi_modal_data": {"image": ims}} if ims else t for t, ims in cases]


GREEDY = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)


def _clean(llm):
    eng = llm.engine
    assert not eng.requests and not eng.scheduler.has_unfinished()
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_usable_blocks


def test_prefill_logits_and_greedy_tokens(vlm):
    """Every position's logits within 1e-4 of transformers (images' bidirectional attention
    included), and the same greedy tokens for the 1-, 2- and 3-image prompts batched with a
    text-only one; each image encoded once."""
    family, path, _, _, images, cases, want_logits, want_tokens = vlm
    llm = LLM(str(path), dtype="float32", kv_cache_memory_mb=16)
    for (text, ims), want in zip(cases, want_logits):
        mm = llm.processor.process(text, ims)
        # Gemma 3: 16 tokens an image; Idefics3: tiles and a global image of 16 tokens each, with
        # row/column markers (text) between the tiles.
        sizes = [im.num_embeds for im in mm.images]
        if family == "gemma3":
            assert sizes == [16] * len(ims)
        elif family == "qwen2_5_vl":  # each image at its own resolution
            assert sizes == [QWEN_TOKENS[images.index(im)] for im in ims]
        else:
            assert all(n % 16 == 0 and n > 16 and n < im.length for n, im in zip(sizes, mm.images))
        got = llm.prompt_logits(mm)
        assert got.shape == want.shape
        assert (got - want).abs().max().item() < 1e-4
    assert len({tuple(t) for t in want_tokens}) > 1  # the prompts do lead to different answers
    outs = llm.generate(_reqs(cases), GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want_tokens
    # Four distinct images: each encoded once (the generate pass found them cached).
    assert llm.engine.runner.encoder_stats["images_encoded"] == 4
    _clean(llm)


def test_chunked_prefill_around_images(vlm):
    """A step budget a little over one image, and an encoder budget of one image a step.
    Gemma 3 (20 tokens, 16-token images): prefill chunks stop before an image and take each image
    whole in one chunk (its bidirectional attention needs all of it). Idefics3 (48 tokens,
    80-token images) and Qwen2.5-VL (12 tokens, 6- to 16-token images, whose chunks after the
    first image rotate by M-RoPE positions behind their token indices): chunks cut through
    images, each taking its slice of the image's embeddings. The same logits and tokens."""
    family, path, _, _, _, cases, want_logits, want_tokens = vlm
    step, size = CHUNKED[family]
    llm = LLM(
        str(path), dtype="float32", kv_cache_memory_mb=16, max_num_batched_tokens=step, max_num_encoder_tokens=size
    )
    eng = llm.engine
    chunks = []
    real = eng.runner.execute

    def spy(batch, images=False):
        for it in batch:
            if it.seq.mm is not None:
                chunks.append((it.seq.mm, it.seq.num_computed_tokens, it.num_new_tokens, len(it.images)))
        return real(batch, images)

    eng.runner.execute = spy
    text, ims = cases[2]
    got = llm.prompt_logits(llm.processor.process(text, ims))
    assert (got - want_logits[2]).abs().max().item() < 1e-4
    outs = llm.generate(_reqs(cases), GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want_tokens
    assert len(chunks) > 6
    inside = 0
    for mm, start, n, held in chunks:
        inside += sum(im.offset < start + n < im.end for im in mm.images)
        # Without the encoder cache's help, one image's tokens a step: the encoder budget is one image.
        assert held <= (1 if family == "gemma3" else 2)
    if family == "gemma3":
        assert inside == 0  # never a chunk that ends inside an image
    else:
        assert inside > 3  # chunks that end inside an image, and the next that go on through it
    _clean(llm)


def test_preemption(vlm):
    """A KV cache far smaller than the batch: sequences with images are preempted and recomputed
    (their images from the encoder cache), with the same greedy tokens."""
    family, path, _, _, _, cases, _, want_tokens = vlm
    llm = LLM(
        str(path),
        dtype="float32",
        block_size=8,
        enable_prefix_caching=False,
        **(
            dict(max_num_batched_tokens=32, kv_cache_context_len=96)
            if family != "idefics3"
            else dict(max_num_batched_tokens=96, kv_cache_context_len=420)
        ),
    )
    reqs = _reqs(cases) * 2
    outs = llm.generate(reqs, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True), use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids[:NEW] for o in outs] == want_tokens * 2
    _clean(llm)


def test_prefix_cache_two_turns_and_two_images(vlm):
    """A second chat turn on the same image reuses the first turn's KV blocks, image blocks
    included (hit rate shown); the same conversation about a different image shares only the
    text before the image. Both give transformers' tokens for their whole prompt."""
    family, path, ref, proc, images, _, _, _ = vlm
    llm = LLM(str(path), dtype="float32", block_size=8, kv_cache_memory_mb=16)
    # Qwen2.5-VL's 90x70 image is 6 tokens: its largest test image (16) keeps the first turn long.
    img, other = (images[2], images[0]) if family == "qwen2_5_vl" else (images[0], images[2])

    def turn1(img):
        return [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "Look at this:"},
                    {"type": "image", "image": img},
                    {"type": "text", "text": "What colour dominates?"},
                ],
            }
        ]

    def ref_greedy(msgs, ims):
        text = proc.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        inp = proc(text=[text], images=[ims], return_tensors="pt", add_special_tokens=False)
        with torch.no_grad():
            out = ref.generate(**inp, max_new_tokens=NEW, do_sample=False, eos_token_id=None, pad_token_id=0)
        return out[0, inp["input_ids"].shape[1] :].tolist()

    def hf_msgs(msgs):  # transformers' processor takes images as {"type": "image"} parts
        return [
            {
                **m,
                "content": [{"type": p["type"], **({"text": p["text"]} if "text" in p else {})} for p in m["content"]],
            }
            if isinstance(m["content"], list)
            else m
            for m in msgs
        ]

    first = llm.chat(turn1(img), GREEDY, use_tqdm=False)
    assert first.outputs[0].token_ids == ref_greedy(hf_msgs(turn1(img)), [img])
    conv = turn1(img) + [
        {"role": "assistant", "content": first.outputs[0].text},
        {"role": "user", "content": "And what shape is it?"},
    ]
    bm = llm.engine.block_manager
    before = (bm.stats.queries, bm.stats.hits)
    second = llm.chat(conv, GREEDY, use_tqdm=False)
    queries, hits = bm.stats.queries - before[0], bm.stats.hits - before[1]
    rate = hits / queries
    print(f"second turn: {hits} of {queries} prompt tokens from the prefix cache (hit rate {rate:.2f})")
    mm = llm.processor.chat(conv)
    assert second.num_cached_tokens == hits
    assert hits >= mm.images[0].end  # the image's blocks are reused
    assert rate > 0.5
    assert second.outputs[0].token_ids == ref_greedy(hf_msgs(conv), [img])
    # The same words about another image: only the text before the image is shared.
    third = llm.chat(turn1(other), GREEDY, use_tqdm=False)
    assert third.num_cached_tokens <= mm.images[0].offset
    assert third.outputs[0].token_ids == ref_greedy(hf_msgs(turn1(other)), [other])
    assert len(llm.engine.encoder_cache) == 2
    _clean(llm)


def test_refusals(vlm, smollm2_gguf_path):
    """Images where they cannot go: each refused with what was wrong, nothing left behind."""
    family, path, _, _, images, _, _, _ = vlm
    IMG = VLM_MARKER[family]
    llm = LLM(str(path), dtype="float32", kv_cache_memory_mb=16, limit_mm_per_prompt=2)
    with pytest.raises(ValueError, match="at most 2"):
        llm.generate({"prompt": f"{IMG}{IMG}{IMG}", "multi_modal_data": {"image": images[:3]}}, use_tqdm=False)
    with pytest.raises(ValueError, match="number of|image places"):
        llm.generate({"prompt": f"{IMG} and {IMG}", "multi_modal_data": {"image": images[:1]}}, use_tqdm=False)
    with pytest.raises(ValueError, match="placeholder token"):
        llm.generate([[5, llm.engine.model.image_token_id, 6]], use_tqdm=False)
    if family == "gemma3":  # its images are prefilled whole: a scoring chunk cannot be shorter
        with pytest.raises(ValueError, match="shorter than an image"):
            llm.prompt_logits(llm.processor.process(f"{IMG} hi", images[:1]), chunk_size=4)
    _clean(llm)
    text = LLM(str(smollm2_gguf_path), kv_cache_memory_mb=16)
    with pytest.raises(ValueError, match="text-only"):
        text.generate({"prompt": "hi", "multi_modal_data": {"image": images[0]}}, use_tqdm=False)


def test_cli_chat_image_command(vlm, tmp_path):
    """`pagedllm chat`'s /image PATH attaches a picture to the next message: the answer is the
    offline chat's for the same image and words; a second message still sees the image."""
    import io

    from pagedllm.cli.chat import ChatSession

    family, path, _, _, images, _, _, _ = vlm
    if family != "gemma3":
        pytest.skip("one family is enough for the terminal's command")
    images[1].save(tmp_path / "pic.png")
    llm = LLM(str(path), dtype="float32", kv_cache_memory_mb=16)
    script = (
        f"/temperature 0\n/max_tokens {NEW}\n/image {tmp_path / 'nope.png'}\n/image {tmp_path / 'pic.png'}\n"
        "What is this?\nAnd again?\n"
    )
    out = io.StringIO()
    ChatSession(llm, out=out, inp=io.StringIO(script)).run()
    text = out.getvalue()
    assert "is not a file" in text and "image attached (50x130)" in text
    from PIL import Image as PILImage

    pic = PILImage.open(tmp_path / "pic.png")
    sp = SamplingParams(max_tokens=NEW, temperature=0.0)
    msgs = [{"role": "user", "content": [{"type": "image", "image": pic}, {"type": "text", "text": "What is this?"}]}]
    first = llm.chat(msgs, sp, use_tqdm=False).outputs[0].text
    msgs += [{"role": "assistant", "content": first}, {"role": "user", "content": "And again?"}]
    second = llm.chat(msgs, sp, use_tqdm=False).outputs[0].text
    assert f">>> {first}\n" in text and f">>> {second}\n" in text
    _clean(llm)


def test_qwen2_5_vl_published_layout(vlm, tmp_path):
    """Qwen2.5-VL as its checkpoints are published (written before transformers 5): the language
    model's keys at the top of config.json with M-RoPE as rope_scaling {"type": "mrope"}, weights
    named model.layers.* and visual.*. The same logits as the folder transformers 5 saves."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    family, path, _, _, _, cases, want_logits, _ = vlm
    if family != "qwen2_5_vl":
        pytest.skip("the older layout is Qwen2.5-VL's")
    old = tmp_path / "published"
    shutil.copytree(path, old)
    cfg = json.loads((path / "config.json").read_text())
    text = cfg.pop("text_config")
    rope = text.pop("rope_parameters")
    text.pop("model_type")
    cfg.update(
        text, rope_theta=rope["rope_theta"], rope_scaling={"type": "mrope", "mrope_section": rope["mrope_section"]}
    )
    (old / "config.json").write_text(json.dumps(cfg))
    renamed = {
        k.replace("model.language_model.", "model.").replace("model.visual.", "visual."): v
        for k, v in load_file(path / "model.safetensors").items()
    }
    assert any(k.startswith("visual.") for k in renamed) and any(k.startswith("model.layers.") for k in renamed)
    save_file(renamed, old / "model.safetensors", metadata={"format": "pt"})
    llm = LLM(str(old), dtype="float32", kv_cache_memory_mb=16)
    text, ims = cases[2]
    got = llm.prompt_logits(llm.processor.process(text, ims))
    assert (got - want_logits[2]).abs().max().item() < 1e-4
    _clean(llm)
