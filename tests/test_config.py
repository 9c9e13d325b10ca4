"""EngineConfig.verify holds every rule of which engine options go together: each is refused
before anything loads, with one message that names the options and what to use instead."""

import dataclasses

import pytest

from pagedllm.config import EngineConfig, ModelConfig

RULES = [
    (dict(enable_lora=True, tensor_parallel_size=2), "LoRA adapters do not run under tensor parallelism"),
    (dict(enable_lora=True, pipeline_parallel_size=2), "LoRA adapters do not run under pipeline parallelism"),
    (dict(max_loras=2), r"go with enable_lora \(--enable-lora\)"),
    (dict(enable_lora=True, max_lora_rank=0), "max_lora_rank must be an integer >= 1"),
    (
        dict(speculative={"method": "draft", "model": "d"}, tensor_parallel_size=2),
        "draft model does not run under tensor",
    ),
    (dict(speculative_draft="d", pipeline_parallel_size=2), "draft model does not run under pipeline"),
    (dict(speculative={"method": "ngram"}, speculative_ngram=3), "not both"),
    (dict(speculative_tokens=3), "needs --speculative-draft"),
    (dict(speculative_ngram=3, speculative_tokens=2), "goes with --speculative-draft"),
    (dict(speculative_draft_weights="Q4_0"), "needs --speculative-draft MODEL"),
    (dict(task="embed", tensor_parallel_size=2), "embedding model runs without"),
    (dict(task="embed", speculative_ngram=3), "embedding model runs without"),
    (dict(task="classify"), "task must be 'auto', 'generate' or 'embed'"),
    (dict(mmproj="p.gguf", pipeline_parallel_size=2), "vision tower is not split into stages"),
    (dict(kv_cache_memory_mb=8, kv_cache_memory_fraction=0.5), r"only one of kv_cache_memory_mb \(--pa-gpu-mem\)"),
    (dict(block_size=12), "block_size=12 is not supported"),
    (dict(decode_latency_factor=0.5), "decode_latency_factor must be 0"),
    (dict(tensor_parallel_size=0), "tensor_parallel_size must be >= 1"),
    (dict(max_rank_memory_mb=-1), "max_rank_memory_mb must be a number of MB > 0"),
]


@pytest.mark.parametrize("kwargs, message", RULES)
def test_each_rule_is_refused_with_its_message(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig.from_kwargs(**kwargs)


def _model(**changes) -> ModelConfig:
    base = ModelConfig(
        architecture="LlamaForCausalLM",
        vocab_size=100,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=4,
        head_dim=16,
        max_position_embeddings=256,
    )
    return dataclasses.replace(base, **changes)


def test_the_rules_that_depend_on_the_model_are_checked_against_its_config(monkeypatch):
    vision = _model(vision={"model_type": "gemma3"})
    with pytest.raises(ValueError, match="vision-language models do not run under tensor parallelism"):
        EngineConfig.from_kwargs(tensor_parallel_size=2).verify(vision)
    with pytest.raises(ValueError, match="vision tower is not split into stages"):
        EngineConfig.from_kwargs(pipeline_parallel_size=2).verify(vision)
    EngineConfig.from_kwargs(tensor_parallel_size=2).verify(_model())  # a text model splits
    with pytest.raises(ValueError, match="max_model_len=512 exceeds the model's 256 positions"):
        EngineConfig.from_kwargs(max_model_len=512).verify(_model())
    monkeypatch.setenv("PAGEDLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")
    EngineConfig.from_kwargs(max_model_len=512).verify(_model())


def test_a_scheduler_config_takes_the_models_length_and_what_lora_and_images_ask():
    cfg = EngineConfig.from_kwargs(max_num_seqs=200, enable_lora=True, max_loras=3, limit_mm_per_prompt=2)
    sched = cfg.scheduler_for(4096)
    assert (sched.max_model_len, sched.max_loras, sched.limit_images) == (4096, 3, 2)
    assert sched.max_num_batched_tokens == 1024  # unset: 1024, or max_num_seqs when that is more
    assert EngineConfig.from_kwargs(max_num_seqs=2000).scheduler.max_num_batched_tokens == 2000


def test_every_family_declares_what_it_is_and_has_what_it_declares():
    # The engine reads `vision` and `mrope` instead of probing for methods
    # (models/contract.py); a family that declares them has the members that go with them.
    from pagedllm.models import MODEL_REGISTRY
    from pagedllm.models.contract import _members, CausalLM, VisionLM, MRopeLM

    for name, cls in MODEL_REGISTRY.items():
        kinds = [CausalLM] + ([VisionLM] if cls.vision else []) + ([MRopeLM] if cls.mrope else [])
        for kind in kinds:
            methods = [n for n in _members(kind) if callable(getattr(kind, n, None))]
            assert all(callable(getattr(cls, n, None)) for n in methods), (name, kind.__name__)
    assert {n for n, c in MODEL_REGISTRY.items() if c.vision} == {
        "Gemma3ForConditionalGeneration",
        "Idefics3ForConditionalGeneration",
        "Qwen2_5_VLForConditionalGeneration",
    }


def test_a_model_lacking_what_it_declares_is_refused_where_it_is_built():
    from pagedllm.models.contract import check_contract

    class Half:
        vision, mrope = True, False

    with pytest.raises(TypeError, match="Half declares CausalLM but lacks"):
        check_contract(Half())


def test_the_threads_option_sets_the_threads_the_engine_computes_with():
    import torch

    from pagedllm import LLM

    before = torch.get_num_threads()
    try:
        LLM("default", threads=1, kv_cache_memory_mb=8)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_llm_leaves_the_config_it_was_given_as_it_was():
    # One EngineConfig may build several engines: what one LLM resolves (the task of its model,
    # the ISQ type's spelling) stays in that LLM's copy.
    from pagedllm import LLM

    cfg = EngineConfig.from_kwargs(kv_cache_memory_mb=8)
    llm = LLM(config=cfg)
    assert cfg.load.task == "auto" and llm.config.load.task == "generate" and llm.config is not cfg
