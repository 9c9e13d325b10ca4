"""The `pagedllm` command: mistral.rs's PagedAttention command lines, chat in a terminal
(pexpect), generate, trace, and the flag checks."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from test_server import ServerProcess, free_port

# slow: whole models, servers or builds; `make test-fast` leaves it out
pytestmark = pytest.mark.slow

httpx = pytest.importorskip("httpx")

# mistral.rs's docs give the KV cache 8 GB, or 95% of GPU memory. On CPU that is RAM, zero-filled
# up front: keep the command lines' shape but use small figures unless the machine is roomy.
ROOMY = psutil.virtual_memory().available > 48 * 2**30
PA_MEM = "8192" if ROOMY else "256"
PA_USAGE = ".95" if ROOMY else ".02"
ENV = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1")


def cli(
    *args: str, input: str | None = None, timeout: float = 180, env: dict | None = None
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pagedllm.cli.main", *args],
        input=input,
        text=True,
        capture_output=True,
        timeout=timeout,
        env=env or ENV,
    )


@pytest.fixture(scope="module")
def plain_dir(tmp_path_factory, hf_smollm2_tokenizer):
    """A small random Llama saved like a user's safetensors model folder (loads in a second)."""
    from models import build_checkpoint

    tok = hf_smollm2_tokenizer
    return build_checkpoint("llama", tmp_path_factory.mktemp("plain"), tok, len(tok))


# -- mistral.rs's command lines ---------------------------------------------------------------------


def test_mistralrs_plain_interactive_through_stdin(plain_dir):
    r = cli(
        "-i",
        "--pa-gpu-mem",
        PA_MEM,
        "--pa-blk-size",
        "32",
        "plain",
        "-m",
        str(plain_dir),
        input="/max_tokens 8\nHello there\n/trace\n/exit\n",
    )
    assert r.returncode == 0, r.stderr
    assert "max_tokens = 8" in r.stdout
    assert "blocks used" in r.stdout and "preemptions" in r.stdout
    assert r.stdout.count(">>> ") >= 3


def test_mistralrs_plain_serves_without_i(plain_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDLLM_API_KEY", "sk-from-env")  # not on the command line, where ps shows it
    port = free_port()
    # Global flags before `plain` (mistral.rs's order) and after it, as after `serve`.
    srv = ServerProcess(
        [
            "--pa-gpu-mem",
            PA_MEM,
            "--pa-blk-size",
            "32",
            "plain",
            "-m",
            str(plain_dir),
            "--port",
            str(port),
            "--max-seqs",
            "4",
        ],
        port,
        tmp_path / "plain.log",
        api_key="sk-from-env",
    )
    try:
        srv.wait_ready()
        body = {"model": plain_dir.name, "prompt": "Hello", "max_tokens": 4, "ignore_eos": True}
        assert httpx.post(f"{srv.url}/v1/completions", json=body, timeout=60).status_code == 401
        r = httpx.post(f"{srv.url}/v1/completions", json=body, headers=srv.headers, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 4
        # Served under the folder's name, never its path.
        assert r.json()["model"] == plain_dir.name
        models = httpx.get(f"{srv.url}/v1/models", headers=srv.headers, timeout=10).json()
        assert [m["id"] for m in models["data"]] == [plain_dir.name]
        # A model this server does not serve: 404, as vLLM and OpenAI answer.
        r = httpx.post(f"{srv.url}/v1/completions", json={**body, "model": "gpt-4o"}, headers=srv.headers, timeout=60)
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found", r.text
        assert "`gpt-4o` does not exist" in r.json()["error"]["message"]
    finally:
        assert srv.stop() in (0, 130), srv.log()


def test_mistralrs_gguf_interactive_through_stdin(smollm2_gguf_path):
    # Asked bare, the answer's first token is a near tie ("The" -1.95 / "L" -1.89 with 2 threads
    # on an AMX CPU, the other way with 1); asked for one sentence, "The" leads by 1.5.
    # -t names a hub repo: it is not a local folder, so the GGUF's own tokenizer is used.
    r = cli(
        "-i",
        "--pa-gpu-mem-usage",
        PA_USAGE,
        "--pa-blk-size",
        "32",
        "--log-level",
        "info",
        "gguf",
        "-t",
        "HuggingFaceTB/SmolLM2-135M-Instruct",
        "-m",
        str(smollm2_gguf_path.parent),
        "-f",
        smollm2_gguf_path.name,
        input="/temperature 0\n/max_tokens 12\nWhat is the capital of France? Answer in one sentence.\n/exit\n",
    )
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout
    assert "not a local folder" in r.stderr


# -- chat in a terminal ------------------------------------------------------------------------------


def test_chat_in_a_terminal(smollm2_gguf_path):
    pexpect = pytest.importorskip("pexpect")
    child = pexpect.spawn(
        sys.executable,
        ["-m", "pagedllm.cli.main", "chat", "--pa-gpu-mem", "128", "--max-tokens", "12", "--temperature", "0"],
        encoding="utf-8",
        timeout=120,
        env=ENV,
        dimensions=(40, 200),
    )
    try:
        child.expect_exact(">>> ")
        child.sendline("/help")
        child.expect_exact("/system MESSAGE")
        child.expect_exact(">>> ")
        child.sendline("/temperature 0.5")
        child.expect_exact("temperature = 0.5")
        child.sendline("/temperature -3")
        child.expect_exact("error:")
        child.sendline("/temperature abc")  # a usage line, not Python's "could not convert"
        child.expect_exact("usage: /temperature VALUE (a number, e.g. /temperature 0.7); now 0.5")
        child.expect_exact(">>> ")
        assert "could not convert" not in child.before
        child.sendline("/temperature 0")
        child.expect_exact("temperature = 0.0")
        child.sendline("What is the capital of France? Answer in one sentence.")  # (not a near tie)
        child.expect_exact("Paris")
        child.expect_exact(">>> ")
        child.sendline("And of Italy?")  # the conversation is kept
        child.expect_exact(">>> ")
        child.sendline("/trace")
        child.expect("blocks used")
        child.sendline("/max_tokens 3")
        child.sendline("Tell me a long story.")  # stopped by max_tokens: marked, /stats being off
        child.expect_exact("[cut off at max_tokens (3 tokens); /max_tokens N allows more]")
        child.sendline("/system You are a terse assistant.")
        child.expect_exact("system message set")
        child.sendline("/clear")
        child.expect_exact("conversation cleared")
        child.sendline("/exit")
        child.expect(pexpect.EOF)
    finally:
        child.close()
    assert child.exitstatus == 0


# -- one-shot commands --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def plain_llm(plain_dir):
    """The same model through the LLM API, with the engine defaults the CLI uses."""
    from pagedllm import LLM

    return LLM(str(plain_dir), kv_cache_memory_mb=16)


def test_generate_prompt_from_stdin(plain_dir, plain_llm):
    from pagedllm import SamplingParams

    r = cli(
        "generate",
        "-m",
        str(plain_dir),
        "--max-tokens",
        "4",
        "--pa-gpu-mem",
        "16",
        input="What is the capital of France?",
    )
    assert r.returncode == 0, r.stderr
    # The same request through the LLM API (chat template, greedy): stdout is exactly its text.
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    want = plain_llm.chat(msgs, SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)
    assert len(want.token_ids) == 4 and want.text
    assert r.stdout == want.text + "\n"


def test_generate_prompt_argument_raw(plain_dir, plain_llm):
    from pagedllm import SamplingParams

    r = cli("generate", "-m", str(plain_dir), "--raw", "--max-tokens", "4", "--pa-gpu-mem", "16", "--stats", "Hello")
    assert r.returncode == 0, r.stderr
    want = plain_llm.generate(["Hello"], SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)[0]
    assert want.text and r.stdout == want.text + "\n"
    assert f"[{len(want.prompt_token_ids)} prompt tokens, 4 generated" in r.stderr


def test_trace_shows_blocks(plain_dir, hf_smollm2_tokenizer):
    import json

    question = "Write a short poem about memory pages."
    r = cli("trace", str(plain_dir), "--max-tokens", "4", "--pa-gpu-mem", "16", "--json", "--prompt", question)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    steps, trace = out["steps"], out["kv_cache_trace"]
    total = trace["capacity_blocks"]
    assert total * trace["block_size"] == trace["capacity_tokens"]
    # One prefill step gives the first token, three decodes the rest.
    assert [s["step"] for s in steps] == [0, 1, 2, 3, 4]
    assert all(s["used_blocks"] + s["free_blocks"] == total and s["preemptions"] == 0 for s in steps)
    # While it runs the request holds exactly the blocks its tokens need, then gives them back.
    # The prompt's length from transformers' tokenizer and chat template.
    text = hf_smollm2_tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False
    )
    plen = len(hf_smollm2_tokenizer(text, add_special_tokens=False).input_ids)
    bs = trace["block_size"]
    for s in steps[1:4]:
        assert s["running"] == 1 and s["used_blocks"] == -(-(plen + s["step"] - 1) // bs), (s, plen)
    assert steps[-1]["running"] == 0 and steps[-1]["used_blocks"] == 0
    # The finished request's full blocks stay in the prefix cache, neither used nor free.
    assert trace["blocks_used"] == 0 and trace["preemptions"] == 0
    assert trace["blocks_free"] + trace["blocks_cached"] == total


# -- flags --------------------------------------------------------------------------------------------


def test_help_and_dispatch(capsys):
    from pagedllm.cli.main import main

    for args in (
        ["--help"],
        ["demo", "--help"],
        ["bench", "throughput", "--help"],
        ["bench", "serve", "--help"],
        ["serve", "--help"],
        ["chat", "--help"],
        ["generate", "--help"],
        ["trace", "--help"],
        ["plain", "--help"],
        ["gguf", "--help"],
    ):
        with pytest.raises(SystemExit) as exc:
            main(args)
        assert exc.value.code == 0, args
    out = capsys.readouterr().out
    assert "--pa-gpu-mem" in out and "--pa-blk-size" in out and "--quantized-filename" in out


def test_flags_after_plain_and_gguf():
    from pagedllm.cli.main import build_parser

    argv = [
        "plain",
        "-m",
        "default",
        "--port",
        "8766",
        "--pa-gpu-mem",
        "64",
        "--dtype",
        "float32",
        "--served-model-name",
        "smol",
        "-i",
    ]
    args = build_parser(argv).parse_args(argv)
    assert (args.command, args.port, args.kv_cache_memory_mb, args.dtype) == ("plain", 8766, 64.0, "float32")
    assert args.served_model_name == ["smol"] and args.interactive_mode
    argv = [
        "--pa-blk-size",
        "16",
        "gguf",
        "-m",
        "d",
        "-f",
        "x.gguf",
        "--host",
        "0.0.0.0",
        "--pa-cache-type",
        "int8",
        "--api-key",
        "k",
    ]
    args = build_parser(argv).parse_args(argv)
    assert (args.block_size, args.host, args.kv_cache_dtype, args.api_key) == (16, "0.0.0.0", "int8", "k")
    assert not args.interactive_mode


@pytest.mark.parametrize(
    "argv, usage, hint",
    [
        (["serve", "--prot", "8000"], "usage: pagedllm serve [MODEL]", "(did you mean --port?)"),
        # An abbreviation is refused (it would hide typos of other flags), with the full name.
        (["generate", "--max-token", "3", "Hi"], "usage: pagedllm generate [PROMPT]", "(did you mean --max-tokens?)"),
        (
            ["plain", "-m", "default", "--pa-gpu-mem-usag", ".1"],
            "usage: pagedllm [-i] [flags] plain",
            "(did you mean --pa-gpu-mem-usage?)",
        ),
        (["serv"], "usage: pagedllm [-h]", "(did you mean serve?)"),
        (["bench", "thruput"], "usage: pagedllm bench", "(did you mean throughput?)"),
    ],
)
def test_typos_get_the_subcommands_usage_and_a_suggestion(capsys, argv, usage, hint):
    from pagedllm.cli.main import main

    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(usage) and hint in err, err
    assert len(err.splitlines()) <= 3, err  # not the whole top-level usage


def test_every_sampling_flag_documents_its_default(capsys):
    from pagedllm.cli.main import main

    for cmd in ("generate", "chat"):
        with pytest.raises(SystemExit):
            main([cmd, "--help"])
        out = " ".join(capsys.readouterr().out.split())
        for flag in (
            "--max-tokens",
            "--temperature",
            "--top-p",
            "--top-k",
            "--min-p",
            "--presence-penalty",
            "--frequency-penalty",
            "--repetition-penalty",
        ):
            help_text = out.split(flag, 1)[1].split(" --", 1)[0]
            assert "default: " in help_text, (cmd, flag, help_text)
        if cmd == "generate":
            # It takes the model as -m only: no phantom MODEL argument in its usage or help.
            assert "[MODEL]" not in out and "instead of MODEL" not in out


def test_isq_bad_type_is_a_clear_error():
    # Refused before anything loads: never a server here.
    r = cli("serve", "--isq", "q4k", "-m", "/nonexistent/model.gguf", timeout=60)
    assert r.returncode != 0 and "unsupported ISQ type 'q4k'" in r.stderr and "Q4_K" in r.stderr, r.stderr


def test_engine_flags_map_to_llm_kwargs():
    from pagedllm.cli.main import build_parser, command_config

    argv = [
        "--pa-blk-size",
        "16",
        "serve",
        "mymodel",
        "--pa-gpu-mem",
        "512",
        "--pa-cache-type",
        "int8",
        "--max-seqs",
        "8",
        "--max-model-len",
        "2048",
        "--no-paged-attn",
        "--dtype",
        "float32",
        "--device",
        "cpu",
        "--seed",
        "3",
    ]
    kw = dict(command_config(build_parser(argv).parse_args(argv)).items())
    assert kw["model"] == "mymodel" and kw["block_size"] == 16 and kw["kv_cache_memory_mb"] == 512
    assert kw["kv_cache_dtype"] == "int8" and kw["max_num_seqs"] == 8 and kw["max_model_len"] == 2048
    assert kw["paged_attention"] is False and kw["dtype"] == "float32" and kw["device"] == "cpu"
    assert kw["seed"] == 3
    argv = ["-i", "--pa-gpu-mem-usage", ".5", "--pa-ctxt-len", "100", "gguf", "-m", "d", "-f", "x.gguf"]
    args = build_parser(argv).parse_args(argv)
    assert args.interactive_mode and args.kv_cache_memory_fraction == 0.5 and args.quantized_filename == "x.gguf"
    with pytest.raises(ValueError, match="only one of"):
        command_config(args)
    args = build_parser().parse_args(["serve", "--prefix-cache-n", "0"])
    assert command_config(args).cache.prefix_caching is False


def test_conflicting_cache_sizes_are_refused():
    r = cli("serve", "--pa-gpu-mem", "64", "--pa-ctxt-len", "1000")
    assert r.returncode == 1 and "only one of" in r.stderr


def test_python_dash_m_pagedllm_runs_the_cli():
    r = subprocess.run([sys.executable, "-m", "pagedllm", "--version"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "0.1.0" in r.stdout + r.stderr, r
    r = subprocess.run(
        [sys.executable, "-m", "pagedllm", "bench", "serve", "--help"], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0 and "--response-format" in r.stdout, r


def test_max_model_len_past_the_models_positions_is_refused(smollm2_gguf_path, tmp_path):
    """As vLLM: refused before the load, naming the limit and the way past it, unless opted in."""
    r = cli("generate", "Hi", "--max-tokens", "1", "--max-model-len", "100000", timeout=300)
    assert r.returncode == 1, r.stderr
    assert (
        "max_model_len=100000 exceeds the model's 8192 positions (max_position_embeddings). To go past "
        "them, give the model rope scaling in its config.json"
    ) in r.stderr, r.stderr
    assert "PAGEDLLM_ALLOW_LONG_MAX_MODEL_LEN=1" in r.stderr, r.stderr
    page = (Path(__file__).resolve().parent.parent / "docs" / "cli.md").read_text()
    quoted = re.search(r"\(`(max_model_len=100000 exceeds[^`]*?) \.\.\.`\)", page, flags=re.S)
    assert quoted and " ".join(quoted.group(1).split()) in r.stderr, "docs/cli.md quotes another message"

    ok = cli(
        "generate",
        "Hi",
        "--max-tokens",
        "1",
        "--max-model-len",
        "9000",
        timeout=300,
        env={**ENV, "PAGEDLLM_ALLOW_LONG_MAX_MODEL_LEN": "1"},
    )
    assert ok.returncode == 0 and ok.stdout.strip(), ok.stderr
    assert "exceeds the model's 8192 positions (allowed by PAGEDLLM_ALLOW_LONG_MAX_MODEL_LEN=1)" in ok.stderr


def test_docs_quote_the_tensor_parallel_refusal():
    """The docs' example of a refused TP size is the message the default model gets."""
    from pagedllm.loading.loader import read_config
    from pagedllm.loading.source import resolve
    from pagedllm.models.parallel import check_tp

    with pytest.raises(ValueError) as e:
        check_tp(read_config(resolve("default", None, None)), 2)
    page = " ".join((Path(__file__).resolve().parent.parent / "docs" / "parallelism.md").read_text().split())
    assert f"`-tp 2` stops with `{e.value}`" in page, str(e.value)
