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
              log: Path) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           # gloo advertises the address the hostname resolves to (here loopback, as on many
           # machines): name the interface that reaches the other node, as docs/scale-out.md says.
           "GLOO_SOCKET_IFNAME": node.dev,
           # The workers' imports find this checkout's pagedllm, as the test does.
           "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    argv = [TORCHRUN, "--nnodes", "2", "--node-rank", str(rank), "--master-addr", master.addr,
            "--master-port", str(port), "--nproc-per-node", "1", "-m", "pagedllm", *args]
    return subprocess.Popen(node.command(argv), env=env, stdout=log.open("w"), stderr=subprocess.STDOUT,
                            start_new_session=True)


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
