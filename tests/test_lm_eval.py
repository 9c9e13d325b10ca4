"""lm-evaluation-harness against `pagedllm serve`: its `local-completions` model, tokenizing
through the server (GET /tokenizer_info, POST /tokenize: no tokenizer argument, nothing
downloaded), scores a multiple-choice task and a perplexity task through /v1/completions
echo+logprobs and generates for a generation task; `local-chat-completions` generates with the
chat template. Per item, the loglikelihoods must equal lm-eval's own `hf` backend on the same
GGUF model (transformers, float32, the weights dequantized on both sides) within 1e-2, and the
greedy generations must be the same. The tasks come from a local JSON file."""

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
ROLLING_TASK = f"""task: pagedllm_tiny_ppl
dataset_path: json
dataset_kwargs:
  data_files:
    test: {DATA}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "Question: {{{{question}}}} Answer: {{{{choices[answer]}}}}."
metric_list:
  - metric: word_perplexity
  - metric: byte_perplexity
  - metric: bits_per_byte
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
        [
            "--dtype",
            "float32",
            "--dequantize-weights",
            "--pa-gpu-mem",
            "256",
            "--max-model-len",
            "1024",
            "--log-level",
            "info",
        ],
    )


@pytest.fixture
def server(started_server):
    return started_server.get()


def _run(model, model_args: dict, tasks: list[str], include: Path, **kw) -> dict:
    """`model`: a registered name built from `model_args`, or an lm-eval LM object. The results
    and, per task, each item's filtered responses in document order."""
    from lm_eval.tasks import TaskManager

    out = lm_eval.simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=tasks,
        task_manager=TaskManager(include_path=str(include)),
        log_samples=True,
        random_seed=0,
        numpy_random_seed=0,
        torch_random_seed=0,
        fewshot_random_seed=0,
        **kw,
    )
    items = {t: [x["filtered_resps"] for x in sorted(v, key=lambda x: x["doc_id"])] for t, v in out["samples"].items()}
    return {"results": out["results"], "items": items}


def _loglikelihoods(resps: list) -> list[float]:
    """The numbers of a task's items: each choice's loglikelihood, or each text's rolling one."""
    out = []
    for r in resps:
        for x in r:
            out.append(float(x[0] if isinstance(x, (list, tuple)) else x))
    return out


TASKS = ["pagedllm_tiny_mc", "pagedllm_tiny_ppl", "pagedllm_tiny_gen"]


def test_lm_eval_local_completions_equals_hf_backend(
    server, tmp_path, hf_smollm2_model, hf_smollm2_tokenizer, monkeypatch
):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    for name, text in (("mc", MC_TASK), ("ppl", ROLLING_TASK), ("gen", GEN_TASK)):
        (tmp_path / f"{name}.yaml").write_text(text)
    # No tokenizer argument: lm-eval's "auto" finds the server's /tokenizer_info and /tokenize.
    # batch_size 4: the harness sends four prompts (token ids) in one request.
    args = {"base_url": f"{server.url}/v1/completions", "model": "default", "num_concurrent": 1, "max_retries": 1}
    ours = _run("local-completions", args | {"batch_size": 4}, TASKS, tmp_path)
    # lm-eval's hf backend on transformers' float32 model of the same GGUF: the session's copy
    # (conftest), not a second ~10 s load of the GGUF by lm-eval (what it would load is the same).
    from lm_eval.models.huggingface import HFLM

    hf_lm = HFLM(pretrained=hf_smollm2_model, tokenizer=hf_smollm2_tokenizer, device="cpu", batch_size=1)
    hf = _run(hf_lm, {}, TASKS, tmp_path)
    for task in ("pagedllm_tiny_mc", "pagedllm_tiny_ppl"):
        a, b = _loglikelihoods(ours["items"][task]), _loglikelihoods(hf["items"][task])
        assert len(a) == len(b) > 10 and max(abs(x - y) for x, y in zip(a, b)) < 1e-2, (task, a, b)
    acc = ours["results"]["pagedllm_tiny_mc"]["acc,none"]
    assert (
        acc == hf["results"]["pagedllm_tiny_mc"]["acc,none"] and acc > 0.5
    )  # a working model: the test means something
    ppl = ours["results"]["pagedllm_tiny_ppl"]["word_perplexity,none"]
    assert ppl == pytest.approx(hf["results"]["pagedllm_tiny_ppl"]["word_perplexity,none"], rel=1e-3)
    assert ours["items"]["pagedllm_tiny_gen"] == hf["items"]["pagedllm_tiny_gen"]  # the same greedy answers
    assert ours["results"]["pagedllm_tiny_gen"]["exact_match,strip"] > 0


def test_lm_eval_local_chat_completions_generates_with_the_chat_template(server, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    (tmp_path / "gen.yaml").write_text(GEN_TASK)
    args = {"base_url": f"{server.url}/v1/chat/completions", "model": "default", "num_concurrent": 1, "max_retries": 1}
    out = _run("local-chat-completions", args, ["pagedllm_tiny_gen"], tmp_path, apply_chat_template=True)
    answers = out["items"]["pagedllm_tiny_gen"]
    assert len(answers) == 12 and all(isinstance(a[0], str) for a in answers)
    assert "exact_match,strip" in out["results"]["pagedllm_tiny_gen"]
