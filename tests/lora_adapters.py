"""Random PEFT LoRA adapters (peft is the reference) for the LoRA tests."""

from __future__ import annotations

import importlib

import torch


def import_peft():
    """peft, told that gptqmodel is absent: peft asks for optimum whenever gptqmodel is installed
    (this env has it for the GPTQ tests), though these float models hold no GPTQ layer."""
    import peft

    for mod in ("peft.tuners.lora.gptq", "peft.tuners.lora.awq", "peft.utils.quantization_utils", "peft.utils.other"):
        m = importlib.import_module(mod)
        if hasattr(m, "is_gptqmodel_available"):
            m.is_gptqmodel_available = lambda: False
    return peft


def base_model(path):
    import transformers as tf

    return tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def make_adapter(base_path, out, seed: int, r: int, alpha: int, rslora: bool, targets: list[str]):
    """A random PEFT LoRA adapter folder for the base model at base_path (B not zero:
    init_lora_weights=False draws A and B as nn.Linear does)."""
    peft = import_peft()
    cfg = peft.LoraConfig(
        r=r, lora_alpha=alpha, use_rslora=rslora, target_modules=targets, init_lora_weights=False, lora_dropout=0.0
    )
    torch.manual_seed(seed)
    model = peft.get_peft_model(base_model(base_path), cfg)
    with torch.no_grad():  # scaled down so the deltas shift, not swamp, the base's logits
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.mul_(0.5)
    model.save_pretrained(out)
    return out


def greedy_references(refs: dict, prompts: list[list[int]], new_tokens: int) -> dict:
    """Each reference model's greedy tokens after each prompt (transformers' generate, no EOS)."""
    expected = {}
    with torch.no_grad():
        for key, ref in refs.items():
            expected[key] = [
                ref.generate(
                    input_ids=torch.tensor([p]),
                    max_new_tokens=new_tokens,
                    do_sample=False,
                    eos_token_id=None,
                    pad_token_id=0,
                )[0, len(p) :].tolist()
                for p in prompts
            ]
    return expected
