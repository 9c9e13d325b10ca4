"""Two nodes for real: two network namespaces joined by a veth pair (tests/netns.py), one
torchrun per namespace started exactly as on two machines (`--nnodes 2 --node-rank R
--master-addr ... --master-port ...`). Skips, saying why, where namespaces cannot be made."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import netns

pytestmark = pytest.mark.skipif(netns.skip_reason() is not None, reason=str(netns.skip_reason()))

TORCHRUN = str(Path(sys.executable).with_name("torchrun"))


def _torchrun(
    node: netns.Node,
    rank: int,
    master: netns.Node,
    port: int,
    args: list[str],
    log: Path,
    script: list[str] | None = None,
) -> subprocess.Popen:
    """torchrun of `pagedllm ARGS` (or of `script` and its arguments) as node `rank`."""
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        # gloo advertises the address the hostname resolves to (here loopback, as on many
        # machines): name the interface that reaches the other node, as docs/scale-out.md says.
        "GLOO_SOCKET_IFNAME": node.dev,
        # The workers' imports find this checkout's pagedllm, as the test does.
        "PYTHONPATH": os.pathsep.join(p for p in sys.path if p),
    }
    argv = [
        TORCHRUN,
        "--nnodes",
        "2",
        "--node-rank",
        str(rank),
        "--master-addr",
        master.addr,
        "--master-port",
        str(port),
        "--nproc-per-node",
        "1",
        *(script or ["-m", "pagedllm", *args]),
    ]
    return subprocess.Popen(
        node.command(argv), env=env, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True
    )


@pytest.mark.slow
def test_bench_p2p_between_two_namespaces(tmp_path):
    """`pagedllm bench p2p` under torchrun, one rank per namespace: the figures come back from
    rank 0, and the bytes crossed the veth pair (each node's interface counters)."""
    sizes = [1792, 524288]
    out = tmp_path / "p2p.json"
    with netns.two_nodes() as (a, b):
        before = b.counter("rx_bytes")
        args = ["bench", "p2p", "--iters", "20", "--sizes", ",".join(map(str, sizes)), "--output", str(out)]
        port = 29400 + os.getpid() % 500
        procs = [_torchrun(n, r, a, port, args, tmp_path / f"node{r}.log") for r, n in enumerate((a, b))]
        try:
            deadline = time.monotonic() + 120
            while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
                time.sleep(0.5)
            logs = "\n".join(f"--- node {r}\n{(tmp_path / f'node{r}.log').read_text()[-3000:]}" for r in range(2))
            assert all(p.returncode == 0 for p in procs), logs
        finally:
            netns.stop(procs)
        crossed = b.counter("rx_bytes") - before
    rec = json.loads(out.read_text())
    assert [r["bytes"] for r in rec["rows"]] == sizes
    assert all(r["one_way_median_us"] > 0 and r["GBps"] > 0 for r in rec["rows"])
    assert a.addr in rec["where"] and "2 node(s)" in rec["where"], rec["where"]
    # Each size's messages went there and back at least (warm-up + iters) times.
    assert crossed > sum(s * 20 for s in sizes), crossed


def _procs_with(text: str) -> list:
    import psutil

    out = []
    for p in psutil.process_iter(["cmdline", "status"]):
        try:
            if p.info["status"] != psutil.STATUS_ZOMBIE and any(text in a for a in p.info["cmdline"] or []):
                out.append(p)
        except psutil.NoSuchProcess:
            pass
    return out


@pytest.mark.slow
def test_pipeline_across_two_namespaces_and_a_killed_node(tmp_path, hf_smollm2_tokenizer):
    """A two-stage pipeline, one stage per namespace (tests/pipeline_node.py under torchrun):
    rank 0's greedy tokens equal transformers'; then `kill -9` of the second node's processes
    fails rank 0's next step with a clear error within 30 s, and no process is left."""
    import signal

    from models import reference_family

    path, _, prompts, want = reference_family("llama", tmp_path / "llama", hf_smollm2_tokenizer, [37], 12, seed=3)
    out = tmp_path / "node0.json"
    script = str(Path(__file__).with_name("pipeline_node.py"))
    with netns.two_nodes() as (a, b):
        port = 29400 + (os.getpid() + 7) % 500
        args = [str(path), str(out), json.dumps(prompts[0]), "--until-killed"]
        procs = [
            _torchrun(n, r, a, port, [], tmp_path / f"node{r}.log", script=[script, *args])
            for r, n in enumerate((a, b))
        ]
        try:
            ready = out.with_suffix(".ready")
            deadline = time.monotonic() + 240
            while not ready.exists() and time.monotonic() < deadline and all(p.poll() is None for p in procs):
                time.sleep(0.5)
            logs = "\n".join(f"--- node {r}\n{(tmp_path / f'node{r}.log').read_text()[-3000:]}" for r in range(2))
            assert ready.exists(), logs
            assert json.loads(ready.read_text()) == want[0]
            killed_at = time.time()
            os.killpg(procs[1].pid, signal.SIGKILL)  # the second node: its torchrun and its rank
            # Rank 0 writes its result when its step fails (its torchrun then waits in its exit
            # barrier for the dead node's agent: stopped below with SIGTERM).
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and "error" not in (out.read_text() if out.exists() else ""):
                time.sleep(0.5)
            assert netns.stop(procs) == [], "SIGTERM did not end node 0's torchrun"
        finally:
            netns.stop(procs)
    result = json.loads(out.read_text())
    assert "StageLinkError" in result["error"] and "The requests in flight failed" in result["error"], result
    assert result["failed_at"] - killed_at < 30, result["failed_at"] - killed_at
    assert not _procs_with(str(out)), "a node's process outlived the run"


@pytest.mark.slow
def test_serve_pp2_across_two_namespaces(tmp_path, hf_smollm2_tokenizer):
    """`torchrun ... -m pagedllm serve MODEL -pp 2` on each node, exactly as on two machines:
    the openai client (inside node 0's namespace, where the server listens) gets pp=1's greedy
    chat, streamed and not, and a forced tool call; `kill -9` of the second node ends the
    request in flight with an error within 30 s and later requests get a 503 at once; SIGTERM
    ends node 0, and no process of the run is left."""
    import signal

    from models import build_checkpoint
    from pagedllm import LLM, SamplingParams

    tok = hf_smollm2_tokenizer
    path = build_checkpoint("llama", tmp_path / "m", tok, len(tok))
    out, inflight = tmp_path / "client.json", tmp_path / "inflight"
    args = [
        "serve",
        str(path),
        "-pp",
        "2",
        "--dtype",
        "float32",
        "--pa-ctxt-len",
        "8192",
        "--port",
        "8000",
        "--served-model-name",
        "tiny",
    ]
    client_env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    with netns.two_nodes() as (a, b):
        port = 29400 + (os.getpid() + 13) % 500
        procs = [_torchrun(n, r, a, port, args, tmp_path / f"node{r}.log") for r, n in enumerate((a, b))]
        client = subprocess.Popen(
            a.command(
                [
                    sys.executable,
                    str(Path(__file__).with_name("pipeline_client.py")),
                    "http://127.0.0.1:8000",
                    str(out),
                    str(inflight),
                ]
            ),
            env=client_env,
            stdout=(tmp_path / "client.log").open("w"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            deadline = time.monotonic() + 400
            while not inflight.exists() and time.monotonic() < deadline and client.poll() is None:
                time.sleep(0.5)
            logs = "\n".join(f"--- {f.name}\n{f.read_text()[-3000:]}" for f in sorted(tmp_path.glob("*.log")))
            assert inflight.exists(), logs
            killed_at = time.time()
            os.killpg(procs[1].pid, signal.SIGKILL)  # the second node: its torchrun and its rank
            client.wait(timeout=120)
            lingered = netns.stop(procs)
        finally:
            netns.stop([*procs, client])
    logs = "\n".join(f"--- {f.name}\n{f.read_text()[-3000:]}" for f in sorted(tmp_path.glob("*.log")))
    result = json.loads(out.read_text())
    one = LLM(str(path), dtype="float32", kv_cache_context_len=2048)
    want = (
        one.chat(
            [{"role": "user", "content": "Name three colours."}],
            SamplingParams(max_tokens=16, temperature=0.0),
            use_tqdm=False,
        )
        .outputs[0]
        .text
    )
    assert result["whole"] == result["streamed"] == want and want, (result, want)
    assert result["finish_reason"] == "tool_calls" and [c["name"] for c in result["tool_calls"]] == ["set_unit"]
    assert json.loads(result["tool_calls"][0]["arguments"])["unit"] in ("C", "F")
    assert "none" not in result["inflight_error"], result
    print(
        f"in-flight request failed {result['inflight_failed_at'] - killed_at:.1f} s after kill -9: "
        f"{result['inflight_error']}; then {result['after']['status']} in {result['after']['seconds']:.2f} s"
    )
    assert result["inflight_failed_at"] - killed_at < 30, (result["inflight_failed_at"] - killed_at, logs)
    assert result["after"]["status"] == 503 and result["after"]["seconds"] < 5, result["after"]
    assert result["health"] == 503
    assert "StageLinkError" in logs  # the server's log says which stage and how
    assert lingered == [], f"SIGTERM did not end node 0's torchrun\n{logs}"
    assert not _procs_with(str(path)), "a node's process outlived the run"
