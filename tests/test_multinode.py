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


def _torchrun(node: netns.Node, rank: int, master: netns.Node, port: int, args: list[str],
              log: Path, script: list[str] | None = None) -> subprocess.Popen:
    """torchrun of `pagedllm ARGS` (or of `script` and its arguments) as node `rank`."""
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           # gloo advertises the address the hostname resolves to (here loopback, as on many
           # machines): name the interface that reaches the other node, as docs/scale-out.md says.
           "GLOO_SOCKET_IFNAME": node.dev,
           # The workers' imports find this checkout's pagedllm, as the test does.
           "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    argv = [TORCHRUN, "--nnodes", "2", "--node-rank", str(rank), "--master-addr", master.addr,
            "--master-port", str(port), "--nproc-per-node", "1", *(script or ["-m", "pagedllm", *args])]
    return subprocess.Popen(node.command(argv), env=env, stdout=log.open("w"), stderr=subprocess.STDOUT,
                            start_new_session=True)


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
        procs = [_torchrun(n, r, a, port, [], tmp_path / f"node{r}.log", script=[script, *args])
                 for r, n in enumerate((a, b))]
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
