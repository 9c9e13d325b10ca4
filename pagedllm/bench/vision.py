"""`pagedllm bench vision`: the time to first token of a one-image question, and the vision
encoder's share of it, beside transformers on the same model folder and image; then a second turn
on the same image, whose encoder output and KV blocks come from the caches.

Each run draws a new image (so neither side has seen it), asks pagedllm and transformers in turn
(interleaved, so the machine's load weighs on both alike), then asks the second turn. Times are
wall clock around the whole call, the processor's work included: what a user waits for.
"""

from __future__ import annotations

import argparse
import time

from .common import machine_info, median_of_runs, write_json

QUESTION = "What is in this picture?"


def _image(seed: int, size: int):
    import torch

    from PIL import Image

    g = torch.Generator().manual_seed(seed)
    return Image.fromarray((torch.rand(size, size, 3, generator=g) * 255).byte().numpy())


def _turns(image, answer: str | None = None) -> list[dict]:
    msgs = [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": QUESTION}]}]
    if answer is not None:
        msgs += [{"role": "assistant", "content": answer}, {"role": "user", "content": "And what colour is it?"}]
    return msgs


class _Timer:
    """Seconds spent inside the modules it hooks (transformers' vision tower and projector)."""

    def __init__(self, *modules) -> None:
        self.total = 0.0
        for m in modules:
            m.register_forward_pre_hook(self._start)
            m.register_forward_hook(self._stop)

    def _start(self, *_):
        self._t0 = time.perf_counter()

    def _stop(self, *_):
        self.total += time.perf_counter() - self._t0


def _hf_ttft(ref, proc, msgs: list[dict], image) -> float:
    import torch

    hf_msgs = [
        {**m, "content": [{"type": p["type"], **({"text": p["text"]} if "text" in p else {})} for p in m["content"]]}
        if isinstance(m["content"], list)
        else m
        for m in msgs
    ]
    t0 = time.perf_counter()
    text = proc.apply_chat_template(hf_msgs, add_generation_prompt=True, tokenize=False)
    inp = proc(text=[text], images=[[image]], return_tensors="pt", add_special_tokens=False)
    with torch.inference_mode():
        ref.generate(**inp, max_new_tokens=1, do_sample=False)
    return time.perf_counter() - t0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model", required=True, help="a vision-language model folder (Gemma 3, SmolVLM / Idefics3, Qwen2.5-VL)"
    )
    p.add_argument("--image-size", type=int, default=640, help="the random image's side in pixels")
    p.add_argument("--runs", type=int, default=3, help="repeat and report medians")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--pa-gpu-mem", type=float, default=256, help="KV cache MB")
    p.add_argument("--output", default="bench-results/vision.json")


def run(args: argparse.Namespace) -> dict:
    import torch
    import transformers as tf

    from .. import LLM, SamplingParams
    from ..multimodal.processor import load_hf_processor

    llm = LLM(args.model, dtype=args.dtype, kv_cache_memory_mb=args.pa_gpu_mem)
    if llm.processor is None:
        raise SystemExit(f"{args.model} is not a vision-language model")
    arch = llm.engine.model_config.architecture
    dtype = getattr(torch, args.dtype) if args.dtype != "auto" else torch.float32
    ref = getattr(tf, arch).from_pretrained(args.model, dtype=dtype).eval()
    proc = load_hf_processor(args.model)  # AutoProcessor's (Qwen2.5-VL's without torchvision: images only)
    inner = ref.model
    hooked = [
        getattr(inner, n)
        for n in ("vision_tower", "multi_modal_projector", "vision_model", "connector", "visual")
        if hasattr(inner, n)
    ]
    hf_encoder = _Timer(*hooked)
    one = SamplingParams(max_tokens=1, temperature=0.0)
    llm.chat(_turns(_image(10_000, args.image_size)), one, use_tqdm=False)  # warm-up, both sides
    _hf_ttft(ref, proc, _turns(_image(10_000, args.image_size)), _image(10_000, args.image_size))
    runs = [_one_image(llm, ref, proc, hf_encoder, one, _image(i, args.image_size)) for i in range(args.runs)]
    r = median_of_runs(runs)
    print(
        f"{arch}, one {args.image_size}px image: TTFT {r['ttft_s'] * 1e3:.0f} ms (encoder "
        f"{r['encoder_share']:.0%}) vs transformers {r['hf_ttft_s'] * 1e3:.0f} ms (encoder "
        f"{r['hf_encoder_share']:.0%}); second turn on the same image: {r['turn2_ttft_s'] * 1e3:.0f} ms, "
        f"encoder {r['turn2_encoder_s'] * 1e3:.0f} ms, {r['turn2_cached_tokens']:.0f} of "
        f"{r['turn2_prompt_tokens']:.0f} prompt tokens from the prefix cache, vs transformers "
        f"{r['hf_turn2_ttft_s'] * 1e3:.0f} ms; medians of {args.runs}"
    )
    result = {"machine": machine_info(), "args": vars(args), "runs": runs, **r}
    path = write_json(args.output, result)
    print(f"results written to {path}")
    return result


def _one_image(llm, ref, proc, hf_encoder, one, image) -> dict:
    """One image: the first turn's time to first token and its encoder's share, on both sides,
    then a second turn on the same image (ours from the prefix and encoder caches)."""
    stats = llm.engine.runner.encoder_stats
    enc0 = stats["encoder_s"]
    t0 = time.perf_counter()
    first = llm.chat(_turns(image), one, use_tqdm=False)
    ttft = time.perf_counter() - t0
    enc = stats["encoder_s"] - enc0
    h0 = hf_encoder.total
    hf = _hf_ttft(ref, proc, _turns(image), image)
    hf_enc = hf_encoder.total - h0
    answer = first.outputs[0].text or "It is a picture."
    enc0 = stats["encoder_s"]
    t0 = time.perf_counter()
    second = llm.chat(_turns(image, answer), one, use_tqdm=False)
    ttft2 = time.perf_counter() - t0
    h0 = hf_encoder.total
    hf2 = _hf_ttft(ref, proc, _turns(image, answer), image)
    return {
        "ttft_s": ttft,
        "encoder_s": enc,
        "encoder_share": enc / ttft,
        "hf_ttft_s": hf,
        "hf_encoder_s": hf_enc,
        "hf_encoder_share": hf_enc / hf,
        "turn2_ttft_s": ttft2,
        "turn2_encoder_s": stats["encoder_s"] - enc0,
        "turn2_cached_tokens": second.num_cached_tokens,
        "turn2_prompt_tokens": len(second.prompt_token_ids),
        "hf_turn2_ttft_s": hf2,
        "hf_turn2_encoder_s": hf_encoder.total - h0,
    }


if __name__ == "__main__":
    import logging

    logging.basicConfig(level=logging.WARNING)
    parser = argparse.ArgumentParser(prog="pagedllm bench vision")
    add_arguments(parser)
    raise SystemExit(0 if run(parser.parse_args()) else 1)
