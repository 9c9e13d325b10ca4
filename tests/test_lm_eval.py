"""lm-evaluation-harness against `pagedllm serve` (issue 12): its `local-completions` model
scores a multiple-choice task through /v1/completions echo+logprobs, and generates for a
generation task; the multiple-choice accuracy must equal lm-eval's own `hf` backend on the
same GGUF model (transformers, float32). The tasks come from a local JSON file."""

from __future__ import annotations

from pathlib import Path

import pytest

lm_eval = pytest.importorskip("lm_eval")
pytest.importorskip("transformers")

from test_server import serving  # noqa: E402

# slow: whole models, servers or builds; `make test-fast` leaves it out
pytestmark = pytest.mark.slow

DATA = Path(__file__).parent / "data" / "tiny_mc.jsonl"
MC_TASK = f"""task: pagedllm_tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {DATA}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""
GEN_TASK = f"""task: pagedllm_tiny_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {DATA}
test_split: test
output_type: generate_until
doc_to_text: "Question: What is the capital of Spain?\\nAnswer: Madrid\\nQuestion: {{{{question}}}}\\nAnswer:"
doc_to_target: "{{{{choices[answer]}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 8
metric_list:
  - metric: exact_match
    ignore_case: true
    ignore_punctuation: true
filter_list:
  - name: strip
    filter:
      - function: regex
        regex_pattern: "([A-Za-z]+)"
      - function: take_first
"""


@pytest.fixture(scope="module")
def started_server(tmp_path_factory, smollm2_gguf_path):
    yield from serving(
        tmp_path_factory,
        "lm_eval",
        ["--dtype", "float32", "--pa-gpu-mem", "256", "--max-model-len", "1024", "--log-level", "info"],
    )


@pytest.fixture
def server(started_server):
    return started_server.get()


def _run(model, model_args: dict, tasks: list[str], include: Path) -> dict:
    """`model`: a registered name built from `model_args`, or an lm-eval LM object."""
    from lm_eval.tasks import TaskManager

    out = lm_eval.simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=tasks,
        task_manager=TaskManager(include_path=str(include)),
        log_samples=False,
        random_seed=0,
        numpy_random_seed=0,
        torch_random_seed=0,
        fewshot_random_seed=0,
    )
    return out["results"]


def test_lm_eval_local_completions_equals_hf_backend(
    server, tmp_path, hf_smollm2_model, hf_smollm2_tokenizer, monkeypatch
):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    (tmp_path / "mc.yaml").write_text(MC_TASK)
    (tmp_path / "gen.yaml").write_text(GEN_TASK)
    hf_smollm2_tokenizer.save_pretrained(tmp_path / "tokenizer")
    ours = _run(
        "local-completions",
        {
            "base_url": f"{server.url}/v1/completions",
            "model": "default",
            "tokenizer_backend": "huggingface",
            "tokenizer": str(tmp_path / "tokenizer"),
            "num_concurrent": 1,
            "max_retries": 1,
        },
        ["pagedllm_tiny_mc", "pagedllm_tiny_gen"],
        tmp_path,
    )
    # lm-eval's hf backend on transformers' float32 model of the same GGUF: the session's copy
    # (conftest), not a second ~10 s load of the GGUF by lm-eval (what it would load is the same).
    from lm_eval.models.huggingface import HFLM

    hf_lm = HFLM(pretrained=hf_smollm2_model, tokenizer=hf_smollm2_tokenizer, device="cpu", batch_size=1)
    hf = _run(hf_lm, {}, ["pagedllm_tiny_mc"], tmp_path)
    acc = ours["pagedllm_tiny_mc"]["acc,none"]
    assert acc == hf["pagedllm_tiny_mc"]["acc,none"], (ours, hf)
    assert acc > 0.5  # a working model on easy questions, so the comparison means something
    gen = ours["pagedllm_tiny_gen"]
    assert gen["exact_match,strip"] > 0, gen
